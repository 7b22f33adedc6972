"""Measured per-node latency from ONNX Runtime's profiler.

:func:`measure_nodes` runs the optimized graph in an ONNX Runtime session at
the optimization level it will really run at (``ORT_ENABLE_ALL`` by default,
so fused and re-laid-out kernels are what gets timed), with
``SessionOptions.enable_profiling`` on, and reads the trace: one
``"cat": "Node"`` event named ``<runtime node>_kernel_time`` per kernel and
run, ``"dur"`` in whole microseconds, between ``model_run`` events. The runtime
graph itself comes from ``optimized_model_filepath``; the profile events carry
op types and shapes but no tensor names. Times go back to the graph's nodes
through :class:`splitinfer.partitioner.runtime_map.Attributor`.

The profiler's own bookkeeping (input and output sizes, memory statistics,
formatting the event's arguments) falls inside each kernel's interval: 2-7 us
per kernel on a current x86 core, as much as a small kernel takes, so the raw
events of a graph of small nodes add up to more than its unprofiled run. So a
second, unprofiled session of the same model is timed in turn with the
profiled one (each measured run right after a run of the same session, so
both see warm caches and the same machine load), and the same amount is taken
off every kernel event so that the node times add up to that median wall time
less the fixed cost of a run (the Python call, feeds and fetches; measured on
a tiny graph, see :func:`executor_costs`). Node times thus include the
executor's dispatch of each node, and ``NodeProfile.overhead_s`` is about that
fixed cost. The two sessions hold the weights twice while measuring.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from splitinfer.partitioner.analysis import GraphAnalysis, analyse
from splitinfer.partitioner.flops import all_flops
from splitinfer.partitioner.runtime_map import Attributor, load_runtime_graph, node_keys
from splitinfer.shared.errors import ConfigError, ModelError
from splitinfer.shared.nodeprofile import NodeProfile

__all__ = ["NodeProfile", "executor_costs", "host_device_name", "measure_nodes"]

Feeds = dict[str, np.ndarray]

OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")
#: Seconds of measured runs per batch size after which :func:`measure_nodes` stops
#: early (after at least :data:`MIN_RUNS`): on a real-size model one run is long
#: and steady enough that three give a stable median, and seven at batch 8 would
#: take most of ``--split auto``'s time (BERT-sized: 4 runs a measurement, ~0.5 s each).
RUN_BUDGET_S = 1.5
MIN_RUNS = 3
#: The same floor at the later batch sizes, whose runs are the longest (batch 8).
MIN_LATER_RUNS = 2
#: A run at least this long warms nothing for the next: its working set (weights and
#: activations) is far larger than the caches, so a measured run is not preceded by an
#: untimed one of the same session (which halves the profiler's time on a real-size model).
LONG_RUN_S = 0.02
_KERNEL_SUFFIX = "_kernel_time"
_QUANT_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul"})
_RUNTIMES = {
    "CPUExecutionProvider": "onnxruntime-cpu",
    "CUDAExecutionProvider": "onnxruntime-cuda",
    "TensorrtExecutionProvider": "onnxruntime-tensorrt",
}


def host_device_name() -> str:
    """This machine in words: board or CPU model and the number of usable cores."""
    model = ""
    with contextlib.suppress(OSError):  # ARM boards (Raspberry Pi, Jetson) name themselves here
        model = Path("/proc/device-tree/model").read_text(errors="replace").strip("\x00\n ")
    if not model:
        try:
            for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
                key, _, value = line.partition(":")
                if key.strip() in {"model name", "Model", "Hardware"} and value.strip():
                    model = value.strip()
                    break
        except OSError:
            pass
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return f"{model} ({cores} cores)"


def _ort() -> Any:
    import onnxruntime as ort

    return ort


def _options(optimization: str, threads: int | None, *, profile_dir: Path | None = None) -> Any:
    from splitinfer.shared.ortsession import session_options

    level = "none" if optimization == "disable" else optimization
    opts = session_options(optimize=level, threads=threads, sequential=True)  # type: ignore[arg-type]
    if profile_dir is not None:
        opts.enable_profiling = True
        opts.profile_file_prefix = str(profile_dir / "ort")
    return opts


def _session(model: onnx.ModelProto, opts: Any, providers: Sequence[str] | None) -> Any:
    from splitinfer.shared.ortsession import CPU, open_session

    return open_session(
        model, providers=list(providers or CPU), options=opts, name="the model for profiling"
    )


def _run(sess: Any, feeds: Feeds) -> None:
    try:
        sess.run(None, feeds)
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        raise ModelError(
            f"ONNX Runtime cannot run the model: {lines[0] if lines else exc}"
        ) from exc


def _walls(sess: Any, feeds: Feeds, runs: int, warmup: int) -> list[float]:
    """Seconds of each of ``runs`` timed ``session.run`` calls after ``warmup`` untimed."""
    for _ in range(warmup):
        _run(sess, feeds)
    walls = []
    for _ in range(runs):
        start = time.perf_counter()
        _run(sess, feeds)
        walls.append(time.perf_counter() - start)
    return walls


def _chain(n: int) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Add", [f"t{i}", "one"], [f"t{i + 1}"], name=f"add{i}") for i in range(n)
    ]
    graph = helper.make_graph(
        nodes,
        "profiler_calibration",
        [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [1, 1])],
        [helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, [1, 1])],
        initializer=[helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@dataclass(frozen=True)
class ExecutorCosts:
    """What ONNX Runtime costs around the kernels on this machine, in seconds."""

    fixed_s: float  # one ``session.run`` call from Python: binding, feeds, fetches
    per_node_s: float  # dispatching one node (with a trivial kernel)
    trivial_event_s: float  # a profiled kernel event of a trivial node: mostly bookkeeping


def executor_costs(threads: int | None = None, runs: int = 30) -> ExecutorCosts:
    """Measure :class:`ExecutorCosts` on chains of one-element Adds.

    Chains of 8 and 72 nodes are timed with the profiler off; the difference
    per extra node is the dispatch, what is left of the short chain the fixed
    cost. Minimums, not medians: these are properties of the machine, and on a
    shared machine the fastest run is the one least disturbed. A profiled run
    of the long chain gives the duration of a trivial kernel's event.
    """
    feeds = {"t0": np.zeros((1, 1), np.float32)}
    short, long = 8, 72
    best = [
        min(_walls(_session(_chain(n), _options("disable", threads), None), feeds, runs, 5))
        for n in (short, long)
    ]
    per_node = max((best[1] - best[0]) / (long - short), 0.0)
    with tempfile.TemporaryDirectory(prefix="splitinfer-calibrate-") as tmp:
        opts = _options("disable", threads, profile_dir=Path(tmp))
        sess = _session(_chain(long), opts, None)
        for _ in range(5):
            _run(sess, feeds)
        events = json.loads(Path(sess.end_profiling()).read_text())
    durations = [
        e["dur"] for e in events if e.get("cat") == "Node" and e["name"].endswith(_KERNEL_SUFFIX)
    ]
    trivial = statistics.median(durations) * 1e-6 if durations else 0.0
    return ExecutorCosts(max(best[0] - short * per_node, 0.0), per_node, trivial)


Samples = dict[str, tuple[np.ndarray, np.ndarray]]


def _samples(runs: list[list[tuple[str, float]]]) -> Samples:
    """Runtime node name -> (seconds in each run, events in each run)."""
    names = sorted({name for run in runs for name, _ in run})
    column = {name: j for j, name in enumerate(names)}
    seconds = np.zeros((len(runs), len(names)))
    counts = np.zeros((len(runs), len(names)))
    for r, run in enumerate(runs):
        for name, dur_us in run:
            seconds[r, column[name]] += dur_us * 1e-6
            counts[r, column[name]] += 1
    return {name: (seconds[:, j], counts[:, j]) for name, j in column.items()}


def _medians(samples: Samples, bookkeeping_s: float) -> dict[str, float]:
    """Median seconds per runtime node once ``bookkeeping_s`` is taken off each event."""
    return {
        name: float(np.median(np.maximum(seconds - bookkeeping_s * counts, 0.0)))
        for name, (seconds, counts) in samples.items()
    }


def _bookkeeping_s(samples: Samples, walls: list[float], costs: ExecutorCosts) -> float:
    """Seconds to take off each kernel event: the profiler's bookkeeping.

    Taken to be the same for every kernel, and chosen so that the median times
    of the runtime nodes add up to the median unprofiled run (timed in turn
    with the profiled ones) less the fixed cost of a run. Bounded by 0 (never
    inflate) and by twice the event of a trivial kernel (a disturbed wall time
    must not wipe out the small kernels).
    """
    target = statistics.median(walls) - costs.fixed_s

    def total(cut: float) -> float:
        return sum(_medians(samples, cut).values())

    low, high = 0.0, 2 * costs.trivial_event_s
    if not samples or total(low) <= target:
        return low
    if total(high) >= target:
        return high
    for _ in range(40):  # total() falls as the cut grows: bisect
        mid = (low + high) / 2
        low, high = (mid, high) if total(mid) > target else (low, mid)
    return high


def _split_runs(events: list[dict[str, Any]]) -> list[list[tuple[str, float]]]:
    """Top-level kernel events of each ``model_run``, in order: (name, microseconds)."""
    runs = sorted(
        (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
        key=lambda e: e["ts"],
    )
    kernels = sorted(
        (
            e
            for e in events
            if e.get("cat") == "Node" and str(e.get("name", "")).endswith(_KERNEL_SUFFIX)
        ),
        key=lambda e: e["ts"],
    )
    out: list[list[tuple[str, float]]] = [[] for _ in runs]
    j = 0
    for k, run in enumerate(runs):
        start, end = run["ts"], run["ts"] + run["dur"]
        last_end = -1.0
        while j < len(kernels) and kernels[j]["ts"] <= end:
            e = kernels[j]
            j += 1
            if e["ts"] < start:
                continue
            if e["ts"] < last_end:  # nested: a subgraph node inside If/Loop/Scan
                continue
            last_end = e["ts"] + e["dur"]
            out[k].append((e["name"][: -len(_KERNEL_SUFFIX)], float(e["dur"])))
    return out


def _attribute(medians: dict[str, float], attributor: Attributor) -> tuple[dict[str, float], float]:
    """Seconds per graph node from seconds per runtime node, and the unattributed rest."""
    node_time = dict.fromkeys(attributor.keys, 0.0)
    lost = 0.0
    for name, t in medians.items():
        shares = attributor.shares(name)
        if shares is None:
            lost += t
            continue
        for i, share in shares.items():
            node_time[attributor.keys[i]] += t * share
    return node_time, lost


def _precision(model: onnx.ModelProto) -> str:
    if any(n.op_type in _QUANT_OPS for n in model.graph.node):
        return "int8"
    if any(t.data_type == TensorProto.FLOAT16 for t in model.graph.initializer):
        return "fp16"
    return "fp32"


def _session_model(
    model: onnx.ModelProto, analysis: GraphAnalysis, keys: list[str]
) -> onnx.ModelProto:
    """``model`` with every node named by its key (a copy only if a name differs)."""
    by_outputs = {tuple(n.output): k for n, k in zip(analysis.nodes, keys, strict=True)}
    if len(by_outputs) != len(keys) or len(model.graph.node) != len(keys):
        raise ValueError("the analysis does not describe this model")
    if all(n.name == by_outputs.get(tuple(n.output)) for n in model.graph.node):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        key = by_outputs.get(tuple(node.output))
        if key is None:
            raise ValueError(f"node {node.name!r} of the model is not in the analysis")
        node.name = key
    return copy


def _check_args(batch_sizes: Sequence[int], runs: int, warmup: int) -> tuple[int, ...]:
    batches = tuple(batch_sizes)
    if not batches or not all(
        isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in batches
    ):
        raise ConfigError(f"batch sizes {list(batches)}: need one or more positive integers")
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ConfigError(f"runs {runs!r}: need at least 1 measured run")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"warmup {warmup!r}: must be 0 or more runs")
    return tuple(sorted(set(batches)))


def _feeds(feeds_for_batch: Callable[[int], Feeds], batch: int, names: list[str]) -> Feeds:
    given = feeds_for_batch(batch)
    missing = [n for n in names if n not in given]
    if missing:
        raise ConfigError(
            f"the feeds for batch {batch} lack input {missing[0]!r}; the model's inputs are "
            + ", ".join(repr(n) for n in names)
        )
    return {n: np.asarray(given[n]) for n in names}


def measure_nodes(
    model: onnx.ModelProto,
    feeds_for_batch: Callable[[int], Feeds],
    batch_sizes: Sequence[int] = (1,),
    runs: int = 10,
    warmup: int = 3,
    providers: Sequence[str] | None = None,
    intra_op_threads: int | None = None,
    *,
    analysis: GraphAnalysis | None = None,
    source_sha256: str | None = None,
    optimization: str = "all",
    calibrate: bool = True,
    run_budget_s: float | None = RUN_BUDGET_S,
) -> NodeProfile:
    """Median seconds per node of ``model`` (the optimized graph) per batch size.

    ``feeds_for_batch(b)`` gives the inputs for ``b`` samples. ``analysis`` is
    ``analyse(model, ...)`` when the caller has it (``Prepared.analysis``);
    without it the model is analysed here at the first batch's shapes.
    ``optimization`` is the ONNX Runtime level the session runs at (one of
    :data:`OPTIMIZATION_LEVELS`). ``calibrate=False`` keeps the profiler's own
    per-kernel bookkeeping in the node times. At each batch size the measured
    runs stop once they have taken ``run_budget_s`` (never fewer than
    :data:`MIN_RUNS`, :data:`MIN_LATER_RUNS` after the first batch size, never more
    than ``runs``); ``meta["runs_by_batch"]`` says
    how many were made. ``run_budget_s=None`` always makes ``runs``.
    """
    batches = _check_args(batch_sizes, runs, warmup)
    if optimization not in OPTIMIZATION_LEVELS:
        raise ConfigError(
            f"optimization level {optimization!r}: use one of {', '.join(OPTIMIZATION_LEVELS)}"
        )
    if analysis is None:
        first = feeds_for_batch(batches[0])
        declared = {vi.name for vi in model.graph.input}
        analysis = analyse(model, {k: list(np.shape(v)) for k, v in first.items() if k in declared})
    keys = node_keys(analysis)
    run_model = _session_model(model, analysis, keys)

    with tempfile.TemporaryDirectory(prefix="splitinfer-profile-") as tmp:
        opts = _options(optimization, intra_op_threads, profile_dir=Path(tmp))
        runtime_path = Path(tmp) / "runtime.onnx"
        opts.optimized_model_filepath = str(runtime_path)
        try:
            profiled = _session(run_model, opts, providers)
        except ModelError:  # some providers cannot save their compiled graph
            opts = _options(optimization, intra_op_threads, profile_dir=Path(tmp))
            profiled = _session(run_model, opts, providers)
        plain = _session(run_model, _options(optimization, intra_op_threads), providers)
        runtime_nodes = load_runtime_graph(str(runtime_path))
        names = [i.name for i in profiled.get_inputs()]
        feeds = {b: _feeds(feeds_for_batch, b, names) for b in batches}
        walls: dict[int, list[float]] = {}
        made: dict[int, int] = {}
        # the sessions are warm after the first batch size; a later one needs a run
        # to size its buffers (on a real-size model a batch-8 run is long)
        warm = {b: warmup if k == 0 else min(warmup, 1) for k, b in enumerate(batches)}
        # per batch size: profiled runs per measurement (2: a measured run right after an
        # untimed one of the same session; 1 where the last warm-up run was long)
        step: dict[int, int] = {}
        for k, b in enumerate(batches):
            least = MIN_RUNS if k == 0 else MIN_LATER_RUNS
            last = 0.0
            for _ in range(warm[b]):
                _run(profiled, feeds[b])
                (last,) = _walls(plain, feeds[b], 1, 0)
            step[b] = 1 if last >= LONG_RUN_S else 2
            walls[b] = []
            start = time.perf_counter()
            for i in range(runs):
                for _ in range(step[b]):
                    _run(profiled, feeds[b])
                walls[b] += _walls(plain, feeds[b], 1, step[b] - 1)
                spent = time.perf_counter() - start
                if run_budget_s is not None and i + 1 >= least and spent > run_budget_s:
                    break
            made[b] = len(walls[b])
        events = json.loads(Path(profiled.end_profiling()).read_text())
        provider = profiled.get_providers()[0]
        del profiled, plain

    costs = executor_costs(intra_op_threads) if calibrate else ExecutorCosts(0.0, 0.0, 0.0)
    per_run = _split_runs(events)
    expected = sum(warm[b] + step[b] * made[b] for b in batches)
    if len(per_run) != expected:
        raise ModelError(
            f"the ONNX Runtime trace holds {len(per_run)} runs, {expected} "
            "expected; cannot tell the batch sizes apart"
        )
    attributor = Attributor(analysis, all_flops(analysis), runtime_nodes)
    times: dict[int, dict[str, float]] = {}
    unattributed: dict[int, float] = {}
    bookkeeping: dict[int, float] = {}
    offset = 0
    for b in batches:
        end = offset + warm[b] + step[b] * made[b]
        measured = per_run[offset + warm[b] + step[b] - 1 : end : step[b]]
        offset = end
        samples = _samples(measured)
        bookkeeping[b] = _bookkeeping_s(samples, walls[b], costs) if calibrate else 0.0
        times[b], unattributed[b] = _attribute(_medians(samples, bookkeeping[b]), attributor)
        # The bookkeeping cut is bounded, so on a disturbed run the node medians can still
        # add up to more than the unprofiled run took; the wall time is what was observed.
        wall, total = statistics.median(walls[b]), sum(times[b].values())
        if total > wall > 0:
            times[b] = {k: v * wall / total for k, v in times[b].items()}

    return NodeProfile(
        device=host_device_name(),
        batch_sizes=batches,
        times=times,
        wall={b: statistics.median(w) for b, w in walls.items()},
        unattributed_s=unattributed,
        runtime=_RUNTIMES.get(
            provider, "onnxruntime-" + provider.removesuffix("ExecutionProvider").lower()
        ),
        source_sha256=source_sha256,
        precision=_precision(model),
        meta={
            "onnxruntime": _ort().__version__,
            "optimization": optimization,
            "runs": runs,
            "runs_by_batch": ", ".join(f"{b}: {made[b]}" for b in batches),
            "warmup": warmup,
            "runs_per_measurement": ", ".join(f"{b}: {step[b]}" for b in batches),
            "intra_op_threads": intra_op_threads,
            "fixed_cost_us": round(costs.fixed_s * 1e6, 3),
            "profiler_bookkeeping_us": ", ".join(
                f"{b}: {bookkeeping[b] * 1e6:.2f}" for b in batches
            ),
            "runtime_graph": runtime_nodes is not None,
            "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
    )
