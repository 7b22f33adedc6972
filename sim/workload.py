"""The workload and what it records: :func:`drive` sends one edge device requests
(Poisson arrivals or a closed loop) for a duration, one :class:`RequestRecord` per
request; :class:`StrategyRun` is one strategy's records and counters.

Both kinds of device drive the same way: an agent's pipeline in process
(:class:`~splitinfer.sim.runner.EdgeDevice`) and an ``edge-agent`` process
(:class:`~splitinfer.sim.agents.ProcessDevice`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class RequestRecord:
    """One request as the application saw it."""

    agent: int
    #: link time (s since the agent's first link started) when it was sent
    start_s: float
    latency_s: float
    #: the cut that served it; "local" for the fallback model
    cut: str = ""
    local: bool = False
    #: "" when answered, else the error's one line
    error: str = ""
    up_bytes: int = 0
    down_bytes: int = 0
    endpoint: str = ""
    epsilon: float | None = None
    timings: Mapping[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.error


class Device(Protocol):
    """What the workload needs of an edge device (in process or an agent process)."""

    index: int

    async def infer(self, inputs: Mapping[str, Array]) -> RequestRecord: ...


async def drive(
    device: Device,
    kind: str,
    rate: float,
    concurrency: int,
    duration_s: float,
    samples: Sequence[Mapping[str, Array]],
    seed: int = 0,
) -> list[RequestRecord]:
    """Send ``device`` requests for ``duration_s``; wait for every answer or error."""
    rng = random.Random(seed)
    records: list[RequestRecord] = []
    count = 0

    async def one() -> None:
        nonlocal count
        sample = samples[count % len(samples)]
        count += 1
        records.append(await device.infer(sample))

    loop = asyncio.get_running_loop()
    end = loop.time() + duration_s
    if kind == "closed":

        async def worker() -> None:
            while loop.time() < end:
                await one()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records
    pending: set[asyncio.Task[None]] = set()
    at = loop.time()
    while True:
        at += rng.expovariate(rate)
        if at >= end:
            break
        await asyncio.sleep(max(at - loop.time(), 0.0))
        task = asyncio.create_task(one())
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.gather(*pending)
    return records


@dataclass
class StrategyRun:
    """What one strategy did."""

    strategy: str
    records: list[RequestRecord]
    duration_s: float
    #: bytes the links carried, up and down (all links of all agents)
    link_up_bytes: int = 0
    link_down_bytes: int = 0
    #: cut switches of adaptive agents, summed
    switches: int = 0
    #: batches and samples the cloud ran during this strategy
    cloud_batches: float = 0.0
    cloud_samples: float = 0.0
    #: the largest privacy budget spent by an agent (its /v1/status); None: no budget
    epsilon_spent: float | None = None
