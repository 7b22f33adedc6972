"""Edge agents as processes: ``edge-agent`` daemons behind emulated links.

:class:`AgentProcess` starts one ``edge-agent`` (``sys.executable -m
splitinfer.edge.cli``) with ``--cloud`` pointing at its own links, ``--listen
127.0.0.1:0`` (it prints ``edge-agent: listening on http://HOST:PORT`` on stderr
once warm) and the emulated device (``--emulate-device PROFILE``);
:class:`ProcessDevice` is the scenario's view of it: the application's requests go
to its local API (``POST /v1/infer``), and the answer's headers say the cut, where
it was computed, the stage timings and the endpoint. :func:`started` starts many
in parallel and stops every one of them on the way out, errors and Ctrl-C
included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.shared.contract import (
    HEADER_CUT,
    HEADER_DOWN_BYTES,
    HEADER_LOCAL,
    HEADER_TIMINGS,
    HEADER_UP_BYTES,
    NPZ_TYPE,
)
from splitinfer.sim.daemon import Daemon, command
from splitinfer.sim.link import EmulatedLink
from splitinfer.sim.scenario import Scenario
from splitinfer.sim.workload import RequestRecord

Array = np.ndarray[Any, Any]

#: Seconds an agent may take to load its package, warm up and listen.
AGENT_START_S = 60.0
#: Seconds a stopping agent gets before it is killed.
AGENT_STOP_S = 10.0
_ENTRY = re.compile(
    r'(?P<name>[A-Za-z0-9_-]+)(?:;dur=(?P<dur>[0-9.]+))?(?:;desc="(?P<desc>[^"]*)")?'
)


def agent_argv(
    index: int,
    package: Path,
    model: str,
    scenario: Scenario,
    links: Sequence[EmulatedLink],
    *,
    adaptive: bool,
    device: str | None,
) -> list[str]:
    """The ``edge-agent`` command line of agent ``index`` (its links' URLs as ``--cloud``)."""
    edge = scenario.edge
    argv = [
        *command("edge-agent"),
        "--package",
        str(package),
        "--cloud",
        ",".join(f"http://127.0.0.1:{link.port}" for link in links),
        "--listen",
        "127.0.0.1:0",
        "--model",
        model,
        "--device-id",
        f"sim-{index}",
        "--log-level",
        "info",
        "--providers",
        "cpu",
        "--no-verify",
        "--uplink-timeout",
        f"{edge.timeout_s:g}s",
        "--uplink-connect-timeout",
        f"{min(edge.timeout_s, 2.0):g}s",
        "--uplink-max-attempts",
        "3",
        "--uplink-breaker-failures",
        "2",
        "--uplink-breaker-reset",
        "2s",
        "--uplink-health-interval",
        "1s",
        "--adapt-enabled" if adaptive else "--no-adapt-enabled",
        "--adapt-min-dwell",
        str(edge.min_dwell),
        "--adapt-min-rate-sample",
        str(edge.min_rate_bytes),
        "--adapt-link-half-life",
        f"{edge.link_half_life_s:g}s",
        "--queue-request-timeout",
        f"{edge.request_timeout_s:g}s",
        # the workload, not the agent's admission, is what a scenario measures
        "--queue-max-queue",
        "100000",
    ]
    if device is not None:
        argv += ["--emulate-device", device]
    return argv


class AgentProcess:
    """One ``edge-agent`` subprocess (:class:`~splitinfer.sim.daemon.Daemon`); ``url``
    once started. What it writes goes to ``log_path``."""

    def __init__(self, argv: Sequence[str], log_path: Path) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        self.url = ""
        self._daemon: Daemon | None = None

    @property
    def pid(self) -> int | None:
        return self._daemon.pid if self._daemon is not None else None

    async def start(self, timeout_s: float = AGENT_START_S) -> str:
        self._daemon = Daemon(self.argv, log=self.log_path, timeout_s=timeout_s)
        try:
            self.url = await self._daemon.wait_async()
        except BaseException:
            self._daemon = None
            raise
        return self.url

    async def stop(self) -> None:
        if self._daemon is not None:
            await self._daemon.stop_async(AGENT_STOP_S)
            self._daemon = None


@contextlib.asynccontextmanager
async def started(agents: Sequence[AgentProcess]) -> AsyncIterator[list[str]]:
    """Start every agent at once; their URLs. Every one is stopped on the way out,
    and all of them when any fails to start."""
    try:
        results = await asyncio.gather(*(a.start() for a in agents), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        yield [str(r) for r in results]
    finally:
        await asyncio.shield(asyncio.gather(*(a.stop() for a in agents)))


def parse_timings(header: str) -> tuple[dict[str, float], dict[str, str]]:
    """``X-Splitinfer-Timings`` (Server-Timing syntax): stage seconds, and the descriptions
    (cut, local, endpoint, ...)."""
    stages: dict[str, float] = {}
    desc: dict[str, str] = {}
    for part in header.split(","):
        m = _ENTRY.match(part.strip())
        if m is None:
            continue
        if m["desc"] is not None:
            desc[m["name"]] = m["desc"]
        elif m["dur"] is not None and m["name"] != "total":
            stages[m["name"]] = float(m["dur"]) / 1e3
    return stages, desc


def npz_body(inputs: Mapping[str, Array]) -> bytes:
    from splitinfer.edge.payload import npz_bytes

    return npz_bytes(inputs)


async def agent_status(session: Any, url: str) -> dict[str, Any]:
    """The agent's ``GET /v1/status`` document."""
    async with session.get(url + "/v1/status") as resp:
        doc: dict[str, Any] = json.loads(await resp.read())
        return doc


class ProcessDevice:
    """The application's side of one agent process: requests to its local API."""

    def __init__(
        self,
        index: int,
        url: str,
        links: Sequence[EmulatedLink],
        session: Any,
        request_timeout_s: float,
    ) -> None:
        self.index = index
        self.url = url
        self.links = list(links)
        self.session = session
        self.timeout_s = request_timeout_s + 5.0

    def now(self) -> float:
        return self.links[0].now()

    async def infer(self, inputs: Mapping[str, Array]) -> RequestRecord:
        import aiohttp

        body = npz_body(inputs)
        headers = {
            "Content-Type": NPZ_TYPE,
            "Accept": NPZ_TYPE,
            HEADER_TIMINGS: "1",
        }
        start = self.now()
        t = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self.session.post(
                self.url + "/v1/infer", data=body, headers=headers, timeout=timeout
            ) as resp:
                payload = await resp.read()
                elapsed = time.monotonic() - t
                if resp.status != 200:
                    return RequestRecord(self.index, start, elapsed, error=_error_line(payload))
                answer = resp.headers
        except (aiohttp.ClientError, TimeoutError) as exc:
            line = " ".join(str(exc).split()) or type(exc).__name__
            return RequestRecord(self.index, start, time.monotonic() - t, error=line)
        stages, desc = parse_timings(answer.get(HEADER_TIMINGS, ""))
        return RequestRecord(
            self.index,
            start,
            elapsed,
            cut=answer.get(HEADER_CUT, desc.get("cut", "")),
            local=answer.get(HEADER_LOCAL) == "1",
            up_bytes=_int(answer.get(HEADER_UP_BYTES)),
            down_bytes=_int(answer.get(HEADER_DOWN_BYTES)),
            endpoint=desc.get("endpoint", ""),
            timings=stages,
        )


def _int(text: str | None) -> int:
    return int(text) if text is not None and text.isdigit() else 0


def _error_line(payload: bytes) -> str:
    try:
        doc = json.loads(payload)
        text = f"{doc['status']}: {doc['error']}"
    except (ValueError, KeyError, TypeError):
        text = payload[:200].decode(errors="replace")
    return " ".join(text.split()) or "empty error answer"
