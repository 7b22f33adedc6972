"""Quantize each weight once for all the edge segments cut from one model.

``--split auto`` quantizes an edge segment per shortlisted cut, and on a model
whose best cuts lie near its end those segments share nearly all their weights.
ONNX Runtime's quantizer computes the per-channel scales of a weight and its
quantized tensor in Python loops over the channels (``compute_data_quant_params``
per channel, ``quantize_onnx_initializer``): for a 22M-parameter encoder about
half of each segment's quantization time. :func:`weights_once` memoizes both,
per weight name and every setting they depend on, for the duration of a
``with`` block, in a dict the caller keeps for one source model (the weights
of two segments of the same model with the same name are the same tensor).

The memo wraps two ONNX Runtime 1.x internals
(``QDQQuantizer._calc_initializer_quant_params`` and the module-level
``quantize_onnx_initializer`` it calls); it stores and hands out deep copies,
since the quantizer adjusts weight scales in place afterwards (the int32 bias
rule). Without a memo dict the quantizer runs untouched.

What the memo computes itself it computes in numpy across the channels at once
(:func:`per_channel_params`, :func:`per_channel_weight`) instead of ORT's loop of
one Python call per channel (20,774 channels on the encoder: 2 of its 3 s of
quantization), for the common case only: an int8/uint8 per-channel float32 weight
with no overrides, block size or minimum range; anything else goes to ORT's code.
Element for element the operations and dtypes are ORT's (min and max, the float64
range, the float32 scale, round-half-even, the clip), so the results are the same
bits: ``tests/test_quantize_once.py`` compares whole quantized models against ORT's
own path.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = ["weights_once"]

_LOCK = threading.Lock()


def _fast_types() -> tuple[int, ...]:
    from onnx import TensorProto

    return (TensorProto.INT8, TensorProto.UINT8)


def per_channel_params(data: np.ndarray, axis: int, quant_type: int, reduce_range: bool) -> Any:
    """ORT's symmetric per-channel ``(zero_point, scale)`` of a float32 weight, every
    channel at once: ``compute_data_quant_params`` / ``compute_scale_zp`` vectorized."""
    from onnxruntime.quantization.quant_utils import get_qmin_qmax_for_qType

    qmin, qmax = get_qmin_qmax_for_qType(quant_type, reduce_range, symmetric=True)
    rows = np.moveaxis(data, axis, 0).reshape(data.shape[axis], -1)
    zero = np.float32(0)
    rmin = np.minimum(rows.min(axis=1), zero)
    rmax = np.maximum(rows.max(axis=1), zero)
    absmax = np.maximum(np.abs(rmin), np.abs(rmax))
    dr = absmax.astype(np.float64) - (-absmax).astype(np.float64)
    dq = np.array(qmax, dtype=np.float64) - np.array(qmin, dtype=np.float64)
    scale64 = dr / dq
    degenerate = scale64 < np.finfo(np.float32).tiny
    scale = np.where(degenerate, np.float32(1.0), scale64.astype(np.float32)).astype(np.float32)
    mid = np.array(np.round((qmin + qmax) / np.array(2.0, dtype=np.float64)), dtype=qmin.dtype)
    zero_point = np.where(degenerate, np.array(0, dtype=qmin.dtype), mid).astype(qmin.dtype)
    return zero_point, scale


def _fast_params(q: Any, name: str, info: Any) -> Any | None:
    """ORT's ``QuantizationParams`` of initializer ``name`` by :func:`per_channel_params`,
    or None where ORT's own code must compute them."""
    from onnxruntime.quantization import qdq_quantizer
    from onnxruntime.quantization.quant_utils import normalize_axis, tensor_proto_to_array

    if info.axis is None or info.tensor_type is not qdq_quantizer.QDQQuantTensorType.WEIGHT:
        return None
    if getattr(q, "block_size", 0) or q.min_real_range is not None:
        return None
    if q.weight_qType not in _fast_types():
        return None
    init = qdq_quantizer.find_by_name(name, q.model.initializer())
    if not init:
        return None
    data = tensor_proto_to_array(init)
    ok, axis = normalize_axis(info.axis, len(data.shape))
    if not ok or data.dtype != np.float32 or data.size == 0:
        return None
    zero_point, scale = per_channel_params(data, axis, q.weight_qType, q.reduce_range)
    return qdq_quantizer.QuantizationParams(
        zero_point=zero_point, scale=scale, quant_type=q.weight_qType, axis=axis
    )


