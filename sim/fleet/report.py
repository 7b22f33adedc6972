"""What a fleet run says: percentiles end to end and per component, the replicas'
utilisation and batch sizes, cut switches, fallbacks, cost per million requests; the
table, ``report.json``, the pictures, and the comparison with a real run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from splitinfer.sim.fleet.results import (
    CLOUD,
    COMPONENTS,
    FALLBACK_LATE,
    FALLBACK_REFUSED,
    LATE,
    LOCAL,
    OUTCOMES,
    REFUSED,
    FleetRun,
)

F64 = npt.NDArray[np.float64]
QS = (50.0, 95.0, 99.0)


def _stats(values: npt.ArrayLike) -> dict[str, float | None]:
    """p50/p95/p99/mean in milliseconds (None when there is nothing)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {"p50_ms": None, "p95_ms": None, "p99_ms": None, "mean_ms": None, "count": 0}
    p = np.percentile(v, QS)
    return {
        "p50_ms": float(p[0]) * 1e3,
        "p95_ms": float(p[1]) * 1e3,
        "p99_ms": float(p[2]) * 1e3,
        "mean_ms": float(v.mean()) * 1e3,
        "count": int(v.size),
    }


def latency_quantile(run: FleetRun, q: float = 0.99) -> float:
    """Seconds at quantile ``q`` of every request's end-to-end latency; a request that got
    no answer (an error) counts as infinitely late."""
    e2e = run.requests.e2e.astype(np.float64)
    if e2e.size == 0:
        return 0.0
    return float(np.quantile(np.where(np.isnan(e2e), np.inf, e2e), q, method="higher"))


def summary(run: FleetRun) -> dict[str, Any]:
    """Everything the table, ``report.json`` and the checks read, JSON-ready."""
    sc, req, b = run.scenario, run.requests, run.batches
    out = req.outcome
    cloud = out == CLOUD
    answered = ~np.isnan(req.e2e)
    counts = np.bincount(out, minlength=len(OUTCOMES))
    hours = sc.duration_s / 3600.0
    dollars = sc.cloud.replicas * sc.cloud.price_per_hour * hours
    rows = b["rows"]
    slots = sc.cloud.batching.max_concurrent_batches
    replicas = []
    for r in range(sc.cloud.replicas):
        mine = rows[b["replica"] == r]
        replicas.append(
            {
                "replica": r,
                "utilization": run.busy_s[r] / (sc.duration_s * slots),
                "batches": int(mine.size),
                "mean_batch": float(mine.mean()) if mine.size else 0.0,
                "p50_batch": float(np.percentile(mine, 50)) if mine.size else 0.0,
                "p95_batch": float(np.percentile(mine, 95)) if mine.size else 0.0,
                "max_batch": int(mine.max()) if mine.size else 0,
            }
        )
    cut_ids = list(sc.costs)
    per_cut = np.bincount(req.cut, minlength=len(cut_ids))
    return {
        "scenario": {
            "name": sc.name,
            "devices": sc.devices,
            "duration_s": sc.duration_s,
            "seed": sc.seed,
            "decide_every_s": sc.decide_every_s,
            "package": sc.source,
            "cloud_profile": sc.cloud.profile,
            "price_per_hour": sc.cloud.price_per_hour,
            "replicas": sc.cloud.replicas,
            "degradations": [
                {"start_s": a, "end_s": e, "factor": f, "devices": n} for a, e, f, n in run.degraded
            ],
        },
        "requests": int(req.n),
        "outcomes": {name: int(c) for name, c in zip(OUTCOMES, counts, strict=True)},
        "answered_on_device_by_fallback": int(counts[FALLBACK_REFUSED] + counts[FALLBACK_LATE]),
        "errors": int(counts[REFUSED] + counts[LATE]),
        "end_to_end": _stats(req.e2e[answered]),
        "end_to_end_cloud": _stats(req.e2e[cloud]),
        "end_to_end_device": _stats(req.e2e[out == LOCAL]),
        "components": {c: _stats(req.parts[i, cloud]) for i, c in enumerate(COMPONENTS)},
        "p99_with_errors_ms": latency_quantile(run) * 1e3,
        "replica": replicas,
        "batch_size_histogram": np.bincount(rows).tolist() if rows.size else [],
        "mean_batch": float(rows.mean()) if rows.size else 0.0,
        "cuts": {c: int(n) for c, n in zip(cut_ids, per_cut, strict=True)},
        "switches": int(run.switches),
        "switches_per_device": run.switches / max(1, sc.devices),
        "chooser_calls": int(run.chooser_calls),
        "cost": {
            "usd": dollars,
            "usd_per_million_requests": dollars / max(1, req.n) * 1e6,
            "usd_per_million_cloud_answers": dollars / max(1, int(counts[CLOUD])) * 1e6,
        },
        "wall_s": run.wall_s,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:9.1f}"


