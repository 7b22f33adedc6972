"""Load an ONNX model, check it, and fix free dimensions for analysis."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper

from splitinfer.shared.errors import ConfigError, ModelError


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
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError) as exc:
        raise ModelError(f"{path}: fails the ONNX checker: {_first_line(exc)}") from exc
    return LoadedModel(model=model, path=path, sha256=sha256_file(path))


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
    """Dimensions of a value: an int, a symbol name, or None where unknown."""
    out: list[int | str | None] = []
    if not vi.type.tensor_type.HasField("shape"):
        return out
    for d in vi.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            out.append(int(d.dim_value))
        elif d.HasField("dim_param"):
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
