"""Does the cost model pick the cut that really is fastest? Predicted vs measured,
end to end on this machine, for every zoo model and a range of links.

    python bench/bench_costmodel.py [--quick] [--max-measured 40] [--json out.json]

PREDICT. Per-node times of the optimized graph at batch 1 come from ONNX
Runtime's profiler (``partitioner/profiler.measure_nodes``, one intra-op thread,
``ORT_ENABLE_ALL``), the fixed cost of a run from the same profile. The wire
codec (int8 + zstd) is measured on calibration activations (16 samples, seed 1):
the compression ratio per tensor, encode/decode throughput and cost per call.
``partitioner/costmodel.cut_costs`` turns them into a cost per cut and
``shared/costs.choose`` picks the cut of least expected latency for each link.

MEASURE. For each measured cut, its edge and cloud segments
(``partitioner/segments``) run in their own ONNX Runtime sessions with the same
settings (median of ``--runs``), on a held-out sample (seed 2); the real codec
encodes and decodes the real cut tensors (median of ``--runs``); the link time
comes from the encoded bytes: ``bytes*8/rate + rtt`` for a fixed rate, and for
a Mahimahi trace a packet-by-packet ``MahimahiTrace.delivery_time`` replay
averaged over 400 start times evenly spaced over the trace. Nothing sleeps.
The result goes down at 20 Mbit/s.

Cuts measured per model: all of them when there are at most ``--max-measured``;
otherwise (the transformer has thousands) the predicted best for every link and
scenario, the 3 next best for each, none and all, and cuts evenly spaced in
edge FLOPs up to the limit. "Measured best" is the best of the measured cuts.

Links: uplinks 0.5, 1, 2, 5, 10, 20, 50 Mbit/s, and every bundled uplink trace (sim/traces/)
planned two ways: with its mean rate alone (``mean``) and with its capacity
distribution (``dist``, 0.1 s windows); round trip 50 ms.

Scenarios: ``A`` is the acceptance setting (edge and cloud both this CPU, rtt
50 ms). The zoo models run in well under a millisecond here, so a 50 ms round
trip makes the all-edge cut best almost everywhere and A tests little of the
ranking. ``B`` makes the choice hard: the edge is emulated 30x slower than this
CPU (its measured compute and encode times, predicted and measured alike, are
multiplied by 30) and the round trip is 2 ms.

Columns: ``model ms`` is the model's expected latency of the cut it picked,
``pred ms`` the measured latency of that cut, ``best ms`` the measured
optimum. A row PASSes when the measured latency of the predicted cut is within 10% of
the measured optimum. Rows planned with a trace's mean alone are a baseline that
shows what the distribution buys; they do not count toward the verdict. Every
timing is profiled and measured ``--rounds`` times (2) at different moments and
the least kept, per segment, and for the node profile the round whose nodes add up
to least (a sum of per-node minima taken from different rounds is a run that never
happened): the machine is shared, and a load spike during one measurement would
otherwise decide the comparison. The speed
line times ``cut_costs`` on a 10-layer version of the zoo transformer (about
300 nodes; the first 2,400 of its cuts).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from splitinfer.partitioner.costmodel import cut_costs, estimate_codec, quant_axis, tensor_ratios
from splitinfer.partitioner.cuts import CutPlan
from splitinfer.partitioner.pipeline import Prepared, prepare
from splitinfer.partitioner.profiler import measure_nodes
from splitinfer.partitioner.segments import cloud_model, edge_model
from splitinfer.shared.codecs import Int8ZstdCodec, QuantParams, RawCodec, calibrate_params
from splitinfer.shared.costs import CutCost, rank
from splitinfer.shared.links import Link, MahimahiTrace
from splitinfer.sim import traces

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))
TRACES = traces.DIR

UPLINKS_MBIT = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
QUICK_UPLINKS_MBIT = (0.5, 5.0, 50.0)
QUICK_TRACES = ("ATT-LTE-driving-2016.up", "TMobile-LTE-short.up")
DOWNLINK_BPS = 20e6
TARGET = 1.10
SPEED_LIMIT_S = 1.0
REPLAY_STARTS = 400
CALIB_BATCH, CALIB_SEED, EVAL_SEED = 16, 1, 2


@dataclass(frozen=True)
class Scenario:
    name: str
    label: str
    edge_scale: float
    rtt_s: float


SCENARIOS = (
    Scenario("A", "edge = cloud = this CPU, rtt 50 ms", 1.0, 0.050),
    Scenario("B", "edge 30x slower than this CPU, rtt 2 ms", 30.0, 0.002),
)


@dataclass(frozen=True)
class LinkCase:
    """A link to plan for (``plan``) and how its time is measured (``trace`` or fixed)."""

    label: str
    plan: Link
    trace: MahimahiTrace | None


@dataclass(frozen=True)
class Measured:
    cut_id: str
    edge_s: float
    encode_s: float
    up_bytes: int
    decode_s: float
    cloud_s: float
    down_bytes: int


Array = np.ndarray
Feeds = dict[str, Array]


# -- set-up ------------------------------------------------------------------------


def export_zoo(out: Path, names: list[str]) -> dict[str, Path]:
    import torch  # noqa: F401  (configures torch logging before we quieten it)
    from zoo import ZOO, export

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    paths: dict[str, Path] = {}
    for name in names:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            paths[name] = export(ZOO[name], out / f"{name}.onnx")
    return paths


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(
        model.SerializeToString(), sess_options=opts, providers=["CPUExecutionProvider"]
    )


def median_time(fn: Callable[[], object], runs: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def all_activations(prepared: Prepared, feeds: Feeds) -> Feeds:
    """Every batched tensor of the optimized graph (inputs included) for ``feeds``."""
    a = prepared.analysis
    probe = onnx.ModelProto()
    probe.CopyFrom(a.model)
    existing = {o.name for o in probe.graph.output}
    wanted = [n for n, t in a.tensors.items() if t.batched and not t.is_input]
    for name in wanted:
        if name not in existing:
            elem = helper.np_dtype_to_tensor_dtype(np.dtype(a.tensors[name].dtype))
            probe.graph.output.append(helper.make_tensor_value_info(name, elem, None))
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    sess = ort.InferenceSession(probe.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    out = dict(zip(names, sess.run(names, feeds), strict=True))
    out.update({k: v for k, v in feeds.items() if a.tensors[k].batched})
    return {k: np.asarray(v) for k, v in out.items() if k in a.tensors and a.tensors[k].batched}


def link_cases(quick: bool, rtt_s: float) -> list[LinkCase]:
    cases = [
        LinkCase(f"{m:g} Mbit/s", Link(m * 1e6, DOWNLINK_BPS, rtt_s), None)
        for m in (QUICK_UPLINKS_MBIT if quick else UPLINKS_MBIT)
    ]
    for path in sorted(TRACES.glob("*.up")):
        if quick and path.name not in QUICK_TRACES:
            continue
        trace = MahimahiTrace.load(path)
        short = path.name.removesuffix(".up")
        mean = Link(trace.mean_bps, DOWNLINK_BPS, rtt_s)
        dist = Link.from_trace(trace, rtt_s=rtt_s, downlink_bps=DOWNLINK_BPS)
        cases.append(LinkCase(f"{short} mean", mean, trace))
        cases.append(LinkCase(f"{short} dist", dist, trace))
    return cases


# -- predict -------------------------------------------------------------------------


def predict(
    prepared: Prepared,
    feeds_for_batch: Callable[[int], Feeds],
    calib: Feeds,
    runs: int,
    rounds: int,
) -> tuple[list[CutCost], dict[str, Any]]:
    profiles = [
        measure_nodes(
            prepared.optimized,
            feeds_for_batch,
            (1,),
            runs=runs,
            warmup=3,
            intra_op_threads=1,
            analysis=prepared.analysis,
        )
        for _ in range(rounds)
    ]
    # the least disturbed round as a whole (the machine is shared). Not the least of each
    # node across rounds: with hundreds of 1-2 us nodes, a sum of per-node minima is a run
    # that never happened (26 % under any real run of the zoo transformer)
    calm = min(profiles, key=lambda p: sum(p.times[1].values()))
    times = dict(calm.times[1])
    overhead = max(calm.overhead_s[1], 0.0)
    wall = calm.wall[1]
    codec = Int8ZstdCodec()
    ratios = tensor_ratios(calib, codec)
    estimates = [estimate_codec(calib, codec, repeats=5) for _ in range(rounds)]
    est = estimates[0]._replace(
        encode_bps=max(e.encode_bps for e in estimates),
        decode_bps=max(e.decode_bps for e in estimates),
        encode_call_s=min(e.encode_call_s for e in estimates),
        decode_call_s=min(e.decode_call_s for e in estimates),
    )
    costs = cut_costs(
        prepared.space,
        prepared.analysis,
        times,
        times,
        ratios,
        est.encode_bps,
        est.decode_bps,
        encode_call_s=est.encode_call_s,
        decode_call_s=est.decode_call_s,
        run_overhead_s=overhead,
    )
    info = {
        "node_sum_ms": sum(times.values()) * 1e3,
        "wall_ms": wall * 1e3,
        "run_overhead_us": overhead * 1e6,
        "codec_ratio": est.ratio,
        "encode_call_us": est.encode_call_s * 1e6,
        "encode_gbps": est.encode_bps / 1e9,
    }
    return costs, info


def scaled(costs: list[CutCost], s: Scenario) -> list[CutCost]:
    return [
        dataclasses.replace(c, edge_s=c.edge_s * s.edge_scale, encode_s=c.encode_s * s.edge_scale)
        for c in costs
    ]


def pick_measured(
    plans: list[CutPlan], costs: list[CutCost], cases: dict[str, list[LinkCase]], limit: int
) -> list[CutPlan]:
    """All cuts if few; else the predicted bests (and runners-up), none, all, and a
    spread in edge FLOPs, ``limit`` in all (more only if the predicted bests need it)."""
    if len(plans) <= limit:
        return plans
    by_id = {p.id: p for p in plans}
    must: list[str] = [plans[0].id, plans[-1].id]
    extra: list[str] = []
    for scenario in SCENARIOS:
        for case in cases[scenario.name]:
            ranked = rank(scaled(costs, scenario), case.plan)
            must.append(ranked[0].cost.cut_id)
            extra.extend(r.cost.cut_id for r in ranked[1:4])
    chosen = list(dict.fromkeys(must))
    for cid in extra:
        if len(chosen) >= max(limit * 2 // 3, len(must)):
            break
        if cid not in chosen:
            chosen.append(cid)
    spread = sorted(plans, key=lambda p: (p.edge_flops, p.bytes_per_sample, p.id))
    for i in np.linspace(0, len(spread) - 1, num=limit).astype(int):
        if len(chosen) >= limit:
            break
        if spread[i].id not in chosen:
            chosen.append(spread[i].id)
    return [by_id[c] for c in chosen]


# -- measure -------------------------------------------------------------------------


def measure_cut(
    prepared: Prepared, plan: CutPlan, feeds: Feeds, params: dict[str, QuantParams], runs: int
) -> Measured:
    a = prepared.analysis
    int8, raw = Int8ZstdCodec(), RawCodec()
    if plan.kind == "none":
        edge_s = 0.0
        crossing = {n: feeds[n] for n in plan.crossing}
    else:
        edge = session(edge_model(a, plan))
        names = [o.name for o in edge.get_outputs()]
        wanted = {i.name: feeds[i.name] for i in edge.get_inputs()}
        crossing = dict(zip(names, edge.run(names, wanted), strict=True))
        edge_s = median_time(lambda: edge.run(names, wanted), runs)
    if plan.kind == "all":
        return Measured(plan.id, edge_s, 0.0, 0, 0.0, 0.0, 0)
    encode_s = decode_s = 0.0
    up = 0
    for name, value in crossing.items():
        x = np.ascontiguousarray(value)
        if x.dtype.kind == "f":
            p: QuantParams | None = params[name]
            codec: Int8ZstdCodec | RawCodec = int8
        else:
            p, codec = None, raw
        data = codec.encode(x, p)
        up += len(data)
        encode_s += median_time(_encoder(codec, x, p), runs)
        decode_s += median_time(_decoder(codec, data, x, p), runs)
    cloud = session(cloud_model(a, plan))
    cfeeds = {i.name: crossing[i.name] for i in cloud.get_inputs()}
    outs = [o.name for o in cloud.get_outputs()]
    results = cloud.run(outs, cfeeds)
    cloud_s = median_time(lambda: cloud.run(outs, cfeeds), runs)
    down = sum(np.asarray(r).nbytes for r in results)
    return Measured(plan.id, edge_s, encode_s, up, decode_s, cloud_s, down)


def least(a: Measured, b: Measured) -> Measured:
    """Field by field, the faster of two measurements of the same cut."""
    return Measured(
        a.cut_id,
        min(a.edge_s, b.edge_s),
        min(a.encode_s, b.encode_s),
        a.up_bytes,
        min(a.decode_s, b.decode_s),
        min(a.cloud_s, b.cloud_s),
        a.down_bytes,
    )


def _encoder(
    codec: Int8ZstdCodec | RawCodec, x: Array, p: QuantParams | None
) -> Callable[[], object]:
    return lambda: codec.encode(x, p)


def _decoder(
    codec: Int8ZstdCodec | RawCodec, data: bytes, x: Array, p: QuantParams | None
) -> Callable[[], object]:
    limit = 8 * x.nbytes + 4096
    return lambda: codec.decode(data, str(x.dtype), tuple(x.shape), p, limit)


def measured_latency(m: Measured, s: Scenario, case: LinkCase) -> float:
    compute = (m.edge_s + m.encode_s) * s.edge_scale + m.decode_s + m.cloud_s
    if m.up_bytes == 0 and m.down_bytes == 0:
        return compute
    down = m.down_bytes * 8 / DOWNLINK_BPS
    if case.trace is None:
        return float(compute + m.up_bytes * 8 / case.plan.uplink_bps + s.rtt_s + down)
    trace = case.trace
    starts = np.arange(REPLAY_STARTS) * (trace.duration_ms / REPLAY_STARTS)
    upload = float((trace.delivery_times(m.up_bytes, starts) - starts).mean()) / 1000
    return compute + upload + s.rtt_s + down


# -- the run ---------------------------------------------------------------------------


def bench_model(
    name: str, path: Path, quick: bool, runs: int, limit: int, rounds: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from zoo import ZOO

    zoo = ZOO[name]
    prepared = prepare(path)
    plans = prepared.space.plans()
    calib = all_activations(prepared, zoo.sample(CALIB_BATCH, CALIB_SEED))
    costs, info = predict(prepared, lambda b: zoo.sample(b, CALIB_SEED), calib, runs, rounds)
    params = {
        k: calibrate_params(v, axis=quant_axis(v.ndim))
        for k, v in calib.items()
        if v.dtype.kind == "f"
    }
    cases = {s.name: link_cases(quick, s.rtt_s) for s in SCENARIOS}
    chosen = pick_measured(plans, costs, cases, limit)
    feeds = zoo.sample(1, EVAL_SEED)
    measured = {p.id: measure_cut(prepared, p, feeds, params, runs) for p in chosen}
    for _ in range(rounds - 1):
        for p in chosen:
            measured[p.id] = least(measured[p.id], measure_cut(prepared, p, feeds, params, runs))
    info.update({"cuts": len(plans), "measured": len(chosen)})
    rows: list[dict[str, Any]] = []
    for s in SCENARIOS:
        sc = scaled(costs, s)
        for case in cases[s.name]:
            top = rank(sc, case.plan)[0]
            predicted = top.cost
            lat = {cid: measured_latency(m, s, case) for cid, m in measured.items()}
            best = min(lat, key=lambda c: (lat[c], c))
            ratio = lat[predicted.cut_id] / lat[best]
            rows.append(
                {
                    "model": name,
                    "scenario": s.name,
                    "link": case.label,
                    "predicted": predicted.cut_id,
                    "predicted_kind": predicted.kind,
                    "measured_best": best,
                    "model_ms": top.latency.mean_s * 1e3,
                    "predicted_ms": lat[predicted.cut_id] * 1e3,
                    "best_ms": lat[best] * 1e3,
                    "ratio": ratio,
                    "pass": predicted.cut_id == best or ratio <= TARGET,
                    "baseline": case.label.endswith(" mean"),
                }
            )
    return rows, info


def speed_check(quick: bool, zoo_paths: dict[str, Path]) -> dict[str, Any]:
    """Seconds of cut_costs for 2,400 cuts of a ~300-node transformer (quick: the zoo's)."""
    if quick:
        prepared = prepare(zoo_paths["transformer"])
        label = "zoo transformer"
    else:
        import torch
        from zoo import ZOO

        from splitinfer.partitioner.torch_export import export_onnx

        torch.manual_seed(0)
        spec = ZOO["transformer"]
        net = spec.build()
        layer = type(net.layers[0])
        net.layers = torch.nn.ModuleList([layer(32) for _ in range(10)])
        net.eval()
        example = tuple(torch.from_numpy(v) for v in spec.sample(2).values())
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "transformer10.onnx"
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")
                export_onnx(net, example, path, list(spec.inputs), list(spec.outputs))
            prepared = prepare(path, max_cuts=100_000)
        label = "10-layer transformer"
    plans = prepared.space.plans()[:2400]
    times = {n.name: 1e-5 for n in prepared.analysis.nodes}
    seconds = median_time(
        lambda: cut_costs(plans, prepared.analysis, times, times), 3 if quick else 5, warmup=1
    )
    return {
        "graph": label,
        "nodes": len(prepared.analysis.nodes),
        "cuts": len(plans),
        "seconds": seconds,
        "pass": seconds < SPEED_LIMIT_S,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'model':<12}{'sc':<3}{'link':<32}{'predicted':>10}{'meas. best':>11}"
        f"{'model ms':>10}{'pred ms':>10}{'best ms':>10}{'ratio':>7}  verdict"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['model']:<12}{r['scenario']:<3}{r['link']:<32}{r['predicted']:>10}"
            f"{r['measured_best']:>11}{r['model_ms']:>10.3f}{r['predicted_ms']:>10.3f}"
            f"{r['best_ms']:>10.3f}"
            f"{r['ratio']:>7.3f}  {'PASS' if r['pass'] else 'FAIL'}"
            + ("  (baseline: planned with the mean rate)" if r["baseline"] else "")
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer links, runs and cuts")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per measurement")
    ap.add_argument("--max-measured", type=int, default=None, help="cuts measured per model")
    ap.add_argument(
        "--rounds", type=int, default=None, help="profile and measure this often, keep the least"
    )
    ap.add_argument("--models", default=None, help="comma-separated zoo models (default: all)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    from zoo import ZOO

    runs = args.runs or (10 if args.quick else 30)
    limit = args.max_measured or (12 if args.quick else 40)
    rounds = args.rounds or 2
    names = args.models.split(",") if args.models else list(ZOO)
    print(f"cost model vs measurement: {len(names)} zoo models, {runs} runs per timing, "
          f"at most {limit} cuts measured per model, least of {rounds} rounds, this CPU, "
          "one thread")  # fmt: skip
    rows: list[dict[str, Any]] = []
    infos: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = export_zoo(Path(tmp), names)
        for name in names:
            t0 = time.perf_counter()
            model_rows, info = bench_model(name, paths[name], args.quick, runs, limit, rounds)
            info["seconds"] = time.perf_counter() - t0
            rows += model_rows
            infos[name] = info
            print(
                f"  {name}: {info['cuts']} cuts, {info['measured']} measured; whole graph "
                f"{info['wall_ms']:.3f} ms wall, node times sum {info['node_sum_ms']:.3f} ms, "
                f"run overhead {info['run_overhead_us']:.1f} us; codec ratio "
                f"{info['codec_ratio']:.2f}, {info['encode_call_us']:.0f} us/call "
                f"({info['seconds']:.1f} s)",
                flush=True,
            )
        speed = speed_check(args.quick, paths) if "transformer" in paths or not args.quick else {}
        # (quick mode times the zoo transformer, so it needs it among --models)
    print()
    for s in SCENARIOS:
        print(f"scenario {s.name}: {s.label}")
    print()
    print_table(rows)
    print()
    verdict = True
    for s in SCENARIOS:
        mine = [r for r in rows if r["scenario"] == s.name and not r["baseline"]]
        ok = sum(r["pass"] for r in mine)
        same = sum(r["predicted"] == r["measured_best"] for r in mine)
        worst = max((r["ratio"] for r in mine), default=math.nan)
        base = [r for r in rows if r["scenario"] == s.name and r["baseline"]]
        print(
            f"scenario {s.name}: {ok}/{len(mine)} within 10% ({same} exact matches), "
            f"worst ratio {worst:.3f} -> {'PASS' if ok == len(mine) else 'FAIL'}; "
            f"baseline planning traces by their mean: {sum(r['pass'] for r in base)}/{len(base)}"
        )
        verdict &= s.name != "A" or ok == len(mine)
    if speed:
        print(
            f"cut_costs speed: {speed['cuts']} cuts of the {speed['graph']} "
            f"({speed['nodes']} nodes) in {speed['seconds'] * 1e3:.1f} ms "
            f"(target < {SPEED_LIMIT_S:g} s) -> {'PASS' if speed['pass'] else 'FAIL'}"
        )
        verdict &= bool(speed["pass"])
    print(f"acceptance (scenario A and speed): {'PASS' if verdict else 'FAIL'}")
    if args.json:
        args.json.write_text(
            json.dumps({"rows": rows, "models": infos, "speed": speed}, indent=2), encoding="utf-8"
        )
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
