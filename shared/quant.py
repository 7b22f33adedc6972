"""Affine int8 quantization: the parameters, calibration, and the fast and reference paths.

``x ~ (q - zero_point) * scale`` per channel along ``axis`` (or one pair for the
tensor). The vectorised :func:`quantize`/:func:`dequantize` use ONNX Runtime's
kernels where they are faster (:mod:`.quantops`, the same bytes) and numpy
otherwise; :func:`quantize_reference`/:func:`dequantize_reference` loop one
channel at a time, and the tests check they agree bit for bit. The image codecs'
float-to-pixel mapping (:func:`calibrate_image`, :func:`to_pixels`) is the same
affine with ``u = q + 128``. Used by the codecs (:mod:`.codecs`), which re-export
every name here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from splitinfer.shared import images, quantops
from splitinfer.shared.errors import CodecError

#: Scales must be normal float32 numbers; calibration never goes below _MIN_SCALE.
_F32_TINY = float(np.finfo(np.float32).tiny)
_F32_MAX = float(np.finfo(np.float32).max)
_MIN_SCALE = 1e-30
_INT8_MIN, _INT8_MAX = -128, 127

Array = npt.NDArray[Any]
Buffer = bytes | bytearray | memoryview
F32 = npt.NDArray[np.float32]
I8 = npt.NDArray[np.int8]
U8 = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class QuantParams:
    """Affine int8 parameters: ``x ~ (q - zero_point) * scale``.

    One scale and zero point per channel along ``axis`` (axis 1 for NCHW or NC
    tensors), or a single pair for the whole tensor, in which case ``axis`` is
    not used.
    """

    scale: tuple[float, ...]
    zero_point: tuple[int, ...]
    axis: int = 1

    def __post_init__(self) -> None:
        if not self.scale:
            raise CodecError("quant.scale: empty")
        if len(self.zero_point) != len(self.scale):
            raise CodecError(
                f"quant.zero_point: {len(self.zero_point)} values for {len(self.scale)} scales"
            )
        for s in self.scale:
            if not isinstance(s, float) or not _F32_TINY <= s <= _F32_MAX:
                raise CodecError(f"quant.scale: {s!r} is not a normal float32 > 0")
        for z in self.zero_point:
            if not isinstance(z, int) or isinstance(z, bool) or not _INT8_MIN <= z <= _INT8_MAX:
                raise CodecError(f"quant.zero_point: {z!r} is not an int in [-128, 127]")
        if not isinstance(self.axis, int) or isinstance(self.axis, bool) or self.axis < 0:
            raise CodecError(f"quant.axis: {self.axis!r} is not an int >= 0")

    @property
    def per_tensor(self) -> bool:
        return len(self.scale) == 1

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Raise :class:`CodecError` unless these parameters fit a tensor of ``shape``."""
        if self.per_tensor:
            return
        if self.axis >= len(shape):
            raise CodecError(f"quant.axis: {self.axis} is out of range for rank {len(shape)}")
        if shape[self.axis] != len(self.scale):
            raise CodecError(
                f"quant.scale: {len(self.scale)} channels, but axis {self.axis} of shape "
                f"{list(shape)} has {shape[self.axis]}"
            )

    @functools.cached_property
    def _linear(self) -> tuple[F32, npt.NDArray[np.int8], int]:
        scale = np.asarray(self.scale, dtype=np.float32)
        zero = np.asarray(self.zero_point, dtype=np.int8)
        if self.per_tensor:
            return scale.reshape(()), zero.reshape(()), -1
        return scale, zero, self.axis

    def _linear_args(self) -> tuple[F32, npt.NDArray[np.int8], int]:
        """Scale, zero point and axis (-1: one for the tensor) as QuantizeLinear takes them."""
        return self._linear

    def _broadcast(self, ndim: int) -> tuple[F32, F32]:
        scale = np.asarray(self.scale, dtype=np.float32)
        zero = np.asarray(self.zero_point, dtype=np.float32)
        if self.per_tensor:
            return scale.reshape(()), zero.reshape(())
        view = [1] * ndim
        view[self.axis] = len(self.scale)
        return scale.reshape(view), zero.reshape(view)


def calibrate_params(samples: Array, axis: int | None = 1) -> QuantParams:
    """Symmetric int8 parameters from the min/max of ``samples``.

    Per channel along ``axis``, or per tensor when ``axis`` is None. Zero points
    are 0 and ``scale = max(|min|, |max|) / 127``, at least 1e-30; an all-zero
    channel gets 1.0.
    """
    x = np.asarray(samples, dtype=np.float64)
    if x.size == 0 or not np.isfinite(x).all():
        raise CodecError("calibration samples must be non-empty and finite")
    if axis is None:
        amax = np.array([np.abs(x).max()])
        axis = 0
    else:
        if not 0 <= axis < x.ndim:
            raise CodecError(f"calibration axis {axis} is out of range for rank {x.ndim}")
        others = tuple(d for d in range(x.ndim) if d != axis)
        amax = np.abs(x).max(axis=others) if others else np.abs(x)
    scale = tuple(max(float(a) / _INT8_MAX, _MIN_SCALE) if a > 0 else 1.0 for a in amax)
    return QuantParams(scale=scale, zero_point=(0,) * len(scale), axis=axis)


