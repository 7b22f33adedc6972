"""INT8 edge segments: ONNX Runtime static quantization in QDQ form, and its measured quality.

QDQ ONNX is the one INT8 format: ONNX Runtime runs it on CPU (fusing each
DequantizeLinear → op → QuantizeLinear group into an integer kernel at session
creation) and TensorRT builds an engine from its explicit Q/DQ nodes. It adds
default-domain ops only; an op outside that domain the segment already holds (a
source model's contrib op) stays fp32, and such a segment runs on ONNX Runtime
only. A model quantized before keeps its own names
(:func:`~.quant_recipe.quantizer_clashes`). The recipe follows the target (:func:`config_for`):
u8s8 where ORT's CPU kernels want it, s8s8 with TensorRT's placement for
TensorRT, checked against :mod:`.trt_rules`.

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
from pathlib import Path
from typing import Any

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
from splitinfer.partitioner.quant_config import QuantConfig
from splitinfer.partitioner.quant_memo import weights_once
from splitinfer.partitioner.quant_ranges import (
    ModelRanges,
    calibrate,
    calibrate_data,
    entropy_threshold,
    save_cache,
    tensor_types,
)
from splitinfer.partitioner.quant_recipe import (
    CPU_INT8_OPS,
    TENSORRT_WEIGHTED_OPS,
    foreign_nodes,
    fp32_nodes,
    global_pool,
    log_guards,
    output_guards,
    own_biases,
    quantizer_clashes,
    rename,
    tensorrt_nodes,
    vector_gemm_bias,
    without_pass_through,
)
from splitinfer.shared.errors import ConfigError, ModelError

__all__ = [
    "CPU_INT8_OPS",
    "Agreement",
    "ModelRanges",
    "QuantConfig",
    "activations_for",
    "agreement",
    "check_agreement",
    "config_for",
    "count_qdq",
    "entropy_threshold",
    "fp32_nodes",
    "global_pool",
    "model_ranges",
    "output_guards",
    "output_quant_params",
    "pick_metric",
    "quantize_model",
    "worst_layers",
]

Array = npt.NDArray[Any]
Feed = dict[str, Array]

QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


CPU_RUNTIMES = ("onnxruntime-cpu", "cpu")
#: ``onnxruntime-tensorrt``: a profile measured through ONNX Runtime's TensorRT provider.
TENSORRT_RUNTIMES = ("tensorrt", "onnxruntime-tensorrt")


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


#: DequantizeLinear gained its ``axis`` (per-channel weight scales) in opset 13; an
#: older model gets per-tensor weight scales rather than a graph the checker refuses.
PER_AXIS_OPSET = 13


def _opset(model: onnx.ModelProto) -> int:
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)


def config_for(runtime: str, method: str = "minmax", per_channel: bool = True) -> QuantConfig:
    """The :class:`QuantConfig` for a target runtime.

    CPU targets get 7-bit weights (``reduce_range``): the target CPU may lack
    VNNI, and saturation there costs far more accuracy than the lost weight bit.
    They quantize only :data:`CPU_INT8_OPS` and keep the RGB stem and depthwise
    convolutions fp32, with ``ReduceMean`` pooling as ``GlobalAveragePool``:
    each measured faster on an AVX2 CPU (``bench/bench_int8.py``, docs/profiles.md).
    TensorRT does exact int32 accumulation and keeps the full 8 bits; its Q/DQ go
    where TensorRT fuses them (``placement="tensorrt"``), checked against its rules.
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
        placement="ops" if cpu else "tensorrt",
    )


def runtime_for_profile(edge_profile: str | None) -> str:
    """The INT8 recipe's runtime for an ``--edge-profile``: ``tensorrt`` or ``cpu``.

    A built-in TensorRT device (``jetson-*``) or a profile measured through ONNX
    Runtime's TensorRT provider (runtime ``onnxruntime-tensorrt``) gets the TensorRT
    recipe; everything else, and no profile (this machine), the CPU one.
    """
    if not edge_profile:
        return "cpu"
    from splitinfer.partitioner.profiles import resolve_profile

    runtime = str(getattr(resolve_profile(edge_profile, "edge"), "runtime", ""))
    return "tensorrt" if runtime.strip().lower() in TENSORRT_RUNTIMES else "cpu"


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


def _extra_options(config: QuantConfig) -> dict[str, Any]:
    if config.activations == "u8s8":
        return {}
    # TensorRT: zero points 0 everywhere; a float bias (TensorRT fuses it and has
    # no int32 DequantizeLinear) and Q→DQ on fp32 weights, the explicit-quantization
    # form every TensorRT version parses.
    options: dict[str, Any] = {
        "ActivationSymmetric": True,
        "WeightSymmetric": True,
        "QuantizeBias": False,
        "AddQDQPairToWeight": True,
    }
    if config.placement == "tensorrt":
        # "do not quantize the outputs of weighted operations" (TensorRT's placement)
        options["OpTypesToExcludeOutputQuantization"] = list(TENSORRT_WEIGHTED_OPS)
    return options


