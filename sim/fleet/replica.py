"""One cloud replica on virtual time: the real :class:`~splitinfer.cloud.batcher.Batcher`
and the real overload control, driven as :class:`~splitinfer.cloud.engine.Engine` drives
them, with each batch's compute taken from a latency table instead of a runtime.

The engine submits every request (``Batcher.submit``, which refuses with
:class:`~splitinfer.cloud.overload.QueueFull` or
:class:`~splitinfer.cloud.overload.DeadlineUnmeetable`), asks ``Batcher.schedule(now)``
after each submit, each finished batch and each ``wake_at`` timer, launches the batches
it answers, refuses the expired, and calls ``Batcher.complete`` when a batch ends; a
per-device :class:`~splitinfer.cloud.overload.RateLimiter` comes first when
``device_rate`` is set. :class:`Replica` does the same on the simulation's clock.

The cheapest faithful way to drive it (measured by ``bench/bench_fleet.py``): the
engine's ``schedule`` after a submit can only start a batch when the model is idle (a
free slot and nothing running) or a queue just became full, and it only moves the timer
when no timer is pending; with no deadlines and no adaptive delay nothing else changes
its answer (every queue shares one delay, so a new queue's ``oldest + delay`` is never
before the pending timer). So the replica asks after a submit only then, and after every
batch and timer as the engine does; with deadlines or the adaptive delay it asks after
every submit (``exact=True`` forces that too; the tests check both give the same
batches). One :class:`~splitinfer.cloud.batcher.Item` per request, payload its index.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from splitinfer.cloud.batcher import Batch, Batcher, Item, QueueKey
from splitinfer.cloud.config import BatchingConfig, OverloadConfig
from splitinfer.cloud.estimate import LatencyModel
from splitinfer.cloud.overload import RateLimited, RateLimiter, Rejected
from splitinfer.shared.errors import SplitInferError

_INF = math.inf
#: events at one instant before the replica decides the batcher is stuck
_SPIN = 10_000


@dataclass
class Finished:
    """What a replica finished during one :meth:`Replica.advance`: per batch, and per
    request in batch order (request index and the time it was submitted)."""

    started: list[float] = field(default_factory=list)
    ended: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    cut: list[int] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    #: refused requests: index, time, and why ("queue full", "deadline", "rate")
    refused: list[int] = field(default_factory=list)
    refused_at: list[float] = field(default_factory=list)
    refused_why: list[str] = field(default_factory=list)


class Replica:
    """One replica: a batcher, its running batches and its timer, on virtual time."""

    def __init__(
        self,
        batching: BatchingConfig,
        overload: OverloadConfig,
        cut_ids: Sequence[str],
        latency: Mapping[str, list[float]],
        *,
        jitter: float = 0.0,
        seed: int = 0,
        exact: bool = False,
        devices: Sequence[str] = (),
    ) -> None:
        self.batcher: Batcher[int] = Batcher(batching)
        self.config = batching
        self.keys = [QueueKey(0, c) for c in cut_ids]
        self.cut_index = {c: i for i, c in enumerate(cut_ids)}
        self.table = {c: latency[c] for c in cut_ids if c in latency}
        for cut, seconds in self.table.items():  # the engine's warm-up seeds the model
            model = LatencyModel()
            for rows in sorted({1, min(8, len(seconds) - 1), len(seconds) - 1}):
                model.observe(rows, seconds[rows])
            self.batcher.adopt(0, cut, model)
        self.limiter = (
            RateLimiter(overload.device_rate, overload.burst, overload.max_devices)
            if overload.device_rate > 0
            else None
        )
        self.devices = devices
        self.exact = exact or batching.adaptive_delay
        self.jitter = jitter
        self._rng = random.Random(seed)
        self.running: list[tuple[float, float, Batch[int]]] = []  # (end, seconds, batch)
        self.wake: float | None = None
        self.next_end = _INF  # the earliest end among the running batches
        self.busy_s = 0.0
        self.batches = 0

    # -- the engine's moves ------------------------------------------------------------------
    def _launch(self, now: float, batches: Sequence[Batch[int]]) -> None:
        for batch in batches:
            seconds = self.table[batch.key.cut_id][batch.rows]
            if self.jitter:
                seconds *= self._rng.lognormvariate(0.0, self.jitter)
            self.running.append((now + seconds, seconds, batch))
            self.next_end = min(self.next_end, now + seconds)
            self.busy_s += seconds
            self.batches += 1

    def _pump(self, now: float, out: Finished) -> None:
        decision = self.batcher.schedule(now)
        for item in decision.expired:
            out.refused.append(item.payload)
            out.refused_at.append(now)
            out.refused_why.append("deadline")
        if decision.batches:
            self._launch(now, decision.batches)
        self.wake = decision.wake_at

    def _complete(self, now: float, out: Finished) -> None:
        k = min(range(len(self.running)), key=lambda i: self.running[i][0])
        end, seconds, batch = self.running.pop(k)
        self.next_end = min((r[0] for r in self.running), default=_INF)
        self.batcher.complete(batch, end, seconds)
        self._pump(end, out)  # the next batch starts before this one's callers hear
        out.started.append(batch.started)
        out.ended.append(end)
        out.rows.append(batch.rows)
        out.cut.append(self.cut_index[batch.key.cut_id])
        out.load.append(self.batcher.load)
        out.ids.extend([item.payload for item in batch.items])

    def advance(
        self,
        times: Sequence[float],
        ids: Sequence[int],
        cuts: Sequence[int],
        deadlines: Sequence[float] | None,
        devices: Sequence[int] | None,
        horizon: float,
    ) -> Finished:
        """Take the arrivals (sorted by time, all before ``horizon``) and every batch
        and timer before ``horizon``; return what finished and what was refused."""
        out = Finished()
        batcher = self.batcher
        submit = batcher.submit
        keys = self.keys
        slots = self.config.max_concurrent_batches
        limiter = self.limiter
        exact = self.exact or deadlines is not None
        n = len(times)
        i = 0
        last, spin = -_INF, 0
        while True:
            ta = times[i] if i < n else _INF
            tf = self.next_end
            tw = self.wake if self.wake is not None else _INF
            t = min(ta, tf, tw)
            if t >= horizon:
                return out
            spin = spin + 1 if t == last else 0
            if spin > _SPIN:
                raise SplitInferError(f"replica stuck at t={t:.6f} s: the batcher never advances")
            last = t
            if tf <= t:
                self._complete(tf, out)
                continue
            if tw <= t:
                self.wake = None
                self._pump(tw, out)
                continue
            req = ids[i]
            item = Item(keys[cuts[i]], 1, req)
            if deadlines is not None:
                item.deadline = deadlines[i]
            i += 1
            try:
                if limiter is not None and devices is not None:
                    limiter.check(self.devices[devices[i - 1]], ta)
                submit(item, ta)
            except (Rejected, RateLimited) as exc:
                out.refused.append(req)
                out.refused_at.append(ta)
                out.refused_why.append(type(exc).__name__)
                continue
            running = len(self.running)
            if exact or (
                running < slots
                and (not running or self.wake is None or batcher.queued_rows >= batcher.max_rows)
            ):
                self._pump(ta, out)

    @property
    def idle(self) -> bool:
        return not self.running and not self.batcher.queued
