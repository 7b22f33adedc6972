"""The wire frame: one request from the edge, one response from the cloud.

Layout, all integers little-endian::

    magic    4 bytes  b"SPLT"
    version  u8       FRAME_VERSION
    kind     u8       1 = request, 2 = response
    hlen     u32      length of the header
    header   hlen     UTF-8 JSON object (ids, tensor specs, privacy, deadline),
                      padded with trailing spaces so that the first payload starts
                      16-byte aligned (JSON allows them; a decoder need not rely on it)
    then per tensor, in header order:
    plen     u32      length of the payload
    payload  plen     the codec's bytes

A decoder checks the whole header against the manifest, and every payload
length against the limits, before it decodes any tensor, and insists that every
byte is consumed. It raises only :class:`ProtocolError` or :class:`CodecError`,
each naming the field at fault (``frame.tensors[0].shape: ...``).
"""

from __future__ import annotations

import functools
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splitinfer.shared.codecs import (
    RAW,
    ZSTD,
    ZSTD_COMPANIONS,
    Array,
    Codec,
    QuantParams,
    default_codecs,
    dtype_name,
    get_codec,
)
from splitinfer.shared.errors import CodecError, ConfigError, ProtocolError
from splitinfer.shared.manifest import Manifest, QuantSpec, TensorSpec

#: The media type of a wire frame, both ways.
FRAME_TYPE = "application/vnd.splitinfer.frame"
MAGIC = b"SPLT"
FRAME_VERSION = 1
KIND_REQUEST = 1
KIND_RESPONSE = 2
STATUS_OK = 200
#: A tensor's ``quant`` header value meaning "the manifest's calibrated parameters".
QUANT_FROM_MANIFEST = "manifest"

_PREAMBLE = struct.Struct("<4sBBI")
_LENGTH = struct.Struct("<I")
_MAX_TEXT = 256
#: Encoders pad the header so that the first payload starts at a multiple of this
#: (from the frame's start): a receiver's buffer is at least 16-byte aligned, so a
#: raw payload decodes to a view, not a copy (see ``RawCodec``).
_PAYLOAD_ALIGN = 16
_MAX_RANK = 8
_MAX_U64 = 2**64 - 1

_REQUEST_KEYS = frozenset(
    {"request_id", "model", "model_version", "cut_id", "tensors", "privacy", "deadline_ms"}
    | {"trace_id"}
)
_RESPONSE_KEYS = frozenset({"request_id", "status", "message", "tensors", "model_version", "load"})
_TENSOR_KEYS = frozenset({"name", "dtype", "shape", "codec", "quant"})
_QUANT_KEYS = frozenset({"scale", "zero_point", "axis"})
_PRIVACY_KEYS = frozenset({"noise_multiplier", "clip", "epsilon"})


