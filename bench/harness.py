"""What the load benchmarks share: a frozen load configuration passed down, servers
started through the one daemon launcher, the closed loop, and CPU accounting.

    load = LoadConfig(client=load_client("auto"), seconds=3.0)
    with server(argv, ready="/readyz") as srv:              # a daemon, its own group
        with cpu_of(srv) as used:                             # CPU of all its processes
            result = load.run(srv.url + "/infer", bodies, "application/json", 32)
        print(result.rps, result.p99_ms, used())

The closed loop: each of ``c`` clients (one connection each) sends a request,
waits for its answer and sends the next. It is wrk (``wrk_closed_loop.lua``, one
thread) when asked for, else aiohttp's client in this process. A warm-up of
``min(1, seconds / 2)`` s fills the pipeline before the measured window.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from splitinfer.sim.daemon import Daemon

WRK_SCRIPT = Path(__file__).resolve().parent / "wrk_closed_loop.lua"
CLIENTS = ("wrk", "aiohttp")


def load_client(choice: str) -> str:
    """``wrk`` or ``aiohttp`` for ``--client auto|wrk|aiohttp`` (auto: wrk when on PATH)."""
    if choice == "wrk" and shutil.which("wrk") is None:
        raise SystemExit("--client wrk: wrk is not on PATH (apt install wrk, brew install wrk)")
    if choice == "auto":
        return "wrk" if shutil.which("wrk") else "aiohttp"
    return choice


@dataclass(frozen=True)
class Load:
    """What one closed-loop run measured."""

    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    client_cpu_s: float  # the load generator's CPU time over the measured window

    @property
    def client_cpu_ms(self) -> float:
        """The load generator's CPU ms per measured request."""
        return 1000 * self.client_cpu_s / self.requests if self.requests else float("nan")


@dataclass(frozen=True)
class LoadConfig:
    """How every level of a benchmark is driven: the load generator and the window."""

    client: str = "aiohttp"  # "wrk" (C, a few µs of CPU per request) or "aiohttp"
    seconds: float = 3.0  # the measured window of one level

    def __post_init__(self) -> None:
        if self.client not in CLIENTS:
            raise ValueError(f"client={self.client!r}: choose one of {', '.join(CLIENTS)}")
        if not self.seconds > 0:
            raise ValueError(f"seconds={self.seconds}: must be positive")

    @property
    def warmup_s(self) -> float:
        return min(1.0, self.seconds / 2)

    def run(self, url: str, bodies: Sequence[bytes], content_type: str, concurrency: int) -> Load:
        """``concurrency`` clients, each sending its next request when its answer is in."""
        if self.client == "wrk":
            return self._wrk(url, bodies, content_type, concurrency)
        return asyncio.run(self._aiohttp(url, bodies, content_type, concurrency))

    def _wrk(self, url: str, bodies: Sequence[bytes], content_type: str, concurrency: int) -> Load:
        """wrk (C, one thread): a load generator that costs its host a few µs per request."""
        with tempfile.TemporaryDirectory(prefix="bench-wrk-") as tmp:
            files = []
            for i, body in enumerate(bodies):
                files.append(Path(tmp) / f"{i}.body")
                files[-1].write_bytes(body)
            cmd = ["wrk", "-t1", f"-c{concurrency}", "-s", str(WRK_SCRIPT)]
            args = [url, "--", content_type, *map(str, files)]
            warm = max(1, round(self.warmup_s))
            subprocess.run([*cmd, f"-d{warm}s", *args], capture_output=True, check=True)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            out = subprocess.run(
                [*cmd, f"-d{max(1, round(self.seconds))}s", "--timeout", "30s", *args],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
        line = next((ln for ln in out.splitlines() if ln.startswith("WRK-RESULT ")), None)
        if line is None:
            raise RuntimeError(f"wrk printed no result: {out[-500:]}")
        r = json.loads(line.split(" ", 1)[1])
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        return Load(
            r["requests"] / (r["duration_us"] / 1e6),
            r["p50_us"] / 1000,
            r["p99_us"] / 1000,
            r["requests"],
            r["socket_errors"] + r["non_2xx"],
            cpu,
        )

    async def _aiohttp(
        self, url: str, bodies: Sequence[bytes], content_type: str, concurrency: int
    ) -> Load:
        """The same closed loop in this process with aiohttp's client (when wrk is absent)."""
        import aiohttp

        latencies: list[float] = []
        errors = 0
        measuring = False
        stop = False
        headers = {"Content-Type": content_type}
        conn = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=conn) as http:

            async def client(i: int) -> None:
                nonlocal errors
                n = i
                while not stop:
                    body = bodies[n % len(bodies)]
                    n += concurrency
                    t0 = time.perf_counter()
                    async with http.post(url, data=body, headers=headers) as resp:
                        await resp.read()
                        ok = resp.status == 200
                    if measuring:
                        if ok:
                            latencies.append(time.perf_counter() - t0)
                        else:
                            errors += 1

            tasks = [asyncio.create_task(client(i)) for i in range(concurrency)]
            await asyncio.sleep(self.warmup_s)  # fill the pipeline
            measuring = True
            t0, cpu0 = time.perf_counter(), time.process_time()
            await asyncio.sleep(self.seconds)
            measuring = False
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            stop = True
            await asyncio.gather(*tasks)
        return Load(
            len(latencies) / elapsed,
            pct(latencies, 50),
            pct(latencies, 99),
            len(latencies),
            errors,
            cpu,
        )


def pct(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of seconds, in ms (NaN when there are none)."""
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q)) * 1000.0


# -- servers ------------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port free right now (for servers that cannot take port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server(
    argv: Sequence[str | Path],
    *,
    url: str | None = None,
    ready: str | None = None,
    timeout_s: float = 120.0,
) -> Daemon:
    """A server process through the one launcher (:mod:`splitinfer.sim.daemon`), in its
    own process group (so :func:`cpu_of` counts its workers and stop ends them all).
    ``url``: known beforehand (a chosen port) instead of read from its ``listening
    on`` line; ``ready``: a path that must answer 200 first. Use it with ``with``."""
    return Daemon(argv, url=url, ready=ready, timeout_s=timeout_s, new_session=True)


def group_cpu(pgid: int) -> float:
    """CPU seconds used so far by the live processes of process group ``pgid``."""
    import psutil

    total = 0.0
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                times = proc.cpu_times()
                total += times.user + times.system
        except (psutil.Error, OSError):  # gone meanwhile
            continue
    return total


@contextlib.contextmanager
def cpu_of(daemon: Daemon) -> Iterator[Callable[[], float]]:
    """CPU seconds the server's processes use inside the block: call the yielded
    function after it (inside, it gives the CPU so far)."""
    assert daemon.pid is not None, f"{daemon.name} is not running"
    pgid = daemon.pid
    start = group_cpu(pgid)
    used: list[float] = []
    try:
        yield lambda: used[0] if used else group_cpu(pgid) - start
    finally:
        used.append(group_cpu(pgid) - start)
