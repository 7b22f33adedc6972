"""Closed-loop load on the cloud service: throughput, latency and batch size vs concurrency.

    python bench/bench_cloud.py [--quick] [--seconds 3] [--levels 1,2,4,8,16,32,64]
                                [--size 48] [--spinning] [--no-peer] [--json out.json]
                                [--client auto|wrk|aiohttp]

The model is a VGG-style CNN built with onnx.helper (conv-relu pairs of
widths 32, 64, 128 on a 3x48x48 input, max pools between them); the package
is cut after the first pool and the service serves the cloud segment (a
32x24x24 float activation in, 10 logits out). Every system below serves that
same ONNX segment with ONNX Runtime on the CPU and the same session options
(the service's: default intra-op threads, idle threads not spinning unless
``--spinning``).

- ``bare``: one ONNX Runtime session in this process, batch sizes 1..64; its
  best samples/s is the **ceiling**, its batch-1 p50 the latency floor. The
  machine may be shared, so both are re-measured (batch 1, 32 and the sweep's
  best) just before and just after every level and averaged; each row is
  compared with its own ceiling.
- ``batching``: ``cloud-service`` (a subprocess, --no-auth) with dynamic
  batching (max_batch_size 32, max_queue_delay 2 ms, one batch at a time).
- ``no-batch``: the same service with ``--no-batching``.
- ``overhead`` (c=32 only): the batching service on a near-zero segment (the same
  CNN with 2 channels on 8x8): what the service itself costs per request through
  HTTP, the figure to watch when working on its overhead.
- ``http-echo`` (c=1 only): an aiohttp server that reads the frame and answers
  a canned one: the transport's own share of the c=1 latency.
- ``litserve``: LitServe (``LitAPI(max_batch_size=32, batch_timeout=0.002)``,
  one CPU worker) serving the segment; requests carry the activation as
  base64 in JSON (LitServe takes JSON or forms), answers are JSON.

The load generator is a closed loop: each of ``c`` clients (one connection
each) sends a request, waits for its answer and sends the next. It is wrk
(``bench/wrk_closed_loop.lua``, one thread) when wrk is on PATH (``apt install
wrk``), else aiohttp's client in this process (``--client`` chooses). Either
shares the CPUs with the servers; wrk takes about 0.05 ms of CPU per request,
the aiohttp client about 0.25 ms, which on 2 CPUs is CPU the servers lose.
Columns: req/s over the measured window; p50 and p99 of the client-side
latency; ``batch``: mean samples per executed batch (from the service's
/metrics, from LitServe's predict calls); ``ceiling`` and ``%ceil``: the ceiling
around that level, and req/s over it; ``load``: the machine's 1-minute load
average after the level (2 CPUs: above 2 means other work competed for them,
and every figure of that row is suspect); ``srv cpu`` and ``gen cpu``: CPU ms
per request of the server's processes (all threads, ONNX Runtime's included)
and of the load generator. The verdicts add a CPU budget line: at 80% of the
ceiling, what the CPUs leave per request beside ONNX Runtime's own share, and
what the service and the load generator took; and under the p99 verdict, the
mean latency Little's law gives 32 closed-loop clients (32 / req/s) at the
measured rate, at 80% of the ceiling and at the ceiling: no p99 is below it.

The pieces: ``harness.py`` (the closed loop, servers through the daemon
launcher, CPU accounting, the frozen load configuration), ``cloud_setup.py``
(this benchmark's frozen settings, the model, the frames, the bare session),
``cloud_peers.py`` (the echo server and LitServe, as processes) and
``cloud_report.py`` (rows, the table and the verdicts).

Targets (issue 5): at concurrency 32 the batching service reaches >= 80% of the
ceiling, with p99 <= max_queue_delay + 2 x its mean batch compute time; it is at
least as fast as the peer at equal or lower p99; its p50 at concurrency 1 is
less than 1 ms above a bare session's batch-1 p50.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import cloud_peers
import numpy as np
from cloud_report import HEADER, Row, print_row, row, verdicts
from cloud_setup import MODEL, Bare, Settings, build_repo, frames_for, sample_arrays, sample_shape
from harness import LoadConfig, cpu_of, free_port, load_client, server

from splitinfer.shared.frame import FRAME_TYPE


def scrape(base: str) -> dict[str, float]:
    """The service's inference, execution and compute counters of the model."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    wanted = {
        "splitinfer_inferences_total": "inferences",
        "splitinfer_executions_total": "executions",
        "splitinfer_compute_seconds_sum": "compute_sum",
        "splitinfer_compute_seconds_count": "compute_count",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted and s.labels.get("model") == MODEL:
                out[wanted[s.name]] += s.value
    return out


# -- the systems ----------------------------------------------------------------------------


