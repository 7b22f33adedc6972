"""Calibration data for INT8 quantization: user samples from a folder, or synthetic ones.

Every function returns *feeds*: dicts from input name to an array with a
leading batch axis of size 1 (inputs that have no batch axis get one whole
value per feed). The quantizer runs the model once per feed to collect
activation ranges, and the agreement check compares fp32 and int8 outputs on
held-out feeds (:func:`split_holdout`).
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from splitinfer.shared.errors import CodecError, ConfigError
from splitinfer.shared.manifest import Dim, TensorSpec
from splitinfer.shared.preprocess import PreprocessSpec, image_to_input, is_image_file

Array = npt.NDArray[Any]
Feed = dict[str, Array]

SUFFIXES = (".npy", ".npz")
#: Synthetic integer inputs (token ids, indices) are drawn from ``0 .. SYNTH_INT_HIGH - 1``.
SYNTH_INT_HIGH = 8
#: Synthetic size of a symbolic non-batch dimension (sequence length, image side...).
SYNTH_FREE_DIM = 8


def _has_batch_axis(spec: TensorSpec, batch_dim: str | None) -> bool:
    """The leading axis is the batch: the model's batch symbol, or a fixed size of 1."""
    if not spec.shape:
        return False
    lead = spec.shape[0]
    return (batch_dim is not None and lead == batch_dim) or lead == 1