def per_channel_weight(
    weight: Any, quant_type: int, zero_point: Any, scale: Any, axis: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """``(zero_point, scale)`` per channel spread over every element of ``weight`` and
    raveled, for ORT's per-tensor arithmetic (per element the same as its per-channel
    loop); None where ORT's own loop must run."""
    zp, sc = np.asarray(zero_point), np.asarray(scale)
    dims = tuple(int(d) for d in weight.dims)
    if quant_type not in _fast_types() or sc.dtype != np.float32 or zp.ndim != 1:
        return None
    if not 0 <= axis < len(dims) or dims[axis] != sc.size or zp.size != sc.size:
        return None
    if weight.data_type != 1:  # TensorProto.FLOAT
        return None
    shape = [1] * len(dims)
    shape[axis] = sc.size
    return (
        np.broadcast_to(zp.reshape(shape), dims).ravel(),
        np.broadcast_to(sc.reshape(shape), dims).ravel(),
    )


def _settings(q: Any) -> tuple[Any, ...]:
    """Everything besides the weight itself that its quantization parameters depend on."""
    return (
        q.weight_qType,
        q.activation_qType,
        q.reduce_range,
        q.per_channel,
        q.is_weight_symmetric(q.weight_qType),
        q.is_activation_symmetric,
        q.min_real_range,
        getattr(q, "block_size", 0),
    )


@contextmanager
def weights_once(memo: dict[Any, Any] | None) -> Iterator[None]:
    """Within the block, ORT's QDQ quantizer reuses the weight quantization in ``memo``."""
    if memo is None:
        yield
        return
    from onnxruntime.quantization import qdq_quantizer

    cls = qdq_quantizer.QDQQuantizer
    calc = cls._calc_initializer_quant_params
    quantize_init = qdq_quantizer.quantize_onnx_initializer

    def cached_calc(self: Any) -> dict[str, Any]:
        if getattr(self, "tensor_quant_overrides", None):  # user overrides: not memoized
            return calc(self)  # type: ignore[no-any-return]
        settings = _settings(self)
        keys = {
            name: ("params", name, info.tensor_type, info.axis, settings)
            for name, info in self.tensors_to_quantize.items()
        }
        out = {n: copy.deepcopy(memo[k]) for n, k in keys.items() if k in memo}
        todo = {n: i for n, i in self.tensors_to_quantize.items() if n not in out}
        fresh: dict[str, Any] = {}
        for name, info in todo.items():
            params = _fast_params(self, name, info)
            if params is not None:
                fresh[name] = params
        slow = {n: i for n, i in todo.items() if n not in fresh}
        if slow:
            whole = self.tensors_to_quantize
            self.tensors_to_quantize = slow
            try:
                fresh.update(calc(self))
            finally:
                self.tensors_to_quantize = whole
        for name, params in fresh.items():
            memo[keys[name]] = copy.deepcopy(params)
            out[name] = params
        return out

    def cached_quantize(
        weight: Any,
        quant_type: Any,
        zero_point: Any,
        scale: Any,
        axis: Any = None,
        quant_weight_name: str | None = None,
        block_size: int = 0,
    ) -> Any:
        zp, sc = np.asarray(zero_point), np.asarray(scale)
        key = ("weight", weight.name, quant_type, zp.dtype.str, zp.tobytes(), sc.dtype.str,
               sc.tobytes(), axis, quant_weight_name, block_size)  # fmt: skip
        if key not in memo:
            spread = None
            if axis is not None and not block_size:
                spread = per_channel_weight(weight, quant_type, zero_point, scale, axis)
            if spread is None:
                memo[key] = quantize_init(
                    weight, quant_type, zero_point, scale, axis, quant_weight_name, block_size
                )
            else:  # every channel at once, through ORT's per-tensor arithmetic
                memo[key] = quantize_init(weight, quant_type, *spread, None, quant_weight_name, 0)
        return copy.deepcopy(memo[key])

    with _LOCK:
        cls._calc_initializer_quant_params = cached_calc
        qdq_quantizer.quantize_onnx_initializer = cached_quantize
        try:
            yield
        finally:
            cls._calc_initializer_quant_params = calc
            qdq_quantizer.quantize_onnx_initializer = quantize_init
