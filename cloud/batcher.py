"""Dynamic batching for one model: pure logic with an injected clock.

The engine calls :meth:`Batcher.submit` for each request, :meth:`Batcher.schedule`
whenever something changed (a submit, a batch finished, a timer fired) and
:meth:`Batcher.complete` when a batch finishes. ``schedule(now)`` answers with
the batches to run now, the requests whose deadline can no longer be met, and
when to call again (``wake_at``). Nothing here sleeps, reads a clock or runs a
model, so the tests drive it with plain numbers.

Queues. One per :class:`QueueKey`: loaded version, cut and per-sample shape
(after any padding to a bucket); only requests of one queue batch together.

When a queue is dispatched (the rule, precisely):

1. ``max_concurrent_batches`` batches of this model already run: nothing
   starts; the next :meth:`complete` is the next chance.
2. No batch of this model is running (the model is idle): every ready queue
   starts now with whatever it holds. Waiting could only help if a request
   arrived during the wait, and an idle model would spend that wait doing
   nothing; requests that arrive while this batch runs form the next one.
   This is what keeps batch size from sticking at 1 without needless waits:
   under load, batches grow to the number of requests that arrive during one
   batch's compute.
3. Otherwise (a batch runs and there is a free slot) a queue starts when it
   holds a full batch, when its oldest request has waited the queue delay
   (``max_queue_delay_ms``, or the adaptive delay), or when its most urgent
   deadline would be missed by waiting longer.

Within a queue, requests are taken by priority (higher first), then deadline,
then arrival. Among ready queues the one whose head request ranks first goes
first.

Deadlines. A request whose deadline cannot be met is refused at :meth:`submit`
(estimated wait for the batches ahead of it plus its own batch's compute) and,
later, as soon as ``now + compute(alone) > deadline`` while it still waits
(``Decision.expired``). Compute times come from a :class:`LatencyModel` per
version and cut, learned from finished batches (and seeded by warm-up); before
anything is learned only deadlines already past are refused.

Adaptive delay (optional): with ``t(b) = a + c*b`` learned, waiting for one
more request is worth at most the per-batch cost ``a`` it saves, so the delay
is ``min(max_queue_delay, a)`` when the expected gap to the next arrival is
below ``a``, else 0 (BentoML's adaptive batching learns the same line). AIMD
(optional): the batch size limit grows by 1 after each batch that computed
within ``aimd_target_ms`` and shrinks to 90% after one that did not (Clipper).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from splitinfer.cloud.config import BatchingConfig
from splitinfer.cloud.estimate import ArrivalRate, LatencyModel
from splitinfer.cloud.overload import DeadlineUnmeetable, QueueFull

P = TypeVar("P")

Shape = tuple[tuple[int, ...], ...]
_EPS = 1e-6  # wake just after a request's last feasible start, when it expires


@dataclass(frozen=True)
class QueueKey:
    """What must be equal for requests to share a batch."""

    uid: int  # the loaded version (a reloaded version gets a new uid)
    cut_id: str
    shape: Shape = ()  # per-tensor shape without the batch dimension
    solo: bool = False  # a model without a batch dimension: one request per run


@dataclass(eq=False)
class Item(Generic[P]):
    """One queued request: ``rows`` samples along the batch dimension."""

    key: QueueKey
    rows: int
    payload: P
    priority: int = 5
    deadline: float = math.inf  # monotonic seconds
    arrival: float = 0.0
    seq: int = 0

    def rank(self) -> tuple[int, float, int]:
        return (-self.priority, self.deadline, self.seq)


@dataclass(frozen=True, eq=False)
class Batch(Generic[P]):
    key: QueueKey
    items: tuple[Item[P], ...]
    started: float
    reason: str  # idle, full, delay, deadline, unbatched

    @property
    def rows(self) -> int:
        return sum(i.rows for i in self.items)


@dataclass(frozen=True)
class Decision(Generic[P]):
    batches: tuple[Batch[P], ...] = ()
    expired: tuple[Item[P], ...] = ()
    wake_at: float | None = None


@dataclass
class _Queue(Generic[P]):
    items: list[Item[P]] = field(default_factory=list)
    rows: int = 0

    def oldest(self) -> float:
        return self.items[0].arrival  # items stay in arrival order

    def deadline(self) -> float:
        return min(i.deadline for i in self.items)

    def head(self) -> Item[P]:
        return min(self.items, key=Item.rank)


class Batcher(Generic[P]):
    """The queues and batching decisions of one model."""

    def __init__(self, config: BatchingConfig) -> None:
        self.config = config
        self._queues: dict[QueueKey, _Queue[P]] = {}
        self._running: list[Batch[P]] = []
        self._latency: dict[tuple[int, str], LatencyModel] = {}
        self._arrivals = ArrivalRate()
        self._seq = itertools.count()
        self._rows = 0
        self._rows_by_priority: dict[int, int] = {}
        self._deadlined = 0  # queued items with a finite deadline
        self.max_rows = config.max_batch_size  # AIMD moves this within [1, max_batch_size]

    # -- state ---------------------------------------------------------------

    @property
    def queued_rows(self) -> int:
        return self._rows

    @property
    def queued(self) -> int:
        return sum(len(q.items) for q in self._queues.values())

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def load(self) -> float:
        """Queue pressure, 0 (empty) to 1 (full)."""
        return min(1.0, self._rows / self.config.max_queue_size)

    def queue_keys(self) -> list[QueueKey]:
        return list(self._queues)

    def latency(self, key: QueueKey) -> LatencyModel:
        return self._latency.setdefault((key.uid, key.cut_id), LatencyModel())

    def adopt(self, uid: int, cut_id: str, model: LatencyModel) -> None:
        """Use ``model`` (e.g. seeded by warm-up) for version ``uid``, cut ``cut_id``."""
        self._latency.setdefault((uid, cut_id), model)

    def forget(self, uid: int) -> None:
        """Drop the latency models of a retired version."""
        for k in [k for k in self._latency if k[0] == uid]:
            del self._latency[k]

    def delay(self, key: QueueKey) -> float:
        """Seconds a queue may wait for more requests while another batch runs."""
        base = self.config.max_queue_delay_ms / 1000.0
        if not self.config.adaptive_delay:
            return base
        per_batch, _ = self.latency(key).coefficients()
        return min(base, per_batch) if self._arrivals.gap <= per_batch else 0.0

    # -- requests in -----------------------------------------------------------

    def submit(self, item: Item[P], now: float) -> None:
        """Queue ``item`` or refuse it (:class:`QueueFull`, :class:`DeadlineUnmeetable`)."""
        cap = self.config.max_queue_size
        if self._rows + item.rows > cap:
            raise QueueFull(
                f"queue full: {self._rows} samples queued for this model (max_queue_size={cap})",
                retry_after=self._drain_time(now),
            )
        if item.deadline <= now:
            raise DeadlineUnmeetable("deadline already passed when the request arrived", 1.0)
        finish = self.finish_estimate(item, now) if math.isfinite(item.deadline) else now
        if finish > item.deadline:
            raise DeadlineUnmeetable(
                f"deadline cannot be met: expected to finish {1000 * (finish - now):.1f} ms "
                f"from now, the deadline is in {1000 * (item.deadline - now):.1f} ms",
                retry_after=max(0.0, finish - item.deadline),
            )
        item.arrival = now
        item.seq = next(self._seq)
        queue = self._queues.get(item.key)
        if queue is None:
            queue = self._queues[item.key] = _Queue()
        queue.items.append(item)
        queue.rows += item.rows
        self._rows += item.rows
        self._rows_by_priority[item.priority] = (
            self._rows_by_priority.get(item.priority, 0) + item.rows
        )
        self._deadlined += math.isfinite(item.deadline)
        self._arrivals.observe(now)

    def finish_estimate(self, item: Item[P], now: float) -> float:
        """When ``item`` would finish if queued now: the batches ahead, then its own."""
        lat = self.latency(item.key)
        if not lat.known:
            return now
        cap = max(1, self.max_rows if self.config.enabled else 1)
        slots = self.config.max_concurrent_batches
        wait = 0.0
        if len(self._running) >= slots:
            wait = min(
                max(0.0, b.started + self.latency(b.key).estimate(b.rows) - now)
                for b in self._running
            )
        ahead = sum(n for p, n in self._rows_by_priority.items() if p >= item.priority)
        full, rest = divmod(ahead, cap)
        wait += full * lat.estimate(cap) / slots
        return now + wait + lat.estimate(min(cap, rest + item.rows))

    def cancel(self, item: Item[P]) -> bool:
        """Remove a still-queued ``item`` (its caller went away); False if not queued."""
        queue = self._queues.get(item.key)
        if queue is None or item not in queue.items:
            return False
        self._remove(queue, [item])
        return True

    def drain(self) -> list[Item[P]]:
        """Remove and return everything queued (shutdown after the drain timeout)."""
        items = [i for q in self._queues.values() for i in q.items]
        self._queues.clear()
        self._rows_by_priority.clear()
        self._rows = self._deadlined = 0
        return items

    # -- decisions -------------------------------------------------------------

    def schedule(self, now: float) -> Decision[P]:
        """The batches to start now, the requests to refuse, and when to ask again."""
        expired = self._expire(now) if self._deadlined else []
        batches: list[Batch[P]] = []
        while len(self._running) < self.config.max_concurrent_batches:
            best: tuple[tuple[int, float, int], QueueKey, str] | None = None
            for key, queue in self._queues.items():
                reason = self._ready(key, queue, now)
                if reason is not None:
                    rank = queue.head().rank()
                    if best is None or rank < best[0]:
                        best = (rank, key, reason)
            if best is None:
                break
            batch = self._take(best[1], now, best[2])
            self._running.append(batch)
            batches.append(batch)
        return Decision(tuple(batches), tuple(expired), self._wake_at(now))

    def complete(self, batch: Batch[P], now: float, seconds: float, ok: bool = True) -> None:
        """A batch finished (``ok``) or failed after ``seconds`` of compute."""
        self._running.remove(batch)
        if not ok:
            return
        self.latency(batch.key).observe(batch.rows, seconds)
        if self.config.aimd:
            top = self.config.max_batch_size
            if seconds * 1000.0 > self.config.aimd_target_ms:
                self.max_rows = max(1, min(self.max_rows - 1, int(self.max_rows * 0.9)))
            else:
                self.max_rows = min(top, self.max_rows + 1)

    # -- internals ---------------------------------------------------------------

    def _ready(self, key: QueueKey, queue: _Queue[P], now: float) -> str | None:
        if not queue.items:
            return None
        if not self.config.enabled or key.solo:
            return "unbatched"
        if not self._running:
            return "idle"
        if queue.rows >= self.max_rows:
            return "full"
        if now >= queue.oldest() + self.delay(key):
            return "delay"
        if now >= self._urgent_at(key, queue):
            return "deadline"
        return None

    def _urgent_at(self, key: QueueKey, queue: _Queue[P]) -> float:
        """The last moment the queue can start and still meet its tightest deadline."""
        deadline = queue.deadline()
        if math.isinf(deadline):
            return math.inf
        return deadline - self.latency(key).estimate(min(queue.rows, self.max_rows))

    def _take(self, key: QueueKey, now: float, reason: str) -> Batch[P]:
        queue = self._queues[key]
        ordered = sorted(queue.items, key=Item.rank)
        taken = [ordered[0]]
        if self.config.enabled and not key.solo:
            rows = ordered[0].rows
            for item in ordered[1:]:
                if rows + item.rows > self.max_rows:
                    break
                taken.append(item)
                rows += item.rows
        self._remove(queue, taken)
        return Batch(key, tuple(taken), now, reason)

    def _remove(self, queue: _Queue[P], items: Iterable[Item[P]]) -> None:
        gone = set(map(id, items))
        kept = [i for i in queue.items if id(i) not in gone]
        for item in queue.items:
            if id(item) in gone:
                queue.rows -= item.rows
                self._rows -= item.rows
                self._rows_by_priority[item.priority] -= item.rows
                self._deadlined -= math.isfinite(item.deadline)
        queue.items = kept
        if not kept:
            self._queues = {k: q for k, q in self._queues.items() if q.items}

    def _expire(self, now: float) -> list[Item[P]]:
        expired: list[Item[P]] = []
        for key, queue in list(self._queues.items()):
            lat = self.latency(key)
            late = [i for i in queue.items if now + lat.estimate(i.rows) > i.deadline]
            if late:
                self._remove(queue, late)
                expired += late
        return expired

    def _wake_at(self, now: float) -> float | None:
        times: list[float] = []
        free = len(self._running) < self.config.max_concurrent_batches
        for key, queue in self._queues.items():
            lat = self.latency(key)
            if self._deadlined:
                times += (i.deadline - lat.estimate(i.rows) + _EPS for i in queue.items)
            if free and self.config.enabled and not key.solo:
                times += (queue.oldest() + self.delay(key), self._urgent_at(key, queue))
        finite = [max(t, now) for t in times if math.isfinite(t)]
        return min(finite) if finite else None

    def _drain_time(self, now: float) -> float:
        lat = next(iter(self._latency.values()), None)
        if lat is None or not lat.known:
            return 1.0
        batches = math.ceil(self._rows / max(1, self.max_rows))
        return batches * lat.estimate(self.max_rows) / self.config.max_concurrent_batches
