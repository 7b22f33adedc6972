"""The local API's bodies: .npy, .npz, JSON or a picture in, .npz or JSON out, all checked.

An application sends the model's input as an ``.npy`` body (one input), an
``.npz`` keyed by input name (any number), JSON ``{"inputs": {name: nested
lists}}``, or one picture (``Content-Type: image/png``, ``image/jpeg``, any
``image/*`` Pillow reads) when the package declares preprocessing for its single
input: the picture becomes one sample through the same function the partitioner
calibrated with (:func:`splitinfer.shared.preprocess.image_to_input`). A
picture for a package that declares none is refused with 415.

:func:`check_inputs` holds every input to the manifest: the names,
the dtype (a same-kind cast such as float64 to float32 is made; anything else
is refused), the rank and every fixed dimension, and a symbol (the batch) of
the same size across inputs. Anything wrong is a :class:`BadInput` (HTTP 400)
whose one line names the input and the fix.
"""

from __future__ import annotations

import io
import json
import math
import threading
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from splitinfer.shared.errors import CodecError, ProtocolError
from splitinfer.shared.manifest import Manifest, TensorSpec
from splitinfer.shared.preprocess import image_to_input

Array = np.ndarray[Any, Any]

NPY_TYPES = ("application/x-npy", "application/npy")
NPZ_TYPES = ("application/x-npz", "application/npz", "application/zip")
JSON_TYPE = "application/json"
IMAGE_PREFIX = "image/"
#: numpy parses an .npy header with ``ast.literal_eval``; CPython 3.11 before 3.11.8 keeps the
#: AST constructor's recursion depth in state shared by all threads, so two headers parsed at
#: once in the executor can fail with "SystemError: AST constructor recursion depth mismatch"
#: (python/cpython#106905; seen in CI as a 500). Headers are a few hundred bytes: parse one at a
#: time, and only once per array.
_HEADER_LOCK = threading.Lock()
#: PNG, JPEG, GIF, BMP, WebP (RIFF) signatures: a picture sent without a Content-Type.
_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF8", b"BM", b"RIFF")
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"
#: Largest batch accepted (the wire frame's own limit).
MAX_BATCH = 256


class BadInput(ProtocolError):
    """The application's request does not fit the model (HTTP 400)."""

    http_status = 400


class UnsupportedBody(BadInput):
    """A body this package cannot take, e.g. a picture without declared preprocessing (415)."""

    http_status = 415


def body_kind(content_type: str, body: bytes) -> str:
    """The body's format (npy, npz or json): from the Content-Type, else its first bytes."""
    if not body:
        raise BadInput("empty body; send the model's input as .npy, .npz or JSON")
    ctype = content_type.split(";", maxsplit=1)[0].strip().lower()
    if ctype in NPY_TYPES:
        return "npy"
    if ctype in NPZ_TYPES:
        return "npz"
    if ctype == JSON_TYPE or ctype.endswith("+json"):
        return "json"
    if ctype.startswith(IMAGE_PREFIX):
        return "image"
    if body.startswith(_NPY_MAGIC):
        return "npy"
    if body.startswith(_ZIP_MAGIC):
        return "npz"
    if body.lstrip()[:1] == b"{":
        return "json"
    if body.startswith(_IMAGE_MAGIC):
        return "image"
    raise BadInput(
        f"body of Content-Type {content_type or 'none'!r} is not .npy, .npz or JSON, nor a "
        f"picture; send {NPY_TYPES[0]}, {NPZ_TYPES[0]}, {JSON_TYPE} or image/png"
    )


def parse_body(
    kind: str, body: bytes, manifest: Manifest, max_bytes: int = 64 * 2**20
) -> dict[str, Array]:
    """The raw arrays of a request body, by input name (not yet checked).

    Nothing is allocated from what a header claims: an ``.npy`` header's shape
    and dtype must account for exactly the bytes that follow it, and an
    ``.npz`` whose members would inflate beyond ``max_bytes`` in all is refused
    from the archive's directory, before anything is inflated (and a member is
    never inflated past the size its directory entry states).
    """
    if not body:
        raise BadInput("empty body; send the model's input as .npy, .npz or JSON")
    if kind == "npy":
        if len(manifest.inputs) != 1:
            names = ", ".join(s.name for s in manifest.inputs)
            raise BadInput(
                f"a .npy body carries one array, the model takes {len(manifest.inputs)} "
                f"inputs ({names}); send an .npz keyed by input name"
            )
        return {manifest.inputs[0].name: _load_npy(body, max_bytes)}
    if kind == "npz":
        return _load_npz(body, max_bytes)
    if kind == "json":
        return _load_json(body)
    if kind == "image":
        return _load_image(body, manifest)
    raise BadInput(f"unknown body kind {kind!r}")


