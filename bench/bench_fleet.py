"""How fast does ``netsim fleet`` simulate, and where does its time go?

    python bench/bench_fleet.py [--scenario sim/scenarios/fleet_demo.toml]
                                [--devices 1000 3000 10000] [--duration 1h]
                                [--replicas N] [--enqueue] [--profile] [--json out.json]

Each size runs in its own process (so each peak RSS is its own): the scenario with that
many devices for ``--duration`` of simulated time; it prints the requests simulated,
the batches, the wall seconds, requests per wall second and peak RSS; ``--profile``
adds the share of the time spent in the replicas' batchers (under cProfile, which
slows the run). The target (issue 30): 10,000 devices for one
simulated hour at one request per device every 2 s (18 M requests) in <= 10 minutes
with peak RSS under 4 GB on a 2-core machine.

``--enqueue`` first measures the cost per request of driving the real batcher three
ways on the same arrivals: ``schedule`` after every submit (as the engine does), the
fleet's replica with that rule (``exact``), and the fleet's replica asking only when
the answer can change (the default); the batches must be the same.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "sim" / "scenarios" / "fleet_demo.toml"


def one(
    scenario: Path, devices: int, duration: str, replicas: int | None, profile: bool = False
) -> dict[str, float]:
    """One size in this process: the figures as a dict."""
    import cProfile
    import pstats

    from splitinfer.sim.fleet.engine import run_fleet
    from splitinfer.sim.fleet.reading import load_fleet
    from splitinfer.sim.fleet.scenario import parse_span

    sc = load_fleet(scenario).scaled(devices, parse_span(duration, "--duration"))
    if replicas:
        sc = sc.with_replicas(replicas)
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    run = run_fleet(sc)
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t0
    out = {
        "devices": devices,
        "simulated_s": sc.duration_s,
        "replicas": sc.cloud.replicas,
        "requests": run.requests.n,
        "batches": int(run.batches["rows"].size),
        "wall_s": wall,
        "requests_per_s": run.requests.n / wall,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "chooser_calls": run.chooser_calls,
        "switches": run.switches,
    }
    if prof is not None:  # the share of the batchers (replica.advance) in a profiled run
        stats = pstats.Stats(prof)
        advance = [v for k, v in stats.stats.items() if k[2] == "advance"]  # type: ignore[attr-defined]
        out["replica_share"] = sum(v[3] for v in advance) / max(1e-9, stats.total_tt)  # type: ignore[attr-defined]
    return out


def enqueue(n: int = 200_000) -> None:
    """Microseconds per request of three ways to drive the real batcher."""
    import numpy as np

    from splitinfer.cloud.batcher import Batcher, Item, QueueKey
    from splitinfer.cloud.config import BatchingConfig, OverloadConfig
    from splitinfer.sim.fleet.replica import Replica
    from splitinfer.sim.fleet.scenario import BatchLatency

    table = BatchLatency(((1, 0.0017), (8, 0.0057), (32, 0.0195))).table(32)
    times = np.cumsum(np.random.default_rng(0).exponential(1 / 1500, n)).tolist()

    def engine_like() -> list[int]:  # the engine's loop: schedule after every event
        b: Batcher[int] = Batcher(BatchingConfig())
        key, rows, i, run, end, wake = QueueKey(0, "c0"), [], 0, None, float("inf"), None
        while i < n or run is not None:
            ta = times[i] if i < n else float("inf")
            tw = wake if wake is not None else float("inf")
            t = min(ta, end, tw)
            if end <= t:
                b.complete(run, end, end - run.started)
                run, end = None, float("inf")
            elif tw <= t:
                wake = None
            else:
                b.submit(Item(key, 1, i), ta)
                i += 1
            d = b.schedule(t)
            wake = d.wake_at
            for batch in d.batches:
                run, end = batch, t + table[batch.rows]
                rows.append(batch.rows)
        return rows

    def replica(exact: bool) -> list[int]:
        r = Replica(BatchingConfig(), OverloadConfig(), ["c0"], {"c0": table}, exact=exact)
        out = r.advance(times, list(range(n)), [0] * n, None, None, times[-1] + 60)
        return out.rows

    results = {}
    for name, fn in (
        ("engine loop", engine_like),
        ("replica, exact", lambda: replica(True)),
        ("replica (default)", lambda: replica(False)),
    ):
        t0 = time.perf_counter()
        rows = fn()
        dt = time.perf_counter() - t0
        results[name] = rows
        print(
            f"{name:20s} {dt / n * 1e6:6.2f} us/request  {len(rows):,} batches, "
            f"mean {sum(rows) / len(rows):.2f} rows"
        )
    same = len({tuple(r) for r in results.values()}) == 1
    print(f"same batches: {'yes' if same else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", type=Path, default=DEFAULT)
    p.add_argument("--devices", type=int, nargs="+", default=[1000, 3000, 10000])
    p.add_argument("--duration", default="1h")
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--enqueue", action="store_true", help="first, the batcher drive costs")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--profile", action="store_true", help="profile each run: the batchers' share of the time"
    )
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one is not None:
        figures = one(args.scenario, args.one, args.duration, args.replicas, args.profile)
        print(json.dumps(figures))
        return 0
    if args.enqueue:
        enqueue()
    rows = []
    print(
        f"{'devices':>8s} {'sim s':>6s} {'requests':>12s} {'batches':>10s} {'wall s':>8s} "
        f"{'req/s':>9s} {'peak RSS':>9s}"
    )
    for n in args.devices:
        cmd = [
            sys.executable,
            __file__,
            "--scenario",
            str(args.scenario),
            "--one",
            str(n),
            "--duration",
            args.duration,
        ]
        if args.replicas:
            cmd += ["--replicas", str(args.replicas)]
        if args.profile:
            cmd.append("--profile")
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        r = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(r)
        extra = f"  batchers {r['replica_share']:.0%} of the time" if "replica_share" in r else ""
        print(
            f"{r['devices']:8,d} {r['simulated_s']:6.0f} {r['requests']:12,d} {r['batches']:10,d} "
            f"{r['wall_s']:8.1f} {r['requests_per_s']:9,.0f} {r['peak_rss_mb']:7.0f} MB{extra}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