def quantize(x: Array, params: QuantParams) -> I8:
    """Vectorised affine int8 quantization; values outside the range are clipped.

    ONNX Runtime's QuantizeLinear when it is there (:mod:`.quantops`: one pass, the
    same bytes), numpy otherwise.
    """
    x32 = _finite_f32(x)
    params.check_shape(x32.shape)
    fast = quantops.quantize(x32, *params._linear_args())
    if fast is not None:
        return fast
    return _quantize_numpy(x32, params)


def _quantize_numpy(x32: F32, params: QuantParams) -> I8:
    scale, zero = params._broadcast(x32.ndim)
    with np.errstate(over="ignore"):
        q = np.rint(x32 / scale)
    q += zero
    np.clip(q, _INT8_MIN, _INT8_MAX, out=q)
    out: I8 = q.astype(np.int8)
    return out


def dequantize(q: I8, params: QuantParams) -> F32:
    """Vectorised inverse of :func:`quantize` (up to the rounding it did); ONNX
    Runtime's DequantizeLinear when it is there, numpy otherwise."""
    params.check_shape(q.shape)
    fast = quantops.dequantize(q, *params._linear_args())
    if fast is not None:
        return fast
    return _dequantize_numpy(q, params)


def _dequantize_numpy(q: I8, params: QuantParams) -> F32:
    scale, zero = params._broadcast(q.ndim)
    out = q.astype(np.float32)
    out -= zero
    out *= scale
    return out


def quantize_reference(x: Array, params: QuantParams) -> I8:
    """Reference quantization: one channel at a time, the same float32 steps."""
    x32 = _finite_f32(x)
    params.check_shape(x32.shape)
    out = np.empty(x32.shape, dtype=np.int8)
    for c, (s, z) in enumerate(zip(params.scale, params.zero_point, strict=True)):
        index = (slice(None),) * params.axis + (c,) if not params.per_tensor else ...
        with np.errstate(over="ignore"):
            q = np.rint(x32[index] / np.float32(s)) + np.float32(z)
        out[index] = np.clip(q, _INT8_MIN, _INT8_MAX).astype(np.int8)
    return out


def dequantize_reference(q: I8, params: QuantParams) -> F32:
    """Reference dequantization: one channel at a time."""
    params.check_shape(q.shape)
    out = np.empty(q.shape, dtype=np.float32)
    for c, (s, z) in enumerate(zip(params.scale, params.zero_point, strict=True)):
        index = (slice(None),) * params.axis + (c,) if not params.per_tensor else ...
        out[index] = (q[index].astype(np.float32) - np.float32(z)) * np.float32(s)
    return out


def calibrate_image(samples: Array) -> QuantParams:
    """Per-tensor parameters that map ``samples`` to 256 pixel levels (image codecs).

    When every value lies on a grid of at most 256 levels that holds 0 (sklearn's
    digits scaled to k/16, pictures as k/255 or 0..255), the scale is the grid step
    and those values come back exactly (bit for bit when the step and the values
    are exact in float32, as k/16 and whole numbers are; else within an ulp).
    Otherwise the min/max range, widened to hold 0, is split into 255 steps:
    ``|err| <= scale / 2`` within it.
    """
    x = np.asarray(samples, dtype=np.float64)
    if x.size == 0 or not np.isfinite(x).all():
        raise CodecError("calibration samples must be non-empty and finite")
    found = images.grid(x)
    if found is not None and _F32_TINY <= found[0] <= _F32_MAX:
        step, j = found
    else:
        lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
        step = max((hi - lo) / 255, _MIN_SCALE) if hi > lo else 1.0
        j = int(np.clip(np.rint(-lo / step), 0, 255))
    return QuantParams(scale=(float(step),), zero_point=(j - 128,), axis=0)


def to_pixels(x: Array, params: QuantParams) -> U8:
    """Float values as uint8 pixels: the int8 quantization shifted by 128."""
    u: U8 = quantize(x, params).view(np.uint8) ^ np.uint8(0x80)
    return u


def from_pixels(u: U8, params: QuantParams) -> F32:
    """The inverse of :func:`to_pixels` (up to its rounding)."""
    return dequantize((np.asarray(u, dtype=np.uint8) ^ np.uint8(0x80)).view(np.int8), params)


def to_pixels_reference(x: Array, params: QuantParams) -> U8:
    """Reference of :func:`to_pixels`: one value at a time, the same float32 steps."""
    x32 = _finite_f32(x)
    params.check_shape(x32.shape)
    out = np.empty(x32.shape, dtype=np.uint8)
    for index in np.ndindex(*x32.shape):
        c = 0 if params.per_tensor else index[params.axis]
        s, z = np.float32(params.scale[c]), np.float32(params.zero_point[c])
        with np.errstate(over="ignore"):
            q = np.rint(x32[index] / s) + z
        out[index] = int(np.clip(q, _INT8_MIN, _INT8_MAX)) + 128
    return out


def _finite_f32(x: Array) -> F32:
    x32 = np.asarray(x, dtype=np.float32)
    if x32.size and not math.isfinite(float(x32.min()) + float(x32.max())):
        raise CodecError("cannot encode NaN or infinity with a lossy codec")
    return x32