def _fmt(shape: Sequence[Dim]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _cast(arr: Array, spec: TensorSpec, where: str) -> Array:
    """Cast ``arr`` to the input's dtype when no value changes meaning.

    Allowed: numpy's safe casts, float to a narrower float (float64 files are
    common), and integer or boolean to an integer type that holds every value.
    """
    want = np.dtype(spec.dtype)
    have = arr.dtype
    if have == want:
        return arr
    if np.can_cast(have, want, casting="safe"):
        return arr.astype(want)
    if have.kind == "f" and want.kind == "f":
        return arr.astype(want)
    if have.kind in "biu" and want.kind in "iu":
        info = np.iinfo(want)
        if arr.size == 0 or (int(arr.min()) >= info.min and int(arr.max()) <= info.max):
            return arr.astype(want)
    raise ConfigError(
        f"{where}: input {spec.name!r} is {want}, the file holds {have}, which cannot be "
        f"converted without changing values; save the samples as {want}"
    )


def _split_samples(arr: Array, spec: TensorSpec, batched: bool, where: str) -> list[Array]:
    """One array (a single sample, or a stack of samples) to per-feed arrays."""
    sample_shape = spec.shape[1:] if batched else spec.shape
    if arr.ndim == len(sample_shape):
        stack = arr[None]
    elif arr.ndim == len(sample_shape) + 1:
        stack = arr
    else:
        stack = None
    if stack is not None:
        for want, have in zip(sample_shape, stack.shape[1:], strict=True):
            if isinstance(want, int) and want != have:
                stack = None
                break
    if stack is None:
        raise ConfigError(
            f"{where}: input {spec.name!r} expects one sample of shape {_fmt(sample_shape)} "
            f"or a batch {_fmt(('n', *sample_shape))}, got {list(arr.shape)}"
        )
    if batched:
        return [stack[i : i + 1] for i in range(stack.shape[0])]
    return [stack[i] for i in range(stack.shape[0])]


def _read(path: Path) -> dict[str, Array] | Array:
    try:
        if path.suffix == ".npy":
            return np.asarray(np.load(path, allow_pickle=False))
        with np.load(path, allow_pickle=False) as data:
            return {key: np.asarray(data[key]) for key in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"calibration file {path}: cannot be read as {path.suffix} ({reason})"
        ) from exc


def _feeds_from_file(path: Path, inputs: Sequence[TensorSpec], batch_dim: str | None) -> list[Feed]:
    content = _read(path)
    if isinstance(content, np.ndarray):
        if len(inputs) != 1:
            names = ", ".join(repr(s.name) for s in inputs)
            raise ConfigError(
                f"calibration file {path}: a .npy file holds one array but the model has "
                f"{len(inputs)} inputs ({names}); use .npz files keyed by input name"
            )
        content = {inputs[0].name: content}
    if not content:
        raise ConfigError(f"calibration file {path}: holds no arrays")
    per_input: dict[str, list[Array]] = {}
    for spec in inputs:
        if spec.name not in content:
            keys = ", ".join(repr(k) for k in sorted(content))
            raise ConfigError(
                f"calibration file {path}: no array for input {spec.name!r} (keys: {keys}); "
                "save the .npz with one key per model input"
            )
        arr = _cast(content[spec.name], spec, f"calibration file {path}")
        per_input[spec.name] = _split_samples(
            arr, spec, _has_batch_axis(spec, batch_dim), f"calibration file {path}"
        )
    counts = {name: len(v) for name, v in per_input.items()}
    if len(set(counts.values())) > 1:
        detail = ", ".join(f"{k}: {v}" for k, v in counts.items())
        raise ConfigError(
            f"calibration file {path}: inputs hold different numbers of samples ({detail})"
        )
    n = next(iter(counts.values()))
    return [{name: per_input[name][i] for name in per_input} for i in range(n)]


def load_calibration(
    path: Path,
    inputs: Sequence[TensorSpec],
    batch_dim: str | None,
    limit: int | None = None,
    preprocessing: Mapping[str, PreprocessSpec] | None = None,
) -> list[Feed]:
    """Read calibration feeds from a folder of ``.npy`` / ``.npz`` files or of pictures,
    in file-name order.

    A ``.npy`` file (single-input models only) or each array of a ``.npz`` file
    (keyed by input name) holds one sample without the batch axis, or a batch
    of samples. Each is split into feeds of batch size 1. A folder of pictures
    (:data:`~splitinfer.shared.preprocess.IMAGE_SUFFIXES`) feeds a single-input
    model whose ``preprocessing`` is declared: one picture, one feed, through
    :func:`~splitinfer.shared.preprocess.image_to_input`. A folder holding both
    kinds is refused. Other files are ignored. ``limit`` caps the number of feeds read.
    """
    if limit is not None and limit < 1:
        raise ConfigError(f"calibration sample limit {limit} must be at least 1")
    if not inputs:
        raise ConfigError("the model has no inputs to calibrate")
    if not path.exists():
        raise ConfigError(f"calibration folder {path} does not exist")
    if not path.is_dir():
        raise ConfigError(f"calibration path {path} is not a folder of .npy/.npz files or images")
    entries = sorted(p for p in path.iterdir() if p.is_file())
    files = [p for p in entries if p.suffix in SUFFIXES]
    images = [p for p in entries if is_image_file(p.name)]
    if files and images:
        raise ConfigError(
            f"calibration folder {path} mixes {len(files)} .npy/.npz file(s) and "
            f"{len(images)} image(s); keep one kind of sample per folder"
        )
    if images:
        return _feeds_from_images(path, images, inputs, preprocessing or {}, limit)
    if not files:
        raise ConfigError(
            f"calibration folder {path} holds no .npy or .npz files, nor pictures "
            "(.png, .jpg, ... with --preprocess)"
        )
    feeds: list[Feed] = []
    for file in files:
        feeds.extend(_feeds_from_file(file, inputs, batch_dim))
        if limit is not None and len(feeds) >= limit:
            return feeds[:limit]
    return feeds


def _feeds_from_images(
    folder: Path,
    images: Sequence[Path],
    inputs: Sequence[TensorSpec],
    preprocessing: Mapping[str, PreprocessSpec],
    limit: int | None,
) -> list[Feed]:
    """One feed per picture, through the input's declared preprocessing."""
    if len(inputs) != 1:
        names = ", ".join(repr(s.name) for s in inputs)
        raise ConfigError(
            f"calibration folder {folder} holds images, but the model has {len(inputs)} "
            f"inputs ({names}); a picture feeds a single-input model, use .npz files"
        )
    spec = inputs[0]
    pre = preprocessing.get(spec.name)
    if pre is None:
        raise ConfigError(
            f"calibration folder {folder} holds images, but no preprocessing is declared for "
            f"input {spec.name!r}; give --preprocess (e.g. mode=RGB,size=224x224,scale=1/255)"
        )
    pre.check_fits(spec, f"--preprocess for input {spec.name!r}", ConfigError)
    feeds: list[Feed] = []
    for file in images[:limit]:
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise ConfigError(f"calibration file {file}: cannot be read ({exc.strerror})") from None
        try:
            feeds.append({spec.name: image_to_input(data, pre, spec)})
        except CodecError as exc:
            raise ConfigError(f"calibration file {file}: {exc}") from None
    return feeds


def _synthetic_shape(
    spec: TensorSpec, overrides: Mapping[str, tuple[int, ...]] | None
) -> tuple[int, ...]:
    given = (overrides or {}).get(spec.name)
    if given is not None and len(given) != len(spec.shape):
        raise ConfigError(
            f"input {spec.name!r}: shape override {list(given)} has rank {len(given)}, the "
            f"input has rank {len(spec.shape)} ({_fmt(spec.shape)})"
        )
    shape: list[int] = []
    for axis, dim in enumerate(spec.shape):
        if isinstance(dim, int):
            if given is not None and given[axis] != dim:
                raise ConfigError(
                    f"input {spec.name!r}: shape override {list(given)} sets axis {axis} to "
                    f"{given[axis]}, the model fixes it to {dim}"
                )
            shape.append(dim)
        elif given is not None:
            shape.append(int(given[axis]))
        else:
            shape.append(1 if axis == 0 else SYNTH_FREE_DIM)
    if any(d < 1 for d in shape):
        raise ConfigError(f"input {spec.name!r}: synthetic shape {shape} has a dimension < 1")
    return tuple(shape)


def _synthetic_value(spec: TensorSpec, shape: tuple[int, ...], rng: np.random.Generator) -> Array:
    dtype = np.dtype(spec.dtype)
    if "mask" in spec.name.lower():
        value = rng.integers(0, 2, size=shape)
        if value.ndim:
            value[..., 0] = 1  # never an all-padding row: masked means would divide by zero
        return value.astype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, SYNTH_INT_HIGH, size=shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dtype)
    raise ConfigError(
        f"input {spec.name!r} has dtype {dtype}, for which no synthetic calibration data "
        "exists; pass --calibration with real samples"
    )


