"""Running a scenario: a cloud service, edge devices behind emulated links, a workload.

* :class:`~splitinfer.sim.cloud.CloudService`: ``cloud-service`` as a subprocess on a
  free loopback port (``--no-auth``), serving every strategy's package as a version;
* edge devices, each behind one :class:`~splitinfer.sim.link.EmulatedLink` per
  cloud endpoint: ``edge-agent`` subprocesses (``edge.mode = "process"``, the
  default; :mod:`~splitinfer.sim.agents`) or, in process, :class:`EdgeDevice`:
  the agent's pipeline (:class:`~splitinfer.edge.pipeline.Pipeline`), its uplink
  over real HTTP (:class:`~splitinfer.edge.transport.HttpTransport`), its
  health-check loop, and its compute on its own thread. Either way the device's
  profile stretches the edge segments (``edge/emulate.py``);
* :func:`~splitinfer.sim.workload.drive`: the workload (Poisson arrivals or a closed
  loop) for a duration, one :class:`~splitinfer.sim.workload.RequestRecord` per
  request: latency, cut, bytes, errors, epsilon;
* :func:`run_strategy` and :func:`run_scenario`: all of it, strategy by strategy,
  each on a fresh link with the same configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from splitinfer.edge.config import AdaptConfig, UplinkConfig
from splitinfer.edge.failover import Uplink
from splitinfer.edge.model import EdgeModel, load_model, sample_inputs
from splitinfer.edge.pipeline import Pipeline
from splitinfer.edge.transport import HttpTransport, Transport, make_session
from splitinfer.shared.auth import HEADER_DEVICE
from splitinfer.shared.errors import SplitInferError
from splitinfer.shared.manifest import load_manifest
from splitinfer.sim.agents import AgentProcess, ProcessDevice, agent_argv, agent_status, started
from splitinfer.sim.cloud import CloudService, batch_sizes
from splitinfer.sim.config import LinkConfig
from splitinfer.sim.device import emulated
from splitinfer.sim.link import EmulatedLink
from splitinfer.sim.scenario import Scenario
from splitinfer.sim.strategies import Strategy, build, device_profile
from splitinfer.sim.workload import Device, RequestRecord, StrategyRun, drive

__all__ = [
    "CloudService",
    "RequestRecord",
    "StrategyRun",
    "batch_sizes",
    "drive",
    "run_scenario",
    "run_strategy",
]

log = logging.getLogger(__name__)
T = TypeVar("T")
Array = np.ndarray[Any, Any]
Progress = Callable[[str], None]
#: seconds between the "N s of M s" lines while a workload runs
TICK_S = 5.0


def _silent(_message: str) -> None:
    return None


# -- one edge device --------------------------------------------------------------------


class EdgeDevice:
    """An edge agent's pipeline in process behind its links; see the module docstring."""

    def __init__(
        self,
        index: int,
        strategy: Strategy,
        scenario: Scenario,
        links: Sequence[EmulatedLink],
        model: EdgeModel,
        device: str | None = None,
    ) -> None:
        self.index = index
        self.strategy = strategy
        self.links = list(links)
        edge = scenario.edge
        self.config = UplinkConfig(
            timeout_s=edge.timeout_s,
            connect_timeout_s=min(edge.timeout_s, 2.0),
            max_attempts=3,
            breaker_failures=2,
            breaker_reset_s=2.0,
            health_interval_s=1.0,
        )
        self.adapt = AdaptConfig(
            enabled=strategy.adaptive,
            min_dwell=edge.min_dwell,
            min_rate_bytes=edge.min_rate_bytes,
            link_half_life_s=edge.link_half_life_s,
        )
        self.model = emulated(model, device)
        self.request_timeout_s = edge.request_timeout_s
        self.headers = {HEADER_DEVICE: f"sim-{index}"}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"edge-{index}")
        self._session: Any = None
        self._probes: asyncio.Task[None] | None = None
        self.pipeline: Pipeline | None = None

    async def _compute(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def start(self) -> Pipeline:
        self._session = make_session(self.config.max_connections, self.config.connect_timeout_s)
        transports: list[Transport] = [
            HttpTransport(f"http://127.0.0.1:{link.port}", self._session, 64 << 20)
            for link in self.links
        ]
        uplink = Uplink(transports, self.config, clock=time.monotonic)
        self.pipeline = Pipeline(
            self.model,
            uplink,
            model_version=self.strategy.version,
            adapt=self.adapt,
            device_id=f"sim-{self.index}",
            request_timeout_s=self.request_timeout_s,
            compute=self._compute,
        )
        await self.pipeline.warm_up()
        self._probes = asyncio.create_task(self._probe_loop())
        return self.pipeline

    async def _probe_loop(self) -> None:
        assert self.pipeline is not None
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.pipeline.probe()
            except Exception:  # a probe must never stop the loop
                log.exception("health check failed")

    def now(self) -> float:
        return self.links[0].now()

    async def infer(self, inputs: Mapping[str, Array]) -> RequestRecord:
        assert self.pipeline is not None
        start = self.now()
        t = time.monotonic()
        try:
            r = await self.pipeline.infer(inputs, headers=self.headers)
        except SplitInferError as exc:
            line = " ".join(str(exc).split())
            return RequestRecord(self.index, start, time.monotonic() - t, error=line)
        return RequestRecord(
            self.index,
            start,
            time.monotonic() - t,
            cut=r.cut_id,
            local=r.local,
            up_bytes=r.up_bytes,
            down_bytes=r.down_bytes,
            endpoint=r.endpoint,
            epsilon=r.epsilon_spent,
            timings=dict(r.timings),
        )

    async def stop(self) -> None:
        if self._probes is not None:
            self._probes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probes
        if self._session is not None:
            await self._session.close()
        self._executor.shutdown(wait=False, cancel_futures=True)


# -- one strategy, one scenario ---------------------------------------------------------


@contextlib.asynccontextmanager
async def _links(
    configs: Sequence[LinkConfig], target: tuple[str, int], agents: int, shared: bool
) -> AsyncIterator[list[list[EmulatedLink]]]:
    """Per agent, one started link per endpoint (the same ones for every agent if shared)."""
    made: list[EmulatedLink] = []
    try:
        rows: list[list[EmulatedLink]] = []
        for i in range(agents):
            if shared and rows:
                rows.append(rows[0])
                continue
            row = []
            for cfg in configs:
                cfg_i = cfg if shared else dataclasses.replace(cfg, seed=cfg.seed + i)
                link = EmulatedLink(cfg_i, target)
                made.append(link)
                row.append(link)
            rows.append(row)
        for link in made:
            await link.start()
        yield rows
    finally:
        for link in made:
            await link.close()


def _target(url: str) -> tuple[str, int]:
    host, _, port = url.rpartition("://")[2].rpartition(":")
    return host, int(port)


async def run_strategy(
    scenario: Scenario,
    strategy: Strategy,
    cloud: CloudService,
    *,
    samples: Sequence[Mapping[str, Array]] | None = None,
    profile: Path | str | None = None,
    logs: Path | None = None,
    progress: Progress = _silent,
) -> StrategyRun:
    """One strategy: its agents behind fresh links, the workload, the counters.
    ``profile``: the device (see :func:`~splitinfer.sim.strategies.device_profile`);
    ``logs``: the folder of the agent processes' logs (default: beside the package);
    ``progress``: a line now and then while the workload runs."""
    edge = scenario.edge
    work = scenario.workload
    profile = None if profile is None else str(profile)
    if samples is None:
        manifest = load_manifest(strategy.package)
        samples = [sample_inputs(manifest, work.batch, seed=s) for s in range(8)]
    configs = [scenario.link] + ([scenario.backup_link] if scenario.backup_link else [])
    before = batch_sizes(await cloud.get("/metrics"))
    async with _links(configs, _target(cloud.url), edge.agents, edge.shared_link) as rows:
        if edge.mode == "process":
            log_dir = logs or strategy.package.parent.parent.parent / "agent-logs"
            run = await _run_processes(
                scenario, strategy, rows, samples, profile, log_dir, progress
            )
        else:
            run = await _run_inprocess(scenario, strategy, rows, samples, profile, progress)
        links = {id(link): link for row in rows for link in row}.values()
        run.link_up_bytes = sum(link.uplink_stats.delivered_bytes for link in links)
        run.link_down_bytes = sum(link.downlink_stats.delivered_bytes for link in links)
    after = batch_sizes(await cloud.get("/metrics"))
    run.cloud_batches = after["count"] - before["count"]
    run.cloud_samples = after["sum"] - before["sum"]
    return run


async def _ticker(progress: Progress, name: str, total_s: float, t0: float) -> None:
    """``name: 5 s of 20 s`` every :data:`TICK_S` until cancelled."""
    while True:
        await asyncio.sleep(TICK_S)
        done = time.monotonic() - t0
        if done < total_s:
            progress(f"  {name}: {done:.0f} s of {total_s:g} s")
        else:
            progress(f"  {name}: {done:.0f} s, waiting for the last answers")


async def _drive_all(
    scenario: Scenario,
    devices: Sequence[Device],
    samples: Sequence[Mapping[str, Array]],
    progress: Progress = _silent,
    name: str = "",
) -> tuple[list[RequestRecord], float]:
    work = scenario.workload
    t0 = time.monotonic()
    ticker = asyncio.create_task(_ticker(progress, name, work.duration_s, t0))
    try:
        per_agent = await _gather_drives(scenario, devices, samples)
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
    return [r for rs in per_agent for r in rs], time.monotonic() - t0


async def _gather_drives(
    scenario: Scenario, devices: Sequence[Device], samples: Sequence[Mapping[str, Array]]
) -> list[list[RequestRecord]]:
    work = scenario.workload
    return await asyncio.gather(
        *(
            drive(
                d,
                work.kind,
                work.rate,
                work.concurrency,
                work.duration_s,
                samples,
                seed=scenario.seed + d.index,
            )
            for d in devices
        )
    )


async def _run_inprocess(
    scenario: Scenario,
    strategy: Strategy,
    rows: Sequence[Sequence[EmulatedLink]],
    samples: Sequence[Mapping[str, Array]],
    profile: str | None,
    progress: Progress = _silent,
) -> StrategyRun:
    edge = scenario.edge
    models = [load_model(strategy.package) for _ in range(edge.agents)]
    devices = [
        EdgeDevice(i, strategy, scenario, rows[i], models[i], profile) for i in range(edge.agents)
    ]
    try:
        await asyncio.gather(*(d.start() for d in devices))
        progress(f"  {strategy.name}: {edge.agents} device(s) warm, workload started")
        records, elapsed = await _drive_all(scenario, devices, samples, progress, strategy.name)
    finally:
        for d in devices:
            await d.stop()
    switches = sum(d.pipeline.chooser.switches for d in devices if d.pipeline is not None)
    return StrategyRun(strategy.name, records, elapsed, switches=switches)


async def _run_processes(
    scenario: Scenario,
    strategy: Strategy,
    rows: Sequence[Sequence[EmulatedLink]],
    samples: Sequence[Mapping[str, Array]],
    profile: str | None,
    log_dir: Path,
    progress: Progress = _silent,
) -> StrategyRun:
    import aiohttp

    edge = scenario.edge
    model = f"{strategy.package.parent.name}:{strategy.version}"
    agents = [
        AgentProcess(
            agent_argv(
                i,
                strategy.package,
                model,
                scenario,
                rows[i],
                adaptive=strategy.adaptive,
                device=profile,
            ),
            log_dir / f"{strategy.version}-agent{i}.log",
        )
        for i in range(edge.agents)
    ]
    connector = aiohttp.TCPConnector(limit=0)
    async with started(agents) as urls, aiohttp.ClientSession(connector=connector) as session:
        devices = [
            ProcessDevice(i, url, rows[i], session, edge.request_timeout_s)
            for i, url in enumerate(urls)
        ]
        progress(f"  {strategy.name}: {edge.agents} edge-agent(s) listening, workload started")
        records, elapsed = await _drive_all(scenario, devices, samples, progress, strategy.name)
        states = await asyncio.gather(*(agent_status(session, u) for u in urls))
    spent = [s["privacy_epsilon_spent"] for s in states if "privacy_epsilon_spent" in s]
    return StrategyRun(
        strategy.name,
        records,
        elapsed,
        switches=sum(int(s.get("switches", 0)) for s in states),
        epsilon_spent=max(spent) if spent else None,
    )


async def run_scenario(
    scenario: Scenario, out_dir: Path, progress: Progress = _silent
) -> list[StrategyRun]:
    """Build every strategy's package, start the cloud, run the strategies one by one;
    ``progress`` hears what it is doing and how far along (``netsim`` prints it on
    stderr unless ``-q``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    repo = out_dir / "repository"
    t0 = time.monotonic()
    if scenario.edge.device is None and scenario.edge.slowdown > 1:
        progress(f"profiling the model for a device {scenario.edge.slowdown:g}x slower")
    profile = device_profile(scenario, out_dir / "work")
    progress(f"building the packages of {len(scenario.strategies)} strategy entries")
    strategies = build(scenario, repo, out_dir / "work", profile, progress=progress)
    progress(
        f"{len(strategies)} package(s) built ({time.monotonic() - t0:.0f} s); "
        "starting the cloud service"
    )
    models = sorted({s.package.parent.name for s in strategies})
    runs: list[StrategyRun] = []
    async with CloudService(repo, models, scenario.cloud, out_dir / "cloud-service.log") as cloud:
        for i, strategy in enumerate(strategies, 1):
            log.info("running %s", strategy.name)
            t1 = time.monotonic()
            progress(
                f"strategy {i}/{len(strategies)}: {strategy.name} "
                f"({scenario.workload.duration_s:g} s of {scenario.workload.kind} workload)"
            )
            run = await run_strategy(
                scenario,
                strategy,
                cloud,
                profile=profile,
                logs=out_dir / "agent-logs",
                progress=progress,
            )
            runs.append(run)
            ok = [r.latency_s for r in run.records if r.ok]
            p50 = f", p50 {np.percentile(ok, 50) * 1e3:.1f} ms" if ok else ""
            progress(
                f"  {strategy.name}: {len(ok)}/{len(run.records)} answered{p50} "
                f"({time.monotonic() - t1:.0f} s)"
            )
    return runs
