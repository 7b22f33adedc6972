"""Declared input preprocessing: how a picture becomes a model input.

A split package may declare, per image input, how an application's picture
(a PNG, JPEG, ... file) turns into the input tensor. The partitioner reads
calibration images with it and the edge agent reads image request bodies with
it, through the same function (:func:`image_to_input`), so both see the same
numbers::

    pixels = Pillow.open(file) -> EXIF orientation -> convert(mode) -> resize(size)
    x = (pixels * scale - mean) / std        (per channel, in float64)
    x laid out as [1, C, H, W] (NCHW), [1, H, W, C] (NHWC) or [1, H, W] (rank-3 grey)

Only 8-bit pictures are read (a 16-bit or float picture is refused rather than
clipped), and a picture above ``max_pixels`` (Pillow's ``MAX_IMAGE_PIXELS`` by
default) is refused from its header, before a pixel is decoded.

Pillow is imported at the point of use.
"""

from __future__ import annotations

import io
import json
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from splitinfer.shared.errors import CodecError, ConfigError, PackageError, SplitInferError

Array = npt.NDArray[Any]
U8 = npt.NDArray[np.uint8]

MODES = {"L": 1, "RGB": 3}  # mode -> channels
LAYOUTS = ("NCHW", "NHWC")
FILTERS = ("nearest", "box", "bilinear", "hamming", "bicubic", "lanczos")
#: Largest side of the declared size: a bound on what a request can make the agent allocate.
MAX_SIDE = 16384
#: File suffixes read as pictures in a calibration folder (compared in lower case).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff", ".ppm")
#: Pillow modes of 8-bit pictures, which convert to L or RGB without losing range.
_EIGHT_BIT = frozenset({"1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK"})
_EIGHT_BIT |= {"YCbCr", "LAB", "HSV"}
_KEYS = ("mode", "size", "layout", "scale", "mean", "std", "resize")