def synthetic_calibration(
    inputs: Sequence[TensorSpec],
    n: int,
    seed: int,
    overrides: Mapping[str, tuple[int, ...]] | None = None,
) -> list[Feed]:
    """``n`` random feeds: standard normal floats, small non-negative ints, 0/1 masks.

    An input whose name contains ``mask`` gets 0/1 values (the first position of
    the last axis always 1). Symbolic dimensions take their size from
    ``overrides`` (input name to full shape, as ``--input-shape`` gives it), else
    1 for the leading (batch) axis and 8 for any other.
    """
    if n < 1:
        raise ConfigError(f"synthetic calibration needs at least 1 sample, {n} asked")
    rng = np.random.default_rng(seed)
    shapes = {spec.name: _synthetic_shape(spec, overrides) for spec in inputs}
    return [
        {spec.name: _synthetic_value(spec, shapes[spec.name], rng) for spec in inputs}
        for _ in range(n)
    ]


def split_holdout(
    samples: Sequence[Feed], fraction: float = 0.2, seed: int = 0
) -> tuple[list[Feed], list[Feed]]:
    """Shuffle ``samples`` with ``seed`` and split off ``fraction`` of them (at least one).

    Returns ``(calibration, holdout)``; both are non-empty.
    """
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"hold-out fraction {fraction} must be between 0 and 1 (exclusive)")
    if len(samples) < 2:
        raise ConfigError(
            f"{len(samples)} calibration sample(s): at least 2 are needed to hold some out "
            "for the agreement check"
        )
    order = np.random.default_rng(seed).permutation(len(samples))
    held = min(len(samples) - 1, max(1, round(len(samples) * fraction)))
    holdout = [samples[i] for i in sorted(order[:held])]
    calib = [samples[i] for i in sorted(order[held:])]
    return calib, holdout
