"""The split package's manifest: ``manifest.json`` beside the segment files.

The format is versioned. A reader checks ``format`` and ``format_version``
first and refuses a newer version with a clear message; the JSON schema in
``manifest.schema.json`` (next to this module) documents every field.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from splitinfer.shared.errors import PackageError
from splitinfer.shared.preprocess import PreprocessSpec, specs_from_dict

FORMAT = "splitinfer.split-package"
FORMAT_VERSION = 2
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


PRECISIONS = ("fp32", "fp16", "int8")
CODEC_NAMES = ("raw", "fp16", "int8", "int8+zstd", "png", "jpeg", "int4+zstd")
CUT_KINDS = ("none", "all", "split")


@dataclass(frozen=True)
class Segment:
    """One ONNX file of the package and the tensor names it takes and gives.

    ``nonstandard_ops``: the ops outside the default ONNX domain it holds
    (``domain::op_type``, sorted; the source model's own, such as
    ``com.microsoft::DynamicQuantizeLSTM``). A segment with any needs ONNX Runtime:
    TensorRT cannot build it. Optional; absent in the JSON when empty.
    """

    file: str
    sha256: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: int
    precision: str = "fp32"
    nonstandard_ops: tuple[str, ...] = ()

    @property
    def needs_onnxruntime(self) -> bool:
        """True when TensorRT cannot run this segment (it holds a non-standard op)."""
        return bool(self.nonstandard_ops)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Segment:
        obj = _obj(data, where)
        file = _field(obj, "file", str, where)
        _check_relative(file, f"{where}.file")
        precision = obj.get("precision", "fp32")
        if precision not in PRECISIONS:
            raise PackageError(f"{where}.precision: {precision!r} is not one of {PRECISIONS}")
        ops = obj.get("nonstandard_ops", [])
        if not isinstance(ops, list) or not all(
            isinstance(op, str) and "::" in op.strip(":") for op in ops
        ):
            raise PackageError(
                f"{where}.nonstandard_ops: expected a list of 'domain::op_type', got {ops!r}"
            )
        return cls(
            file=file,
            sha256=_field(obj, "sha256", str, where),
            inputs=tuple(_field(obj, "inputs", list, where)),
            outputs=tuple(_field(obj, "outputs", list, where)),
            nodes=_field(obj, "nodes", int, where),
            precision=precision,
            nonstandard_ops=tuple(ops),
        )


@dataclass(frozen=True)
class CodecSpec:
    """How the cut tensors travel: the wire codec and its settings.

    ``png`` and ``jpeg`` carry image-shaped tensors (the inputs of a cloud-only
    cut); their float-to-pixel mapping is the tensor's :class:`QuantSpec`
    (``x = (u - 128 - zero_point) * scale`` for pixel u), ``quality`` the JPEG
    quality (1-100; null for the other codecs).
    """

    name: str = "int8+zstd"
    level: int = 1
    dictionary: str | None = None  # a file in the package: a zstd dictionary
    quality: int | None = None  # jpeg only

    def __post_init__(self) -> None:
        _check_quality(self.name, self.quality, "codec")

    @classmethod
    def from_dict(cls, data: Any, where: str) -> CodecSpec:
        obj = _obj(data, where)
        name = _field(obj, "name", str, where)
        if name not in CODEC_NAMES:
            raise PackageError(f"{where}.name: {name!r} is not one of {', '.join(CODEC_NAMES)}")
        dictionary = obj.get("dictionary")
        if dictionary is not None:
            if not isinstance(dictionary, str):
                raise PackageError(f"{where}.dictionary: expected a file name or null")
            _check_relative(dictionary, f"{where}.dictionary")
        quality = obj.get("quality")
        _check_quality(name, quality, where)
        return cls(
            name=name, level=int(obj.get("level", 1)), dictionary=dictionary, quality=quality
        )


def _sample_shapes(data: Any, where: str) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in _obj(data, where).items():
        ok = isinstance(shape, list) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        )
        if not ok:
            raise PackageError(f"{where}.{name}: {shape!r} is not a list of sizes")
        out[name] = tuple(shape)
    return out


def _check_quality(name: str, quality: Any, where: str) -> None:
    if quality is None:
        return
    if name != "jpeg":
        raise PackageError(f"{where}.quality: {quality!r} given, but only the jpeg codec has one")
    if not isinstance(quality, int) or isinstance(quality, bool) or not 1 <= quality <= 100:
        raise PackageError(f"{where}.quality: {quality!r} is not an integer in [1, 100]")


@dataclass(frozen=True)
class QuantSpec:
    """Calibrated int8 parameters of one cut tensor (per channel along ``axis``).

    The image codecs read the same fields as the affine to pixels (per tensor):
    ``x = offset + scale * u`` with ``offset = -(128 + zero_point) * scale``.
    """

    scale: tuple[float, ...]
    zero_point: tuple[int, ...]
    axis: int | None

    @classmethod
    def from_dict(cls, data: Any, where: str) -> QuantSpec:
        obj = _obj(data, where)
        scale = _field(obj, "scale", list, where)
        zero = _field(obj, "zero_point", list, where)
        axis = obj.get("axis")
        if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
            raise PackageError(f"{where}.axis: expected an integer or null, got {axis!r}")
        if len(scale) != len(zero) or not scale:
            raise PackageError(f"{where}: scale and zero_point must be non-empty, equal length")
        return cls(tuple(float(v) for v in scale), tuple(int(v) for v in zero), axis)


@dataclass(frozen=True)
class Adaptation:
    """A cut's ``quality.adaptation``: its cloud segment was fine-tuned for the noise.

    Written by ``partition --adapt-cloud`` (``partitioner/adapt.py``): for which
    mechanism (epsilon, delta, clip C, noise multiplier z, bottleneck width K or
    None), on how many calibration samples, and the top-1 agreement with the
    fp32 model under that mechanism on held-out samples before and after.
    ``adapted`` is false when the fine-tune did not help and the cut kept its
    segments. The mechanism is the package's ``privacy``: a package whose
    ``privacy`` differs from an adapted cut's is refused.
    """

    adapted: bool
    epsilon: float
    delta: float
    clip: float
    noise_multiplier: float
    bottleneck: int | None
    samples: int
    utility_before: float
    utility_after: float

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Adaptation:
        obj = _obj(data, where)
        adapted = obj.get("adapted")
        if not isinstance(adapted, bool):
            raise PackageError(f"{where}.adapted: {adapted!r} is not true or false")
        nums = {}
        for key in ("epsilon", "delta", "clip", "noise_multiplier"):
            v = obj.get(key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise PackageError(f"{where}.{key}: {v!r} is not a positive number")
            nums[key] = float(v)
        for key in ("utility_before", "utility_after"):
            v = obj.get(key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1:
                raise PackageError(f"{where}.{key}: {v!r} is not a fraction in [0, 1]")
            nums[key] = float(v)
        k = obj.get("bottleneck")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise PackageError(f"{where}.bottleneck: {k!r} is not a width >= 1 or null")
        n = obj.get("samples")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise PackageError(f"{where}.samples: {n!r} is not a sample count >= 1")
        return cls(adapted=adapted, bottleneck=k, samples=n, **nums)

    def matches(self, privacy: PrivacySpec) -> bool:
        """Whether this adaptation was made for exactly ``privacy``'s mechanism."""
        mine = (self.epsilon, self.delta, self.clip, self.noise_multiplier)
        theirs = (privacy.epsilon, privacy.delta, privacy.clip, privacy.noise_multiplier)
        return all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(mine, theirs, strict=True))