@dataclass(frozen=True)
class PreprocessSpec:
    """How one picture becomes one sample of an image input.

    ``x = (pixels * scale - mean) / std`` per channel, after converting the
    picture to ``mode`` ("L" grey, 1 channel; "RGB", 3) and resizing it to
    ``size`` (height, width) with the ``resize`` filter; laid out as ``layout``.
    ``mean`` and ``std`` hold one value (every channel) or one per channel.
    """

    mode: str
    size: tuple[int, int]  # (height, width)
    layout: str = "NCHW"
    scale: float = 1 / 255
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    resize: str = "bilinear"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PackageError(f"preprocess.mode: {self.mode!r} is not one of L (grey), RGB")
        size = self.size
        if (
            not isinstance(size, tuple)
            or len(size) != 2
            or not all(_is_int(d) and 1 <= d <= MAX_SIDE for d in size)
        ):
            raise PackageError(
                f"preprocess.size: {size!r} is not [height, width] in pixels (1..{MAX_SIDE})"
            )
        if self.layout not in LAYOUTS:
            raise PackageError(f"preprocess.layout: {self.layout!r} is not one of NCHW, NHWC")
        if not _is_number(self.scale) or not self.scale > 0:
            raise PackageError(f"preprocess.scale: {self.scale!r} is not a positive number")
        for key, values, positive in (("mean", self.mean, False), ("std", self.std, True)):
            if not isinstance(values, tuple) or len(values) not in {1, self.channels}:
                raise PackageError(
                    f"preprocess.{key}: {values!r} must hold 1 value or {self.channels} "
                    f"(one per channel of mode {self.mode})"
                )
            bad = [v for v in values if not _is_number(v) or (positive and not v > 0)]
            if bad:
                what = "positive numbers" if positive else "numbers"
                raise PackageError(
                    f"preprocess.{key}: {bad[0]!r} is not allowed; use finite {what}"
                )
        if self.resize not in FILTERS:
            raise PackageError(
                f"preprocess.resize: {self.resize!r} is not one of {', '.join(FILTERS)}"
            )

    @property
    def channels(self) -> int:
        return MODES.get(self.mode, 0)

    @property
    def identity(self) -> bool:
        """True when the values are the pixels themselves (an integer input may take them)."""
        return self.scale == 1 and set(self.mean) == {0} and set(self.std) == {1}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}

    @classmethod
    def from_dict(cls, data: Any, where: str = "preprocess") -> PreprocessSpec:
        """A spec from its JSON object; a bad field raises :class:`PackageError` naming it."""
        if not isinstance(data, dict):
            raise PackageError(f"{where}: expected an object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_KEYS))
        if unknown:
            raise PackageError(f"{where}.{unknown[0]}: unknown field; fields: {', '.join(_KEYS)}")
        for key in ("mode", "size"):
            if key not in data:
                raise PackageError(f"{where}.{key}: missing")
        kw: dict[str, Any] = dict(data)
        for key in ("size", "mean", "std"):
            if key in kw:
                if not isinstance(kw[key], list):
                    raise PackageError(f"{where}.{key}: expected a list, got {kw[key]!r}")
                kw[key] = tuple(kw[key])
        try:
            return cls(**kw)
        except PackageError as exc:
            raise PackageError(str(exc).replace("preprocess", where, 1)) from None

    def check_fits(
        self,
        tensor: Any,
        where: str,
        error: type[SplitInferError] = PackageError,
    ) -> None:
        """Raise ``error`` (one line, starting with ``where``) unless ``tensor`` (a
        :class:`~splitinfer.shared.manifest.TensorSpec`) takes one picture of this spec."""
        shape = tuple(tensor.shape)
        dims = _image_dims(shape, self.layout)
        pretty = "[" + ", ".join(str(d) for d in shape) + "]"
        if dims is None:
            raise error(
                f"{where}: input {tensor.name!r} of shape {pretty} is not an image batch "
                f"({self.layout}, or [N, H, W] for grey); preprocessing needs one"
            )
        lead, channels, height, width = dims
        if not (isinstance(lead, str) or lead == 1):
            raise error(
                f"{where}: input {tensor.name!r} of shape {pretty} has no batch axis first; "
                "one picture is one sample along it"
            )
        if isinstance(channels, int) and channels != self.channels:
            mode = {1: "L", 3: "RGB"}.get(channels)
            fix = f"use mode={mode}" if mode else "preprocessing gives 1 (L) or 3 (RGB) channels"
            raise error(
                f"{where}: mode {self.mode} gives {self.channels} channel(s), input "
                f"{tensor.name!r} {pretty} ({self.layout}) has {channels}; {fix}"
            )
        fixed = isinstance(height, int) and isinstance(width, int)
        for axis, got, side in (("height", height, self.size[0]), ("width", width, self.size[1])):
            if isinstance(got, int) and got != side:
                raise error(
                    f"{where}: size {self.size[0]}x{self.size[1]} does not match input "
                    f"{tensor.name!r} {pretty} ({self.layout}): its {axis} is {got}; "
                    + (f"use size={height}x{width}" if fixed else f"use {axis} {got}")
                )
        kind = np.dtype(tensor.dtype).kind
        if kind != "f" and not (kind in "iu" and self.identity):
            raise error(
                f"{where}: input {tensor.name!r} is {tensor.dtype}; scaled pictures need a "
                "float input (an integer input takes raw pixels: scale=1, mean 0, std 1)"
            )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _image_dims(shape: tuple[Any, ...], layout: str) -> tuple[Any, Any, Any, Any] | None:
    """(lead, channels, height, width) of an input shape in ``layout``; rank 3 is grey."""
    if len(shape) == 3:
        return shape[0], 1, shape[1], shape[2]
    if len(shape) != 4:
        return None
    if layout == "NCHW":
        return shape[0], shape[1], shape[2], shape[3]
    return shape[0], shape[3], shape[1], shape[2]


# -- the compact command-line form -------------------------------------------------------

_SPLIT = re.compile(r",(?=\s*[A-Za-z_]+\s*=)")


def parse_compact(text: str, where: str = "--preprocess") -> tuple[str | None, PreprocessSpec]:
    """``(input name or None, spec)`` from ``mode=L,size=8x8,scale=1/16[,input=NAME]``.

    ``size`` is ``HxW`` (or one number: a square); ``scale`` a number or a
    fraction ``1/255``; ``mean`` and ``std`` one number or one per channel,
    comma-separated (``mean=0.485,0.456,0.406``). Raises :class:`ConfigError`.
    """
    fields: dict[str, str] = {}
    for item in _SPLIT.split(text.strip()):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not value.strip():
            raise ConfigError(f"{where} {text!r}: {item!r} is not key=value")
        if key not in (*_KEYS, "input"):
            raise ConfigError(f"{where}: unknown key {key!r}; keys: {', '.join(_KEYS)}, input")
        if key in fields:
            raise ConfigError(f"{where}: {key} given twice")
        fields[key] = value.strip()
    data: dict[str, Any] = {k: v for k, v in fields.items() if k in ("mode", "layout", "resize")}
    if "size" in fields:
        data["size"] = _size(fields["size"], where)
    for key in ("scale", "mean", "std"):
        if key in fields:
            values = [_number(v, f"{where} {key}") for v in fields[key].split(",")]
            data[key] = values[0] if key == "scale" and len(values) == 1 else values
    try:
        spec = PreprocessSpec.from_dict(data, where)
    except PackageError as exc:
        raise ConfigError(str(exc)) from None
    return fields.get("input"), spec


def parse_option(
    text: str, inputs: Sequence[Any], where: str = "--preprocess"
) -> dict[str, PreprocessSpec]:
    """The ``--preprocess`` option: the compact form or a JSON file (``*.json``, or any
    existing file) holding the manifest entry's keys (plus an optional ``input``).

    Returns ``{input name: spec}``, checked against that input (``inputs`` are
    ``TensorSpec`` s); ``input`` may be left out for a single-input model. Raises
    :class:`ConfigError` (one line).
    """
    path = Path(text)
    if text.lower().endswith(".json") or path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{where} {text}: cannot be read ({exc.strerror})") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"{where} {text}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where} {text}: expected a JSON object of preprocess keys")
        name = data.pop("input", None)
        try:
            spec = PreprocessSpec.from_dict(data, where)
        except PackageError as exc:
            raise ConfigError(str(exc)) from None
    else:
        name, spec = parse_compact(text, where)
    by_name = {t.name: t for t in inputs}
    if name is None:
        if len(by_name) != 1:
            raise ConfigError(
                f"{where}: the model has {len(by_name)} inputs ({', '.join(by_name)}); "
                "name the image input with input=NAME"
            )
        name = next(iter(by_name))
    if name not in by_name:
        raise ConfigError(f"{where} input={name}: not a model input; inputs: {', '.join(by_name)}")
    spec.check_fits(by_name[name], where, ConfigError)
    return {str(name): spec}