@dataclass(frozen=True)
class Limits:
    """Bounds a decoder enforces before it allocates anything."""

    max_frame_bytes: int = 256 * 2**20
    max_tensor_bytes: int = 128 * 2**20
    max_batch: int = 256
    max_header_bytes: int = 64 * 2**10

    def __post_init__(self) -> None:
        for name in ("max_frame_bytes", "max_tensor_bytes", "max_batch", "max_header_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"Limits.{name}: {value!r} is not a positive integer")


@dataclass(frozen=True)
class WireTensor:
    """One tensor of a frame: its name, values and how they travel."""

    name: str
    array: Array
    codec: int = RAW
    quant: QuantParams | None = None
    #: ``quant`` is the package's calibrated parameters of this cut tensor: the
    #: header says ``"quant": "manifest"`` instead of listing them (a per-channel
    #: list costs tens of bytes per channel in every request).
    quant_ref: bool = False


@dataclass(frozen=True)
class Privacy:
    """The privacy mechanism the edge applied before sending (0 = none)."""

    noise_multiplier: float = 0.0
    clip: float = 0.0
    epsilon: float = 0.0


@dataclass(frozen=True)
class Request:
    """An edge-to-cloud frame: the cut tensors of one batch."""

    request_id: str
    model_name: str
    model_version: str
    cut_id: str
    tensors: tuple[WireTensor, ...]
    privacy: Privacy = field(default_factory=Privacy)
    deadline_ms: int = 0
    trace_id: str = ""


@dataclass(frozen=True)
class Response:
    """A cloud-to-edge frame: the model outputs, or a status and a message."""

    request_id: str
    status: int = STATUS_OK
    tensors: tuple[WireTensor, ...] = ()
    message: str = ""
    model_version: str = ""  # the version that served the request
    load: float = 0.0  # the cloud's queue pressure, 0 (idle) to 1 (full); the edge adapts to it


def encode_request(request: Request, codecs: Mapping[int, Codec] | None = None) -> bytes:
    """The request as frame bytes; no manifest is needed to encode."""
    header = {
        "request_id": request.request_id,
        "model": request.model_name,
        "model_version": request.model_version,
        "cut_id": request.cut_id,
        "privacy": {
            "noise_multiplier": float(request.privacy.noise_multiplier),
            "clip": float(request.privacy.clip),
            "epsilon": float(request.privacy.epsilon),
        },
        "deadline_ms": int(request.deadline_ms),
        "trace_id": request.trace_id,
    }
    return _encode(KIND_REQUEST, header, request.tensors, codecs)


def encode_response(response: Response, codecs: Mapping[int, Codec] | None = None) -> bytes:
    """The response as frame bytes."""
    header = {
        "request_id": response.request_id,
        "status": int(response.status),
        "message": response.message,
        "model_version": response.model_version,
        "load": float(response.load),
    }
    return _encode(KIND_RESPONSE, header, response.tensors, codecs)


@dataclass(frozen=True)
class RequestHead:
    """A request frame whose preamble is checked and whose header is parsed, but not yet
    validated against a manifest: what routing needs, kept so that
    :func:`decode_request` does not parse the header a second time."""

    model: str
    model_version: str
    cut_id: str
    header: dict[str, Any]
    view: memoryview
    end: int  # where the payloads start


def read_request_head(data: bytes, limits: Limits) -> RequestHead:
    """The routing fields of a request frame; raises :class:`ProtocolError`."""
    try:
        header, view, end = _split(data, KIND_REQUEST, _REQUEST_KEYS, limits)
        return RequestHead(
            _text(header, "model", "frame"),
            _text(header, "model_version", "frame"),
            _text(header, "cut_id", "frame"),
            header,
            view,
            end,
        )
    except ProtocolError:
        raise
    except (ValueError, TypeError, UnicodeDecodeError, struct.error) as exc:
        raise ProtocolError(f"frame: malformed ({type(exc).__name__}: {exc})") from exc


def peek_request(data: bytes, limits: Limits) -> tuple[str, str, str] | None:
    """``(model, model_version, cut_id)`` from a request frame's header, or None.

    Only the preamble and the JSON header are read, to route the frame (which
    version, which cut's codecs) before it is decoded; :func:`decode_request`
    reports what is wrong with a frame this returns None for.
    """
    try:
        head = read_request_head(data, limits)
    except ProtocolError:
        return None
    return head.model, head.model_version, head.cut_id


def decode_request(
    data: bytes | RequestHead,
    manifest: Manifest,
    limits: Limits,
    codecs: Mapping[int, Codec] | None = None,
    *,
    strict_codec: bool = False,
    finite: bool = False,
) -> Request:
    """Parse and validate a request frame against the manifest's cut tensors.

    ``data`` may be the frame's :class:`RequestHead` (from :func:`read_request_head`).
    ``strict_codec``: every tensor must travel in the cut's codec (the manifest's
    ``codec.name``), or raw where that codec cannot carry its dtype.
    ``finite``: a float tensor holding NaN or infinity is refused.
    """
    try:
        cut_id: str | None
        version: str | None
        if isinstance(data, RequestHead):  # its routing fields are checked already
            header, view, end = data.header, data.view, data.end
            model, cut_id, version = data.model, data.cut_id, data.model_version
        else:
            header, view, end = _split(data, KIND_REQUEST, _REQUEST_KEYS, limits)
            model = _text(header, "model", "frame")
            cut_id = version = None
        if model != manifest.model_name:
            raise ProtocolError(
                f"frame.model: {model!r} does not match the package's {manifest.model_name!r}"
            )
        if cut_id is None:
            cut_id = _text(header, "cut_id", "frame")
        cut = manifest.find_cut(cut_id)
        if cut is None or cut.kind == "all":
            raise ProtocolError(
                f"frame.cut_id: {cut_id!r} is not a cut the package serves in the cloud "
                f"({', '.join(c.id for c in manifest.cuts if c.kind != 'all') or 'none'})"
            )
        privacy = _obj(header["privacy"], "frame.privacy", _PRIVACY_KEYS)
        deadline = header["deadline_ms"]
        if not _is_int(deadline) or not 0 <= deadline <= _MAX_U64:
            raise ProtocolError(f"frame.deadline_ms: {deadline!r} is not a uint64")
        request_id = _text(header, "request_id", "frame")
        if version is None:
            version = _text(header, "model_version", "frame")
        trace_id = _text(header, "trace_id", "frame")
        priv = Privacy(
            noise_multiplier=_amount(privacy, "noise_multiplier", "frame.privacy"),
            clip=_amount(privacy, "clip", "frame.privacy"),
            epsilon=_amount(privacy, "epsilon", "frame.privacy"),
        )
        want = _cut_codec(cut.codec.name, codecs) if strict_codec else None
        tensors = _tensors(
            header["tensors"], view, end, manifest, cut.tensors, limits, codecs, cut.quant, want
        )
        if finite:
            for i, t in enumerate(tensors):
                if t.array.dtype.kind in "fc" and not np.isfinite(t.array).all():
                    raise ProtocolError(
                        f"frame.tensors[{i}].payload: {t.name!r} holds NaN or infinity"
                    )
    except (ProtocolError, CodecError):
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, struct.error) as exc:
        raise ProtocolError(f"frame: malformed ({type(exc).__name__}: {exc})") from exc
    return Request(request_id, model, version, cut_id, tensors, priv, deadline, trace_id)