def _strip_unused_opsets(model: onnx.ModelProto) -> None:
    """Keep only the opset imports the graph uses (ORT's optimizer lists every domain it knows)."""
    used = {n.domain or "" for n in model.graph.node}
    keep = [
        o for o in model.opset_import if (o.domain or "") in used or o.domain in ("", "ai.onnx")
    ]
    del model.opset_import[:]
    model.opset_import.extend(keep)


def _restore_io(result: onnx.ModelProto, source: onnx.ModelProto) -> None:
    """Graph inputs and outputs exactly as the source declared them (names, types, shapes).

    Outputs that are graph inputs too were left out of the quantized graph
    (:func:`~splitinfer.partitioner.quant_recipe.without_pass_through`) and come back here.
    """
    src_in = {vi.name: vi for vi in source.graph.input}
    inputs = {vi.name for vi in source.graph.input}
    got_out = [vi.name for vi in result.graph.output]
    src_out = [vi.name for vi in source.graph.output if vi.name not in inputs or vi.name in got_out]
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


def _foreign(model: onnx.ModelProto) -> set[str]:
    return {f"{n.domain}::{n.op_type}" for n in model.graph.node if n.domain not in ("", "ai.onnx")}


def _check_qdq(model: onnx.ModelProto, source: onnx.ModelProto) -> None:
    """Refuse non-standard ops the quantizer added (those ``source`` holds stay, fp32)."""
    added = sorted(_foreign(model) - _foreign(source))
    if added:
        raise ModelError(
            f"the quantized model uses non-standard ops {', '.join(added)}; TensorRT "
            "could not build it"
        )