def _size(text: str, where: str) -> list[int]:
    m = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?", text)
    if not m:
        raise ConfigError(f"{where} size {text!r}: use HEIGHTxWIDTH, e.g. size=224x224")
    height = int(m.group(1))
    return [height, int(m.group(2) or height)]


def _number(text: str, where: str) -> float:
    num, sep, den = text.partition("/")
    try:
        value = float(num) / float(den) if sep else float(num)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"{where} {text.strip()!r}: not a number (e.g. 0.5 or 1/255)") from None
    return value


# -- pictures to arrays ------------------------------------------------------------------


def decode_pixels(data: bytes, spec: PreprocessSpec, *, max_pixels: int | None = None) -> U8:
    """One picture file as ``[H, W, C]`` uint8 pixels of ``spec.mode`` and ``spec.size``.

    Raises :class:`CodecError` (one line) when Pillow cannot read it, when it is
    not an 8-bit picture, or when its header claims more than ``max_pixels``
    (default ``PIL.Image.MAX_IMAGE_PIXELS``).
    """
    from PIL import Image, ImageOps

    limit = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if limit is not None and width * height > limit:
                    raise CodecError(
                        f"a picture of {width}x{height} exceeds the limit of {limit} pixels"
                    )
                if image.mode not in _EIGHT_BIT:
                    raise CodecError(
                        f"a {image.format} picture of mode {image.mode} (not 8 bits per "
                        "channel); save it as 8-bit grey or RGB"
                    )
                image.load()
                picture = ImageOps.exif_transpose(image).convert(spec.mode)
    except CodecError:
        raise
    except Exception as exc:  # Pillow raises UnidentifiedImageError, OSError, SyntaxError, ...
        reason = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise CodecError(f"not a picture Pillow can read ({reason})") from None
    height, width = spec.size
    if picture.size != (width, height):
        resample = getattr(Image.Resampling, spec.resize.upper())
        picture = picture.resize((width, height), resample=resample)
    pixels = np.asarray(picture, dtype=np.uint8)
    return pixels[..., None] if pixels.ndim == 2 else pixels


def normalize(pixels: U8, spec: PreprocessSpec, dtype: str, rank: int = 4) -> Array:
    """``[N, H, W, C]`` pixels as the input: ``(pixels * scale - mean) / std`` in the layout.

    Computed in float64 and cast once to ``dtype``; ``rank`` 3 drops the channel
    axis (a grey ``[N, H, W]`` input).
    """
    x = pixels.astype(np.float64) * spec.scale
    x = (x - np.asarray(spec.mean, dtype=np.float64)) / np.asarray(spec.std, dtype=np.float64)
    if rank == 3:
        x = x[..., 0]
    elif spec.layout == "NCHW":
        x = x.transpose(0, 3, 1, 2)
    want = np.dtype(dtype)
    if want.kind in "iu":
        x = np.rint(x)
    return np.ascontiguousarray(x.astype(want))


def image_to_input(
    data: bytes, spec: PreprocessSpec, tensor: Any, *, max_pixels: int | None = None
) -> Array:
    """One picture file as one sample (batch axis of 1) of ``tensor`` (a ``TensorSpec``)."""
    pixels = decode_pixels(data, spec, max_pixels=max_pixels)
    return normalize(pixels[None], spec, tensor.dtype, len(tensor.shape))


def specs_from_dict(data: Any, where: str) -> dict[str, PreprocessSpec]:
    """The manifest's ``preprocessing`` object: input name to spec."""
    if not isinstance(data, Mapping):
        raise PackageError(f"{where}: expected an object, got {type(data).__name__}")
    return {str(k): PreprocessSpec.from_dict(v, f"{where}.{k}") for k, v in data.items()}


def is_image_file(name: str) -> bool:
    return any(name.lower().endswith(s) for s in IMAGE_SUFFIXES)
