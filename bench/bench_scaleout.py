"""Throughput of the single-process cloud service vs the Ray Serve deployment, same workload.

    python bench/bench_scaleout.py [--quick] [--seconds 3] [--levels 8,32] [--size 48]
                                   [--json out.json]

The model and workload are bench_cloud.py's: a VGG-style CNN cut after its
first pool, the service serving the cloud segment; closed-loop clients
(aiohttp, one connection each) post request frames and wait for the answer.

- ``single``: ``cloud-service`` in a subprocess (--no-auth, batching max 32,
  2 ms queue delay), the embedded default.
- ``ray-1`` / ``ray-2``: ``splitinfer.cloud.scale.ray_serve`` on a local Ray
  (``ray.init(num_cpus=2)``) with one and two engine replicas behind the
  Serve HTTP proxy and the ingress deployment; same batching config.

Caveat, and it dominates: this machine has 2 CPUs. The load generator, Serve's
HTTP proxy, the ingress, and every replica share them, and each hop (proxy ->
ingress -> replica) costs CPU the single process does not spend. Two replicas
cannot beat one process here; the figure measures the cost of the
distributed path, not the gain of scaling out, which needs a replica per
accelerator or per host. Target (issue 10, for a machine with a core per
replica): two replicas >= 1.5x the single process at the highest level.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cloud_setup as bc  # noqa: E402
from harness import LoadConfig, free_port, load_client, server  # noqa: E402

from splitinfer.shared.frame import FRAME_TYPE  # noqa: E402

TARGET = 1.5
SETTINGS = bc.Settings()  # bench_cloud's service settings
CLIENT = load_client("auto")  # as bench_cloud's default


def measure(
    system: str, base: str, frames: list[bytes], levels: list[int], seconds: float
) -> list[dict[str, Any]]:
    rows = []
    url = f"{base}/v1/models/{bc.MODEL}/infer"
    for c in levels:
        load = LoadConfig(CLIENT, seconds).run(url, frames, FRAME_TYPE, c)
        row = {
            "system": system,
            "concurrency": c,
            "rps": load.rps,
            "p50_ms": load.p50_ms,
            "p99_ms": load.p99_ms,
            "errors": load.errors,
            "load": os.getloadavg()[0],
        }
        print(
            f"{system:<8} {c:>5} {load.rps:>9.1f} {load.p50_ms:>9.2f} {load.p99_ms:>9.2f} "
            f"{load.errors:>6} {row['load']:>5.1f}",
            flush=True,
        )
        rows.append(row)
    return rows


def run_single(
    repo: Path, frames: list[bytes], levels: list[int], seconds: float
) -> list[dict[str, Any]]:
    with server(SETTINGS.service_argv(repo, batching=True), ready="/readyz") as srv:
        return measure("single", srv.url, frames, levels, seconds)


def run_ray(
    repo: Path, frames: list[bytes], levels: list[int], seconds: float, replica_counts: list[int]
) -> list[dict[str, Any]]:
    import ray

    from splitinfer.cloud.config import BatchingConfig, ServiceConfig
    from splitinfer.cloud.scale.config import ScaleConfig
    from splitinfer.cloud.scale.ray_serve import deploy, shutdown

    service = ServiceConfig(
        repository=str(repo),
        no_auth=True,
        accept_raw=True,  # bench_cloud.frames_for() sends the cut tensor raw
        log_level="warning",
        batching=BatchingConfig(
            max_batch_size=SETTINGS.max_batch,
            max_queue_delay_ms=SETTINGS.delay_ms,
            max_queue_size=4096,
        ),
    )
    rows: list[dict[str, Any]] = []
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        port = free_port()
        for n in replica_counts:
            scale = ScaleConfig(
                service=service,
                min_replicas=n,
                max_replicas=n,
                num_cpus=0.5,
                ingress_num_cpus=0.25,
                max_ongoing_requests=64,
            )
            started = time.perf_counter()
            base = deploy(scale, port=port, timeout_s=180)
            # the first request of a version loads it on the replica it reaches
            LoadConfig(CLIENT, 1.0).run(f"{base}/v1/models/{bc.MODEL}/infer", frames, FRAME_TYPE, 4)
            print(
                f"(ray-{n}: deployed and warm in {time.perf_counter() - started:.1f} s)", flush=True
            )
            rows += measure(f"ray-{n}", base, frames, levels, seconds)
    finally:
        shutdown()
        ray.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one level (16) for 2 s, two replicas only")
    p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per level")
    p.add_argument("--levels", default="8,32", help="concurrency levels")
    p.add_argument("--size", type=int, default=48, help="input height and width of the CNN")
    p.add_argument("--json", type=Path, help="write the rows and verdicts here")
    args = p.parse_args(argv)
    try:
        import ray  # noqa: F401
    except ImportError:
        print("Ray is not installed (pip install 'splitinfer[ray]'): nothing to compare")
        return 1
    levels = [16] if args.quick else [int(v) for v in args.levels.split(",")]
    seconds = 2.0 if args.quick else args.seconds
    counts = [2] if args.quick else [1, 2]

    work = Path(tempfile.mkdtemp(prefix="bench-scaleout-"))
    _, manifest = bc.build_repo(work, args.size, (32, 64, 128))
    frames = bc.frames_for(manifest, bc.sample_arrays(manifest, 64))
    print(
        f"cloud segment: {manifest.cut.id}, {manifest.cut.cloud_flops / 1e6:.0f} MFLOP/sample; "
        f"cpus: {os.cpu_count()}; load average {os.getloadavg()[0]:.1f}; "
        f"load generator: {CLIENT}\n"
    )
    head = ("system", "conc", "req/s", "p50 ms", "p99 ms", "errors", "load")
    print("{:<8} {:>5} {:>9} {:>9} {:>9} {:>6} {:>5}".format(*head))
    rows = run_single(work / "repo", frames, levels, seconds)
    rows += run_ray(work / "repo", frames, levels, seconds, counts)

    print()
    verdicts: list[tuple[str, bool | None]] = []
    by = {(r["system"], r["concurrency"]): r for r in rows}
    for c in levels:
        single = by[("single", c)]["rps"]
        for n in counts:
            r = by[(f"ray-{n}", c)]
            ratio = r["rps"] / single if single else float("nan")
            verdicts.append(
                (
                    f"c={c}: ray-{n} {r['rps']:.1f} req/s = {ratio:.2f}x single {single:.1f} req/s",
                    None,
                )
            )
    top = max(levels)
    ratio = by[("ray-2", top)]["rps"] / by[("single", top)]["rps"]
    verdicts.append(
        (
            f"c={top}: two replicas {ratio:.2f}x the single process (target >= {TARGET}x with a "
            f"core per replica; this machine has {os.cpu_count()} CPUs shared by everything)",
            ratio >= TARGET,
        )
    )
    errors = sum(r["errors"] for r in rows)
    verdicts.append((f"errors: {errors} (target 0)", errors == 0))
    for text, ok in verdicts:
        print(f"{'INFO' if ok is None else 'PASS' if ok else 'FAIL'}  {text}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"rows": rows, "verdicts": [{"text": t, "pass": ok} for t, ok in verdicts]},
                indent=2,
            )
        )
    return 0 if all(ok is not False for _, ok in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
