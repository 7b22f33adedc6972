"""INT8 edge segments: ONNX Runtime static quantization in QDQ form, and its measured quality.

The QDQ ONNX is the single INT8 artifact: ONNX Runtime runs it on CPU (fusing
each DequantizeLinear → op → QuantizeLinear group into an integer kernel at
session creation) and TensorRT builds an engine from the same explicit Q/DQ
nodes. It therefore holds default-domain ops only.

Quality is measured, not assumed: :func:`agreement` compares the fp32 and int8
models on held-out samples and names the intermediate tensors with the
largest relative error; :func:`check_agreement` turns a shortfall into a
one-line :class:`ModelError` (both live in :mod:`.agreement` and are
re-exported here).

``onnxruntime.quantization`` is imported at the point of use.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import onnx

from splitinfer.partitioner.agreement import (
    Agreement,
    agreement,
    check_agreement,
    pick_metric,
    worst_layers,
)
from splitinfer.partitioner.quant_recipe import (
    CPU_INT8_OPS,
    fp32_nodes,
    global_pool,
    output_guards,
)
from splitinfer.shared.errors import ConfigError, ModelError

__all__ = [
    "CPU_INT8_OPS",
    "Agreement",
    "QuantConfig",
    "activations_for",
    "agreement",
    "check_agreement",
    "config_for",
    "count_qdq",
    "fp32_nodes",
    "global_pool",
    "output_guards",
    "output_quant_params",
    "pick_metric",
    "quantize_model",
    "worst_layers",
]

Array = npt.NDArray[Any]
Feed = dict[str, Array]

ACTIVATIONS = ("u8s8", "s8s8")
METHODS = ("minmax", "entropy", "percentile")
#: Histogram bins of the Entropy calibrator and the quantized bins its KL-divergence
#: search compares against (TensorRT's classic 2048 / 128): thresholds from 1/16 of
#: the largest |value| up to all of it are tried.
ENTROPY_BINS = 2048
ENTROPY_QUANTIZED_BINS = 128
#: Percentile the Percentile calibrator keeps: of |activation| for s8s8; for u8s8 each
#: tail loses half of the rest (0.0005%).
PERCENTILE = 99.999
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


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

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATIONS:
            raise ConfigError(
                f"activation type {self.activations!r} is not one of {', '.join(ACTIVATIONS)}"
            )
        if self.method not in METHODS:
            raise ConfigError(
                f"calibration method {self.method!r} is not one of {', '.join(METHODS)}"
            )
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


CPU_RUNTIMES = ("onnxruntime-cpu", "cpu")
TENSORRT_RUNTIMES = ("tensorrt",)


def activations_for(runtime: str) -> str:
    """The activation type the target runtime runs fastest and correctly.

    TensorRT takes explicit Q/DQ only with signed int8 and zero point 0, so its
    activations are symmetric signed (``s8s8``). ONNX Runtime's x86 CPU kernels
    (MLAS) are built around unsigned × signed products (``vpmaddubsw``, and
    ``vpdpbusd`` with VNNI): ``u8s8`` runs at full speed, while ``s8s8`` costs an
    extra shift of every activation and ran slower than fp32 in our
    measurements (see ``bench/bench_int8.py``).
    """
    key = runtime.strip().lower()
    if key in TENSORRT_RUNTIMES:
        return "s8s8"
    if key in CPU_RUNTIMES:
        return "u8s8"
    known = ", ".join((*TENSORRT_RUNTIMES, *CPU_RUNTIMES))
    raise ConfigError(f"runtime {runtime!r} has no INT8 activation type; use one of {known}")


def config_for(runtime: str, method: str = "minmax", per_channel: bool = True) -> QuantConfig:
    """The :class:`QuantConfig` for a target runtime.

    CPU targets get 7-bit weights (``reduce_range``): the target CPU may lack
    VNNI, and saturation there costs far more accuracy than the lost weight bit.
    They quantize only :data:`CPU_INT8_OPS` and keep the RGB stem and depthwise
    convolutions fp32, with ``ReduceMean`` pooling as ``GlobalAveragePool``:
    each measured faster on an AVX2 CPU (``bench/bench_int8.py``, docs/profiles.md).
    TensorRT does exact int32 accumulation and keeps the full 8 bits; it has int8
    kernels for every op, so everything is quantized.
    """
    acts = activations_for(runtime)
    cpu = acts == "u8s8"
    return QuantConfig(
        activations=acts,  # type: ignore[arg-type]
        method=method,  # type: ignore[arg-type]
        per_channel=per_channel,
        reduce_range=cpu,
        op_types=CPU_INT8_OPS if cpu else None,
        fp32_stem=cpu,
        fp32_depthwise=cpu,
        global_pool=cpu,
    )


def _graph_input_names(model: onnx.ModelProto) -> list[str]:
    inits = {t.name for t in model.graph.initializer}
    return [vi.name for vi in model.graph.input if vi.name not in inits]


@contextlib.contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """Silence the quantizer's noise: progress ``print`` calls and root-logger notices.

    onnxruntime.quantization prints histogram progress to stdout and logs
    advice ("consider pre-processing") on the root logger; neither is useful to
    a caller. Logging is disabled below ERROR for the duration and restored.
    """
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            # onnx's shape inference helpers inside the quantizer use deprecated onnx APIs
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            yield
    finally:
        logging.disable(previous)


def _calibrate(
    model_path: Path, feeds: list[Feed], config: QuantConfig, tmp: Path
) -> tuple[Any, Path]:
    """Activation ranges for ``config.method``, saved as ORT's calibration cache.

    Calibration runs here rather than inside ``quantize_static`` because that
    function cannot pass histogram settings through: its Entropy calibrator
    keeps 128 bins for 128 quantized bins, which leaves a single candidate
    threshold (the min-max range), and its Percentile calibrator symmetrizes
    ranges, which wastes half the codes of unsigned activations. The ranges go
    to ``quantize_static`` through its calibration cache file.
    """
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        create_calibrator,
        save_tensors_data,
    )

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self._it = iter(feeds)

        def get_next(self) -> Feed | None:
            return next(self._it, None)

    symmetric = config.activations == "s8s8"
    method, options = {
        "minmax": (CalibrationMethod.MinMax, {"symmetric": symmetric}),
        "entropy": (
            CalibrationMethod.Entropy,
            {
                "symmetric": symmetric,
                "num_bins": ENTROPY_BINS,
                "num_quantized_bins": ENTROPY_QUANTIZED_BINS,
            },
        ),
        "percentile": (
            CalibrationMethod.Percentile,
            {"symmetric": symmetric, "num_bins": 2048, "percentile": PERCENTILE},
        ),
    }[config.method]
    calibrator = create_calibrator(
        model_path,
        augmented_model_path=str(tmp / "augmented.onnx"),
        calibrate_method=method,
        extra_options=options,
    )
    calibrator.collect_data(Reader())
    if config.method == "entropy":
        # same search, vectorized per candidate: ORT's loops over bins in Python
        # (about 1.5 s per tensor at 2048 bins, against 50 ms here)
        calibrator.collector.get_entropy_threshold = entropy_threshold
    cache = tmp / "calibration.json"
    save_tensors_data(calibrator.compute_data(), cache)
    return method, cache


def _smooth(p: Array, eps: float = 0.0001) -> Array | None:
    """ORT's ``smooth_distribution``: zeros become ``eps``, taken off the non-zeros (float32)."""
    zeros = p == 0
    n_zeros = int(np.count_nonzero(zeros))
    if n_zeros == p.size:
        return None
    eps1 = eps * float(n_zeros) / float(p.size - n_zeros)
    out = p.astype(np.float32)
    out += np.where(zeros, np.float32(eps), np.float32(-eps1)).astype(np.float32)
    return out