def _load_image(body: bytes, manifest: Manifest) -> dict[str, Array]:
    """One picture as one sample of the single input, by the package's preprocessing."""
    if not manifest.preprocessing:
        raise UnsupportedBody(
            "this package declares no preprocessing, so a picture cannot become the model's "
            "input; send .npy, .npz or JSON, or partition with --preprocess"
        )
    if len(manifest.inputs) != 1:
        names = ", ".join(s.name for s in manifest.inputs)
        raise UnsupportedBody(
            f"a picture is one sample of a single-input model; this one takes {names}: "
            "send an .npz keyed by input name"
        )
    spec = manifest.inputs[0]
    pre = manifest.preprocessing.get(spec.name)
    if pre is None:
        raise UnsupportedBody(
            f"this package declares no preprocessing for input {spec.name!r}; send .npy, .npz "
            "or JSON"
        )
    try:
        return {spec.name: image_to_input(body, pre, spec)}
    except CodecError as exc:
        raise BadInput(f"image body: {exc}") from None


def _load_npy(body: bytes, max_bytes: int, where: str = "body") -> Array:
    fp = io.BytesIO(body)
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fp)
        with _HEADER_LOCK:
            if version == (1, 0):
                shape, fortran, dtype = fmt.read_array_header_1_0(fp)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, dtype = fmt.read_array_header_2_0(fp)
            else:
                raise ValueError(f"unsupported .npy version {version}")
    except (ValueError, OSError, EOFError, SyntaxError) as exc:
        raise BadInput(f"{where} is not a valid .npy file ({_short(exc)})") from None
    if dtype.hasobject:
        raise BadInput(f"{where} is not a valid .npy file of numbers (it holds objects)")
    try:
        need = math.prod(shape) * dtype.itemsize
    except (TypeError, OverflowError):
        raise BadInput(f"{where}: .npy header shape {shape!r} is not a shape") from None
    have = len(body) - fp.tell()
    if need > max_bytes:
        raise BadInput(
            f"{where}: .npy header claims shape {list(shape)} {dtype} ({need} bytes), over the "
            f"limit of {max_bytes} bytes"
        )
    if need != have:
        raise BadInput(
            f"{where}: .npy header claims shape {list(shape)} {dtype} ({need} bytes), but "
            f"{have} bytes follow it"
        )
    # the header is checked above: the bytes after it are the array (a copy, so it is writable)
    flat = np.frombuffer(body, dtype=dtype, count=math.prod(shape), offset=fp.tell())
    return flat.reshape(shape, order="F" if fortran else "C").copy(order="K")


def _load_npz(body: bytes, max_bytes: int) -> dict[str, Array]:
    out: dict[str, Array] = {}
    try:
        with zipfile.ZipFile(io.BytesIO(body)) as archive:
            members = archive.infolist()
            total = sum(m.file_size for m in members)
            if total > max_bytes:
                raise BadInput(
                    f"body: the .npz members inflate to {total} bytes, over the limit of "
                    f"{max_bytes} bytes"
                )
            for member in members:
                name = member.filename
                if not name.endswith(".npy") or member.is_dir():
                    raise BadInput(f"body: .npz member {name[:64]!r} is not an .npy file")
                with archive.open(member) as stream:
                    # ZipExtFile inflates at most the entry's file_size (then checks the CRC)
                    data = stream.read(member.file_size)
                    if stream.read(1):
                        raise BadInput(f"body: .npz member {name[:64]!r} is longer than stated")
                out[name[: -len(".npy")]] = _load_npy(data, max_bytes, f".npz member {name!r}")
    except BadInput:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError, RuntimeError) as exc:
        raise BadInput(f"body is not a valid .npz archive ({_short(exc)})") from None
    return out


def _load_json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadInput(f"body is not valid JSON ({_short(exc)})") from None
    if not isinstance(data, dict) or not isinstance(data.get("inputs"), dict):
        raise BadInput('JSON body must be {"inputs": {name: nested lists}}')
    extra = sorted(set(data) - {"inputs"})
    if extra:
        raise BadInput(f"JSON body: unknown field {extra[0]!r}; only 'inputs' is read")
    return dict(data["inputs"])


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:160] or type(exc).__name__


