"""Load an ONNX model, check it, and fix free dimensions for analysis."""

from __future__ import annotations

import hashlib
import math
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper

from splitinfer.shared.errors import ConfigError, ModelError
from splitinfer.shared.ortsession import session_options


@dataclass(frozen=True)
class LoadedModel:
    """A checked model with everything needed later to describe its source."""

    model: onnx.ModelProto
    path: Path
    sha256: str


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_model(path: Path) -> LoadedModel:
    """Read ``path`` with its external data and run the ONNX checker.

    Every failure is a :class:`ModelError` naming the file and the reason.
    """
    if not path.exists():
        raise ModelError(f"{path}: no such file")
    if not path.is_file():
        raise ModelError(f"{path}: not a file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise ModelError(f"{path}: not an ONNX model ({_first_line(exc)})") from exc
    if not model.HasField("graph") or model.ir_version <= 0 or not model.graph.node:
        raise ModelError(f"{path}: not an ONNX model (no graph, no IR version or no nodes)")
    if any(
        external_data_helper.uses_external_data(t)
        for t in external_data_helper._get_all_tensors(model)
    ):
        _load_external(model, path)
    try:
        _check(model)
    except (onnx.checker.ValidationError, ValueError) as exc:
        raise ModelError(f"{path}: fails the ONNX checker: {_first_line(exc)}") from exc
    return LoadedModel(model=model, path=path, sha256=sha256_file(path))


def _check(model: onnx.ModelProto) -> None:
    """The ONNX checker on ``model``, without serializing its large weights (seconds on a
    real-size model): it reads a copy whose large initializers are external-data
    references to an empty file, and the size check it makes of their data is made
    here, with its words."""
    shell = onnx.ModelProto()
    copy_except(shell, model, "graph")
    copy_except(shell.graph, model.graph, "initializer")
    for t in model.graph.initializer:
        need = _raw_size(t)
        if need <= BIG_INITIALIZER or _has_typed_fields(t):  # the latter: the checker's to refuse
            shell.graph.initializer.add().CopyFrom(t)
            continue
        have = len(t.raw_data)
        if have < need:
            raise onnx.checker.ValidationError(
                f"TensorProto (tensor name: {t.name}) raw_data size ({have} bytes) is too small "
                f"for the declared shape and type ({need} bytes required)."
            )
        held = shell.graph.initializer.add()
        held.name, held.data_type, held.doc_string = t.name, t.data_type, t.doc_string
        held.dims.extend(t.dims)
        held.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", HELD), ("offset", "0"), ("length", str(have))):
            entry = held.external_data.add()
            entry.key, entry.value = key, value
    with tempfile.TemporaryDirectory(prefix="splitinfer-check-") as tmp:
        (Path(tmp) / HELD).touch()
        target = Path(tmp) / "model.onnx"
        target.write_bytes(shell.SerializeToString())
        onnx.checker.check_model(str(target))


def _has_typed_fields(t: onnx.TensorProto) -> bool:
    fields = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")
    return any(len(getattr(t, f)) for f in fields)


def _load_external(model: onnx.ModelProto, path: Path) -> None:
    base = path.parent
    for tensor in external_data_helper._get_all_tensors(model):
        if not external_data_helper.uses_external_data(tensor):
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = base / info.get("location", "")
        if not location.is_file():
            raise ModelError(
                f"{path}: external data file {info.get('location')!r} for tensor "
                f"{tensor.name!r} is missing (expected at {location})"
            )
    try:
        external_data_helper.load_external_data_for_model(model, str(base))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: cannot read external data: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_SHAPE_RE = re.compile(r"^([^=]+)=(\d+(?:[xX,]\d+)*)$")


def parse_input_shapes(specs: list[str]) -> dict[str, list[int]]:
    """Parse repeated ``NAME=1x3x640x640`` options (``x`` or ``,`` between dims)."""
    shapes: dict[str, list[int]] = {}
    for spec in specs:
        match = _SHAPE_RE.match(spec.strip())
        if not match:
            raise ConfigError(
                f"--input-shape {spec!r}: expected NAME=DxDxD..., e.g. images=1x3x640x640"
            )
        name, dims_text = match.group(1), match.group(2)
        dims = [int(d) for d in re.split(r"[xX,]", dims_text)]
        if any(d <= 0 for d in dims):
            raise ConfigError(f"--input-shape {spec!r}: every dimension must be positive")
        if name in shapes:
            raise ConfigError(f"--input-shape given twice for input {name!r}")
        shapes[name] = dims
    return shapes


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The real inputs: graph inputs that are not initializers (older exporters list both)."""
    inits = {t.name for t in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in inits]


def dims_of(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    """Dimensions of a value: an int, a symbol name, or None where unknown.

    Exporters write an unknown size several ways: no value, ``-1`` or ``0`` as a value
    (PaddlePaddle's ``[-1, 3, ?, ?]``), or ``?`` as a name; all are None here."""
    out: list[int | str | None] = []
    if not vi.type.tensor_type.HasField("shape"):
        return out
    for d in vi.type.tensor_type.shape.dim:
        if d.HasField("dim_value") and d.dim_value > 0:
            out.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param not in ("", "?"):
            out.append(d.dim_param)
        else:
            out.append(None)
    return out


def analysis_input_shapes(
    model: onnx.ModelProto, overrides: dict[str, list[int]]
) -> dict[str, list[int]]:
    """Concrete per-sample shapes (batch dimension excluded) for each model input.

    The leading dimension of an input is its batch dimension when it is symbolic;
    every other free dimension must be fixed by ``overrides`` (``--input-shape``),
    whose leading dimension is the batch and is not used for analysis.
    """
    inputs = {vi.name: vi for vi in graph_inputs(model)}
    unknown = sorted(set(overrides) - set(inputs))
    if unknown:
        raise ConfigError(
            f"--input-shape names unknown input {unknown[0]!r}; the model's inputs are "
            + ", ".join(repr(n) for n in inputs)
        )
    result: dict[str, list[int]] = {}
    for name, vi in inputs.items():
        dims = dims_of(vi)
        if not dims:
            result[name] = []
            continue
        if name in overrides:
            given = overrides[name]
            if len(given) != len(dims):
                raise ConfigError(
                    f"--input-shape {name}: rank {len(given)} given, the model's input has "
                    f"rank {len(dims)} ({_fmt_dims(dims)})"
                )
            for axis, (want, have) in enumerate(zip(given[1:], dims[1:], strict=True), 1):
                if isinstance(have, int) and have != want:
                    raise ConfigError(
                        f"--input-shape {name}: dimension {axis} is fixed to {have} by the "
                        f"model, {want} given"
                    )
            result[name] = given[1:]
            continue
        free = [(i, d) for i, d in enumerate(dims) if i > 0 and not isinstance(d, int)]
        if free:
            axis, sym = free[0]
            example = "x".join(
                "1" if i == 0 else str(d) if isinstance(d, int) else f"<{d or 'size'}>"
                for i, d in enumerate(dims)
            )
            raise ConfigError(
                f"input {name!r} has free dimension {sym or '?'} at axis {axis} "
                f"({_fmt_dims(dims)}): fix it for analysis with --input-shape {name}={example}"
            )
        result[name] = [int(d) for d in dims[1:] if isinstance(d, int)]
    return result


def _fmt_dims(dims: list[int | str | None]) -> str:
    return "x".join("?" if d is None else str(d) for d in dims)


#: Initializers larger than this (bytes) are held beside the graph (see :class:`WeightShell`).
BIG_INITIALIZER = 1 << 12
#: The external-data location of a held initializer in a shell.
HELD = "splitinfer-held-beside-the-graph"


class WeightShell:
    """A copy of a model whose large initializers carry no data, and that data.

    Serializing a model with its weights in it costs seconds on a real-size
    model (protobuf, superlinear in the size); shape inference reads only the
    weights' dims, and ONNX Runtime takes them beside the graph
    (``SessionOptions.add_external_initializers``, replaced before any
    optimization). Each held tensor becomes an external-data reference of the
    same name, type and dims; the source model is not touched.
    """

    def __init__(self, model: onnx.ModelProto) -> None:
        shell = onnx.ModelProto()
        copy_except(shell, model, "graph")
        copy_except(shell.graph, model.graph, "initializer")
        self.names: list[str] = []
        self.arrays: list[np.ndarray] = []
        for t in model.graph.initializer:
            data = _raw_size(t)
            if data <= BIG_INITIALIZER:
                shell.graph.initializer.add().CopyFrom(t)
                continue
            raw = t.raw_data
            held = shell.graph.initializer.add()
            held.name, held.data_type = t.name, t.data_type
            held.dims.extend(t.dims)
            held.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", HELD), ("offset", "0"), ("length", str(len(raw)))):
                entry = held.external_data.add()
                entry.key, entry.value = key, value
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
            self.names.append(t.name)
            arr = np.frombuffer(raw, dtype=dtype, count=math.prod(t.dims))
            self.arrays.append(arr.reshape(tuple(t.dims)))
        self.model = shell

    def options(self, **choices: Any) -> Any:
        """SessionOptions (``choices`` as for ``session_options``) that supply the held data.

        The values point into this shell's arrays: keep the shell until the session is made
        (ONNX Runtime copies them then)."""
        import onnxruntime as ort

        opts = session_options(**choices)
        if self.names:
            self._values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.arrays]
            opts.add_external_initializers(self.names, self._values)
        return opts


def _raw_size(t: onnx.TensorProto) -> int:
    """Bytes of ``raw_data`` from the dims (reading the field copies it); 0 if none."""
    if t.data_location == onnx.TensorProto.EXTERNAL or not t.HasField("raw_data"):
        return 0
    try:
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        return 0
    return int(math.prod(t.dims)) * int(itemsize)


def copy_except(dst: Any, src: Any, skip: str) -> None:
    """Copy the set fields of message ``src`` into ``dst``, all but ``skip``."""
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        if fd.is_repeated:
            getattr(dst, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)