def table(doc: Mapping[str, Any]) -> str:
    """The fleet's figures as text."""
    s = doc["scenario"]
    n = doc["requests"]
    lines = [
        f"{s['name']}: {s['devices']:,} devices, {s['duration_s']:g} s simulated, {n:,} requests "
        f"({n / s['duration_s']:,.0f}/s), seed {s['seed']}; cloud {s['replicas']} x "
        f"{s['cloud_profile']} (USD {s['price_per_hour']:.4g}/h)",
        f"{'':20s}{'p50 ms':>9s} {'p95 ms':>9s} {'p99 ms':>9s} {'mean ms':>9s} {'requests':>11s}",
    ]
    rows = [
        ("end to end", doc["end_to_end"]),
        ("  cloud answers", doc["end_to_end_cloud"]),
        ("  on the device", doc["end_to_end_device"]),
        *((f"  {c}", st) for c, st in doc["components"].items()),
    ]
    for label, st in rows:
        lines.append(
            f"{label:20s}{_ms(st['p50_ms'])} {_ms(st['p95_ms'])} {_ms(st['p99_ms'])} "
            f"{_ms(st['mean_ms'])} {st['count']:11,d}"
        )
    lines.append("(components: requests answered by the cloud; uplink includes the cloud's decode)")
    o = doc["outcomes"]
    lines.append(
        f"answers: cloud {o['cloud']:,}, device by its cut {o['device (its cut)']:,}, device by "
        f"fallback {doc['answered_on_device_by_fallback']:,} (refused {o['fallback (refused)']:,}, "
        f"late {o['fallback (late)']:,}); errors {doc['errors']:,}"
    )
    share = ", ".join(f"{c} {k / max(1, n):.1%}" for c, k in doc["cuts"].items())
    lines.append(
        f"cuts: {share}; switches {doc['switches']:,} ({doc['switches_per_device']:.2f} per device)"
    )
    lines.append(
        f"{'replica':>8s} {'util':>6s} {'batches':>10s} {'mean':>6s} {'p50':>5s} "
        f"{'p95':>5s} {'max':>4s}"
    )
    for r in doc["replica"]:
        lines.append(
            f"{r['replica']:8d} {r['utilization']:6.1%} {r['batches']:10,d} {r['mean_batch']:6.2f} "
            f"{r['p50_batch']:5.0f} {r['p95_batch']:5.0f} {r['max_batch']:4d}"
        )
    c = doc["cost"]
    lines.append(
        f"cost: USD {c['usd']:.2f} for the run: USD {c['usd_per_million_requests']:.3f} per "
        f"million requests, USD {c['usd_per_million_cloud_answers']:.3f} per million cloud answers"
    )
    return "\n".join(lines)


