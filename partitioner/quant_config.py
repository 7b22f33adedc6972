"""How an edge segment is quantized: :class:`QuantConfig`, on its own.

The recipe modules (:mod:`.quant_recipe`, :mod:`.quant_ranges`) and the
quantizer (:mod:`.quantize`, which chooses a config per runtime in
``config_for``) all read it; it depends on none of them, so the three import
in one direction only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from splitinfer.shared.errors import ConfigError

__all__ = ["ACTIVATIONS", "METHODS", "PLACEMENTS", "QuantConfig"]

ACTIVATIONS = ("u8s8", "s8s8")
METHODS = ("minmax", "entropy", "percentile")
PLACEMENTS = ("ops", "tensorrt")


@dataclass(frozen=True)
class QuantConfig:
    """How an edge segment is quantized.

    ``activations``: ``u8s8`` (unsigned asymmetric activations, signed weights:
    ONNX Runtime on x86 CPUs) or ``s8s8`` (signed symmetric activations, zero
    point 0: TensorRT). Weights are always signed symmetric int8.
    ``method``: calibration of activation ranges (MinMax, Entropy or Percentile
    99.999 over the calibration samples).
    ``per_channel``: one weight scale per output channel (Conv, Gemm, MatMul).
    ``op_types``: the op types to quantize (``None``: every one the quantizer knows);
    others stay fp32, with no Q/DQ pair inserted around them.
    ``fp32_stem``: convolutions with at most
    :data:`~splitinfer.partitioner.quant_recipe.STEM_CHANNELS` input channels
    (and the activation/pool right after them) stay fp32.
    ``fp32_depthwise``: depthwise convolutions (one input channel per group) stay fp32.
    ``global_pool``: ``ReduceMean`` over H and W with ``keepdims`` becomes
    ``GlobalAveragePool`` (same values) before quantization, which ORT keeps in
    NHWC next to its int8 convolutions instead of reducing a transposed tensor.
    ``placement``: ``ops`` quantizes every node of ``op_types``; ``tensorrt`` follows
    TensorRT's placement (:func:`~splitinfer.partitioner.quant_recipe.tensorrt_nodes`:
    the inputs of Conv/ConvTranspose/MatMul/Gemm, whose outputs stay float, and both
    inputs of residual Adds), and the result must pass
    :func:`~splitinfer.partitioner.trt_rules.check_tensorrt_qdq`.
    ``reduce_range``: 7-bit weights. x86 CPUs without VNNI multiply u8×s8 pairs
    with a saturating 16-bit add (``vpmaddubsw``); 7-bit weights cannot
    saturate. Measured on the digits classifier on an AVX2 CPU: top-1 agreement
    0.996 (u8s8) and 0.969 (s8s8) without it, 0.998 to 1.0 with it.
    """

    activations: Literal["u8s8", "s8s8"]
    method: Literal["minmax", "entropy", "percentile"] = "minmax"
    per_channel: bool = True
    reduce_range: bool = False
    op_types: tuple[str, ...] | None = None
    fp32_stem: bool = False
    fp32_depthwise: bool = False
    global_pool: bool = False
    placement: Literal["ops", "tensorrt"] = "ops"

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATIONS:
            raise ConfigError(
                f"activation type {self.activations!r} is not one of {', '.join(ACTIVATIONS)}"
            )
        if self.method not in METHODS:
            raise ConfigError(
                f"calibration method {self.method!r} is not one of {', '.join(METHODS)}"
            )
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"placement {self.placement!r} is not one of {', '.join(PLACEMENTS)}")
        if self.placement == "tensorrt" and self.activations != "s8s8":
            raise ConfigError("placement 'tensorrt' needs activations 's8s8' (TensorRT is int8)")
        if self.op_types is not None and (
            not isinstance(self.op_types, tuple)
            or not self.op_types
            or not all(isinstance(o, str) and o for o in self.op_types)
        ):
            raise ConfigError(
                f"op_types must be a non-empty tuple of op names or None, got {self.op_types!r}"
            )
        for name in ("per_channel", "reduce_range", "fp32_stem", "fp32_depthwise", "global_pool"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
