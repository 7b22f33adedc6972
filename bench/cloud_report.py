"""bench_cloud's table and verdicts: one :class:`Row` per system and level, the
PASS/FAIL lines against the issue-5 targets, and the INFO lines (the CPU budget, the
p99 against Little's law)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from cloud_setup import Settings
from harness import Load

TARGET_CEILING = 0.80
TARGET_OVERHEAD_MS = 1.0


@dataclass
class Row:
    system: str
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    batch: float
    requests: int
    errors: int
    compute_ms: float = 0.0  # mean batch compute (service only)
    ceiling: float = 0.0  # the bare session's best samples/s, measured around this level
    bare_p50_ms: float = 0.0  # the bare session's batch-1 p50, measured around this level
    loadavg: float = 0.0  # the machine's 1-minute load average after this level
    server_cpu_ms: float = float("nan")  # CPU per request of the server's processes
    client_cpu_ms: float = float("nan")  # CPU per request of the load generator
    ceiling_cpu_ms: float = float("nan")  # the bare session's CPU per sample at the ceiling


def row(
    system: str,
    c: int,
    load: Load,
    batch: float,
    compute_ms: float,
    ceiling: float,
    floor: float,
    server_cpu_s: float,
    served: float,
    ceiling_cpu_ms: float,
) -> Row:
    """One table row; CPU per request over everything the server answered meanwhile
    (warm-up included: the load generator's own CPU is per measured request)."""
    return Row(
        system,
        c,
        load.rps,
        load.p50_ms,
        load.p99_ms,
        batch,
        load.requests,
        load.errors,
        compute_ms,
        ceiling,
        floor,
        os.getloadavg()[0],
        1000 * server_cpu_s / served if served else float("nan"),
        load.client_cpu_ms,
        ceiling_cpu_ms,
    )


# -- report ------------------------------------------------------------------------------

HEADER = (
    f"{'system':<10} {'conc':>5} {'req/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'batch':>7} "
    f"{'ceiling':>8} {'%ceil':>6} {'errors':>6} {'load':>5} {'srv cpu':>8} {'gen cpu':>8}"
)


def print_row(r: Row) -> None:
    print(
        f"{r.system:<10} {r.concurrency:>5} {r.rps:>9.1f} {r.p50_ms:>9.2f} {r.p99_ms:>9.2f} "
        f"{r.batch:>7.1f} {r.ceiling:>8.1f} {100 * r.rps / r.ceiling:>5.0f}% {r.errors:>6} "
        f"{r.loadavg:>5.1f} {r.server_cpu_ms:>8.3f} {r.client_cpu_ms:>8.3f}",
        flush=True,
    )


def budget(r: Row, client: str) -> str:
    """Where the CPU goes at the ceiling target: what is left beside ONNX Runtime's share."""
    ncpu = os.cpu_count() or 1
    rate = TARGET_CEILING * r.ceiling
    per_request = 1000 * ncpu / rate
    left = per_request - r.ceiling_cpu_ms
    return (
        f"c={r.concurrency}: CPU per request at {rate:.0f} req/s ({100 * TARGET_CEILING:.0f}% "
        f"of the ceiling) on {ncpu} CPUs: {per_request:.3f} ms, of which ONNX Runtime needs "
        f"{r.ceiling_cpu_ms:.3f} (bare, best batch), leaving {left:.3f} ms for the service "
        f"beyond it, the load generator and the kernel; measured: service "
        f"{r.server_cpu_ms - r.ceiling_cpu_ms:.3f} beyond it (its {r.server_cpu_ms:.3f} "
        f"minus the bare compute), load generator {r.client_cpu_ms:.3f} ({client})"
    )


def little(r: Row, bound: float) -> str:
    """The p99 bound against Little's law: a closed loop of N clients with no think time
    has a mean latency of exactly N / throughput, so no p99 is below that."""
    n = r.concurrency
    floor = {
        "at the measured rate": 1000 * n / r.rps,
        f"at {100 * TARGET_CEILING:.0f}% of the ceiling": 1000 * n / (TARGET_CEILING * r.ceiling),
        "at the ceiling": 1000 * n / r.ceiling,
    }
    return (
        f"c={n}: by Little's law the mean latency of {n} closed-loop clients is {n} / req/s: "
        + ", ".join(f"{v:.1f} ms {k}" for k, v in floor.items())
        + f" (the p99 bound above: {bound:.1f} ms)"
    )


def verdicts(rows: list[Row], settings: Settings) -> list[tuple[str, bool | None]]:
    """PASS/FAIL lines; each compares against the bare session measured just before."""

    def at(system: str, c: int) -> Row | None:
        return next((r for r in rows if r.system == system and r.concurrency == c), None)

    out: list[tuple[str, bool | None]] = []
    b32, b1, peer = at("batching", 32), at("batching", 1), at("litserve", 32)
    off = at("no-batch", 32)
    if b32 is not None:
        share = b32.rps / b32.ceiling
        line = (
            f"c=32: {b32.rps:.1f} req/s = {100 * share:.0f}% of the ceiling "
            f"{b32.ceiling:.1f} (target >= {100 * TARGET_CEILING:.0f}%)"
        )
        if off is not None:
            line += f"; batching off: {off.rps:.1f} req/s = {100 * off.rps / off.ceiling:.0f}%"
        out.append((line, share >= TARGET_CEILING))
        out.append((budget(b32, settings.load.client), None))
        delay = settings.delay_ms
        bound = delay + 2 * b32.compute_ms
        out.append(
            (
                f"c=32: p99 {b32.p99_ms:.1f} ms <= max_queue_delay + 2 x mean batch "
                f"compute = {delay:g} + 2 x {b32.compute_ms:.1f} = {bound:.1f} ms",
                b32.p99_ms <= bound,
            )
        )
        out.append((little(b32, bound), None))
        if peer is not None:
            out.append(
                (
                    f"c=32: {b32.rps:.1f} req/s at p99 {b32.p99_ms:.1f} ms vs LitServe "
                    f"{peer.rps:.1f} req/s at p99 {peer.p99_ms:.1f} ms "
                    f"({b32.rps / peer.rps:.2f}x the throughput)",
                    b32.rps >= peer.rps and b32.p99_ms <= peer.p99_ms,
                )
            )
    echo, tiny = at("http-echo", 1), at("overhead", 32)
    if tiny is not None:
        line = (
            f"c=32 on a near-zero segment (2 channels, 8x8): {tiny.rps:.0f} req/s, the "
            f"service's CPU {tiny.server_cpu_ms:.3f} ms per request"
        )
        if echo is not None:
            line += f" (an aiohttp server answering a canned frame: {echo.server_cpu_ms:.3f})"
        out.append((line, None))
    if b1 is not None:
        added = b1.p50_ms - b1.bare_p50_ms
        if echo is not None:
            out.append(
                (
                    f"c=1: the HTTP round trip alone (aiohttp, same client and frames) "
                    f"takes {echo.p50_ms:.2f} ms p50; the engine adds "
                    f"{added - echo.p50_ms:+.2f} ms beyond it",
                    None,
                )
            )
        out.append(
            (
                f"c=1: p50 {b1.p50_ms:.2f} ms vs a bare session's batch-1 p50 "
                f"{b1.bare_p50_ms:.2f} ms: {added:+.2f} ms (target < {TARGET_OVERHEAD_MS:g} ms)",
                added < TARGET_OVERHEAD_MS,
            )
        )
    return out