def check_inputs(manifest: Manifest, raw: Mapping[str, Any]) -> dict[str, Array]:
    """Every model input, as an array of the manifest's dtype and a fitting shape."""
    names = [s.name for s in manifest.inputs]
    extra = sorted(set(raw) - set(names))
    if extra:
        raise BadInput(f"unknown input {extra[0]!r}; the model takes {', '.join(names)}")
    missing = [n for n in names if n not in raw]
    if missing:
        raise BadInput(f"input {missing[0]!r} is missing; the model takes {', '.join(names)}")
    symbols: dict[str, tuple[int, str]] = {}
    out: dict[str, Array] = {}
    for spec in manifest.inputs:
        array = _as_dtype(raw[spec.name], spec)
        _check_shape(array, spec, manifest.batch_dim, symbols)
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            raise BadInput(f"input {spec.name!r}: holds NaN or infinity; send finite values")
        out[spec.name] = array
    return out


def _as_dtype(value: Any, spec: TensorSpec) -> Array:
    want = np.dtype(spec.dtype)
    if isinstance(value, np.ndarray):
        have = value.dtype
        if have == want:
            return value
        if have.kind in "OUSV" or not np.can_cast(have, want, "same_kind"):
            raise BadInput(
                f"input {spec.name!r}: dtype {have} does not convert to the model's {want}; "
                f"send {want}"
            )
        if want.kind in "iu" and value.size:
            info = np.iinfo(want)
            if value.min() < info.min or value.max() > info.max:
                raise BadInput(f"input {spec.name!r}: values out of the range of {want}")
        return value.astype(want)
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise BadInput(f"input {spec.name!r}: not a rectangular array ({_short(exc)})") from None
    if array.dtype.kind not in "biuf" or array.dtype == object:
        raise BadInput(
            f"input {spec.name!r}: expected nested lists of numbers of equal length, "
            f"got {array.dtype} values"
        )
    if want.kind in "iub" and array.dtype.kind == "f":
        raise BadInput(f"input {spec.name!r}: the model takes {want}; send whole numbers")
    try:
        return _as_dtype(array, spec)
    except BadInput:
        if want.kind == "f" and array.dtype.kind in "biu":
            return array.astype(want)
        raise


def _check_shape(
    array: Array, spec: TensorSpec, batch_dim: str | None, symbols: dict[str, tuple[int, str]]
) -> None:
    shape = array.shape
    pretty = "[" + ", ".join(str(d) for d in spec.shape) + "]"
    if len(shape) != len(spec.shape):
        raise BadInput(
            f"input {spec.name!r}: shape {list(shape)} has rank {len(shape)}, the model takes "
            f"{pretty} (rank {len(spec.shape)})"
        )
    for axis, (got, want) in enumerate(zip(shape, spec.shape, strict=True)):
        if isinstance(want, int):
            if got != want:
                raise BadInput(
                    f"input {spec.name!r}: dimension {axis} is {got}, the model takes {pretty}"
                )
            continue
        if want == batch_dim or (batch_dim is None and axis == 0):
            if got < 1 or got > MAX_BATCH:
                raise BadInput(
                    f"input {spec.name!r}: batch of {got}; send between 1 and {MAX_BATCH} samples"
                )
        elif got < 1:
            raise BadInput(f"input {spec.name!r}: dimension {axis} is empty")
        if want == "?":
            continue
        seen = symbols.get(want)
        if seen is not None and seen[0] != got:
            raise BadInput(
                f"input {spec.name!r}: dimension {axis} ({want}) is {got}, but input "
                f"{seen[1]!r} has {want}={seen[0]}; they must agree"
            )
        symbols.setdefault(want, (got, spec.name))


# -- answers -----------------------------------------------------------------------


def npz_bytes(outputs: Mapping[str, Array]) -> bytes:
    """The outputs as an uncompressed .npz, keyed by output name."""
    buf = io.BytesIO()
    arrays: dict[str, Any] = {k: np.asarray(v) for k, v in outputs.items()}
    np.savez(buf, **arrays)
    return buf.getvalue()


def json_bytes(document: Mapping[str, Any]) -> bytes:
    """A JSON answer; arrays become nested lists. NaN or infinity cannot be sent as JSON."""

    def default(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            return value.tolist()
        if isinstance(value, np.generic):
            return value.item()
        raise TypeError(f"{type(value).__name__} is not JSON serialisable")

    try:
        return json.dumps(document, default=default, allow_nan=False).encode("utf-8")
    except ValueError:
        raise ProtocolError(
            "an output holds NaN or infinity, which JSON cannot carry; ask for .npz "
            "(Accept: application/x-npz)"
        ) from None
