"""``--split auto``: measure, predict, choose, then build and check the candidates.

1. **Samples.** The calibration folder, or synthetic data with a loud warning;
   a fifth is held out for the quality checks.
2. **Per-node times** for the edge and the cloud: a built-in device profile
   (roofline), a measured profile JSON from the device, or (no profile given)
   ONNX Runtime's profiler on this machine. For an INT8 edge measured here,
   fp32 node times are scaled by the whole model's measured int8/fp32 ratio.
3. **Wire bytes** per tensor: the int8+zstd codec run on real activations of
   every tensor that can cross a cut.
4. **Costs of every cut** (:func:`costmodel.cut_costs`) and a shortlist: the
   best few under the objective plus the cuts best across link speeds.
5. **Each shortlisted cut is built for real:** INT8 edge segment, end-to-end
   agreement with the fp32 model on held-out samples, the codec chosen on its
   activations, the utility left under the privacy noise (with the optional
   PCA bottleneck). Its measured wire bytes and accuracy drop replace the
   estimates.
6. **Choice** under the objective and constraints; ``--candidates K`` adds the
   cuts best across link speeds. The default cut is first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from splitinfer.partitioner.calibration import (
    load_calibration,
    split_holdout,
    synthetic_calibration,
)
from splitinfer.partitioner.costmodel import (
    candidate_table,
    cut_costs,
    estimate_codec,
    tensor_ratios,
)
from splitinfer.partitioner.cuts import CutPlan
from splitinfer.partitioner.dp import (
    apply_bottleneck,
    check_private_cut,
    fit_bottleneck,
    noise_batch,
)
from splitinfer.partitioner.pipeline import (
    CutArtifacts,
    PackageExtras,
    Prepared,
    artifacts_for,
    io_spec,
    tensor_spec,
)
from splitinfer.partitioner.wirecodec import InputCodec
from splitinfer.shared.codecs import Int8ZstdCodec
from splitinfer.shared.costs import Constraints, CutCost, best_across_links, rank
from splitinfer.shared.errors import ConfigError, ModelError
from splitinfer.shared.links import Link
from splitinfer.shared.manifest import PrivacySpec, TensorSpec
from splitinfer.shared.preprocess import PreprocessSpec

if TYPE_CHECKING:
    from splitinfer.partitioner.adapt import AdaptOptions

Feed = dict[str, np.ndarray]
Progress = Callable[[str], None]

#: Uplink speeds (bits/s) over which --candidates picks the cuts to switch among.
SWITCH_RATES = tuple(float(r) for r in np.geomspace(0.25e6, 100e6, 32))
ACTIVATION_SAMPLES = 16
PRECISIONS = ("int8", "fp16", "fp32")


@dataclass(frozen=True)
class AutoOptions:
    """Everything ``--split auto`` takes; see ``partition --help``."""

    link: Link
    edge_profile: str | None = None  # None: measure on this machine
    cloud_profile: str | None = None
    objective: str = "latency"
    constraints: Constraints = field(default_factory=Constraints)
    precision: str = "int8"
    calibration: Path | None = None
    calibration_method: str = "minmax"
    min_agreement: float | None = None
    candidates: int = 1
    privacy: PrivacySpec | None = None
    bottleneck: int | None = None
    #: ``--adapt-cloud``: fine-tune the cloud segment for the noise (``partitioner/adapt.py``).
    adapt: AdaptOptions | None = None
    #: How the cloud-only cut's inputs travel (``--input-codec``).
    input_codec: InputCodec = field(default_factory=InputCodec)
    #: Declared picture -> input preprocessing (``--preprocess``): how a calibration
    #: folder of pictures is read, recorded in the manifest.
    preprocessing: Mapping[str, PreprocessSpec] = field(default_factory=dict)
    shortlist: int = 6
    synthetic_samples: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision {self.precision!r}: use one of {PRECISIONS}")
        if self.candidates < 1:
            raise ConfigError(f"--candidates {self.candidates}: must be at least 1")
        if self.shortlist < 1:
            raise ConfigError(f"shortlist {self.shortlist}: must be at least 1")
        if self.bottleneck is not None and self.bottleneck < 1:
            raise ConfigError(f"--bottleneck {self.bottleneck}: must be at least 1")
        if self.bottleneck is not None and self.privacy is None:
            raise ConfigError("--bottleneck goes with --epsilon (it shapes the privacy noise)")
        if self.adapt is not None and self.privacy is None:
            raise ConfigError("--adapt-cloud goes with --epsilon (it trains for the privacy noise)")
        m = self.min_agreement
        if m is not None and not (math.isfinite(m) and 0 < m <= 1):
            raise ConfigError(f"--min-agreement {m!r}: must be in (0, 1]")


@dataclass
class AutoResult:
    artifacts: list[CutArtifacts]  # the default cut first
    extras: PackageExtras
    chosen: CutCost
    table: list[dict[str, Any]]
    notes: list[str]


@dataclass
class _Measured:
    """What one shortlisted cut turned out to be when built."""

    art: CutArtifacts
    cost: CutCost
    agreement: float | None
    metric: str


def auto_split(
    prepared: Prepared,
    opts: AutoOptions,
    progress: Progress,
    warn: Callable[[str], None],
) -> AutoResult:
    a = prepared.analysis
    notes: list[str] = []
    inputs = [io_spec(vi) for vi in a.model.graph.input if vi.name in a.inputs]
    samples = _samples(prepared, inputs, opts, warn)
    calib, held = split_holdout(samples, 0.2, seed=opts.seed)
    progress(f"{len(calib)} calibration and {len(held)} held-out samples")

    progress("running the model on calibration samples (activations of every tensor)")
    plans = prepared.space.plans()
    crossing = sorted({t for p in plans for t in p.crossing})
    acts = _activations(prepared, _stack(calib[:ACTIVATION_SAMPLES]), crossing)
    codec = Int8ZstdCodec()
    floats = {k: v for k, v in acts.items() if v.dtype.kind == "f"}
    ratios = tensor_ratios(floats, codec)
    est = estimate_codec(floats, codec) if floats else None

    edge_times, cloud_times, by_batch, overhead = _node_times(
        prepared, opts, calib, notes, progress
    )
    progress(f"predicting the cost of {len(plans)} cuts")
    costs = cut_costs(
        plans,
        a,
        edge_times,
        cloud_times,
        ratios,
        *((est.encode_bps, est.decode_bps) if est else ()),
        encode_call_s=est.encode_call_s if est else 0.0,
        decode_call_s=est.decode_call_s if est else 0.0,
        run_overhead_s=overhead,
        cloud_times_by_batch=by_batch,
    )
    by_id = {p.id: p for p in plans}
    loose = replace(opts.constraints, max_accuracy_drop=None)
    pre = rank(costs, opts.link, opts.objective, loose)
    short = [r.cost for r in pre[: opts.shortlist]]
    if opts.candidates > 1:
        short += best_across_links(
            [r.cost for r in pre],
            SWITCH_RATES,
            opts.link.rtt_s,
            opts.candidates,
            opts.link.downlink_bps,
        )
    short = list({c.cut_id: c for c in short}.values())

    reference = _run(prepared.optimized, _stack(held), optimize=True)
    calib_stack = _stack(calib)
    measured: dict[str, _Measured] = {}
    for cost in short:
        plan = by_id[cost.cut_id]
        progress(f"building cut {plan.id} ({plan.kind}): {opts.precision} edge, codec, checks")
        measured[plan.id] = _build(prepared, plan, cost, opts, calib, calib_stack, held, reference)
    if opts.adapt is not None:
        from splitinfer.partitioner.adapt_auto import adapt_measured

        adapt_measured(prepared, measured, opts, calib_stack, _stack(held), reference, progress)

    final = [m.cost for m in measured.values()]
    ranked = rank(final, opts.link, opts.objective, opts.constraints)
    chosen = ranked[0].cost
    best = measured[chosen.cut_id]
    if opts.min_agreement is not None and best.agreement is not None:
        _check_min(prepared, best, opts, calib, held)
    picked = [chosen]
    if opts.candidates > 1:
        spread = best_across_links(
            [r.cost for r in ranked],
            SWITCH_RATES,
            opts.link.rtt_s,
            opts.candidates,
            opts.link.downlink_bps,
        )
        picked += [c for c in spread if c.cut_id != chosen.cut_id]
        # A cut that wins at every link speed leaves room: fill it with the next best by
        # the objective, so the agent can still move work when the device or cloud is busy.
        seen = {c.cut_id for c in picked}
        picked += [r.cost for r in ranked if r.cost.cut_id not in seen]
        picked = picked[: opts.candidates]
    table = candidate_table(final, opts.link, chosen=chosen.cut_id)
    arts = []
    for cost in picked:
        m = measured[cost.cut_id]
        stats = next(r.latency for r in ranked if r.cost.cut_id == cost.cut_id)
        m.art.predicted = {
            **cost.to_dict(),
            "latency_mean_s": stats.mean_s,
            "latency_p50_s": stats.p50_s,
            "latency_p95_s": stats.p95_s,
        }
        arts.append(m.art)
    extras = PackageExtras(
        privacy=opts.privacy,
        preprocessing=dict(opts.preprocessing),
        planning={
            "objective": opts.objective,
            "edge_profile": opts.edge_profile or "measured on this machine",
            "cloud_profile": opts.cloud_profile or "measured on this machine",
            "link": {
                "uplink_bps": opts.link.uplink_bps,
                "downlink_bps": opts.link.downlink_bps,
                "rtt_s": opts.link.rtt_s,
                "description": opts.link.describe(),
            },
            "precision": opts.precision,
            "calibration": str(opts.calibration) if opts.calibration else "synthetic",
            "cuts_costed": len(plans),
            "cuts_built": len(measured),
            "table": table,
            "notes": notes,
        },
    )
    return AutoResult(arts, extras, chosen, table, notes)


# -- samples and activations ---------------------------------------------------------


def _samples(
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
    shapes = {k: (1, *v) for k, v in a.sample_input_shapes.items()}
    return synthetic_calibration(inputs, opts.synthetic_samples, opts.seed, shapes)


def _stack(samples: Sequence[Feed]) -> Feed:
    return {k: np.concatenate([s[k] for s in samples]) for k in samples[0]}


def _session(model: onnx.ModelProto, optimize: bool) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], optimize: bool) -> Feed:
    sess = _session(model, optimize)
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name: feeds[i.name] for i in sess.get_inputs()}
    return dict(zip(names, sess.run(names, wanted), strict=True))


def _activations(prepared: Prepared, feeds: Feed, names: Sequence[str]) -> Feed:
    """The values of ``names`` (tensors of the optimized graph) for ``feeds``."""
    from onnx import helper

    a = prepared.analysis
    probe = onnx.ModelProto()
    probe.CopyFrom(a.model)
    existing = {o.name for o in probe.graph.output}
    for name in names:
        if name not in existing and name not in feeds:
            elem = helper.np_dtype_to_tensor_dtype(np.dtype(a.tensors[name].dtype))
            probe.graph.output.append(helper.make_tensor_value_info(name, elem, None))
    out = _run(probe, feeds, optimize=False)
    out.update(feeds)
    return {n: np.asarray(out[n]) for n in names if n in out}


# -- node times ---------------------------------------------------------------------


def _node_times(
    prepared: Prepared,
    opts: AutoOptions,
    calib: list[Feed],
    notes: list[str],
    progress: Progress,
) -> tuple[dict[str, float], dict[str, float], dict[int, dict[str, float]], float]:
    from splitinfer.partitioner.profiler import measure_nodes
    from splitinfer.partitioner.profiles import node_times, resolve_profile

    a = prepared.analysis
    sha = prepared.source.sha256
    host = None
    overhead = 0.0
    if opts.edge_profile is None or opts.cloud_profile is None:
        progress("measuring per-node latency on this machine (ONNX Runtime profiler)")
        pool = _stack(calib)

        def feeds_for(batch: int) -> Feed:
            idx = np.arange(batch) % next(iter(pool.values())).shape[0]
            return {k: v[idx] for k, v in pool.items()}

        host = measure_nodes(
            a.model,
            feeds_for,
            batch_sizes=(1, 8),
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
        factor = _precision_factor(prepared, opts, calib)
        edge_t = {k: v * factor for k, v in edge_t.items()}
        notes.append(
            f"edge at {opts.precision}: fp32 node times on this machine x {factor:.2f} "
            "(the whole model's measured ratio)"
        )
    cloud = node_times(a, cloud_src, "fp32", 1, model_sha256=sha)
    notes += [f"cloud: {cloud.source}", *cloud.notes]
    by_batch = {b: node_times(a, cloud_src, "fp32", b, model_sha256=sha).times for b in (8, 32)}
    return edge_t, dict(cloud.times), by_batch, overhead


def _precision_factor(prepared: Prepared, opts: AutoOptions, calib: list[Feed]) -> float:
    """Measured wall time of the whole model at the edge precision / at fp32."""
    import time

    full = prepared.optimized
    low = _convert(full, opts, calib[: max(8, len(calib) // 2)])
    feeds = calib[0]
    times = []
    for model in (full, low):
        sess = _session(model, optimize=True)
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
    return times[1] / max(times[0], 1e-9)


def _runtime(opts: AutoOptions) -> str:
    if opts.edge_profile:
        from splitinfer.partitioner.profiles import BUILTIN

        prof = BUILTIN.get(opts.edge_profile)
        if prof is not None and prof.runtime == "tensorrt":
            return "tensorrt"
    return "cpu"


def _convert(model: onnx.ModelProto, opts: AutoOptions, calib: Sequence[Feed]) -> onnx.ModelProto:
    """The edge segment at the edge precision."""
    if opts.precision == "fp32":
        return model
    if opts.precision == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        out: onnx.ModelProto = convert_float_to_float16(model, keep_io_types=True)
        return out
    from splitinfer.partitioner.quantize import config_for, quantize_model

    cfg = config_for(_runtime(opts), opts.calibration_method)
    return quantize_model(model, calib, cfg)


# -- building one cut ---------------------------------------------------------------


def _build(
    prepared: Prepared,
    plan: CutPlan,
    cost: CutCost,
    opts: AutoOptions,
    calib: list[Feed],
    calib_stack: Feed,
    held: list[Feed],
    reference: Feed,
) -> _Measured:
    from splitinfer.partitioner.wirecodec import plan_wire

    art = artifacts_for(prepared, plan)
    held_stack = _stack(held)
    exact = opts.precision == "fp32" or _runtime(opts) == "tensorrt"
    if art.edge is not None and opts.precision != "fp32":
        art.edge = _convert(art.edge, opts, calib)
        art.edge_precision = opts.precision
    crossing = list(plan.crossing)
    if art.edge is not None:
        edge_held = _run(art.edge, held_stack, optimize=not exact)
        edge_calib = _run(art.edge, calib_stack, optimize=not exact)
    else:
        edge_held, edge_calib = dict(held_stack), dict(calib_stack)
    out_name = prepared.analysis.outputs[0]
    ref = reference[out_name]
    metric = "top1" if ref.ndim == 2 and ref.shape[1] > 1 else "cosine"

    def score_outputs(got: np.ndarray) -> float:
        return _agree(metric, ref, got)

    if art.cloud is None:  # all edge: the edge segment gives the outputs
        value = score_outputs(edge_held[out_name])
        art.quality = {"metric": metric, "value": value, "samples": len(held)}
        drop = 1.0 - value if metric == "top1" else None
        return _Measured(art, replace(cost, accuracy_drop=drop), value, metric)

    specs: list[TensorSpec] = [tensor_spec(prepared.analysis, t) for t in crossing]
    if opts.privacy is not None:
        check_private_cut(specs)
    if opts.bottleneck is not None and len(crossing) == 1 and art.edge is not None:
        (t,) = crossing
        k = min(opts.bottleneck, edge_calib[t].shape[0], int(np.prod(edge_calib[t].shape[1:])))
        bn = fit_bottleneck(t, edge_calib[t], k)
        art.edge, art.cloud = apply_bottleneck(_need(art.edge), art.cloud, bn)
        edge_calib = {bn.projected: _project(edge_calib[t], bn)}
        edge_held = {bn.projected: _project(edge_held[t], bn)}
        crossing = [bn.projected]
        batch = specs[0].shape[0]
        specs = [TensorSpec(bn.projected, "float32", (batch, bn.dims))]
        art.quality["bottleneck"] = {"dims": bn.dims, "explained_variance": bn.explained}
    cloud = _session(art.cloud, optimize=True)
    out_names = [o.name for o in cloud.get_outputs()]
    out_idx = out_names.index(out_name)

    def cloud_out(moved: Mapping[str, np.ndarray]) -> np.ndarray:
        feeds = {i.name: moved[i.name] for i in cloud.get_inputs()}
        result: np.ndarray = cloud.run(out_names, feeds)[out_idx]
        return result

    clean = score_outputs(cloud_out(edge_held))
    art.quality.update({"metric": metric, "value": clean, "samples": len(held)})
    calib_out = cloud_out(edge_calib)
    wire = plan_wire(
        {t: edge_calib[t] for t in crossing},
        dictionary_file=f"codec/{plan.id}.zdict",
        score=lambda rounded: _agree(metric, calib_out, cloud_out(rounded)),
        input_codec=opts.input_codec if plan.kind == "none" else None,
    )
    art.codec, art.quant = wire.codec, wire.quant
    art.tensors = tuple(specs)
    if wire.dictionary is not None:
        art.files[f"codec/{plan.id}.zdict"] = wire.dictionary
    art.quality["wire"] = wire.summary()
    value = clean
    if opts.privacy is not None:
        rng = np.random.default_rng(opts.seed)
        noised = noise_batch([edge_held[t] for t in crossing], opts.privacy, rng)
        value = score_outputs(cloud_out(dict(zip(crossing, noised, strict=True))))
        art.quality["private"] = {"metric": metric, "value": value, "epsilon": opts.privacy.epsilon}
    drop = (1.0 - value) if metric == "top1" else None
    new = replace(cost, up_bytes=round(wire.wire_bytes), accuracy_drop=drop)
    return _Measured(art, new, clean, metric)


def _need(model: onnx.ModelProto | None) -> onnx.ModelProto:
    if model is None:
        raise ModelError("internal: a split cut has no edge segment")
    return model


def _project(x: np.ndarray, bn: Any) -> np.ndarray:
    flat = x.reshape(x.shape[0], -1).astype(np.float32) - bn.mean
    out: np.ndarray = flat @ bn.components.T
    return out


def _agree(metric: str, ref: np.ndarray, got: np.ndarray) -> float:
    """Top-1 agreement, or mean cosine similarity per sample."""
    if metric == "top1":
        return float(np.mean(ref.argmax(axis=1) == got.argmax(axis=1)))
    r = ref.reshape(ref.shape[0], -1).astype(np.float64)
    g = got.reshape(got.shape[0], -1).astype(np.float64)
    den = np.linalg.norm(r, axis=1) * np.linalg.norm(g, axis=1)
    cos = np.where(den > 0, (r * g).sum(axis=1) / np.maximum(den, 1e-300), 1.0)
    return float(np.mean(cos))


def _check_min(
    prepared: Prepared, best: _Measured, opts: AutoOptions, calib: list[Feed], held: list[Feed]
) -> None:
    assert opts.min_agreement is not None
    assert best.agreement is not None
    if best.agreement >= opts.min_agreement:
        return
    worst = ""
    edge_fp32 = artifacts_for(prepared, best.art.plan).edge
    if edge_fp32 is not None and opts.precision == "int8":
        from splitinfer.partitioner.agreement import worst_layers

        layers = worst_layers(edge_fp32, _convert(edge_fp32, opts, calib), held)
        worst = "; worst layers: " + ", ".join(f"{n} ({e:.3g})" for n, e in layers[:5])
    raise ModelError(
        f"cut {best.art.plan.id}: {opts.precision} edge keeps {best.metric} agreement "
        f"{best.agreement:.4f} with the fp32 model on {len(held)} held-out samples, below "
        f"--min-agreement {opts.min_agreement}{worst}"
    )