def decode_response(
    data: bytes, manifest: Manifest, limits: Limits, codecs: Mapping[int, Codec] | None = None
) -> Response:
    """Parse and validate a response frame against the manifest's outputs.

    A status other than 200 must carry no tensors; its message says why.
    """
    try:
        header, view, end = _split(data, KIND_RESPONSE, _RESPONSE_KEYS, limits)
        request_id = _text(header, "request_id", "frame")
        message = _text(header, "message", "frame", max_len=4096)
        status = header["status"]
        if not _is_int(status) or not 100 <= status <= 999:
            raise ProtocolError(f"frame.status: {status!r} is not a status code")
        version = _text(header, "model_version", "frame")
        load = _amount(header, "load", "frame")
        specs = manifest.outputs if status == STATUS_OK else ()
        tensors = _tensors(header["tensors"], view, end, manifest, specs, limits, codecs)
    except (ProtocolError, CodecError):
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, struct.error) as exc:
        raise ProtocolError(f"frame: malformed ({type(exc).__name__}: {exc})") from exc
    return Response(request_id, status, tensors, message, version, load)


def _encode(
    kind: int,
    header: dict[str, Any],
    tensors: Sequence[WireTensor],
    codecs: Mapping[int, Codec] | None,
) -> bytes:
    metas: list[dict[str, Any]] = []
    payloads: list[bytes] = []
    for i, t in enumerate(tensors):
        codec = get_codec(t.codec, codecs)
        array = np.asarray(t.array)
        try:
            payloads.append(codec.encode(array, t.quant))
        except CodecError as exc:
            raise CodecError(f"frame.tensors[{i}] ({t.name}): {exc}") from exc
        quant: dict[str, Any] | str | None = None
        if t.quant is not None and t.quant_ref:
            quant = QUANT_FROM_MANIFEST
        elif t.quant is not None:
            quant = {
                "scale": list(t.quant.scale),
                "zero_point": list(t.quant.zero_point),
                "axis": t.quant.axis,
            }
        metas.append(
            {
                "name": t.name,
                "dtype": dtype_name(array.dtype),
                "shape": list(array.shape),
                "codec": codec.id,
                "quant": quant,
            }
        )
    header["tensors"] = metas
    blob = _JSON_ENCODER.encode(header).encode("utf-8")
    if payloads:  # pad the JSON with spaces: the first payload starts 16-byte aligned
        blob += b" " * (-(_PREAMBLE.size + len(blob) + _LENGTH.size) % _PAYLOAD_ALIGN)
    parts = [_PREAMBLE.pack(MAGIC, FRAME_VERSION, kind, len(blob)), blob]
    for p in payloads:
        parts += [_LENGTH.pack(len(p)), p]
    return b"".join(parts)