def run_service(
    system: str, repo: Path, frames: list[bytes], levels: list[int], settings: Settings, bare: Bare
) -> list[Row]:
    """``cloud-service`` (batching, or not for ``no-batch``) at every level."""
    rows = []
    argv = settings.service_argv(repo, batching=system != "no-batch")
    with server(argv, ready="/readyz") as srv:
        for c in levels:
            probe = bare.now()
            before = scrape(srv.url)
            with cpu_of(srv) as cpu:
                infer = f"{srv.url}/v1/models/{MODEL}/infer"
                load = settings.load.run(infer, frames, FRAME_TYPE, c)
            after = scrape(srv.url)
            ceiling, floor = bare.around(probe)
            if system == "overhead":  # another segment: the CNN's ceiling does not apply
                ceiling = float("nan")
            d = {k: after[k] - before[k] for k in after}
            batch = d["inferences"] / d["executions"] if d["executions"] else float("nan")
            compute = 1000 * d["compute_sum"] / d["compute_count"] if d["compute_count"] else 0.0
            rows.append(
                row(system, c, load, batch, compute, ceiling, floor, cpu(), d["inferences"],
                    bare.ceiling_cpu_ms)
            )  # fmt: skip
            print_row(rows[-1])
    return rows


def run_overhead(root: Path, settings: Settings, bare: Bare) -> list[Row]:
    """The batching service at c=32 on a near-zero segment (2 channels, 8x8): what the
    service costs per request through HTTP when the model costs almost nothing.
    Its ceiling columns are the CNN's (they do not apply to this row)."""
    root.mkdir(parents=True, exist_ok=True)
    _, manifest = build_repo(root, 8, (2, 2))
    frames = frames_for(manifest, sample_arrays(manifest, 16, seed=1))
    return run_service("overhead", root / "repo", frames, [32], settings, bare)


def run_echo(frames: list[bytes], settings: Settings, bare: Bare) -> list[Row]:
    """The HTTP round trip alone at concurrency 1: what no service on aiohttp can beat."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with server(cloud_peers.echo_argv(port), url=url, ready="/readyz") as srv:
        probe = bare.now()
        with cpu_of(srv) as cpu:
            load = settings.load.run(f"{url}/echo", frames, FRAME_TYPE, 1)
        ceiling, floor = bare.around(probe)
        seconds = settings.load.seconds
        served = load.requests * (1 + settings.load.warmup_s / seconds)  # with the warm-up
        r = row("http-echo", 1, load, float("nan"), 0.0, ceiling, floor, cpu(), served,
                bare.ceiling_cpu_ms)  # fmt: skip
        print_row(r)
    return [r]


def run_peer(
    segment: Path, bodies: list[bytes], levels: list[int], settings: Settings, bare: Bare
) -> list[Row]:
    """LitServe serving the same segment at every level."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp()) / "batches.log"
    log.touch()
    rows = []
    argv = cloud_peers.litserve_argv(segment, port, log, settings)
    with server(argv, url=url, ready="/health") as srv:
        for c in levels:
            probe = bare.now()
            seen = len(log.read_text().split())
            with cpu_of(srv) as cpu:
                load = settings.load.run(f"{url}/predict", bodies, "application/json", c)
            sizes = [int(v) for v in log.read_text().split()[seen:]]
            ceiling, floor = bare.around(probe)
            batch = statistics.mean(sizes) if sizes else float("nan")
            rows.append(
                row("litserve", c, load, batch, 0.0, ceiling, floor, cpu(), sum(sizes),
                    bare.ceiling_cpu_ms)
            )  # fmt: skip
            print_row(rows[-1])
    return rows


def engine_cpu(
    repo: Path, frames: list[bytes], concurrency: int, settings: Settings, sample: tuple[int, ...]
) -> float:
    """CPU µs per request of the engine alone: in this process, no sockets, every
    segment replaced by a stub answering zeros at once (so only the engine is left:
    routing, frame decode and encode, batching, thread hand-offs, metrics)."""
    from splitinfer.cloud.config import BatchingConfig, RuntimeConfig, ServiceConfig
    from splitinfer.cloud.engine import Engine
    from splitinfer.cloud.runtime import Runtime

    class Stub:
        def __init__(self, path: Path, config: RuntimeConfig) -> None:
            real = Runtime(path, config)
            self.inputs, self.outputs, self.providers = real.inputs, real.outputs, real.providers
            probe = {n: np.zeros((1, *sample), np.float32) for n in real.inputs}
            self.rows = {k: v.shape[1:] for k, v in real.run(probe).items()}

        def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
            n = len(next(iter(feeds.values())))
            return {k: np.zeros((n, *shape), np.float32) for k, shape in self.rows.items()}

    seconds = settings.load.seconds

    async def drive() -> float:
        cfg = ServiceConfig(
            repository=str(repo),
            no_auth=True,
            accept_raw=True,  # frames_for() sends the cut tensor raw
            log_level="warning",
            batching=BatchingConfig(
                max_batch_size=settings.max_batch, max_queue_delay_ms=settings.delay_ms
            ),
        )
        done = 0
        stop = False
        async with Engine(cfg, runtime_factory=Stub) as engine:  # type: ignore[arg-type]

            async def client(i: int) -> None:
                nonlocal done
                while not stop:
                    await engine.infer(MODEL, frames[i % len(frames)])
                    done += 1
                    i += concurrency

            tasks = [asyncio.create_task(client(i)) for i in range(concurrency)]
            await asyncio.sleep(settings.load.warmup_s)
            done, cpu0 = 0, time.process_time()
            await asyncio.sleep(seconds)
            cpu, count = time.process_time() - cpu0, done
            stop = True
            await asyncio.gather(*tasks)
        return 1e6 * cpu / max(1, count)

    return asyncio.run(drive())


