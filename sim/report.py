"""A scenario's results: the JSON report and the PNG plots.

Per strategy: requests, errors, local answers, p50/p95/p99 latency of the answered
requests, throughput (answered requests per second), bytes on the wire per request
(what the emulated links carried, health checks included), the cuts used, switches,
the cloud's batches, and epsilon spent. Plots (matplotlib, Agg): the latency CDF
per strategy, the per-cut latency breakdown (edge, encode, uplink, decode), and the
timeline of the link's uplink capacity with the cut each request used.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.sim.config import LinkConfig
from splitinfer.sim.workload import StrategyRun

STAGES = ("edge", "privacy", "encode", "uplink", "decode", "local")


def _ms(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 3) if values else None


def summarize(run: StrategyRun) -> dict[str, Any]:
    """One strategy's figures (latencies in ms)."""
    ok = [r for r in run.records if r.ok]
    lat = [r.latency_s for r in ok]
    eps = [r.epsilon for r in run.records if r.epsilon is not None]
    if run.epsilon_spent is not None:
        eps.append(run.epsilon_spent)
    n = len(run.records)
    return {
        "strategy": run.strategy,
        "requests": n,
        "answered": len(ok),
        "errors": n - len(ok),
        "error_examples": sorted({r.error for r in run.records if not r.ok})[:3],
        "local_answers": sum(r.local for r in ok),
        "latency_ms": {"p50": _ms(lat, 50), "p95": _ms(lat, 95), "p99": _ms(lat, 99)},
        "throughput_rps": round(len(ok) / run.duration_s, 3) if run.duration_s > 0 else 0.0,
        "wire_bytes_per_request": {
            "up": round(run.link_up_bytes / n, 1) if n else None,
            "down": round(run.link_down_bytes / n, 1) if n else None,
        },
        "cuts": dict(Counter(r.cut for r in ok)),
        "switches": run.switches,
        "cloud_batches": run.cloud_batches,
        "cloud_mean_batch": round(run.cloud_samples / run.cloud_batches, 3)
        if run.cloud_batches
        else None,
        "epsilon_spent": max(eps) if eps else None,
        "duration_s": round(run.duration_s, 3),
    }


def report(runs: Sequence[StrategyRun], scenario: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": "splitinfer.netsim-report",
        "version": 1,
        "scenario": scenario,
        "strategies": [summarize(r) for r in runs],
    }


def write_json(doc: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return path


def uplink_capacity(link: LinkConfig, seconds: float, step_s: float = 1.0) -> list[float]:
    """The configured uplink capacity (bits/s) per ``step_s`` of link time (inf: no limit;
    0 inside outages), with the scheduled changes applied."""
    out: list[float] = []
    for k in range(max(1, math.ceil(seconds / step_s))):
        t = k * step_s
        direction, since = link.uplink, 0.0
        for change in link.changes:
            if change.at_s <= t and change.uplink is not None:
                direction, since = change.uplink, change.at_s
        if any(a <= t < a + d for a, d in link.outages):
            out.append(0.0)
        elif direction.trace is not None:
            caps = direction.trace.capacity_bps(step_s)
            i = int((direction.trace_offset_s + t - since) / step_s) % len(caps)
            out.append(float(caps[i]))
        else:
            out.append(direction.mean_bps)
    return out


def plot(runs: Sequence[StrategyRun], link: LinkConfig, out_dir: Path) -> list[Path]:
    """latency-cdf.png, breakdown.png, timeline.png in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        lat = np.sort([r.latency_s * 1e3 for r in run.records if r.ok])
        if lat.size:
            ax.step(lat, np.arange(1, lat.size + 1) / lat.size, where="post", label=run.strategy)
    ax.set(xlabel="latency (ms)", ylabel="fraction of requests", title="Latency CDF")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "latency-cdf.png"))

    rows: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for r in run.records:
            if r.ok:
                key = f"{run.strategy}\n{r.cut}"
                for stage in STAGES:
                    rows.setdefault(key, {}).setdefault(stage, []).append(r.timings.get(stage, 0.0))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4.5))
    labels = list(rows)
    bottom = np.zeros(len(labels))
    for stage in STAGES:
        heights = np.array([np.median(rows[k].get(stage, [0.0])) * 1e3 for k in labels])
        if heights.any():
            ax.bar(labels, heights, bottom=bottom, label=stage)
            bottom += heights
    ax.set(ylabel="median ms", title="Latency breakdown per strategy and cut")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "breakdown.png"))

    end = max((r.start_s + r.latency_s for run in runs for r in run.records), default=1.0)
    caps = uplink_capacity(link, end)
    fig, (top, bot) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    finite = [c / 1e6 if math.isfinite(c) else np.nan for c in caps]
    top.step(np.arange(len(caps)), finite, where="post")
    top.set(ylabel="uplink Mbit/s", title="Link capacity and the cut each request used")
    cuts = sorted({r.cut for run in runs for r in run.records if r.ok})
    for run in runs:
        ok = [r for r in run.records if r.ok]
        bot.scatter(
            [r.start_s for r in ok], [cuts.index(r.cut) for r in ok], s=8, label=run.strategy
        )
    bot.set_yticks(range(len(cuts)), cuts)
    bot.set(xlabel="link time (s)", ylabel="cut")
    bot.legend(fontsize=7)
    paths.append(_save(fig, out_dir / "timeline.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def table(docs: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """The Neurosurgeon-style table: per trace, each strategy's p50 latency and the
    speedup of auto and adaptive over cloud-only and edge-only."""
    lines = []
    for trace, doc in docs:
        by = {s["strategy"]: s for s in doc["strategies"]}
        lines.append(f"{trace}:")
        lines.append(f"  {'strategy':<12} {'p50 ms':>9} {'p95 ms':>9} {'errors':>6}  cuts")
        for name, s in by.items():
            lat = s["latency_ms"]
            cuts = ",".join(s["cuts"])
            lines.append(
                f"  {name:<12} {_num(lat['p50']):>9} {_num(lat['p95']):>9} {s['errors']:>6}  {cuts}"
            )
        for fast in ("auto", "adaptive"):
            for base in ("cloud-only", "edge-only"):
                a = by.get(fast, {}).get("latency_ms", {}).get("p50")
                b = by.get(base, {}).get("latency_ms", {}).get("p50")
                if a and b:
                    lines.append(f"  speedup {fast} over {base}: {b / a:.2f}x")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
