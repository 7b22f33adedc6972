"""Soak: hours, not seconds (issue 29). Real daemons under a steady load and scheduled
faults; nothing may be lost, nothing may be wrong, nothing may grow.

    python bench/bench_soak.py [--minutes 60] [--window 5] [--rate 1.5] [--ray]
                               [--out out/soak] [--json FILE] [--seed 0]

It builds four small models on the spot (``bench/soak_setup.py``: a cloud-only CNN
whose version is hot-swapped, an INT8 split of the digits CNN, a private split of it,
an MoE split package), starts ``redis-server`` (the nonce store) on a free loopback
port, ``cloud-service`` (or, with ``--ray``, a two-replica Ray Serve application)
with device credentials and that nonce store, and 8 ``edge-agent`` processes, two
per model, each behind its own emulated link (``sim/link.py``) replaying a bundled
cellular trace. Each device's application posts inputs to its agent's local API
(Poisson arrivals, ``--rate`` per second) and keeps a ledger of every request and
its answer: from the cloud, or from the device with the agent's reason. A request
whose agent answers an error it may retry (5xx, 429, no connection) is sent again,
as an application would, for up to ``--retry-for`` seconds; the errors it met are in
the ledger.

Faults, on a schedule that is a function of ``--minutes`` (``sim/soak.py``; an hour
has): a new version of the hot-swapped model every minute (written into the
repository; the service's watcher loads it), the cloud killed (SIGKILL) and started
again every 3 minutes (``--ray``: one replica's worker killed; Serve replaces it), a
10-30 s outage of one device's link every 2 minutes (the next device each time), and
once each: the cloud hung (SIGSTOP) for 15 s, the nonce store stopped for 5 s and
started again (empty), and the repository's disk full for 20 s (the repository is on
a 16 MiB tmpfs the run mounts as root; the ballast fills it to ENOSPC, a hot swap
then fails, and the ballast goes; without root this fault is reported as not done).
Shorter runs compress the periods so every kind happens at least once.

Every window (``--window`` minutes) it prints requests sent, answered (by the cloud,
by the device and why), failed, errors met, p50/p99 latency, RSS and open file
descriptors of every process (psutil), the nonce store's size (DBSIZE) and the
series count of the cloud's ``/metrics``; progress lines go to stderr. At the end it
checks: 0 lost (every request answered), 0 wrong (every exact answer within 1e-5 of
the reference, every agreement package at its stated top-1 agreement), RSS of every
long-lived process within 10 % of its value at minute 10 (runs of 20 minutes or
more), open fds flat, nonce store bounded; it writes a JSON result and every ledger,
and exits 0 only if all hold.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak_procs import (
    ONE_THREAD,
    Cloud,
    RayCloud,
    Redis,
    Repository,
    free_port,
    ray_driver,
    write_toml,
)
from soak_setup import Model, build

from splitinfer.shared.contract import (
    HEADER_CUT,
    HEADER_LOCAL,
    HEADER_LOCAL_REASON,
    HEADER_VERSION,
    NPZ_TYPE,
)
from splitinfer.sim import soak
from splitinfer.sim.daemon import Daemon, command

ROOT = Path(__file__).resolve().parent.parent
DEVICES = 8
#: (uplink trace, offset s) of each device's link
TRACES = (
    ("ATT-LTE-driving-2016.up", 0),
    ("Verizon-LTE-short.up", 0),
    ("TMobile-LTE-short.up", 0),
    ("TMobile-UMTS-driving.up", 0),
    ("ATT-LTE-driving-2016.up", 60),
    ("Verizon-LTE-short.up", 70),
    ("TMobile-LTE-short.up", 70),
    ("Verizon-EVDO-driving.up", 0),
)
#: the agents' settings that bound a fault (docs/deployment.md, "Time-outs and restarts")
AGENT = {
    "uplink": {"timeout": "3s", "connect_timeout": "2s", "max_attempts": 3,
               "breaker_failures": 3, "breaker_reset": "3s", "health_interval": "2s"},
    "queue": {"request_timeout": "15s", "max_queue": 512},
    "runtime": {"providers": ["cpu"], "threads": 1, "verify": False},
}  # fmt: skip
REQUEST_TIMEOUT_S = 15.0
MAX_ATTEMPTS = 3
CLOUD = {
    "watch_interval": "2s",
    "drain_timeout": "5s",
    "log_level": "info",
    "runtime": {"providers": ["cpu"], "threads": 1},
    "batching": {"max_queue_delay": "2ms"},
}
#: the cloud's replay window (``auth_window``, its default): how long a nonce is kept
AUTH_WINDOW_S = 30.0
#: seconds after the links open before the load starts: the agents' breakers close
SETTLE_S = 8.0


def say(text: str) -> None:
    print(f"bench_soak: {text}", file=sys.stderr, flush=True)


def clock(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 60}:{s % 60:02d}"


@dataclass
class Device:
    index: int
    model: Model
    link_port: int
    agent: Daemon | None = None
    link: Any = None
    url: str = ""
    rng: random.Random = field(default_factory=random.Random)

    @property
    def name(self) -> str:
        return f"sim-{self.index}"


@dataclass
class FaultRecord:
    at_s: float
    kind: str
    what: str
    done: bool
    note: str = ""
    ended_s: float | None = None


class Run:
    """One soak run: its processes, its ledger, its samples."""

    def __init__(self, args: argparse.Namespace, models: list[Model]) -> None:
        self.args = args
        self.out: Path = args.out
        self.duration_s = args.minutes * 60.0
        self.window_s = args.window * 60.0
        self.models = {m.name: m for m in models}
        self.plan = soak.schedule(self.duration_s, DEVICES, seed=args.seed)
        self.ledger = soak.Ledger()
        self.samples: list[soak.Sample] = []
        self.nonces: list[tuple[float, int | None]] = []
        self.series: list[tuple[float, int | None]] = []
        self.faults: list[FaultRecord] = []
        self.windows: list[dict[str, Any]] = []
        self.t0 = math.nan
        self.version = 1
        self.disk_full_now = False
        self.next_window = 1
        self.repo = Repository(self.out / "repository")
        self.redis = Redis(free_port(), self.out / "logs" / "redis.log")
        cloud_port = free_port()
        cls = RayCloud if args.ray else Cloud
        self.cloud: Cloud = cls(
            self.out / "cloud.toml", cloud_port, self.out / "logs" / "cloud.log"
        )
        self.devices = [
            Device(i, models[i % len(models)], free_port(), rng=random.Random(f"{args.seed}:{i}"))
            for i in range(DEVICES)
        ]
        self.tasks: set[asyncio.Task[None]] = set()
        self.session: Any = None

    def now(self) -> float:
        return asyncio.get_running_loop().time() - self.t0

    # -- set-up ------------------------------------------------------------------------------

    def write_configs(self) -> None:
        from splitinfer.shared.auth import generate_credential, render_toml

        creds = self.out / "credentials.toml"
        creds.write_text(
            "".join(render_toml(generate_credential(d.name, "k1")) for d in self.devices)
        )
        creds.chmod(0o600)
        cloud = {
            "repository": str(self.repo.path),
            "listen": f"127.0.0.1:{self.cloud.port}",
            "credentials": str(creds),
            "nonce_store": self.redis.url,
            **CLOUD,
        }
        write_toml(self.cloud.config, cloud)
        for d in self.devices:
            cfg: dict[str, Any] = {
                "package": str(d.model.package),
                "cloud": [f"http://127.0.0.1:{d.link_port}"],
                "listen": "127.0.0.1:0",
                "credentials": str(creds),
                "device_id": d.name,
                **AGENT,
            }
            if d.model.cut is not None:
                cfg["adapt"] = {"cut": d.model.cut}
            write_toml(self.out / f"agent-{d.name}.toml", cfg)

    def install(self) -> None:
        self.repo.mount()
        if not self.repo.mounted:
            say(f"the disk-full fault will not be done: {self.repo.why_not}")
        for m in self.models.values():
            (self.repo.path / m.name).mkdir(parents=True, exist_ok=True)
            self.repo.install(m.name, "1", m.package)
        say(f"repository {self.repo.path}: {self.repo.usage()}"
            + (" (its own tmpfs)" if self.repo.mounted else ""))  # fmt: skip

    async def start(self) -> None:
        from splitinfer.sim.config import Direction, LinkConfig
        from splitinfer.sim.link import EmulatedLink
        from splitinfer.sim.traces import path as trace_path

        await asyncio.to_thread(self.redis.start)
        say(f"nonce store: redis-server on {self.redis.url} (pid {self.redis.pid})")
        took = await self.cloud.start()
        say(f"{self.cloud.mode} ready on {self.cloud.url} in {took:.1f} s")
        for d in self.devices:
            argv = [*command("edge-agent"), "--config", str(self.out / f"agent-{d.name}.toml")]
            d.agent = Daemon(argv, log=self.out / "logs" / f"agent-{d.name}.log", env=ONE_THREAD,
                             timeout_s=180)  # fmt: skip
        t = time.monotonic()
        urls = await asyncio.gather(*(d.agent.wait_async() for d in self.devices if d.agent))
        for d, url in zip(self.devices, urls, strict=True):
            d.url = url
        say(f"{DEVICES} edge agents listening in {time.monotonic() - t:.1f} s")
        for d in self.devices:
            name, offset = TRACES[d.index % len(TRACES)]
            outages = tuple((a + SETTLE_S, b) for a, b in soak.outages_of(self.plan, d.index))
            config = LinkConfig(
                uplink=Direction.from_trace(trace_path(name), offset),
                downlink=Direction.rate("20mbit"),
                delay_ms=20.0,
                outages=outages,
                seed=d.index,
            )
            d.link = EmulatedLink(config, ("127.0.0.1", self.cloud.port), port=d.link_port)
            await d.link.start()
            say(f"{d.name} ({d.model.name}{', cut ' + d.model.cut if d.model.cut else ''}): "
                f"agent {d.url}, link :{d.link_port} {config.uplink.describe()}")  # fmt: skip
        await asyncio.sleep(SETTLE_S)

    async def stop(self) -> None:
        for d in self.devices:
            if d.agent is not None:
                with contextlib.suppress(Exception):
                    await d.agent.stop_async(15)
        for d in self.devices:
            if d.link is not None:
                with contextlib.suppress(Exception):
                    await d.link.close()
        with contextlib.suppress(Exception):
            await self.cloud.stop()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.redis.stop)
        self.repo.unmount()

    # -- the load --------------------------------------------------------------------------

    async def device_loop(self, d: Device) -> None:
        """Poisson arrivals at ``--rate`` until the run's end; each request its own task."""
        sample = d.index * 7
        while True:
            await asyncio.sleep(d.rng.expovariate(self.args.rate))
            if self.now() >= self.duration_s:
                return
            sample = (sample + 1) % len(d.model.inputs)
            task = asyncio.create_task(self.request(d, sample))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def request(self, d: Device, sample: int) -> None:
        import aiohttp

        from splitinfer.edge.payload import npz_bytes

        entry = self.ledger.sent(d.index, d.model.name, sample, self.now())
        body = npz_bytes(d.model.inputs[sample])
        headers = {"Content-Type": NPZ_TYPE, "Accept": NPZ_TYPE}
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S + 10)
        backoff = 1.0
        while True:
            retry_after = None
            try:
                async with self.session.post(
                    d.url + "/v1/infer", data=body, headers=headers, timeout=timeout
                ) as resp:
                    payload = await resp.read()
                    if resp.status == 200:
                        self.answered(d, entry, resp.headers, payload)
                        return
                    error = error_line(resp.status, payload)
                    final = resp.status < 500 and resp.status != 429
                    retry_after = resp.headers.get("Retry-After")
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                error = " ".join(str(exc).split()) or type(exc).__name__
                final = False
            final = final or self.now() - entry.sent_s > self.args.retry_for
            self.ledger.attempt_failed(entry, error, self.now(), final)
            if final:
                return
            wait = float(retry_after) if retry_after and retry_after.isdigit() else backoff
            await asyncio.sleep(min(wait, 5.0))
            backoff = min(backoff * 2, 5.0)

    def answered(self, d: Device, entry: soak.Entry, headers: Any, payload: bytes) -> None:
        local = headers.get(HEADER_LOCAL) == "1"
        version = headers.get(HEADER_VERSION, "")
        with np.load(io.BytesIO(payload)) as z:
            got = {k: z[k] for k in z.files}
        ref = d.model.reference(entry.sample, None if local else version)
        if ref is None:
            verdict = "wrong"  # a version the repository never held
        else:
            verdict = soak.judge(soak.Exact() if local else d.model.rule, got, ref)
        self.ledger.answered(
            entry,
            self.now(),
            local=local,
            verdict=verdict,
            version=version,
            cut=headers.get(HEADER_CUT, ""),
            reason=headers.get(HEADER_LOCAL_REASON, "") or ("unmarked" if local else ""),
        )

    # -- the faults -----------------------------------------------------------------------------

    async def faults_loop(self) -> None:
        running: list[asyncio.Task[None]] = []
        for fault in self.plan:
            await asyncio.sleep(max(0.0, fault.at_s - self.now()))
            running.append(asyncio.create_task(self.inject(fault)))
        await asyncio.gather(*running)

    async def inject(self, fault: soak.Fault) -> None:
        rec = FaultRecord(round(self.now(), 1), fault.kind, fault.describe(), True)
        self.faults.append(rec)
        if fault.duration_s > 0 and fault.kind != "cloud-kill":
            say(f"{clock(rec.at_s)} fault begins: {rec.what}")
        try:
            if fault.kind == "hot-swap":
                full = self.disk_full_now
                written, rec.note = await self.hot_swap()
                rec.done = written or full
                if full and not written:
                    rec.note += " (the disk is full: expected)"
            elif fault.kind == "cloud-kill":
                rec.note = await self.cloud.kill_and_restart()
            elif fault.kind == "cloud-stop":
                async with self.cloud.stopped() as what:
                    rec.note = f"SIGSTOP to {what}"
                    await asyncio.sleep(fault.duration_s)
                rec.note += ", SIGCONT"
            elif fault.kind == "nonce-restart":
                await asyncio.to_thread(self.redis.stop)
                await asyncio.sleep(fault.duration_s)
                await asyncio.to_thread(self.redis.start)
                rec.note = f"started again empty (pid {self.redis.pid})"
            elif fault.kind == "disk-full":
                rec.done, rec.note = await self.disk_full(fault.duration_s)
            elif fault.kind == "link-outage":
                await asyncio.sleep(fault.duration_s)
                link = self.devices[fault.device or 0].link
                a = fault.at_s + SETTLE_S
                moved = link.uplink_stats.delivered_between(a + 0.05, a + fault.duration_s - 0.05)
                rec.note = f"the link's uplink delivered {moved} B during it"
                rec.done = moved == 0
        except Exception as exc:  # a fault that could not be done is reported, not fatal
            rec.done = False
            rec.note = f"{type(exc).__name__}: {exc}"
        rec.ended_s = round(self.now(), 1)
        say(f"{clock(rec.at_s)} fault: {rec.what}: {rec.note}")

    async def hot_swap(self) -> tuple[bool, str]:
        """Write the next version of the chain (the other weight set); whether it was
        written, and what happened."""
        chain = self.models["chain"]
        version = self.version + 1
        variant = (version - 1) % len(chain.sources)
        chain.variants[str(version)] = variant  # before the service can see it
        try:
            await asyncio.to_thread(
                self.repo.install, "chain", str(version), chain.sources[variant]
            )
        except (OSError, shutil.Error) as exc:
            return False, f"writing version {version} failed: {os_error(exc)}"
        self.version = version
        await asyncio.to_thread(self.repo.prune, "chain", self.version)
        return True, f"chain/{version} written (weights of seed {variant})"

    async def disk_full(self, seconds: float) -> tuple[bool, str]:
        if not self.repo.mounted:
            await asyncio.sleep(seconds)
            return False, f"not done: {self.repo.why_not}"
        filled = await asyncio.to_thread(self.repo.fill)
        self.disk_full_now = True
        usage = self.repo.usage()
        try:
            written, probe = await self.hot_swap()
            await asyncio.sleep(seconds)
        finally:
            self.repo.free()
            self.disk_full_now = False
        return not written and "No space left" in probe, (
            f"ballast of {filled / 2**20:.1f} MiB filled it ({usage}); a hot swap meanwhile: "
            f"{probe}; ballast removed"
        )

    # -- reports ---------------------------------------------------------------------------------

    def processes(self) -> dict[str, int]:
        out = dict(self.cloud.processes())
        for d in self.devices:
            if d.agent is not None and d.agent.pid is not None:
                out[f"agent {d.name}"] = d.agent.pid
        if self.redis.pid is not None:
            out["redis"] = self.redis.pid
        out["harness"] = os.getpid()
        return out

    def sample(self, t: float) -> list[soak.Sample]:
        import psutil

        taken = []
        for role, pid in self.processes().items():
            try:
                p = psutil.Process(pid)
                taken.append(soak.Sample(t, role, pid, p.memory_info().rss, p.num_fds()))
            except psutil.Error:
                continue
        self.samples += taken
        return taken

    async def metrics_series(self) -> int | None:
        import aiohttp

        try:
            async with self.session.get(
                self.cloud.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None
        return sum(1 for line in text.splitlines() if line and not line.startswith("#"))

    async def report(self, index: int, start: float, end: float, label: str = "") -> None:
        w = self.ledger.window(index, start, end)
        pending = self.ledger.counts()["pending"]
        taken = self.sample(end)
        dbsize = await asyncio.to_thread(self.redis.dbsize)
        series = await self.metrics_series()
        self.nonces.append((end, dbsize))
        self.series.append((end, series))
        faults = [f for f in self.faults if start <= f.at_s < end]
        lines = [soak.format_window(w, pending) + (f"  {label}" if label else "")]
        if faults:
            kinds: dict[str, int] = {}
            for f in faults:
                kinds[f.kind] = kinds.get(f.kind, 0) + 1
            lines.append("  faults: " + ", ".join(f"{k} x{n}" for k, n in kinds.items()))
        lines.append("  " + process_line(taken))
        lines.append(f"  nonce store {dbsize if dbsize is not None else 'down'} keys, "
                     f"cloud /metrics {series if series is not None else '-'} series")  # fmt: skip
        print("\n".join(lines), flush=True)
        self.windows.append(
            {
                **asdict(w),
                "pending": pending,
                "nonce_keys": dbsize,
                "metrics_series": series,
                "processes": [asdict(s) for s in taken],
            }
        )

    async def windows_loop(self) -> None:
        k = 1
        while k * self.window_s <= self.duration_s + 1e-6:
            await asyncio.sleep(max(0.0, k * self.window_s - self.now()))
            await self.report(k, (k - 1) * self.window_s, k * self.window_s)
            k += 1
        self.next_window = k

    async def progress_loop(self) -> None:
        every = 10.0 if self.window_s <= 60 else 30.0
        while True:
            await asyncio.sleep(every)
            c = self.ledger.counts()
            say(f"{clock(self.now())}  sent {sum(c.values())}  cloud {c['cloud']}  "
                f"device {c['local']}  failed {c['failed']}  pending {c['pending']}  "
                f"cloud pid {self.cloud.pid}")  # fmt: skip

    # -- the run ---------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        import aiohttp

        self.write_configs()
        self.install()
        try:
            await self.start()
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            async with aiohttp.ClientSession(connector=connector) as session:
                self.session = session
                self.t0 = asyncio.get_running_loop().time()
                self.sample(0.0)
                say(f"load: {DEVICES} devices x {self.args.rate:g} requests/s for "
                    f"{self.args.minutes:g} min; {len(self.plan)} faults scheduled")  # fmt: skip
                progress = asyncio.create_task(self.progress_loop())
                loops = [asyncio.create_task(self.device_loop(d)) for d in self.devices]
                faults = asyncio.create_task(self.faults_loop())
                windows = asyncio.create_task(self.windows_loop())
                await asyncio.gather(*loops, faults, windows)
                drain_until = self.now() + self.args.retry_for + 30
                while self.tasks and self.now() < drain_until:
                    await asyncio.sleep(0.5)
                end = self.now()
                last = (self.next_window - 1) * self.window_s
                if end > last + 0.5:
                    await self.report(self.next_window, last, end + 1e-3, "(to the last answer)")
                for task in list(self.tasks):
                    task.cancel()
                progress.cancel()
        finally:
            await self.stop()
        return self.result()

    def result(self) -> dict[str, Any]:
        entries = self.ledger.entries()
        lost = self.ledger.lost()
        wrong = [e for e in entries if e.verdict == "wrong"]
        per_model: dict[str, dict[str, Any]] = {}
        for name, m in self.models.items():
            cloud = [e for e in entries if e.model == name and e.outcome == "cloud"]
            agreed = sum(e.verdict == "ok" for e in cloud)
            # without noise an input's answers are all alike: count each input once
            distinct = len({e.sample for e in cloud})
            noised = isinstance(m.rule, soak.Agreement) and m.rule.noised
            judged = len(cloud) if noised else distinct
            holds = True
            if isinstance(m.rule, soak.Agreement):
                holds = m.rule.holds(agreed, len(cloud), judged)
            per_model[name] = {
                "rule": m.rule.describe(),
                "requests": sum(e.model == name for e in entries),
                "cloud": len(cloud),
                "local": sum(e.model == name and e.outcome == "local" for e in entries),
                "agreed": agreed,
                "agreement": agreed / len(cloud) if cloud else None,
                "floor": m.rule.floor(judged) if isinstance(m.rule, soak.Agreement) else None,
                "inputs": distinct,
                "holds": holds,
                "versions": sorted({e.version for e in cloud}, key=lambda v: int(v or 0)),
            }
        peak_rps = max((w["sent"] / self.window_s for w in self.windows), default=0.0)
        bound = soak.nonce_bound(peak_rps, MAX_ATTEMPTS, AUTH_WINDOW_S)
        exclude = ("harness",)
        checks = {
            "lost": [f"{e.model} sim-{e.device} #{e.seq}: {e.outcome}" for e in lost][:20],
            "wrong": [f"{e.model} sim-{e.device} #{e.seq} {e.outcome} v{e.version}" for e in wrong][
                :20
            ],
            "agreement": [
                f"{n}: {v['agreement']:.3f} < floor {v['floor']:.3f}"
                for n, v in per_model.items()
                if not v["holds"]
            ],
            "rss": soak.rss_findings(self.samples, self.duration_s, exclude=exclude),
            "fds": soak.fd_findings(self.samples, exclude=exclude, warmup_s=self.window_s),
            "nonce_store": soak.nonce_findings(self.nonces, bound),
            "faults": [
                f"{f.kind} at {clock(f.at_s)}: {f.note}"
                for f in self.faults
                if not f.done and not (f.kind == "disk-full" and self.repo.why_not)
            ],
        }
        kinds = {k: sum(f.kind == k and f.done for f in self.faults) for k in soak.FAULT_KINDS}
        return {
            "minutes": self.args.minutes,
            "window_minutes": self.args.window,
            "mode": self.cloud.mode,
            "rate_per_device": self.args.rate,
            "counts": dict(self.ledger.counts()),
            "lost": len(lost),
            "wrong": len(wrong),
            "models": per_model,
            "faults_done": kinds,
            "faults_skipped": {"disk-full": self.repo.why_not} if self.repo.why_not else {},
            "nonce_bound": bound,
            "checks": checks,
            "passed": not any(checks.values()),
            "faults": [asdict(f) for f in self.faults],
            "schedule": [asdict(f) for f in self.plan],
            "windows": self.windows,
        }

    def write_ledgers(self) -> None:
        folder = self.out / "ledgers"
        folder.mkdir(parents=True, exist_ok=True)
        for device, book in self.ledger.devices.items():
            with (folder / f"sim-{device}.jsonl").open("w") as f:
                for e in book:
                    f.write(json.dumps(e.record()) + "\n")


def process_line(samples: Sequence[soak.Sample]) -> str:
    """``rss MB / fds`` of every process, agents as a range."""
    parts, agents = [], [s for s in samples if s.role.startswith("agent ")]
    for s in samples:
        if not s.role.startswith("agent "):
            parts.append(f"{s.role} {s.rss_bytes / 2**20:.0f} MB/{s.fds}")
    if agents:
        rss = [s.rss_bytes / 2**20 for s in agents]
        fds = [s.fds for s in agents]
        parts.insert(1, f"{len(agents)} agents {min(rss):.0f}-{max(rss):.0f} MB/"
                        f"{min(fds)}-{max(fds)}")  # fmt: skip
    return "rss/fds: " + ", ".join(parts)


def os_error(exc: BaseException) -> str:
    """``No space left on device`` from an OSError, or from the first of a copytree's."""
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list):
        first = exc.args[0][0]
        text = str(first[2]) if isinstance(first, tuple) and len(first) == 3 else str(first)
        return text.split(":")[0].split("] ")[-1]
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def error_line(status: int, payload: bytes) -> str:
    try:
        doc = json.loads(payload)
        text = f"{status}: {doc['error']}"
    except (ValueError, KeyError, TypeError):
        text = f"{status}: {payload[:200].decode(errors='replace')}"
    return " ".join(text.split())