@dataclass(frozen=True)
class Cut:
    """One cut of the model: its tensors, its two segments and how it travels.

    ``kind`` is "none" (all cloud: no edge segment), "all" (all edge: no cloud
    segment) or "split".
    """

    id: str
    kind: str
    tensors: tuple[TensorSpec, ...]
    rematerialized: tuple[str, ...]
    bytes_per_sample: int
    edge_flops: int
    cloud_flops: int
    edge: Segment | None = None
    cloud: Segment | None = None
    codec: CodecSpec = field(default_factory=CodecSpec)
    quant: dict[str, QuantSpec] = field(default_factory=dict)
    predicted: dict[str, Any] = field(default_factory=dict)
    quality: dict[str, Any] = field(default_factory=dict)
    #: Per cut tensor, its shape at the analysis inputs (one sample's when it is batched):
    #: what a reader feeds a segment to warm it up when a dimension is a symbol of the
    #: tensor's own (``NAME_dimK``: it varies with the input but is no input dimension).
    sample_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Cut:
        obj = _obj(data, where)
        kind = _field(obj, "kind", str, where)
        if kind not in CUT_KINDS:
            raise PackageError(f"{where}.kind: {kind!r} is not one of none, all, split")
        edge = obj.get("edge")
        cloud = obj.get("cloud")
        codec = obj.get("codec")
        quant = obj.get("quant", {})
        cut = cls(
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
            edge=None if edge is None else Segment.from_dict(edge, f"{where}.edge"),
            cloud=None if cloud is None else Segment.from_dict(cloud, f"{where}.cloud"),
            codec=CodecSpec() if codec is None else CodecSpec.from_dict(codec, f"{where}.codec"),
            quant={
                k: QuantSpec.from_dict(v, f"{where}.quant.{k}")
                for k, v in _obj(quant, f"{where}.quant").items()
            },
            predicted=dict(_obj(obj.get("predicted", {}), f"{where}.predicted")),
            quality=dict(_obj(obj.get("quality", {}), f"{where}.quality")),
            sample_shapes=_sample_shapes(obj.get("sample_shapes", {}), f"{where}.sample_shapes"),
        )
        if "adaptation" in cut.quality:
            Adaptation.from_dict(cut.quality["adaptation"], f"{where}.quality.adaptation")
        if kind != "none" and cut.edge is None:
            raise PackageError(f"{where}.edge: missing (a {kind!r} cut runs an edge segment)")
        if kind != "all" and cut.cloud is None:
            raise PackageError(f"{where}.cloud: missing (a {kind!r} cut runs a cloud segment)")
        return cut

    def segments(self) -> tuple[Segment, ...]:
        return tuple(s for s in (self.edge, self.cloud) if s is not None)

    @property
    def adaptation(self) -> Adaptation | None:
        """How the cloud segment was fine-tuned for the privacy noise (None: it was not)."""
        data = self.quality.get("adaptation")
        if data is None:
            return None
        return Adaptation.from_dict(data, f"cuts[{self.id}].quality.adaptation")


