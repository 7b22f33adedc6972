"""What ``--split auto`` measures before it chooses: samples, activations, node times.

* :func:`samples`: the calibration folder, or synthetic data with a loud warning.
* :func:`activations`: the values of the tensors that can cross, from one run of
  the optimized graph with them exposed.
* :func:`node_times`: seconds per node on the edge and in the cloud, from a
  built-in profile's roofline, a measured profile JSON, or ONNX Runtime's
  profiler on this machine (an INT8 edge measured here: fp32 node times scaled
  by the whole model's measured int8/fp32 ratio, :func:`precision_factor`).
* :func:`convert`: a segment at the edge precision (QDQ INT8, fp16 or fp32).
* :func:`timing_sample`: the activations the codec's speed is timed on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from splitinfer.partitioner.batch import RowSession
from splitinfer.partitioner.calibration import load_calibration, synthetic_calibration
from splitinfer.partitioner.cuts import CutPlan
from splitinfer.partitioner.pipeline import Prepared, synthetic_shapes
from splitinfer.shared.manifest import TensorSpec

if TYPE_CHECKING:
    from splitinfer.partitioner.auto import AutoOptions
    from splitinfer.partitioner.quant_ranges import ModelRanges

Feed = dict[str, np.ndarray]
Progress = Callable[[str], None]

#: Rows per run of the whole model when it screens the shortlisted cuts.
SLICE = 16
#: The codec's speed is timed on at most this many tensors and bytes of activations.
TIMING_TENSORS = 16
TIMING_BYTES = 32 * 2**20


# -- samples and activations ---------------------------------------------------------


def samples(
    prepared: Prepared, inputs: list[TensorSpec], opts: AutoOptions, warn: Callable[[str], None]
) -> list[Feed]:
    a = prepared.analysis
    if opts.calibration is not None:
        return load_calibration(
            opts.calibration, inputs, a.batch_symbol, preprocessing=opts.preprocessing
        )
    warn(
        "no --calibration folder: calibrating INT8 and measuring quality on SYNTHETIC random "
        "inputs; scales, agreement and the chosen cut may not hold for real data"
    )
    shapes = synthetic_shapes(a)
    return synthetic_calibration(inputs, opts.synthetic_samples, opts.seed, shapes)


def stack(samples: Sequence[Feed]) -> Feed:
    return {k: np.concatenate([s[k] for s in samples]) for k in samples[0]}


def session(model: onnx.ModelProto, optimize: bool) -> Any:
    from splitinfer.shared.ortsession import open_session

    return RowSession(open_session(model, optimize="all" if optimize else "none", name="a segment"))


def _axis(prepared: Prepared, name: str) -> int:
    """The axis along which ``name``'s values of several runs join: its batch axis."""
    info = prepared.analysis.tensors.get(name)
    return info.batch_axis or 0 if info is not None else 0


def run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], optimize: bool) -> Feed:
    (out,) = run_many(model, [feeds], optimize)
    return out


def run_many(
    model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]], optimize: bool
) -> list[Feed]:
    """One session of ``model``, run on each of ``feeds`` in turn."""
    sess = session(model, optimize)
    names = [o.name for o in sess.get_outputs()]
    results = []
    for feed in feeds:
        wanted = {i.name: feed[i.name] for i in sess.get_inputs()}
        results.append(dict(zip(names, sess.run(names, wanted), strict=True)))
    return results


def _exposing(prepared: Prepared, model: onnx.ModelProto, where: Mapping[str, str]) -> Any:
    """A copy of ``model`` with graph outputs added: for each tensor of the optimized
    graph in ``where``, the tensor of ``model`` that holds its value (same dtype)."""
    from onnx import helper

    tensors = prepared.analysis.tensors
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {o.name for o in probe.graph.output}
    for name, exposed in where.items():
        if exposed not in existing:
            elem = helper.np_dtype_to_tensor_dtype(np.dtype(tensors[name].dtype))
            probe.graph.output.append(helper.make_tensor_value_info(exposed, elem, None))
            existing.add(exposed)
    return probe


def activations(prepared: Prepared, feeds: Feed, names: Sequence[str]) -> Feed:
    """The values of ``names`` (tensors of the optimized graph) for ``feeds``."""
    probe = _exposing(prepared, prepared.analysis.model, {n: n for n in names if n not in feeds})
    out = run(probe, feeds, optimize=False)
    out.update(feeds)
    return {n: np.asarray(out[n]) for n in names if n in out}