def _kl_smoothed(p: Array, q: Array) -> float:
    """KL(p || q) of the smoothed, normalized histograms, in float32 as ORT computes it."""
    ps, qs = _smooth(p), _smooth(q)
    if ps is None or qs is None:
        return float("inf")
    ps = ps / np.sum(ps)
    qs = qs / np.sum(qs)
    return float(np.sum(ps * np.log(ps / qs)))


def entropy_threshold(histogram: tuple[Any, ...], num_quantized_bins: int) -> tuple[Any, Any]:
    """The KL-divergence threshold of ONNX Runtime's Entropy calibrator, without its loops.

    ``histogram`` is ORT's ``(hist, edges, min, max, ...)`` over a range symmetric
    about zero. For each candidate half-width ``i`` (in bins) the reference ``p``
    is the central slice with the outliers folded into its end bins; ``q`` merges
    the slice into ``num_quantized_bins`` and spreads each back evenly (integer
    division, as ORT does). The ``(low, high)`` edges of the slice with the
    smallest KL(p || q) win, clipped to the observed min and max. The result is
    the same as ``HistogramCollector.get_entropy_threshold`` (tested).
    """
    hist = np.asarray(histogram[0])
    edges = np.asarray(histogram[1])
    num_bins = hist.size
    zero = num_bins // 2
    half = num_quantized_bins // 2
    cumsum = np.concatenate(([0], np.cumsum(hist)))
    best_div, best = np.inf, (edges[0], edges[-1])
    for i in range(half, zero + 1):
        start, end = zero - i, min(zero + i + 1, num_bins)
        sliced = hist[start:end]
        p = sliced.copy()
        p[0] += cumsum[start]
        p[-1] += cumsum[-1] - cumsum[end]
        merged = sliced.size // num_quantized_bins
        whole = num_quantized_bins * merged
        quantized = sliced[:whole].reshape(num_quantized_bins, merged).sum(axis=1)
        quantized[-1] += sliced[whole:].sum()
        nonzero = (p[:whole] != 0).reshape(num_quantized_bins, merged).sum(axis=1)
        spread = np.zeros(num_quantized_bins, dtype=np.int64)
        np.floor_divide(quantized, nonzero, out=spread, where=nonzero != 0)
        q = np.zeros(p.size, dtype=np.int64)
        q[:whole] = np.repeat(spread, merged)
        div = _kl_smoothed(p, q)
        if div < best_div:
            best_div, best = div, (edges[start], edges[end])
    low = max(best[0], histogram[2])
    high = min(best[1], histogram[3])
    dtype = edges.dtype
    return np.array(low, dtype=dtype), np.array(high, dtype=dtype)