def print_verdicts(result: dict[str, Any]) -> None:
    c = result["counts"]
    print(
        f"\n{sum(c.values())} requests: {c.get('cloud', 0)} answered by the cloud, "
        f"{c.get('local', 0)} by the device, {result['lost']} lost, {result['wrong']} wrong"
    )
    for name, m in result["models"].items():
        agree = "" if m["agreement"] is None else f", agreement {m['agreement']:.3f}"
        floor = "" if m["floor"] is None else f" (floor {m['floor']:.3f})"
        print(f"  {name}: {m['requests']} requests, cloud {m['cloud']}{agree}{floor}, "
              f"device {m['local']}; rule {m['rule']}")  # fmt: skip
    print("faults done: " + ", ".join(f"{k} x{n}" for k, n in result["faults_done"].items()))
    series = [w["metrics_series"] for w in result["windows"]]
    keys = [w["nonce_keys"] for w in result["windows"]]
    print(f"INFO  cloud /metrics series per window: {series} (a restarted cloud starts afresh; "
          "inside one process every version served keeps its labelled series)")  # fmt: skip
    print(f"INFO  nonce store keys per window: {keys}")
    for k, why in result["faults_skipped"].items():
        print(f"  {k}: not done ({why})")
    names = {
        "lost": "0 lost",
        "wrong": "0 wrong",
        "agreement": "agreement packages at their stated top-1 agreement",
        "rss": "RSS within 10 % of minute 10"
        + ("" if result["minutes"] >= 20 else " (not judged: runs under 20 minutes)"),
        "fds": "open fds flat",
        "nonce_store": f"nonce store bounded (<= {result['nonce_bound']} keys, no growth)",
        "faults": "every scheduled fault done",
    }
    for key, title in names.items():
        bad = result["checks"][key]
        print(f"{'FAIL' if bad else 'PASS'}  {title}")
        for line in bad[:5]:
            print(f"      {line}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="length of the load (default 60)")
    p.add_argument("--window", type=float, default=5.0, help="report window, minutes (default 5)")
    p.add_argument("--rate", type=float, default=1.5, help="requests/s per device (default 1.5)")
    p.add_argument(
        "--retry-for",
        type=float,
        default=120.0,
        help="seconds an application retries a request its agent refused (default 120)",
    )
    p.add_argument("--ray", action="store_true", help="the cloud as two Ray Serve replicas")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "out" / "soak")
    p.add_argument("--json", type=Path, default=None, help="the result (default OUT/result.json)")
    p.add_argument("--ray-driver", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ray-port", type=int, default=8000, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ray_driver is not None:
        return ray_driver(args.ray_driver, args.ray_port)
    if args.ray:
        try:
            import ray  # noqa: F401
            from ray import serve  # noqa: F401
        except ImportError:
            print("bench_soak: --ray needs Ray Serve (pip install 'splitinfer[ray]')")
            return 2
    try:
        soak.schedule(args.minutes * 60.0, DEVICES, seed=args.seed)
    except Exception as exc:
        print(f"bench_soak: {exc}")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(args.out / "ledgers")
    models = build(args.out / "build")
    run = Run(args, models)
    started = time.monotonic()
    result = asyncio.run(run.run())
    result["wall_s"] = round(time.monotonic() - started, 1)
    run.write_ledgers()
    print_verdicts(result)
    path = args.json or args.out / "result.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"result: {path}; ledgers: {args.out / 'ledgers'}; logs: {args.out / 'logs'}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