def source_activations(
    prepared: Prepared,
    opts: AutoOptions,
    plans: list[CutPlan],
    held: list[Feed],
    calib: Feed,
    limit: int,
    whole: onnx.ModelProto | None = None,
) -> tuple[Feed, Feed] | None:
    """``(held, calibration)`` values of every tensor the shortlisted cuts send, from
    one run of the whole model each, standing for a run of every edge segment.

    For an fp32 edge the run is of the source model, unoptimized: its segments
    compute exactly those tensors (the same kernels on the same inputs). For an
    INT8 edge it is of ``whole``, the whole model quantized with the ranges every
    segment is quantized with (:func:`edge_ranges`); a tensor it quantizes is read
    after its Q/DQ pair, as a segment's output is. That is a *screening* value (a
    segment of its own may differ at its boundary), which is why ``--split auto``
    builds the cuts it picks again for real. None for an fp16 edge, without
    ``whole`` for INT8, or when the values would take more than ``limit`` bytes."""
    if opts.precision == "fp16" or (opts.precision == "int8" and whole is None):
        return None
    tensors = prepared.analysis.tensors
    names = sorted({t for p in plans if p.kind != "none" for t in p.crossing})
    if not names:
        return None
    rows = len(held) + len(next(iter(calib.values())))
    if rows * sum(tensors[t].bytes_per_sample for t in names) > limit:
        return None
    if whole is None:
        return activations(prepared, stack(held), names), activations(prepared, calib, names)
    optimize = runtime(opts) != "tensorrt"
    held_values, calib_values = exposed_values(
        prepared, whole, [stack(held), calib], names, optimize
    )
    return held_values, calib_values