# -- the run --------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Settings, list[int]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="levels 1,8,32 for 1.5 s each")
    p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per level")
    p.add_argument("--levels", default="1,2,4,8,16,32,64", help="concurrency levels")
    p.add_argument("--size", type=int, default=48, help="input height and width of the CNN")
    p.add_argument("--no-peer", action="store_true", help="skip LitServe")
    p.add_argument(
        "--spinning", action="store_true", help="let idle ONNX Runtime threads spin (all systems)"
    )
    p.add_argument("--json", type=Path, help="write the rows and verdicts here")
    p.add_argument(
        "--client",
        choices=("auto", "wrk", "aiohttp"),
        default="auto",
        help="the load generator: wrk (C; auto picks it when it is on PATH) or aiohttp "
        "(Python, in this process: it takes more of the shared CPUs)",
    )
    p.add_argument(
        "--service-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="pass a flag to cloud-service (repeatable), e.g. --service-arg=--threads=1",
    )
    args = p.parse_args(argv)
    levels = [1, 8, 32] if args.quick else [int(v) for v in args.levels.split(",")]
    try:
        client = load_client(args.client)
        load = LoadConfig(client=client, seconds=1.5 if args.quick else args.seconds)
    except (SystemExit, ValueError) as exc:
        p.error(str(exc))
    settings = Settings(load=load, spinning=args.spinning, service_args=tuple(args.service_arg))
    return args, settings, levels


def main(argv: list[str] | None = None) -> int:
    args, settings, levels = parse(argv)
    seconds = settings.load.seconds

    work = Path(tempfile.mkdtemp(prefix="bench-cloud-"))
    segment, manifest = build_repo(work, args.size, (32, 64, 128))
    (spec,) = manifest.cut.tensors
    sample = sample_shape(manifest)
    print(
        f"cloud segment: {manifest.cut.id} input {spec.name} {list(sample)} float32, "
        f"{manifest.cut.cloud_flops / 1e6:.0f} MFLOP/sample; cpus: {os.cpu_count()}; "
        f"load average {os.getloadavg()[0]:.1f}; load generator: {settings.load.client}"
    )

    bare = Bare(segment, sample, settings.spinning)
    table = bare.sweep(seconds=min(seconds, 2.0))
    best = bare.best
    print(
        "\nbare ONNX Runtime session (the ceiling: its best batch, re-measured around each level)"
    )
    print(f"{'batch':>6} {'samples/s':>10} {'p50 ms':>9}")
    for b, (rate, p50) in table.items():
        print(f"{b:>6} {rate:>10.1f} {1000 * p50:>9.2f}{'  <- best' if b == best else ''}")

    arrays = sample_arrays(manifest, 64)
    frames = frames_for(manifest, arrays)
    bodies = [json.dumps({"x": base64.b64encode(a.tobytes()).decode()}).encode() for a in arrays]

    print("\n" + HEADER)
    rows = run_service("batching", work / "repo", frames, levels, settings, bare)
    rows += run_service("no-batch", work / "repo", frames, levels, settings, bare)
    rows += run_echo(frames, settings, bare)
    rows += run_overhead(work / "tiny", settings, bare)
    engine_us = {c: engine_cpu(work / "repo", frames, c, settings, sample) for c in (1, 32)}
    peer_note = ""
    if not args.no_peer:
        if cloud_peers.HAVE_LITSERVE:
            rows += run_peer(segment, bodies, levels, settings, bare)
        else:
            peer_note = "LitServe is not installed (pip install litserve): no peer figures"
            print(peer_note)

    print()
    results = verdicts(rows, settings)
    results.append(
        (
            "the engine alone (in-process, no sockets, segments stubbed to answer at once): "
            + ", ".join(f"{us:.0f} µs of CPU per request at c={c}" for c, us in engine_us.items()),
            None,
        )
    )
    for text, ok in results:
        print(f"{'INFO' if ok is None else 'PASS' if ok else 'FAIL'}  {text}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "best_batch": best,
                    "bare": {str(b): {"rps": r, "p50_ms": 1000 * t} for b, (r, t) in table.items()},
                    "rows": [asdict(r) for r in rows],
                    "verdicts": [{"text": t, "pass": ok} for t, ok in results],
                    "note": peer_note,
                },
                indent=2,
            )
        )
    return 0 if all(ok is not False for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