@dataclass(frozen=True)
class PrivacySpec:
    """Per-request (epsilon, delta) DP of the cut activations (Gaussian mechanism).

    Each sample's cut activation is clipped to L2 norm ``clip`` and gets
    Gaussian noise of std ``noise_multiplier * 2 * clip`` before it is encoded.
    """

    epsilon: float
    delta: float
    clip: float
    noise_multiplier: float
    accountant: str = "prv"

    @classmethod
    def from_dict(cls, data: Any, where: str) -> PrivacySpec:
        obj = _obj(data, where)
        values = {}
        for key in ("epsilon", "delta", "clip", "noise_multiplier"):
            v = obj.get(key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise PackageError(f"{where}.{key}: {v!r} is not a positive number")
            values[key] = float(v)
        if values["delta"] >= 1:
            raise PackageError(f"{where}.delta: {values['delta']} must be below 1")
        return cls(**values, accountant=str(obj.get("accountant", "prv")))


@dataclass(frozen=True)
class Manifest:
    """Everything a reader of a split package needs, minus the ONNX files.

    A package holds one or more candidate cuts, each a complete edge/cloud
    pair; ``default_cut`` is the one the partitioner chose. ``fallback`` is a
    full local model the edge may run when no cloud answers. ``preprocessing``
    declares, per image input (by name), how a picture becomes that input.
    """

    model_name: str
    source_sha256: str
    opset: int
    batch_dim: str | None
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    default_cut: str
    cuts: tuple[Cut, ...]
    fallback: Segment | None = None
    privacy: PrivacySpec | None = None
    planning: dict[str, Any] = field(default_factory=dict)
    analysis_shapes: dict[str, list[int]] = field(default_factory=dict)
    optimization: dict[str, Any] = field(default_factory=dict)
    preprocessing: dict[str, PreprocessSpec] = field(default_factory=dict)
    tool_version: str = ""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        ids = [c.id for c in self.cuts]
        if not ids:
            raise PackageError("manifest.cuts: a package holds at least one cut")
        if len(set(ids)) != len(ids):
            raise PackageError(f"manifest.cuts: duplicate cut ids in {ids}")
        if self.default_cut not in ids:
            raise PackageError(
                f"manifest.default_cut: {self.default_cut!r} is not among the cuts {ids}"
            )
        for c in self.cuts:
            adapted = c.adaptation
            if adapted is not None and (self.privacy is None or not adapted.matches(self.privacy)):
                raise PackageError(
                    f"manifest.cuts[{c.id}].quality.adaptation: made for epsilon "
                    f"{adapted.epsilon:g}, delta {adapted.delta:g}, clip {adapted.clip:g}, but the "
                    f"package's privacy is {self.privacy}; re-run partition --adapt-cloud"
                )
        inputs = {t.name: t for t in self.inputs}
        for name, spec in self.preprocessing.items():
            where = f"manifest.preprocessing.{name}"
            if name not in inputs:
                raise PackageError(
                    f"{where}: {name!r} is not a model input ({', '.join(inputs) or 'none'})"
                )
            spec.check_fits(inputs[name], where)

    @property
    def cut(self) -> Cut:
        """The default cut (the one the partitioner chose)."""
        found = self.find_cut(self.default_cut)
        assert found is not None  # checked in __post_init__
        return found

    def find_cut(self, cut_id: str) -> Cut | None:
        return self._cuts_by_id.get(cut_id)

    @functools.cached_property
    def _cuts_by_id(self) -> dict[str, Cut]:
        """The cuts by id (the first of an id wins), built once: a frame names one."""
        return {c.id: c for c in reversed(self.cuts)}

    @property
    def cut_ids(self) -> tuple[str, ...]:
        return tuple(c.id for c in self.cuts)

    def to_json(self) -> str:
        data = asdict(self)
        if not data["preprocessing"]:  # optional: absent rather than empty
            del data["preprocessing"]
        segments = [data["fallback"], *(c[r] for c in data["cuts"] for r in ("edge", "cloud"))]
        for seg in segments:
            if seg is not None and not seg["nonstandard_ops"]:  # likewise
                del seg["nonstandard_ops"]
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
        if version == 1:
            obj = _from_v1(obj)
        batch_dim = obj.get("batch_dim")
        if batch_dim is not None and not isinstance(batch_dim, str):
            raise PackageError("manifest.batch_dim must be a string or null")
        fallback = obj.get("fallback")
        privacy = obj.get("privacy")
        return cls(
            model_name=_field(obj, "model_name", str, "manifest"),
            source_sha256=_field(obj, "source_sha256", str, "manifest"),
            opset=_field(obj, "opset", int, "manifest"),
            batch_dim=batch_dim,
            inputs=tuple(
                TensorSpec.from_dict(t, f"manifest.inputs[{i}]")
                for i, t in enumerate(_field(obj, "inputs", list, "manifest"))
            ),
            outputs=tuple(
                TensorSpec.from_dict(t, f"manifest.outputs[{i}]")
                for i, t in enumerate(_field(obj, "outputs", list, "manifest"))
            ),
            default_cut=_field(obj, "default_cut", str, "manifest"),
            cuts=tuple(
                Cut.from_dict(c, f"manifest.cuts[{i}]")
                for i, c in enumerate(_field(obj, "cuts", list, "manifest"))
            ),
            fallback=None if fallback is None else Segment.from_dict(fallback, "manifest.fallback"),
            privacy=None if privacy is None else PrivacySpec.from_dict(privacy, "manifest.privacy"),
            planning=dict(_obj(obj.get("planning", {}), "manifest.planning")),
            analysis_shapes=dict(obj.get("analysis_shapes", {})),
            optimization=dict(obj.get("optimization", {})),
            preprocessing=specs_from_dict(obj.get("preprocessing", {}), "manifest.preprocessing"),
            tool_version=str(obj.get("tool_version", "")),
            format=fmt,
            format_version=FORMAT_VERSION,
        )


def _from_v1(obj: dict[str, Any]) -> dict[str, Any]:
    """Read a format-1 manifest (one cut, ``segments`` beside it) as format 2."""
    cut = dict(_field(obj, "cut", dict, "manifest"))
    segments = _field(obj, "segments", dict, "manifest")
    precision = obj.get("precision", {})
    for role in ("edge", "cloud"):
        if role in segments:
            seg = dict(_obj(segments[role], f"manifest.segments.{role}"))
            seg.setdefault("precision", precision.get(role, "fp32"))
            cut[role] = seg
    cut["codec"] = {"name": "raw"}
    out = {k: v for k, v in obj.items() if k not in {"cut", "segments", "precision"}}
    out["cuts"] = [cut]
    out["default_cut"] = cut.get("id")
    return out


def resolve_file(package: Path, relative: str) -> Path:
    """The path of a file the manifest names, refusing anything outside the package."""
    _check_relative(relative, "file")
    return package / relative


def _check_relative(name: str, where: str) -> None:
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts or "\\" in name:
        raise PackageError(f"{where}: {name!r} must be a relative path inside the package")


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