def _extra_options(config: QuantConfig) -> dict[str, Any]:
    if config.activations == "u8s8":
        return {}
    # TensorRT: zero points 0 everywhere; a float bias (TensorRT fuses it and has
    # no int32 DequantizeLinear) and Q→DQ on fp32 weights, the explicit-quantization
    # form every TensorRT version parses.
    return {
        "ActivationSymmetric": True,
        "WeightSymmetric": True,
        "QuantizeBias": False,
        "AddQDQPairToWeight": True,
    }


def _strip_unused_opsets(model: onnx.ModelProto) -> None:
    """Keep only the opset imports the graph uses (ORT's optimizer lists every domain it knows)."""
    used = {n.domain or "" for n in model.graph.node}
    keep = [
        o for o in model.opset_import if (o.domain or "") in used or o.domain in ("", "ai.onnx")
    ]
    del model.opset_import[:]
    model.opset_import.extend(keep)


def _restore_io(result: onnx.ModelProto, source: onnx.ModelProto) -> None:
    """Graph inputs and outputs exactly as the source declared them (names, types, shapes)."""
    src_in = {vi.name: vi for vi in source.graph.input}
    src_out = [vi.name for vi in source.graph.output]
    got_out = [vi.name for vi in result.graph.output]
    if got_out != src_out:
        raise ModelError(f"quantization changed the graph outputs {src_out} into {got_out}")
    missing = [
        n for n in _graph_input_names(source) if n not in {i.name for i in result.graph.input}
    ]
    if missing:
        raise ModelError(f"quantization dropped graph input {missing[0]!r}")
    for i, vi in enumerate(result.graph.input):
        if vi.name in src_in:
            result.graph.input[i].CopyFrom(src_in[vi.name])
    del result.graph.output[:]
    result.graph.output.extend(source.graph.output)


def _check_qdq(model: onnx.ModelProto) -> None:
    foreign = sorted({f"{n.domain}.{n.op_type}" for n in model.graph.node if n.domain})
    if foreign:
        raise ModelError(
            f"the quantized model uses non-standard ops {', '.join(foreign)}; TensorRT "
            "could not build it"
        )


