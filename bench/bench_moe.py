"""MoE expert paging: throughput, p99 and bytes paged at several cache budgets.

A stack of MoE layers (Mixtral-style top-2, SwiGLU experts) with skewed
routing: a Zipf-like bias per expert plus a slowly drifting topic, so that
consecutive batches share their hot experts (as decode steps do). Every case
runs the same workload in one process:

- ``all-resident``: a budget of every expert, warmed: the all-in-memory baseline
- ``naive``: no cache; every needed expert is copied from the memory-mapped
  shard on every batch (on-demand loading), into a reused buffer as any cache
  does (a fresh allocation per page-in would add page faults that are not
  paging, and flatter every cache's ratio against it)
- 50% / 25% / one layer's worth of the experts, LRU and LFRU, prefetch on/off

Beside each case's bytes paged per token: the lower bound for that cache size
(Belady's MIN over the same sequence of expert requests, with no prefetch).

Acceptance (issue 7): >= 2x naive throughput at 25% cache, >= 80% of
all-resident throughput at 50% cache. On this CPU-only machine the "device" is
a bounded numpy cache and a page-in is a memcpy from the page cache, far
cheaper relative to compute than a PCIe copy to a GPU, so the ratios here
understate what paging costs on a GPU (see docs/moe.md). No cache can beat
naive by more than all-resident does: the bench prints that ceiling.

    python bench/bench_moe.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.cloud.moe.cache import CacheConfig, ExpertCache, MoEMetrics
from splitinfer.cloud.moe.executor import MoEExecutor, MoELayerParams
from splitinfer.cloud.moe.store import ExpertStore
from splitinfer.shared.moe import MoESpec, write_layer_shard

SKEW = 0.5  # how strongly routing favours the popular experts (0: not at all)


@dataclass(frozen=True)
class Workload:
    layers: int
    d: int
    hidden: int
    experts: int
    batch: int
    steps: int


def build(w: Workload, folder: Path, seed: int = 0) -> tuple[ExpertStore, MoESpec, np.ndarray]:
    rng = np.random.default_rng(seed)
    spec = MoESpec(w.d, w.hidden, w.experts, 2, "mixtral")
    paths = {}
    bias_dir = rng.standard_normal(w.d).astype(np.float32)
    bias_dir /= np.linalg.norm(bias_dir)
    zipf = 4.0 / np.arange(1, w.experts + 1) ** 1.2  # expert popularity, per layer shuffled
    for layer in range(w.layers):
        router = rng.standard_normal((w.experts, w.d)).astype(np.float32) * 0.3
        router += np.outer(rng.permutation(zipf), bias_dir).astype(np.float32)
        s = 1 / np.sqrt(w.d)
        experts = [
            {
                "w1": (rng.standard_normal((w.hidden, w.d)) * s).astype(np.float32),
                "w2": (rng.standard_normal((w.d, w.hidden)) * s).astype(np.float32),
                "w3": (rng.standard_normal((w.hidden, w.d)) * s).astype(np.float32),
            }
            for _ in range(w.experts)
        ]
        paths[layer] = write_layer_shard(folder / f"layer{layer}.safetensors", router, experts, "")
    store = ExpertStore(paths, dict.fromkeys(range(w.layers), spec.expert_tensors))
    # inputs: a drifting topic vector plus noise, plus the bias direction
    topic = rng.standard_normal(w.d)
    xs = []
    for _ in range(w.steps):
        topic = 0.9 * topic + 0.45 * rng.standard_normal(w.d)
        x = topic + rng.standard_normal((w.batch, w.d)) + SKEW * np.sqrt(w.d) * bias_dir
        xs.append(x.astype(np.float32))
    return store, spec, np.stack(xs)


def _norm(z: np.ndarray) -> np.ndarray:
    out: np.ndarray = (z - z.mean(-1, keepdims=True)) / (z.std(-1, keepdims=True) + 1e-5)
    return out


class _Recorder(ExpertCache):
    trace: list[tuple[int, int]]

    def waves(self, layer: int, experts: Any) -> list[list[int]]:
        self.trace.extend((layer, e) for e in experts)
        return super().waves(layer, experts)


def run_case(
    store: ExpertStore,
    spec: MoESpec,
    xs: np.ndarray,
    budget: int,
    policy: str,
    prefetch: bool,
    warm: bool = False,
) -> dict[str, Any]:
    pool = ThreadPoolExecutor(1) if prefetch else None
    cache = _Recorder(store, CacheConfig(budget, policy), prefetcher=pool, metrics=MoEMetrics())
    cache.trace = []
    layers = [MoELayerParams(spec, store.routers[i]) for i in range(len(store.routers))]
    executor = MoEExecutor(layers, cache, prefetch=prefetch)

    def step(x: np.ndarray) -> None:
        u = _norm(x)
        for layer in range(len(layers)):
            u = _norm(u + executor.forward(layer, u) + x * 0.2)

    if warm:
        for x in xs[: max(1, len(xs) // 10)]:
            step(x)
        cache.metrics = MoEMetrics()
        cache.trace = []
    latencies = []
    start = time.perf_counter()
    for x in xs:
        t = time.perf_counter()
        step(x)
        latencies.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    if pool is not None:
        pool.shutdown()
    m = cache.metrics
    tokens = xs.shape[0] * xs.shape[1]
    return {
        "tokens_per_s": tokens / elapsed,
        "p50_ms": 1e3 * float(np.percentile(latencies, 50)),
        "p99_ms": 1e3 * float(np.percentile(latencies, 99)),
        "bytes_per_token": m.bytes_per_token(),
        "stall_ms_per_step": 1e3 * m.total("stall") / len(xs),
        "hit_rate": m.hit_rate(),
        "prefetch_precision": m.prefetch_precision(),
        "trace": cache.trace,
    }


def belady_misses(trace: list[tuple[int, int]], slots: int) -> int:
    """Misses of the optimal offline policy (MIN) with ``slots`` equal-size experts."""
    nxt: list[float] = [0.0] * len(trace)
    seen: dict[tuple[int, int], int] = {}
    for i in range(len(trace) - 1, -1, -1):
        nxt[i] = seen.get(trace[i], float("inf"))
        seen[trace[i]] = i
    resident: dict[tuple[int, int], float] = {}
    misses = 0
    for i, key in enumerate(trace):
        if key not in resident:
            misses += 1
            if len(resident) >= slots:
                victim = max(resident, key=lambda k: resident[k])
                del resident[victim]
        resident[key] = nxt[i]
    return misses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument(
        "--repeats", type=int, default=3, help="runs per case; the fastest is kept (default 3)"
    )
    args = ap.parse_args(argv)
    w = (
        Workload(layers=8, d=256, hidden=512, experts=8, batch=4, steps=40)
        if args.quick
        else Workload(layers=8, d=512, hidden=1024, experts=8, batch=4, steps=150)
    )
    # One BLAS thread: this box's 2 cores are shared, and BLAS threads spinning
    # against the prefetch thread would measure contention, not paging.
    # (threadpoolctl comes with scikit-learn, the demo extra; without it, set
    # OPENBLAS_NUM_THREADS=1 by hand.)
    try:
        from threadpoolctl import threadpool_limits

        limit: Any = threadpool_limits(1)
    except ImportError:
        limit = contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp, limit:
        store, spec, xs = build(w, Path(tmp))
        one = store.nbytes(0, 0)
        total = one * w.layers * w.experts
        print(
            f"workload: {w.layers} MoE layers x {w.experts} experts (top-2 SwiGLU, d={w.d}, "
            f"hidden={w.hidden}), {one / 1e6:.2f} MB per expert, {total / 1e6:.0f} MB in all; "
            f"{w.steps} batches of {w.batch} tokens"
        )
        budgets = {
            "100%": total,
            "50%": total // 2,
            "25%": total // 4,
            "1 layer": one * w.experts,
        }
        cases: list[tuple[str, int, str, bool, bool]] = [
            ("all-resident", total, "lru", False, True),
            ("naive (no cache)", total, "none", False, False),
        ]
        for size in ("50%", "25%", "1 layer"):
            for policy in ("lru", "lfru"):
                for prefetch in (False, True):
                    cases.append(
                        (
                            f"{size} {policy} pf={'on' if prefetch else 'off'}",
                            budgets[size],
                            policy,
                            prefetch,
                            False,
                        )
                    )
        results: dict[str, dict[str, Any]] = {}
        for _ in range(args.repeats):  # interleaved, so that load from others hits all cases
            for name, budget, policy, prefetch, warm in cases:
                r = run_case(store, spec, xs, budget, policy, prefetch, warm)
                if name not in results or r["tokens_per_s"] > results[name]["tokens_per_s"]:
                    results[name] = r
    base = results["all-resident"]
    naive = results["naive (no cache)"]
    trace = results["naive (no cache)"]["trace"]
    tokens = w.steps * w.batch
    print(
        f"\n{'case':24} {'tok/s':>9} {'x base':>7} {'x naive':>8} {'p99 ms':>8} {'hit':>5} "
        f"{'prec':>5} {'stall ms':>8} {'B/token':>10} {'MIN B/tok':>10}"
    )
    for name, r in results.items():
        budget = next((budgets[s] for s in budgets if name.startswith(s)), 0)
        bound = belady_misses(trace, budget // one) * one / tokens if budget else float("nan")
        if name == "naive (no cache)":
            bound = len(trace) * one / tokens
        print(
            f"{name:24} {r['tokens_per_s']:9.0f} {r['tokens_per_s'] / base['tokens_per_s']:7.2f} "
            f"{r['tokens_per_s'] / naive['tokens_per_s']:8.2f} {r['p99_ms']:8.2f} "
            f"{r['hit_rate']:5.2f} {r['prefetch_precision']:5.2f} "
            f"{r['stall_ms_per_step']:8.2f} {r['bytes_per_token']:10.0f} {bound:10.0f}"
        )
    best25 = max(
        (r["tokens_per_s"] for n, r in results.items() if n.startswith("25%")), default=0.0
    )
    best50 = max(
        (r["tokens_per_s"] for n, r in results.items() if n.startswith("50%")), default=0.0
    )
    ok25 = best25 >= 2.0 * naive["tokens_per_s"]
    ok50 = best50 >= 0.8 * base["tokens_per_s"]
    ceiling = base["tokens_per_s"] / naive["tokens_per_s"]
    print(
        f"\n25% cache vs naive: {best25 / naive['tokens_per_s']:.2f}x "
        f"(target >= 2x): {'PASS' if ok25 else 'FAIL'}"
    )
    print(
        f"  ceiling of any cache vs naive here: all-resident / naive = {ceiling:.2f}x "
        f"(paging is {1 - 1 / ceiling:.0%} of naive's time on this machine)"
    )
    print(
        f"50% cache vs all-resident: {best50 / base['tokens_per_s']:.2f}x "
        f"(target >= 0.8x): {'PASS' if ok50 else 'FAIL'}"
    )
    if args.json:
        slim = {k: {kk: v for kk, v in r.items() if kk != "trace"} for k, r in results.items()}
        args.json.write_text(json.dumps(slim, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
