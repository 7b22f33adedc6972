"""The split package's manifest: ``manifest.json`` beside the segment files.

The format is versioned. A reader checks ``format`` and ``format_version``
first and refuses a newer version with a clear message; the JSON schema in
``manifest.schema.json`` (next to this module) documents every field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from splitinfer.shared.errors import PackageError

FORMAT = "splitinfer.split-package"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SCHEMA_PATH = Path(__file__).with_name("manifest.schema.json")

Dim = int | str


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor: numpy dtype name and shape (a string names a symbolic dim)."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]

    @classmethod
    def from_dict(cls, data: Any, where: str) -> TensorSpec:
        obj = _obj(data, where)
        shape = _field(obj, "shape", list, where)
        for d in shape:
            if not isinstance(d, (int, str)) or isinstance(d, bool):
                raise PackageError(f"{where}.shape: dimension {d!r} is neither int nor symbol")
        return cls(
            name=_field(obj, "name", str, where),
            dtype=_field(obj, "dtype", str, where),
            shape=tuple(shape),
        )


@dataclass(frozen=True)
class Segment:
    """One ONNX file of the package and the tensor names it takes and gives."""

    file: str
    sha256: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: int

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Segment:
        obj = _obj(data, where)
        return cls(
            file=_field(obj, "file", str, where),
            sha256=_field(obj, "sha256", str, where),
            inputs=tuple(_field(obj, "inputs", list, where)),
            outputs=tuple(_field(obj, "outputs", list, where)),
            nodes=_field(obj, "nodes", int, where),
        )


@dataclass(frozen=True)
class Cut:
    """The cut the package was split at, with the figures that describe it."""

    id: str
    kind: str  # "none" (all cloud), "all" (all edge) or "split"
    tensors: tuple[TensorSpec, ...]
    rematerialized: tuple[str, ...]
    bytes_per_sample: int
    edge_flops: int
    cloud_flops: int

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Cut:
        obj = _obj(data, where)
        kind = _field(obj, "kind", str, where)
        if kind not in {"none", "all", "split"}:
            raise PackageError(f"{where}.kind: {kind!r} is not one of none, all, split")
        return cls(
            id=_field(obj, "id", str, where),
            kind=kind,
            tensors=tuple(
                TensorSpec.from_dict(t, f"{where}.tensors[{i}]")
                for i, t in enumerate(_field(obj, "tensors", list, where))
            ),
            rematerialized=tuple(_field(obj, "rematerialized", list, where)),
            bytes_per_sample=_field(obj, "bytes_per_sample", int, where),
            edge_flops=_field(obj, "edge_flops", int, where),
            cloud_flops=_field(obj, "cloud_flops", int, where),
        )


@dataclass(frozen=True)
class Manifest:
    """Everything a reader of a split package needs, minus the ONNX files."""

    model_name: str
    source_sha256: str
    opset: int
    batch_dim: str | None
    precision: dict[str, str]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    cut: Cut
    segments: dict[str, Segment]
    analysis_shapes: dict[str, list[int]] = field(default_factory=dict)
    optimization: dict[str, Any] = field(default_factory=dict)
    tool_version: str = ""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        data = asdict(self)
        ordered = {"format": data.pop("format"), "format_version": data.pop("format_version")}
        ordered.update(data)
        return json.dumps(ordered, indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        obj = _obj(data, "manifest")
        fmt = obj.get("format")
        if fmt != FORMAT:
            raise PackageError(f"manifest.format is {fmt!r}, expected {FORMAT!r}")
        version = obj.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise PackageError(f"manifest.format_version {version!r} is not a positive integer")
        if version > FORMAT_VERSION:
            raise PackageError(
                f"split package format version {version} is newer than this splitinfer "
                f"understands ({FORMAT_VERSION}); upgrade splitinfer"
            )
        segments = _field(obj, "segments", dict, "manifest")
        batch_dim = obj.get("batch_dim")
        if batch_dim is not None and not isinstance(batch_dim, str):
            raise PackageError("manifest.batch_dim must be a string or null")
        return cls(
            model_name=_field(obj, "model_name", str, "manifest"),
            source_sha256=_field(obj, "source_sha256", str, "manifest"),
            opset=_field(obj, "opset", int, "manifest"),
            batch_dim=batch_dim,
            precision=dict(_field(obj, "precision", dict, "manifest")),
            inputs=tuple(
                TensorSpec.from_dict(t, f"manifest.inputs[{i}]")
                for i, t in enumerate(_field(obj, "inputs", list, "manifest"))
            ),
            outputs=tuple(
                TensorSpec.from_dict(t, f"manifest.outputs[{i}]")
                for i, t in enumerate(_field(obj, "outputs", list, "manifest"))
            ),
            cut=Cut.from_dict(_field(obj, "cut", dict, "manifest"), "manifest.cut"),
            segments={
                k: Segment.from_dict(v, f"manifest.segments.{k}") for k, v in segments.items()
            },
            analysis_shapes=dict(obj.get("analysis_shapes", {})),
            optimization=dict(obj.get("optimization", {})),
            tool_version=str(obj.get("tool_version", "")),
            format=fmt,
            format_version=version,
        )


def is_package(path: Path) -> bool:
    """True if ``path`` is a folder holding a manifest of this format (any version)."""
    manifest = path / MANIFEST_NAME
    if not manifest.is_file():
        return False
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def load_manifest(package: Path) -> Manifest:
    """Read and validate ``package/manifest.json``; the format version is checked first."""
    path = package / MANIFEST_NAME
    if not path.is_file():
        raise PackageError(f"{package}: not a split package (no {MANIFEST_NAME})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise PackageError(f"{path}: not valid JSON ({exc})") from exc
    return Manifest.from_dict(data)


def _obj(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise PackageError(f"{where}: expected an object, got {type(data).__name__}")
    return data


def _field(obj: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in obj:
        raise PackageError(f"{where}.{key}: missing")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PackageError(f"{where}.{key}: expected {kind.__name__}, got {value!r}")
    return value
