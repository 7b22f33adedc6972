"""``--split auto``: measure, predict, choose, then build and check the candidates.

1. **Samples.** The calibration folder, or synthetic data with a loud warning;
   a fifth is held out for the quality checks.
2. **Per-node times** for the edge and the cloud: a built-in device profile
   (roofline), a measured profile JSON from the device, or (no profile given)
   ONNX Runtime's profiler on this machine. For an INT8 edge measured here,
   fp32 node times are scaled by the whole model's measured int8/fp32 ratio.
3. **Wire bytes** per tensor: the int8+zstd codec run on real activations of
   every tensor that can cross a cut (8 samples, fewer when they would hold
   more than :data:`ACTIVATION_BYTES`; the codec's speed timed on a spread of
   at most 16 of them, 32 MiB in all: ``automeasure.timing_sample``).
4. **Candidates:** every cut when there are at most ``--max-cuts``; else the
   min-cuts per link point and constraint weighting plus all edge, all cloud
   and the single-tensor cuts (``cutsearch.auto_candidates``). Their **costs**
   (:func:`costmodel.cut_costs`) and a shortlist: the best few under the
   objective plus the cuts best across link speeds.
5. **Each shortlisted cut is built for real:** INT8 edge segment, end-to-end
   agreement with the fp32 model on held-out samples, the codec chosen on its
   activations, the utility left under the privacy noise (with the optional
   PCA bottleneck). Its measured wire bytes and accuracy drop replace the
   estimates.
6. **Choice** under the objective and constraints; ``--candidates K`` adds the
   cuts best across link speeds. The default cut is first.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from splitinfer.partitioner.agreement import output_agreement, output_metric
from splitinfer.partitioner.automeasure import activations as _activations
from splitinfer.partitioner.automeasure import convert as _convert
from splitinfer.partitioner.automeasure import edge_ranges as _edge_ranges
from splitinfer.partitioner.automeasure import node_times as _node_times
from splitinfer.partitioner.automeasure import run as _run
from splitinfer.partitioner.automeasure import runtime as _runtime
from splitinfer.partitioner.automeasure import samples as _samples
from splitinfer.partitioner.automeasure import session as _session
from splitinfer.partitioner.automeasure import source_activations as _source_activations
from splitinfer.partitioner.automeasure import stack as _stack
from splitinfer.partitioner.automeasure import timing_sample
from splitinfer.partitioner.calibration import split_holdout
from splitinfer.partitioner.costmodel import (
    WireModel,
    candidate_table,
    cut_costs,
    estimate_codec,
    tensor_ratios,
)
from splitinfer.partitioner.cuts import CutPlan
from splitinfer.partitioner.cutsearch import flows_of
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
from splitinfer.shared.errors import ConfigError, CutError, ModelError
from splitinfer.shared.links import Link
from splitinfer.shared.manifest import PRECISIONS, PrivacySpec, TensorSpec
from splitinfer.shared.preprocess import PreprocessSpec

if TYPE_CHECKING:
    from splitinfer.partitioner.adapt import AdaptOptions
    from splitinfer.partitioner.quant_ranges import ModelRanges

Feed = dict[str, np.ndarray]
Progress = Callable[[str], None]

#: Uplink speeds (bits/s) over which --candidates picks the cuts to switch among.
SWITCH_RATES = tuple(float(r) for r in np.geomspace(0.25e6, 100e6, 32))
#: Calibration samples the codec's compression of every tensor that can cross is
#: measured on: an estimate for the cost model (a built cut's codec is measured on all).
ACTIVATION_SAMPLES = 8
#: Calibration samples the codec's agreement with the cloud output is scored on.
SCORE_SAMPLES = 16
#: At most this many bytes of activations held at once (fewer samples on big models).
ACTIVATION_BYTES = 512 * 2**20


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
    #: How the candidates were found: "exhaustive over N cuts" or the min-cut summary.
    search: str = ""


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

    space = prepared.space
    progress("listing and planning the cuts")
    plans = space.exhaustive()
    if plans is not None:
        crossing = sorted({t for p in plans for t in p.crossing})
    else:
        crossing = sorted({f.name for f in flows_of(space) if f.crossable})
    progress(f"running the model on calibration samples ({len(crossing)} tensors that can cross)")
    per_sample = sum(a.tensors[t].bytes_per_sample for t in crossing)
    count = int(min(ACTIVATION_SAMPLES, max(2, ACTIVATION_BYTES // max(per_sample, 1))))
    acts = _activations(prepared, _stack(calib[:count]), crossing)
    codec = Int8ZstdCodec()
    floats = {k: v for k, v in acts.items() if v.dtype.kind == "f"}
    del acts
    ratios = tensor_ratios(floats, codec, progress=_counted(progress, "measuring the codec on"))
    est = estimate_codec(timing_sample(floats), codec) if floats else None
    del floats

    ranges = None
    whole = None
    if opts.precision == "int8":
        progress(f"calibrating INT8 activation ranges on the whole model ({len(calib)} samples)")
        ranges = _edge_ranges(prepared, opts, calib)
        progress("quantizing the whole model to INT8 (it screens the shortlisted cuts)")
        # the all-edge cut's segment: it is that cut's INT8 edge too, if it is picked
        everything = space.plan_for(space.full)
        whole = _convert(
            a.model if everything is None else artifacts_for(prepared, everything).edge or a.model,
            opts,
            calib,
            ranges,
        )
    edge_times, cloud_times, by_batch, overhead = _node_times(
        prepared, opts, calib, notes, progress, ranges, whole
    )
    wire = (
        WireModel(ratios, est.encode_bps, est.decode_bps, est.encode_call_s, est.decode_call_s)
        if est
        else WireModel(ratios)
    )
    if plans is not None:
        search: dict[str, Any] = {"method": "exhaustive", "cuts": len(plans)}
        search_line = f"exhaustive over {len(plans)} cuts"
    else:
        plans, search = _mincut_plans(prepared, opts, edge_times, cloud_times, by_batch, wire,
                                      progress)  # fmt: skip
        search_line = search["summary"]
    notes.append(f"cut search: {search_line}")
    progress(f"predicting the cost of {len(plans)} cuts")
    costs = cut_costs(
        plans,
        a,
        edge_times,
        cloud_times,
        ratios,
        wire.encode_bps,
        wire.decode_bps,
        encode_call_s=wire.encode_call_s,
        decode_call_s=wire.decode_call_s,
        run_overhead_s=overhead,
        cloud_times_by_batch=by_batch,
    )
    by_id = {p.id: p for p in plans}
    if opts.privacy is not None:  # noise protects float tensors only (check_private_cut)
        costs = [c for c in costs if _private_ok(prepared, by_id[c.cut_id])] or costs
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
    shortlisted = [by_id[c.cut_id] for c in short]
    # The shortlist is measured in the order of its predicted objective. A cut that
    # cannot beat the best one measured so far even sending nothing is not built (with
    # one cut to package and no --adapt-cloud). Split cuts at an edge precision below
    # fp32 are screened on one run of the whole model for all of them (and built again
    # if picked); the all-edge cut's INT8 segment is the whole model's.
    prune = opts.candidates == 1 and opts.adapt is None
    values: list[tuple[Feed, Feed] | None] = []

    def source() -> tuple[Feed, Feed] | None:
        if not values:  # adapting fine-tunes every cut: build them all
            found = None
            if opts.adapt is None:
                found = _source_activations(
                    prepared, opts, shortlisted, held, calib_stack, ACTIVATION_BYTES, whole
                )
            values.append(found)
        return values[0]

    measured: dict[str, _Measured] = {}
    built: set[str] = set()  # measured as segments of their own
    screened: set[str] = set()  # measured on the whole model's values first
    skipped: list[CutCost] = []
    for k, cost in enumerate(short, 1):
        plan = by_id[cost.cut_id]
        where = f"cut {k}/{len(short)}: {plan.id} ({plan.kind})"
        if prune and _cannot_win(cost, [m.cost for m in measured.values()], opts):
            progress(f"{where} not built: it cannot win even sending nothing")
            skipped.append(cost)
            continue
        src = None
        if plan.kind == "split" or (plan.kind == "all" and whole is None):
            src = source()
        screen = src is not None and opts.precision != "fp32"
        progress(f"{'screening' if screen else 'building'} {where}, {opts.precision} edge, "
                 "codec, checks")  # fmt: skip
        measured[plan.id] = _build(prepared, plan, cost, opts, calib, calib_stack, held,
                                   reference, ranges, src, screen=screen,
                                   whole=whole)  # fmt: skip
        if screen:  # rebuilt if picked: hold no fp32 copies
            measured[plan.id].art.edge = measured[plan.id].art.cloud = None
            screened.add(plan.id)
        else:
            built.add(plan.id)
        gc.collect()  # the cut's sessions (held in closures) before the next cut's
    values.clear()
    if opts.adapt is not None:
        from splitinfer.partitioner.adapt_auto import adapt_measured

        adapt_measured(prepared, measured, opts, calib_stack, _stack(held), reference, progress)

    shortlist_costs = {c.cut_id: c for c in short}
    while True:  # build the cuts picked on screened figures, until the picks are all built
        final = [m.cost for m in measured.values()]
        ranked = rank(final, opts.link, opts.objective, opts.constraints)
        chosen = ranked[0].cost
        picked = _pick(ranked, opts)
        todo = [c.cut_id for c in picked if c.cut_id not in built]
        if not todo:
            break
        for cut_id in todo:
            plan = by_id[cut_id]
            progress(f"building cut {plan.id} ({plan.kind}): {opts.precision} edge segment, "
                     "codec, checks")  # fmt: skip
            measured[cut_id] = _build(prepared, plan, shortlist_costs[cut_id], opts, calib,
                                      calib_stack, held, reference, ranges,
                                      whole=whole)  # fmt: skip
            built.add(cut_id)
    if screened:
        notes.append(
            f"{len(screened)} shortlisted cuts screened on the "
            f"whole {opts.precision} model's values; built as segments and measured: "
            + ", ".join(c for c in measured if c in built)
        )
    if skipped:
        notes.append(
            f"{len(skipped)} shortlisted cuts not built: even sending nothing none could beat "
            f"{chosen.cut_id} ({', '.join(c.cut_id for c in skipped)})"
        )
    best = measured[chosen.cut_id]
    if opts.min_agreement is not None and best.agreement is not None:
        _check_min(prepared, best, opts, calib, held, ranges)
    table = candidate_table([*final, *skipped], opts.link, chosen=chosen.cut_id)
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
            "cuts_screened": len(screened),
            "cuts_built": len(built),
            "cuts_not_built": [c.cut_id for c in skipped],
            "cut_search": search,
            "table": table,
            "notes": notes,
        },
    )
    return AutoResult(arts, extras, chosen, table, notes, search_line)


def _cannot_win(cost: CutCost, done: list[CutCost], opts: AutoOptions) -> bool:
    """True if ``cost`` loses to the best feasible cut of ``done`` even at its most
    hopeful: nothing sent and no accuracy lost (what building it could still change)."""
    if not done:
        return False
    try:
        best = rank(done, opts.link, opts.objective, opts.constraints)[0].cost
    except CutError:  # nothing measured is feasible yet
        return False
    hope = replace(cost, up_bytes=0, accuracy_drop=0.0)
    duel = rank([best, hope], opts.link, opts.objective, opts.constraints)
    return duel[0].cost is best


def _pick(ranked: list[Any], opts: AutoOptions) -> list[CutCost]:
    """The cuts the package carries: the chosen first, then (``--candidates K``) the
    best across link speeds and the next best by the objective."""
    chosen = ranked[0].cost
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
    return picked


def _mincut_plans(
    prepared: Prepared,
    opts: AutoOptions,
    edge_times: Mapping[str, float],
    cloud_times: Mapping[str, float],
    by_batch: Mapping[int, Mapping[str, float]],
    wire: WireModel,
    progress: Progress,
) -> tuple[list[CutPlan], dict[str, Any]]:
    """Candidate cuts of a space too big to list, by min-cut (``cutsearch``)."""
    from splitinfer.partitioner.cutchoice import Pricing, auto_candidates

    space = prepared.space
    count, exact = space.count()
    pricing = Pricing.of(space, edge_times, cloud_times, by_batch, wire,
                         private=opts.privacy is not None)  # fmt: skip
    sweep = SWITCH_RATES if opts.candidates > 1 else SWITCH_RATES[::5]
    found = auto_candidates(space, pricing, opts.link, opts.objective, opts.constraints, sweep,
                            progress)  # fmt: skip
    plans, reasons, refused = found.plans(space)
    total = f"{count:,}" if exact else f">= {count:,}"
    summary = (
        f"min-cut over {found.points} link points x {found.weightings} weightings "
        f"({found.runs} max-flows, {found.distinct} distinct cuts); {len(plans)} cuts "
        f"costed exactly with all edge, all cloud and the single-tensor cuts, of {total} "
        "valid cuts"
    )
    search = {
        "method": "min-cut",
        "summary": summary,
        "link_points": found.points,
        "weightings": found.weightings,
        "max_flows": found.runs,
        "min_cuts": found.distinct,
        "refused": refused,
        "cuts": len(plans),
        "space": count,
        "space_exact": exact,
        "why": reasons,
    }
    return plans, search


def _private_ok(prepared: Prepared, plan: CutPlan) -> bool:
    if plan.kind == "all":
        return True
    tensors = prepared.analysis.tensors
    return all(np.dtype(tensors[t].dtype).kind == "f" for t in plan.crossing)


def _counted(progress: Progress, what: str) -> Callable[[int, int], None]:
    """A ``(done, total)`` callback that reports about every tenth of the way."""

    def report(done: int, total: int) -> None:
        step = max(1, total // 10)
        if done in (1, total) or done % step == 0:
            progress(f"{what} {done}/{total} tensors")

    return report


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
    ranges: ModelRanges | None = None,
    source: tuple[Feed, Feed] | None = None,
    *,
    screen: bool = False,
    whole: onnx.ModelProto | None = None,
) -> _Measured:
    """Build ``plan`` and measure it. ``source``: the values of the tensors it sends
    (:func:`automeasure.source_activations`) instead of runs of its edge segment;
    ``screen``: those values are only a screening (the INT8 whole model's), so the
    edge segment is left unconverted and the cut is built again if it is picked.
    ``whole``: the all-edge cut's edge segment at the edge precision, if made already."""
    from splitinfer.partitioner.wirecodec import plan_wire

    art = artifacts_for(prepared, plan)
    held_stack = _stack(held)
    exact = opts.precision == "fp32" or _runtime(opts) == "tensorrt"
    if art.edge is not None and opts.precision != "fp32" and not screen:
        reuse = whole is not None and plan.kind == "all"
        art.edge = whole if reuse else _convert(art.edge, opts, calib, ranges)
        art.edge_precision = opts.precision
    crossing = list(plan.crossing)
    edge_calib: Feed | None
    if art.edge is not None and source is not None:
        edge_held = {t: source[0][t] for t in crossing}
        edge_calib = {t: source[1][t] for t in crossing}
    elif art.edge is not None:
        edge_held = _run(art.edge, held_stack, optimize=not exact)
        edge_calib = None  # run below, if a cloud segment needs it
    else:
        edge_held, edge_calib = dict(held_stack), dict(calib_stack)
    out_name = prepared.analysis.outputs[0]
    ref = reference[out_name]
    metric = output_metric(ref)

    def score_outputs(got: np.ndarray) -> float:
        return output_agreement(metric, ref, got)

    if art.cloud is None:  # all edge: the edge segment gives the outputs
        value = score_outputs(edge_held[out_name])
        art.quality = {"metric": metric, "value": value, "samples": len(held)}
        drop = 1.0 - value if metric == "top1" else None
        return _Measured(art, replace(cost, accuracy_drop=drop), value, metric)

    if edge_calib is None:
        edge_calib = _run(_need(art.edge), calib_stack, optimize=not exact)
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
    # the codec's agreement is scored on the first SCORE_SAMPLES calibration samples:
    # each score is a cloud run, and plan_wire scores a few codec steps per cut
    scored = {t: v[:SCORE_SAMPLES] for t, v in edge_calib.items()}
    calib_out = cloud_out(scored)

    def score_wire(rounded: Mapping[str, np.ndarray]) -> float:
        return output_agreement(
            metric, calib_out, cloud_out({t: v[:SCORE_SAMPLES] for t, v in rounded.items()})
        )

    wire = plan_wire(
        {t: edge_calib[t] for t in crossing},
        dictionary_file=f"codec/{plan.id}.zdict",
        score=score_wire,
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


def _check_min(
    prepared: Prepared,
    best: _Measured,
    opts: AutoOptions,
    calib: list[Feed],
    held: list[Feed],
    ranges: ModelRanges | None = None,
) -> None:
    assert opts.min_agreement is not None
    assert best.agreement is not None
    if best.agreement >= opts.min_agreement:
        return
    worst = ""
    edge_fp32 = artifacts_for(prepared, best.art.plan).edge
    if edge_fp32 is not None and opts.precision == "int8":
        from splitinfer.partitioner.agreement import worst_layers

        layers = worst_layers(edge_fp32, _convert(edge_fp32, opts, calib, ranges), held)
        worst = "; worst layers: " + ", ".join(f"{n} ({e:.3g})" for n, e in layers[:5])
    raise ModelError(
        f"cut {best.art.plan.id}: {opts.precision} edge keeps {best.metric} agreement "
        f"{best.agreement:.4f} with the fp32 model on {len(held)} held-out samples, below "
        f"--min-agreement {opts.min_agreement}{worst}"
    )