def _pre_process(src: Path, pre: Path, symbolic: bool = True) -> None:
    """ORT's quantization pre-processing (shape inference) of ``src`` into ``pre``;
    ``symbolic=False``: ONNX's shape inference only (ORT's symbolic one imports torch)."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if symbolic:
        # where symbolic inference fails, ORT dumps the model (sym_shape_infer_temp.onnx and
        # a <uuid>.data of its weights) into the working folder: make that src's temporary one
        try:
            with contextlib.chdir(src.resolve().parent):
                quant_pre_process(str(src.resolve()), str(pre.resolve()), skip_optimization=True)
            return
        except Exception:  # symbolic inference fails on some graphs; ONNX's alone will do
            pass
    quant_pre_process(str(src), str(pre), skip_optimization=True, skip_symbolic_shape=True)


def _check_samples(model: onnx.ModelProto, samples: Sequence[Feed]) -> list[Feed]:
    if not samples:
        raise ConfigError("no calibration samples to quantize with")
    names = _graph_input_names(model)
    for i, feed in enumerate(samples):
        missing = [n for n in names if n not in feed]
        if missing:
            raise ConfigError(f"calibration sample {i} has no value for input {missing[0]!r}")
    return [{n: feed[n] for n in names} for feed in samples]


def model_ranges(
    model: onnx.ModelProto, samples: Sequence[Feed], config: QuantConfig
) -> ModelRanges:
    """The activation ranges of every float tensor of ``model`` on ``samples``, once,
    for :func:`quantize_model` of any segment cut from it (``ranges=``)."""
    feeds = _check_samples(model, samples)
    with tempfile.TemporaryDirectory(prefix="splitinfer-ranges-") as tmp:
        src, pre = Path(tmp) / "in.onnx", Path(tmp) / "pre.onnx"
        onnx.save(without_pass_through(model), str(src))
        with _quiet_quantizer():
            try:
                _pre_process(src, pre, symbolic=False)
                inferred = onnx.load(str(pre))
                if config.global_pool and global_pool(inferred):  # as each segment will be
                    onnx.save(inferred, str(pre))
                method, data = calibrate_data(pre, feeds, config, Path(tmp))
            except Exception as exc:
                raise ModelError(f"INT8 calibration failed: {_reason(exc)}") from exc
    value_info = {vi.name: vi for vi in inferred.graph.value_info}
    return ModelRanges(
        activations=config.activations,
        method=config.method,
        calibration_method=method,
        data=data,
        types=tensor_types(inferred),
        value_info=value_info,
        samples=len(feeds),
    )


def _reason(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _inherit(model: onnx.ModelProto, ranges: ModelRanges) -> onnx.ModelProto | None:
    """``model`` (a copy, pass-through outputs left out) with the whole model's shape
    inference and the pre-processed mark, or None where it has a tensor the whole
    model has no type for."""
    from onnxruntime.quantization.quant_utils import add_pre_process_metadata

    out = without_pass_through(model)
    declared = {vi.name for vi in (*out.graph.input, *out.graph.output)}
    inits = {t.name for t in out.graph.initializer}
    names = {n for node in out.graph.node for n in node.output if n} - declared - inits
    if any(n not in ranges.types for n in names):
        return None
    del out.graph.value_info[:]
    known = ranges.value_info
    out.graph.value_info.extend(known[n] for n in sorted(names) if n in known)
    add_pre_process_metadata(out)
    return out


def quantize_model(
    model: onnx.ModelProto,
    samples: Sequence[Feed],
    config: QuantConfig,
    ranges: ModelRanges | None = None,
) -> onnx.ModelProto:
    """Static INT8 quantization in QDQ form, calibrated on ``samples``.

    Pre-processing (``quant_pre_process``: symbolic and ONNX shape inference;
    its ORT optimization step is skipped since the partitioner's passes already
    ran it and re-running would undo their HardSwish fusion), then
    ``quantize_static`` with per-channel int8 weights. Graph inputs and outputs
    keep their names, dtypes and shapes; outputs stay fp32 (dequantized). A
    model with nothing to quantize comes back unchanged (a copy). A graph input
    that is also a graph output (a cut tensor the edge forwards) is left out of
    the quantizer's view, which would otherwise route it through Q/DQ in a cycle.

    ``ranges`` (:func:`model_ranges` of the model this one was cut from, on the
    same samples with the same config) replaces both the pre-processing and the
    calibration run; a segment with a tensor they do not cover does both itself.
    """
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    feeds = _check_samples(model, samples)
    activation_type = QuantType.QUInt8 if config.activations == "u8s8" else QuantType.QInt8
    inherited = None
    clashes = quantizer_clashes(model)  # names a model quantized before holds
    if ranges is not None and ranges.fits(config, len(feeds)) and not clashes:
        inherited = _inherit(model, ranges)

    with tempfile.TemporaryDirectory(prefix="splitinfer-quant-") as tmp:
        src, pre, out = (Path(tmp) / f for f in ("in.onnx", "pre.onnx", "out.onnx"))
        with _quiet_quantizer():
            try:
                if inherited is None:
                    work = without_pass_through(model)
                    rename(work, clashes)
                    onnx.save(work, str(src))
                    del work
                    _pre_process(src, pre)
                    prepared = onnx.load(str(pre))
                else:
                    prepared = inherited
                own_biases(prepared)  # each bias as the quantizer wants it
                vector_gemm_bias(prepared)
                if config.global_pool:
                    global_pool(prepared)
                chosen = tensorrt_nodes(prepared) if config.placement == "tensorrt" else None
                if chosen == []:  # nothing TensorRT runs in int8 ([] would mean "all")
                    return _copy(model)
                subset = None if ranges is None or inherited is None else ranges.subset(prepared)
                onnx.save(prepared, str(pre))
                if ranges is None or subset is None:
                    method, cache = calibrate(pre, feeds, config, Path(tmp))
                else:
                    method, cache = ranges.calibration_method, save_cache(subset, Path(tmp))
                with weights_once(None if ranges is None else ranges.memo):
                    quantize_static(
                        str(pre),
                        str(out),
                        None,
                        quant_format=QuantFormat.QDQ,
                        per_channel=config.per_channel and _opset(prepared) >= PER_AXIS_OPSET,
                        reduce_range=config.reduce_range,
                        activation_type=activation_type,
                        weight_type=QuantType.QInt8,
                        calibrate_method=method,
                        extra_options=_extra_options(config),
                        calibration_cache_path=cache,
                        op_types_to_quantize=list(config.op_types) if config.op_types else None,
                        nodes_to_quantize=chosen,
                        nodes_to_exclude=fp32_nodes(prepared, config)
                        + output_guards(prepared)
                        + log_guards(prepared)
                        + foreign_nodes(prepared),
                    )
            except Exception as exc:  # the quantizer raises bare ValueError/RuntimeError...
                raise ModelError(f"INT8 quantization failed: {_reason(exc)}") from exc
        result = onnx.load(str(out))

    if not any(n.op_type == "QuantizeLinear" for n in result.graph.node):
        return _copy(model)
    if clashes:  # the source's names back, where the quantizer did not take them
        g = result.graph
        present = {n.name for n in g.node} | {o for n in g.node for o in n.output}
        present.update(t.name for t in g.initializer)
        rename(result, {new: old for old, new in clashes.items() if old not in present})
    _strip_unused_opsets(result)
    _restore_io(result, model)
    _check_qdq(result, model)
    onnx.checker.check_model(result)
    if config.placement == "tensorrt":
        _check_tensorrt(result)
    return result


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _check_tensorrt(model: onnx.ModelProto) -> None:
    """Refuse a TensorRT segment that breaks TensorRT's explicit-quantization rules."""
    from splitinfer.partitioner.trt_rules import check_tensorrt_qdq

    broken = check_tensorrt_qdq(model)
    if broken:
        more = f" (and {len(broken) - 1} more)" if len(broken) > 1 else ""
        raise ModelError(f"the TensorRT INT8 segment breaks TensorRT's rules: {broken[0]}{more}")


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