def dequantized_names(model: onnx.ModelProto, names: Sequence[str]) -> dict[str, str]:
    """Per tensor of ``names``: the tensor of the QDQ ``model`` that holds its value as
    its readers see it (the output of its QuantizeLinear -> DequantizeLinear pair),
    or the tensor itself where nothing quantizes it."""
    quantized = {n.input[0]: n.output[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    dequantized = {
        n.input[0]: n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"
    }
    out = {}
    for name in names:
        q = quantized.get(name)
        out[name] = dequantized.get(q, name) if q is not None else name
    return out


def exposed_values(
    prepared: Prepared,
    model: onnx.ModelProto,
    feeds: Sequence[Feed],
    names: Sequence[str],
    optimize: bool,
) -> list[Feed]:
    """Per feed of ``feeds``: the values of ``names`` (tensors of the optimized graph)
    in a run of ``model``, a QDQ copy of it, read after their Q/DQ pairs
    (:func:`dequantized_names`); one session for all the runs."""
    inputs = {vi.name for vi in model.graph.input}
    where = dequantized_names(model, [n for n in names if n not in inputs])
    probe = _exposing(prepared, model, where)
    # in slices of at most SLICE rows: ONNX Runtime's arena grows to the largest batch
    rows = [len(next(iter(f.values()))) for f in feeds]
    slices = [(k, i) for k, n in enumerate(rows) for i in range(0, n, SLICE)]
    sliced = [{n: v[i : i + SLICE] for n, v in feeds[k].items()} for k, i in slices]
    outs = run_many(probe, sliced, optimize)
    results = []
    for k, feed in enumerate(feeds):
        parts = [o for (j, _), o in zip(slices, outs, strict=True) if j == k]
        values = {
            name: np.concatenate([np.asarray(o[e]) for o in parts], axis=_axis(prepared, name))
            for name, e in where.items()
        }
        values.update({n: feed[n] for n in names if n in inputs})
        results.append(values)
    return results


# -- node times ---------------------------------------------------------------------


def node_times(
    prepared: Prepared,
    opts: AutoOptions,
    calib: list[Feed],
    notes: list[str],
    progress: Progress,
    ranges: ModelRanges | None = None,
    whole: onnx.ModelProto | None = None,
) -> tuple[dict[str, float], dict[str, float], dict[int, dict[str, float]], float]:
    from splitinfer.partitioner.profiler import measure_nodes
    from splitinfer.partitioner.profiles import node_times, resolve_profile

    a = prepared.analysis
    sha = prepared.source.sha256
    host = None
    overhead = 0.0
    if opts.edge_profile is None or opts.cloud_profile is None:
        progress("measuring per-node latency on this machine (ONNX Runtime profiler)")
        pool = stack(calib)

        def feeds_for(batch: int) -> Feed:
            idx = np.arange(batch) % next(iter(pool.values())).shape[0]
            return {k: v[idx] for k, v in pool.items()}

        host = measure_nodes(
            a.model,
            feeds_for,
            # a fixed batch axis runs one request per run: the cloud never batches it
            batch_sizes=(1, 8) if a.batch_symbol is not None else (1,),
            runs=7,
            warmup=2,
            analysis=a,
            source_sha256=sha,
        )
        overhead = max(0.0, host.overhead_s.get(1, 0.0))
    edge_src = resolve_profile(opts.edge_profile, "edge") if opts.edge_profile else host
    cloud_src = resolve_profile(opts.cloud_profile, "cloud") if opts.cloud_profile else host
    assert edge_src is not None
    assert cloud_src is not None
    edge_prec = "fp32" if edge_src is host else opts.precision
    edge = node_times(a, edge_src, edge_prec, 1, model_sha256=sha)
    notes += [f"edge: {edge.source}", *edge.notes]
    edge_t = dict(edge.times)
    if edge_src is host and opts.precision != "fp32":
        factor = precision_factor(prepared, opts, calib, ranges, whole)
        edge_t = {k: v * factor for k, v in edge_t.items()}
        notes.append(
            f"edge at {opts.precision}: fp32 node times on this machine x {factor:.2f} "
            "(the whole model's measured ratio)"
        )
    cloud = node_times(a, cloud_src, "fp32", 1, model_sha256=sha)
    notes += [f"cloud: {cloud.source}", *cloud.notes]
    by_batch = {b: node_times(a, cloud_src, "fp32", b, model_sha256=sha).times for b in (8, 32)}
    return edge_t, dict(cloud.times), by_batch, overhead


def precision_factor(
    prepared: Prepared,
    opts: AutoOptions,
    calib: list[Feed],
    ranges: ModelRanges | None = None,
    whole: onnx.ModelProto | None = None,
) -> float:
    """Measured wall time of the whole model at the edge precision / at fp32
    (``ranges``: :func:`edge_ranges`, which spare the INT8 model its calibration;
    ``whole``: the whole model at the edge precision when the caller has it)."""
    import time

    full = prepared.analysis.model
    low = whole if whole is not None else convert(full, opts, calib, ranges)
    feeds = calib[0]
    times = []
    for model in (full, low):
        sess = session(model, optimize=True)
        names = [o.name for o in sess.get_outputs()]
        wanted = {i.name: feeds[i.name] for i in sess.get_inputs()}
        for _ in range(2):
            sess.run(names, wanted)
        runs = []
        for _ in range(7):
            t0 = time.perf_counter()
            sess.run(names, wanted)
            runs.append(time.perf_counter() - t0)
        times.append(float(np.median(runs)))
        del sess
    return times[1] / max(times[0], 1e-9)


def edge_ranges(prepared: Prepared, opts: AutoOptions, calib: Sequence[Feed]) -> ModelRanges | None:
    """The INT8 activation ranges of the whole model on ``calib``, calibrated once for
    every edge segment :func:`convert` makes from it; None unless the edge is INT8."""
    if opts.precision != "int8":
        return None
    from splitinfer.partitioner.quantize import config_for, model_ranges

    cfg = config_for(runtime(opts), opts.calibration_method)
    return model_ranges(prepared.analysis.model, calib, cfg)


def runtime(opts: AutoOptions) -> str:
    from splitinfer.partitioner.quantize import runtime_for_profile

    return runtime_for_profile(opts.edge_profile)


def convert(
    model: onnx.ModelProto,
    opts: AutoOptions,
    calib: Sequence[Feed],
    ranges: ModelRanges | None = None,
) -> onnx.ModelProto:
    """The edge segment at the edge precision (``ranges``: :func:`edge_ranges` of the
    model it was cut from, on the same ``calib``)."""
    if opts.precision == "fp32":
        return model
    if opts.precision == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        out: onnx.ModelProto = convert_float_to_float16(model, keep_io_types=True)
        return out
    from splitinfer.partitioner.quantize import config_for, quantize_model

    cfg = config_for(runtime(opts), opts.calibration_method)
    return quantize_model(model, calib, cfg, ranges=ranges)


def timing_sample(floats: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """At most :data:`TIMING_TENSORS` tensors spread through the graph and
    :data:`TIMING_BYTES`, to time the codec on: its speed is the codec's, not the
    tensor's, and every tensor timed costs a few codec calls per sample."""
    names = [n for n in floats if floats[n].nbytes <= TIMING_BYTES] or list(floats)[:1]
    if len(names) > TIMING_TENSORS:
        idx = np.linspace(0, len(names) - 1, TIMING_TENSORS).round().astype(int)
        names = [names[i] for i in sorted(set(idx.tolist()))]
    picked: dict[str, np.ndarray] = {}
    total = 0
    for n in names:
        arr = floats[n] if floats[n].nbytes <= TIMING_BYTES else floats[n][:1]
        if picked and total + arr.nbytes > TIMING_BYTES:
            continue
        picked[n] = arr
        total += arr.nbytes
    return picked