def quantize_model(
    model: onnx.ModelProto, samples: Sequence[Feed], config: QuantConfig
) -> onnx.ModelProto:
    """Static INT8 quantization in QDQ form, calibrated on ``samples``.

    Pre-processing (``quant_pre_process``: symbolic and ONNX shape inference;
    its ORT optimization step is skipped since the partitioner's passes already
    ran it and re-running would undo their HardSwish fusion), then
    ``quantize_static`` with per-channel int8 weights. Graph inputs and outputs
    keep their names, dtypes and shapes; outputs stay fp32 (dequantized). A
    model with nothing to quantize comes back unchanged (a copy).
    """
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if not samples:
        raise ConfigError("no calibration samples to quantize with")
    names = _graph_input_names(model)
    for i, feed in enumerate(samples):
        missing = [n for n in names if n not in feed]
        if missing:
            raise ConfigError(f"calibration sample {i} has no value for input {missing[0]!r}")
    feeds = [{n: feed[n] for n in names} for feed in samples]
    activation_type = QuantType.QUInt8 if config.activations == "u8s8" else QuantType.QInt8

    with tempfile.TemporaryDirectory(prefix="splitinfer-quant-") as tmp:
        src, pre, out = (Path(tmp) / f for f in ("in.onnx", "pre.onnx", "out.onnx"))
        onnx.save(model, str(src))
        with _quiet_quantizer():
            try:
                quant_pre_process(str(src), str(pre), skip_optimization=True)
            except Exception:  # symbolic inference fails on some graphs; ONNX's alone will do
                quant_pre_process(
                    str(src), str(pre), skip_optimization=True, skip_symbolic_shape=True
                )
            try:
                if config.global_pool:
                    pre_model = onnx.load(str(pre))
                    if global_pool(pre_model):
                        onnx.save(pre_model, str(pre))
                method, cache = _calibrate(pre, feeds, config, Path(tmp))
                prepared = onnx.load(str(pre))
                quantize_static(
                    str(pre),
                    str(out),
                    None,
                    quant_format=QuantFormat.QDQ,
                    per_channel=config.per_channel,
                    reduce_range=config.reduce_range,
                    activation_type=activation_type,
                    weight_type=QuantType.QInt8,
                    calibrate_method=method,
                    extra_options=_extra_options(config),
                    calibration_cache_path=cache,
                    op_types_to_quantize=list(config.op_types) if config.op_types else None,
                    nodes_to_exclude=fp32_nodes(prepared, config) + output_guards(prepared),
                )
            except Exception as exc:  # the quantizer raises bare ValueError/RuntimeError...
                text = str(exc).strip()
                reason = text.splitlines()[0] if text else type(exc).__name__
                raise ModelError(f"INT8 quantization failed: {reason}") from exc
        result = onnx.load(str(out))

    if not any(n.op_type == "QuantizeLinear" for n in result.graph.node):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return copy
    _strip_unused_opsets(result)
    _restore_io(result, model)
    _check_qdq(result)
    onnx.checker.check_model(result)
    return result


def output_quant_params(model: onnx.ModelProto) -> dict[str, dict[str, Any]]:
    """Calibrated quantization parameters of each graph output of a quantized model.

    The cut tensors leave the edge segment through a DequantizeLinear; its scale
    and zero point (per tensor for activations) are what the wire codec can reuse:
    ``{name: {"dtype": "uint8"|"int8", "scale": [...], "zero_point": [...], "axis": int|None}}``.
    Outputs not produced by a DequantizeLinear (nothing quantized there) are left out.
    """
    consts = {t.name: t for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    params: dict[str, dict[str, Any]] = {}
    for out in model.graph.output:
        node = producers.get(out.name)
        if node is None or node.op_type != "DequantizeLinear" or len(node.input) < 3:
            continue
        if node.input[1] not in consts or node.input[2] not in consts:
            continue
        scale = onnx.numpy_helper.to_array(consts[node.input[1]])
        zero = onnx.numpy_helper.to_array(consts[node.input[2]])
        axis = next((a.i for a in node.attribute if a.name == "axis"), None)
        params[out.name] = {
            "dtype": str(zero.dtype),
            "scale": [float(v) for v in np.atleast_1d(scale)],
            "zero_point": [int(v) for v in np.atleast_1d(zero)],
            "axis": axis if scale.size > 1 else None,
        }
    return params


def count_qdq(model: onnx.ModelProto) -> dict[str, int]:
    """How many QuantizeLinear and DequantizeLinear nodes ``model`` holds."""
    counts = dict.fromkeys(sorted(QDQ_OPS), 0)
    for node in model.graph.node:
        if node.op_type in QDQ_OPS:
            counts[node.op_type] += 1
    return counts
