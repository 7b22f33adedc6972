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
        if todo:
            whole = self.tensors_to_quantize
            self.tensors_to_quantize = todo
            try:
                fresh = calc(self)
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
            memo[key] = quantize_init(
                weight, quant_type, zero_point, scale, axis, quant_weight_name, block_size
            )
        return copy.deepcopy(memo[key])

    with _LOCK:
        cls._calc_initializer_quant_params = cached_calc
        qdq_quantizer.quantize_onnx_initializer = cached_quantize
        try:
            yield
        finally:
            cls._calc_initializer_quant_params = calc
            qdq_quantizer.quantize_onnx_initializer = quantize_init