def write_json(doc: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


# -- pictures --------------------------------------------------------------------------------


def _figure() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf_points(values: F64, points: int = 400) -> tuple[F64, F64]:
    q = np.linspace(0.0, 1.0, points)
    return np.quantile(values, q), q


def plot_cdf(run: FleetRun, path: Path) -> Path:
    """End-to-end latency CDF: every answer, cloud answers, device answers."""
    plt = _figure()
    req = run.requests
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for label, mask in (
        ("all answers", ~np.isnan(req.e2e)),
        ("cloud", req.outcome == CLOUD),
        ("device (its cut)", req.outcome == LOCAL),
        ("device (fallback)", (req.outcome == FALLBACK_LATE) | (req.outcome == FALLBACK_REFUSED)),
    ):
        v = req.e2e[mask].astype(np.float64) * 1e3
        if v.size:
            x, y = _cdf_points(v)
            ax.plot(x, y, label=f"{label} ({v.size:,})")
    ax.set_xscale("log")
    ax.set_xlabel("end-to-end latency (ms)")
    ax.set_ylabel("share of requests")
    ax.set_title(
        f"{run.scenario.name}: {run.scenario.devices:,} devices, "
        f"{run.scenario.cloud.replicas} replicas"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def windowed(run: FleetRun, window_s: float) -> dict[str, F64]:
    """Per window of arrival time: its start, p50 and p99 end to end (all requests, an
    error as infinitely late), p99 of the cloud's answers, and the share the cloud answered."""
    req = run.requests
    e2e = np.where(np.isnan(req.e2e), np.inf, req.e2e.astype(np.float64))
    cloud = req.outcome == CLOUD
    bins = np.floor(req.arrival / window_s).astype(np.int64)
    order = np.argsort(bins, kind="stable")
    edges = np.searchsorted(bins[order], np.arange(bins.max() + 2) if bins.size else [0])
    out: dict[str, list[float]] = {k: [] for k in ("start", "p50", "p99", "p99_cloud", "cloud")}
    for k in range(len(edges) - 1):
        part = order[edges[k] : edges[k + 1]]
        if part.size == 0:
            continue
        p = np.quantile(e2e[part], [0.5, 0.99], method="higher")
        mine = e2e[part][cloud[part]]
        out["start"].append(k * window_s)
        out["p50"].append(p[0])
        out["p99"].append(p[1])
        out["p99_cloud"].append(np.quantile(mine, 0.99, method="higher") if mine.size else np.nan)
        out["cloud"].append(float(np.mean(cloud[part])))
    return {k: np.array(v) for k, v in out.items()}


def plot_timeline(run: FleetRun, path: Path, window_s: float | None = None) -> Path:
    """p50/p99 over simulated time, the degradations shaded, and the cloud's share."""
    plt = _figure()
    sc = run.scenario
    window = window_s or max(1.0, sc.duration_s / 120)
    w = windowed(run, window)
    t = w["start"] / 60
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    ax.plot(t, w["p99"] * 1e3, label="p99, all requests", color="tab:red")
    ax.plot(t, w["p99_cloud"] * 1e3, label="p99, cloud answers", color="tab:orange")
    ax.plot(t, w["p50"] * 1e3, label="p50, all requests", color="tab:blue")
    for a, e, f, n in run.degraded:
        ax.axvspan(a / 60, e / 60, color="0.85", label=f"{n:,} uplinks x{f:g}")
    ax.set_yscale("log")
    ax.set_xlabel(f"simulated time (min), {window:g} s windows by arrival")
    ax.set_ylabel("end-to-end latency (ms)")
    ax2 = ax.twinx()
    ax2.plot(t, w["cloud"], color="tab:green", alpha=0.6, label="share answered by the cloud")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("share answered by the cloud")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=7)
    ax.set_title(f"{sc.name}: latency over time, {sc.cloud.replicas} replicas")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_replicas(tried: Mapping[int, float], target_s: float, path: Path, name: str) -> Path:
    """p99 against the number of replicas (a capacity search's runs)."""
    plt = _figure()
    r = sorted(tried)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    p = [min(tried[k], 1e6) * 1e3 for k in r]
    ax.plot(r, p, marker="o", label="p99 end to end")
    ax.axhline(
        target_s * 1e3, color="tab:red", linestyle="--", label=f"target {target_s * 1e3:g} ms"
    )
    ax.set_yscale("log")
    ax.set_xticks(r)
    ax.set_xlabel("replicas")
    ax.set_ylabel("p99 (ms)")
    ax.set_title(f"{name}: p99 vs replicas")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# -- against a real run --------------------------------------------------------------------


def compare(
    measured: Mapping[str, Sequence[float] | npt.ArrayLike],
    run: FleetRun,
    tolerance: float = 0.15,
) -> tuple[str, bool]:
    """A real run's per-request figures against the simulation's; (table, all within).

    ``measured`` holds seconds per request under ``e2e`` and any of the components
    (``device``, ``uplink``, ``queue``, ``batch``, ``downlink``; requests the cloud
    answered), and rows per batch under ``batch_rows``. Checked (the issue's acceptance):
    p50 and p99 end to end and the mean batch size, each within ``tolerance``; the
    components are printed beside them.
    """
    req = run.requests
    sim: dict[str, F64] = {"e2e": req.e2e[~np.isnan(req.e2e)].astype(np.float64)}
    cloud = req.outcome == CLOUD
    for i, c in enumerate(COMPONENTS):
        sim[c] = req.parts[i, cloud].astype(np.float64)
    lines = [f"{'figure':22s}{'real':>10s}{'simulated':>11s}{'diff':>8s}  check"]
    ok = True

    def row(label: str, real: float, simulated: float, checked: bool) -> None:
        nonlocal ok
        diff = (simulated - real) / real if real else math.inf
        verdict = ""
        if checked:
            good = abs(diff) <= tolerance
            ok = ok and good
            verdict = "ok" if good else f"off by more than {tolerance:.0%}"
        lines.append(f"{label:22s}{real:10.2f}{simulated:11.2f}{diff:+8.1%}  {verdict}")

    for key in ("e2e", *COMPONENTS):
        if key not in measured:
            continue
        real = np.asarray(measured[key], dtype=np.float64)
        if real.size == 0 or sim[key].size == 0:
            continue
        for q in (50, 99):
            row(
                f"{key} p{q} ms",
                float(np.percentile(real, q)) * 1e3,
                float(np.percentile(sim[key], q)) * 1e3,
                key == "e2e",
            )
        row(f"{key} mean ms", float(real.mean()) * 1e3, float(sim[key].mean()) * 1e3, False)
    if "batch_rows" in measured and run.batches["rows"].size:
        real_rows = np.asarray(measured["batch_rows"], dtype=np.float64)
        row("mean batch (rows)", float(real_rows.mean()), float(run.batches["rows"].mean()), True)
    return "\n".join(lines), ok