def _split(
    data: bytes, kind: int, keys: frozenset[str], limits: Limits
) -> tuple[dict[str, Any], memoryview, int]:
    """Check the preamble and parse the header; return it, the frame and the payloads' offset."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame: expected bytes, got {type(data).__name__}")
    view = memoryview(data).cast("B")
    if len(view) > limits.max_frame_bytes:
        raise ProtocolError(f"frame: {len(view)} bytes exceeds the limit {limits.max_frame_bytes}")
    if len(view) < _PREAMBLE.size:
        raise ProtocolError(f"frame: {len(view)} bytes is too short for a frame")
    magic, version, got_kind, hlen = _PREAMBLE.unpack_from(view)
    if magic != MAGIC:
        raise ProtocolError(f"frame.magic: {magic!r} is not {MAGIC!r}")
    if version != FRAME_VERSION:
        raise ProtocolError(
            f"frame.version: {version} is not supported (this splitinfer speaks {FRAME_VERSION})"
        )
    if got_kind != kind:
        raise ProtocolError(f"frame.kind: {got_kind} is not {kind}")
    if hlen > limits.max_header_bytes:
        raise ProtocolError(f"frame.header: {hlen} bytes exceeds {limits.max_header_bytes}")
    end = _PREAMBLE.size + hlen
    if end > len(view):
        raise ProtocolError(
            f"frame.header: {hlen} bytes claimed, {len(view) - _PREAMBLE.size} left"
        )
    try:
        header = _JSON_DECODER.decode(str(view[_PREAMBLE.size : end], "utf-8"))
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"frame.header: not UTF-8 JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"frame.header: expected an object, got {type(header).__name__}")
    header = _obj(header, "frame", keys)
    if not isinstance(header["tensors"], list):
        raise ProtocolError("frame.tensors: expected a list")
    return header, view, end


def _payloads(view: memoryview, offset: int, count: int, limits: Limits) -> list[memoryview]:
    """Cut the payload section into ``count`` length-prefixed payloads, every byte used."""
    payloads: list[memoryview] = []
    for i in range(count):
        if offset + _LENGTH.size > len(view):
            raise ProtocolError(f"frame.tensors[{i}].payload: length missing (frame truncated)")
        (plen,) = _LENGTH.unpack_from(view, offset)
        offset += _LENGTH.size
        if plen > limits.max_tensor_bytes:
            raise ProtocolError(
                f"frame.tensors[{i}].payload: {plen} bytes exceeds {limits.max_tensor_bytes}"
            )
        if offset + plen > len(view):
            raise ProtocolError(
                f"frame.tensors[{i}].payload: {plen} bytes claimed, {len(view) - offset} left"
            )
        payloads.append(view[offset : offset + plen])
        offset += plen
    if offset != len(view):
        raise ProtocolError(f"frame: {len(view) - offset} trailing bytes after the last payload")
    return payloads


def _tensors(
    raw: Any,
    view: memoryview,
    end: int,
    manifest: Manifest,
    specs: Sequence[TensorSpec],
    limits: Limits,
    codecs: Mapping[int, Codec] | None,
    calibrated: Mapping[str, QuantSpec] | None = None,
    want: Codec | None = None,
) -> tuple[WireTensor, ...]:
    """Validate every tensor header (:func:`_check_once`), then decode the payloads."""
    checked = _check_once(raw, manifest, specs, limits, codecs, calibrated, want)
    payloads = _payloads(view, end, len(checked), limits)
    tensors = []
    for i, ((dtype, shape, codec, quant, ref), payload) in enumerate(
        zip(checked, payloads, strict=True)
    ):
        try:
            array = codec.decode(payload, dtype, shape, quant, limits.max_tensor_bytes)
        except CodecError as exc:
            raise CodecError(f"frame.tensors[{i}].payload: {exc}") from exc
        tensors.append(WireTensor(specs[i].name, array, codec.id, quant, ref))
    return tuple(tensors)


#: What checking one tensor header gives: dtype, shape, codec, parameters, from the manifest.
_Checked = tuple[str, tuple[int, ...], Codec, QuantParams | None, bool]
#: Tensor headers checked already (see :func:`_check_once`), at most ``_CHECKED_MAX``.
_CHECKED: dict[tuple[Any, ...], tuple[Any, ...]] = {}
_CHECKED_MAX = 256


def _check_once(
    raw: Any,
    manifest: Manifest,
    specs: Sequence[TensorSpec],
    limits: Limits,
    codecs: Mapping[int, Codec] | None,
    calibrated: Mapping[str, QuantSpec] | None,
    want: Codec | None,
) -> tuple[_Checked, ...]:
    """:func:`_check`, remembered: a device sends the same tensor headers request after
    request. The key is the headers' ``repr``, exact to the type (``1``, ``1.0`` and
    ``True`` differ; JSON gives nothing whose ``repr`` is ambiguous), with ``limits`` and
    the identity of everything else the check reads, held by the entry so that no id is
    reused meanwhile. Headers with quantization parameters listed are checked every time
    (keying a per-channel list costs what checking it does); failures are not kept."""
    for t in raw:
        if not isinstance(t, dict) or isinstance(t.get("quant"), (dict, list)):
            return _check(raw, manifest, specs, limits, codecs, calibrated, want)
    key = (repr(raw), limits, id(manifest), id(specs), id(codecs), id(calibrated), id(want))
    hit = _CHECKED.get(key)
    if (
        hit is not None
        and hit[0] is manifest
        and hit[1] is specs
        and hit[2] is codecs
        and hit[3] is calibrated
        and hit[4] is want
    ):
        return hit[5]  # type: ignore[no-any-return]
    checked = _check(raw, manifest, specs, limits, codecs, calibrated, want)
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.clear()
    _CHECKED[key] = (manifest, specs, codecs, calibrated, want, checked)
    return checked


def _check(
    raw: Any,
    manifest: Manifest,
    specs: Sequence[TensorSpec],
    limits: Limits,
    codecs: Mapping[int, Codec] | None,
    calibrated: Mapping[str, QuantSpec] | None,
    want: Codec | None,
) -> tuple[_Checked, ...]:
    """Every tensor header checked against the manifest's ``specs``; raises
    :class:`ProtocolError` naming the field at fault."""
    names = [s.name for s in specs]
    got = [t.get("name") if isinstance(t, dict) else None for t in raw]
    if got != names:
        raise ProtocolError(f"frame.tensors: names {got!r} are not the expected {names!r}")
    symbols: dict[str, int] = {}
    checked: list[_Checked] = []
    for i, (item, spec) in enumerate(zip(raw, specs, strict=True)):
        where = f"frame.tensors[{i}]"
        meta = _obj(item, where, _TENSOR_KEYS)
        dtype = meta["dtype"]
        if dtype != spec.dtype:
            raise ProtocolError(f"{where}.dtype: {dtype!r} is not the manifest's {spec.dtype!r}")
        shape = _shape(meta["shape"], spec, manifest.batch_dim, symbols, limits, where)
        nbytes = math.prod(shape) * _itemsize(spec.dtype)
        if nbytes > limits.max_tensor_bytes:
            raise ProtocolError(
                f"{where}.shape: {list(shape)} is {nbytes} bytes, over {limits.max_tensor_bytes}"
            )
        if not _is_int(meta["codec"]):
            raise ProtocolError(f"{where}.codec: {meta['codec']!r} is not an int")
        try:
            codec = get_codec(meta["codec"], codecs)
        except CodecError as exc:
            raise ProtocolError(f"{where}.codec: {exc}") from exc
        if spec.dtype not in codec.dtypes:
            raise ProtocolError(f"{where}.codec: {codec.name} cannot carry {spec.dtype}")
        if want is not None:
            if spec.dtype in want.dtypes:
                allowed = [want]
            else:  # what the cut's codec cannot carry travels losslessly
                companion = want.id in ZSTD_COMPANIONS
                allowed = [get_codec(c, codecs) for c in ((RAW, ZSTD) if companion else (RAW,))]
            if codec.id not in {c.id for c in allowed}:
                which = " or ".join(c.name for c in allowed)
                raise ProtocolError(
                    f"{where}.codec: {codec.name} is not the cut's codec ({which}, "
                    "from the manifest)"
                )
        ref = meta["quant"] == QUANT_FROM_MANIFEST and codec.needs_params
        quant: QuantParams | None
        if ref:
            quant = _calibrated(calibrated or {}, spec.name, shape, f"{where}.quant")
        else:
            quant = _quant(meta["quant"], codec, shape, f"{where}.quant")
        checked.append((spec.dtype, shape, codec, quant, ref))
    return tuple(checked)


def _cut_codec(name: str, codecs: Mapping[int, Codec] | None) -> Codec:
    registry = default_codecs() if codecs is None else codecs
    for codec in registry.values():
        if codec.name == name:
            return codec
    raise ProtocolError(f"the cut's codec {name!r} is not known here")


def _shape(
    raw: Any,
    spec: TensorSpec,
    batch_dim: str | None,
    symbols: dict[str, int],
    limits: Limits,
    where: str,
) -> tuple[int, ...]:
    """The shape, checked dim by dim; a symbol binds to one value across all tensors."""
    if not isinstance(raw, list) or len(raw) > _MAX_RANK or not all(map(_is_int, raw)):
        raise ProtocolError(f"{where}.shape: {raw!r} is not a list of at most 8 ints")
    if len(raw) != len(spec.shape):
        raise ProtocolError(
            f"{where}.shape: rank {len(raw)} is not the manifest's {len(spec.shape)}"
        )
    for d, (got, want) in enumerate(zip(raw, spec.shape, strict=True)):
        if isinstance(want, int):
            if got != want:
                raise ProtocolError(
                    f"{where}.shape: dim {d} is {got}, the manifest says {want} "
                    f"(shape {list(spec.shape)})"
                )
            continue
        limit = limits.max_batch if want == batch_dim else 2**31 - 1
        if not 1 <= got <= limit:
            raise ProtocolError(f"{where}.shape: dim {d} ({want}) is {got}, not in [1, {limit}]")
        bound = symbols.setdefault(want, got)
        if got != bound:
            raise ProtocolError(
                f"{where}.shape: dim {d} ({want}) is {got}, but an earlier tensor has {bound}"
            )
    return tuple(raw)


def _quant(raw: Any, codec: Codec, shape: tuple[int, ...], where: str) -> QuantParams | None:
    if not codec.needs_params:
        if raw is not None:
            raise ProtocolError(f"{where}: codec {codec.name} takes no quantization parameters")
        return None
    obj = _obj(raw, where, _QUANT_KEYS)
    scale, zero, axis = obj["scale"], obj["zero_point"], obj["axis"]
    if not isinstance(scale, list) or not all(isinstance(s, float) for s in scale):
        raise ProtocolError(f"{where}.scale: expected a list of floats")
    if not isinstance(zero, list) or not all(_is_int(z) for z in zero):
        raise ProtocolError(f"{where}.zero_point: expected a list of ints")
    if not _is_int(axis):
        raise ProtocolError(f"{where}.axis: expected an int")
    try:
        params = QuantParams(tuple(scale), tuple(zero), axis)
        params.check_shape(shape)
    except CodecError as exc:
        raise ProtocolError(f"{where}: {exc}") from exc
    return params


def _calibrated(
    calibrated: Mapping[str, QuantSpec], name: str, shape: tuple[int, ...], where: str
) -> QuantParams:
    spec = calibrated.get(name)
    if spec is None:
        raise ProtocolError(
            f"{where}: {QUANT_FROM_MANIFEST!r}, but the package has no calibrated "
            f"parameters for {name!r}"
        )
    try:
        params = QuantParams(spec.scale, spec.zero_point, spec.axis or 0)
        params.check_shape(shape)
    except CodecError as exc:
        raise ProtocolError(f"{where}: the manifest's parameters do not fit: {exc}") from exc
    return params


def _obj(raw: Any, where: str, keys: frozenset[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where}: expected an object, got {type(raw).__name__}")
    if raw.keys() == keys:
        return raw
    missing = sorted(keys - raw.keys())
    if missing:
        raise ProtocolError(f"{where}.{missing[0]}: missing")
    extra = sorted(raw.keys() - keys)
    if extra:
        raise ProtocolError(f"{where}.{extra[0]}: unknown field")
    return raw


def _text(obj: dict[str, Any], key: str, where: str, max_len: int = _MAX_TEXT) -> str:
    value = obj[key]
    if not isinstance(value, str) or len(value) > max_len:
        raise ProtocolError(f"{where}.{key}: expected a string of at most {max_len} characters")
    return value


def _amount(obj: dict[str, Any], key: str, where: str) -> float:
    value = obj[key]
    if value.__class__ is float and 0.0 <= value < math.inf:  # the usual case, at once
        return value
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ProtocolError(f"{where}.{key}: expected a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number < 0:
        raise ProtocolError(f"{where}.{key}: {value!r} is not a finite number >= 0")
    return number


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _nan(token: str) -> Any:
    raise ValueError(f"{token} is not allowed")


@functools.cache
def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


#: One JSON decoder and encoder for every frame: ``json.loads`` and ``json.dumps`` build a
#: new one on every call that passes an option.
_JSON_DECODER = json.JSONDecoder(parse_constant=_nan)
_JSON_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
