"""The cut tensors on the wire: the codec per tensor and per-batch int8 parameters.

Each cut tensor travels with the cut's codec (``manifest.cuts[].codec``), or raw
when that codec cannot carry its dtype (integer ids and masks). A lossy int8
codec uses the calibrated parameters of the manifest when it has them, else
parameters computed from the batch itself (:func:`batch_params`), per channel
when the channel axis is short enough for the frame's header.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from splitinfer.edge.model import CutRuntime
from splitinfer.shared.codecs import RAW, ZSTD, ZSTD_COMPANIONS, QuantParams, get_codec
from splitinfer.shared.errors import CodecError
from splitinfer.shared.frame import WireTensor

Array = np.ndarray[Any, Any]

#: Per-batch int8 parameters go per channel up to this many channels, else per tensor:
#: every scale travels in the frame's header (64 KiB at most).
MAX_WIRE_CHANNELS = 256


def quant_axis(array: Array) -> int | None:
    """The channel axis for per-batch int8 parameters, or None for one per tensor.

    C of NCHW, the features of [batch, features], the hidden axis of [batch, seq,
    hidden] (never a sequence axis) -- as the partitioner calibrates -- unless that
    axis is longer than :data:`MAX_WIRE_CHANNELS`.
    """
    if array.ndim < 2:
        return None
    axis = 2 if array.ndim == 3 else 1
    return axis if 1 < array.shape[axis] <= MAX_WIRE_CHANNELS else None


def batch_params(array: Array, axis: int | None) -> QuantParams:
    """``shared.codecs.calibrate_params``, bit for bit, in two float32 reductions.

    Symmetric int8 per channel along ``axis`` (per tensor when None): zero points
    0, ``scale = max|x| / 127`` (at least 1e-30; 1.0 for an all-zero channel).
    The reference copies the tensor to float64 first; the maxima are the same.
    """
    a = np.asarray(array, dtype=np.float32)
    if a.size == 0:
        raise CodecError("calibration samples must be non-empty and finite")
    if axis is None:
        amax = [max(-float(a.min()), float(a.max()))]
    else:
        others = tuple(d for d in range(a.ndim) if d != axis)
        amax = np.maximum(-a.min(axis=others), a.max(axis=others)).tolist()
    if not all(math.isfinite(v) for v in amax):
        raise CodecError("calibration samples must be non-empty and finite")
    scale = tuple(max(v / 127, 1e-30) if v > 0 else 1.0 for v in amax)
    return QuantParams(scale=scale, zero_point=(0,) * len(scale), axis=axis or 0)


def wire_tensor(rt: CutRuntime, name: str, array: Array) -> WireTensor:
    """One cut tensor as it travels: codec, and int8 parameters when the codec needs them."""
    codec = get_codec(rt.codec_id, rt.codecs)
    if str(array.dtype) not in codec.dtypes:
        # ids and masks: lossless, zstd-compressed under a zstd cut codec
        return WireTensor(name, array, ZSTD if codec.id in ZSTD_COMPANIONS else RAW)
    quant: QuantParams | None = None
    calibrated = False
    if codec.needs_params:
        quant = rt.quant.get(name)
        calibrated = quant is not None
        if quant is None:
            quant = batch_params(array, quant_axis(array))
    # calibrated parameters are in the manifest both sides hold: send a reference
    return WireTensor(name, array, codec.id, quant, quant_ref=calibrated)
