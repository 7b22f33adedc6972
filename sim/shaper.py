"""One direction of an emulated link as pure logic: bytes offered at ``now`` -> when
they are delivered. No sockets, no sleeps; the caller passes the clock.

The model (see docs/netsim.md):

* **Bottleneck.** A FIFO server with a capacity schedule. A fixed rate serves
  ``rate/8`` bytes per second (fluid). A Mahimahi trace gives one 1500-byte delivery
  opportunity per line; a segment may use the rest of an opportunity that an earlier
  segment started, but capacity nobody was queued for is lost, as in Mahimahi's
  ``LinkQueue``. The trace repeats with period = its last timestamp. Unlimited: no
  rate limit. A segment leaves the bottleneck when its last byte is served.
* **Outages** remove all capacity inside ``[start, start + duration)``: nothing leaves,
  bytes queue and go once it ends (the queue bound still applies).
* **Propagation**: each segment then takes ``delay + uniform(-jitter, +jitter)``
  (never negative), and never arrives before an earlier segment of its stream: a TCP
  receiver hands bytes over in order, so a late segment holds back the ones behind it.
* **Random loss** as TCP feels it: each copy crossing the bottleneck is lost with
  probability ``loss``; the lost copy used bottleneck capacity, the retransmission
  goes out right behind it and arrives ``retransmit_s`` later (doubling for each
  further loss of the same segment, like TCP's backoff). The segment and, through
  in-order delivery, its stream are late by that much.
* **Droptail queue**: a segment that would take the backlog past ``queue_bytes`` is
  dropped on arrival; :meth:`Shaper.offer` says so with the time at which the
  sender's retransmission will be back (``retransmit_s``, doubling per attempt). The
  caller re-offers it then and holds the rest of that stream back meanwhile.
* **Changes** of the direction (at a scheduled time or at once) start the new rate or
  trace at that time; segments still queued are served again, in order, by the new
  schedule and re-timed (so a queue built at a fast rate drains at the slow one).

Times passed in and returned are absolute (the caller's clock, seconds); ``origin``
is link time 0, where outages, scheduled changes and a trace's start are anchored.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from splitinfer.shared.links import PACKET_BYTES, MahimahiTrace
from splitinfer.sim.config import Change, Direction, LinkConfig

#: Most doublings of the retransmission delay (random loss and queue drops).
MAX_BACKOFF_DOUBLINGS = 6
#: Most consecutive losses of one segment drawn (loss < 1 makes more vanishingly rare).
MAX_LOSSES = 16


class Capacity(Protocol):
    """Cumulative capacity of a bottleneck in link time (seconds)."""

    def bytes_before(self, t: float) -> float:
        """Bytes the bottleneck can serve strictly before ``t``."""
        ...

    def time_of(self, position: float) -> float:
        """When byte number ``position`` (> 0, cumulative) is served."""
        ...


class RateCapacity:
    """A fixed rate (bits/s) from link time ``origin`` on."""

    def __init__(self, rate_bps: float, origin: float = 0.0) -> None:
        self.bytes_per_s = rate_bps / 8.0
        self.origin = origin

    def bytes_before(self, t: float) -> float:
        return max(0.0, t - self.origin) * self.bytes_per_s

    def time_of(self, position: float) -> float:
        return self.origin + position / self.bytes_per_s


class TraceCapacity:
    """A Mahimahi trace whose opportunity at ``offset_s`` falls at link time ``origin``.

    Scalar look-ups by bisection on a list: ``MahimahiTrace``'s vectorised ones cost
    an O(trace) conversion per call, too slow for a segment at a time.
    """

    def __init__(self, trace: MahimahiTrace, offset_s: float = 0.0, origin: float = 0.0) -> None:
        self.trace = trace
        self._ts: list[int] = [int(x) for x in trace.timestamps_ms.tolist()]
        self._n = len(self._ts)
        self._period = float(trace.duration_ms)
        self.offset_ms = offset_s * 1000.0
        self.origin = origin
        self._base = self.count_before(self.offset_ms)

    def count_before(self, ms: float) -> int:
        """Opportunities strictly before trace time ``ms`` (counting repeats)."""
        if ms <= 0:
            return 0
        c0 = max(math.floor(ms / self._period) - 1, 0)
        return c0 * self._n + sum(
            bisect.bisect_left(self._ts, ms - (c0 + extra) * self._period) for extra in range(3)
        )

    def opportunity_ms(self, index: int) -> float:
        """Trace time of opportunity ``index`` (0-based, counting repeats)."""
        cycle, i = divmod(index, self._n)
        return self._ts[i] + cycle * self._period

    def bytes_before(self, t: float) -> float:
        if t <= self.origin:
            return 0.0
        ms = (t - self.origin) * 1000.0 + self.offset_ms
        return float((self.count_before(ms) - self._base) * PACKET_BYTES)

    def time_of(self, position: float) -> float:
        index = self._base + max(math.ceil(position / PACKET_BYTES) - 1, 0)
        return self.origin + (self.opportunity_ms(index) - self.offset_ms) / 1000.0


class OutageCapacity:
    """``base`` with no capacity inside each outage ``[start, start + duration)``."""

    def __init__(self, base: Capacity, outages: Sequence[tuple[float, float]]) -> None:
        self.base = base
        self.windows = [(a, a + d) for a, d in sorted(outages)]

    def _lost(self, a: float, b: float) -> float:
        return self.base.bytes_before(b) - self.base.bytes_before(a)

    def bytes_before(self, t: float) -> float:
        lost = sum(self._lost(min(a, t), min(b, t)) for a, b in self.windows if a < t)
        return self.base.bytes_before(t) - lost

    def time_of(self, position: float) -> float:
        lost = 0.0
        for a, b in self.windows:
            if position + lost <= self.base.bytes_before(a):
                break
            lost += self._lost(a, b)
        return self.base.time_of(position + lost)


def capacity_of(direction: Direction, origin: float = 0.0) -> Capacity | None:
    """The capacity of a direction from link time ``origin``; ``None`` if unlimited."""
    if direction.rate_bps is not None:
        return RateCapacity(direction.rate_bps, origin)
    if direction.trace is not None:
        return TraceCapacity(direction.trace, direction.trace_offset_s, origin)
    return None


class _Server:
    """The FIFO bottleneck: a position in cumulative bytes over a capacity schedule,
    or, unlimited, only the outages and the end of an earlier backlog."""

    def __init__(
        self,
        capacity: Capacity | None,
        outages: Sequence[tuple[float, float]],
        busy_until: float,
    ) -> None:
        self.outages = [(a, a + d) for a, d in sorted(outages)]
        self.capacity = OutageCapacity(capacity, outages) if capacity is not None else None
        if self.capacity is not None:
            self.position = self.capacity.bytes_before(busy_until)
        self.busy_until = busy_until  # unlimited: the earliest a new segment can leave
        # unlimited: (leaves at, bytes) held back by an outage, leave times in order
        self._held: deque[tuple[float, int]] = deque()
        self._held_bytes = 0

    def backlog(self, t: float) -> float:
        if self.capacity is not None:
            return max(0.0, self.position - self.capacity.bytes_before(t))
        while self._held and self._held[0][0] <= t:
            self._held_bytes -= self._held.popleft()[1]
        return float(self._held_bytes)

    def serve(self, t: float, nbytes: int) -> float:
        """Queue ``nbytes`` arriving at ``t``; when their last byte leaves."""
        if self.capacity is not None:
            self.position = max(self.position, self.capacity.bytes_before(t)) + nbytes
            return self.capacity.time_of(self.position)
        leave = max(t, self.busy_until)
        for a, b in self.outages:
            if a <= leave < b:
                leave = b
        self.busy_until = leave
        if leave > t:
            self._held.append((leave, nbytes))
            self._held_bytes += nbytes
        return leave


@dataclass(eq=False)
class Delivery:
    """What became of a segment offered to a :class:`Shaper`.

    While the segment waits in the bottleneck queue (``now < left_at``) a change of
    the direction re-times it: read ``deliver_at`` again when it is due.
    """

    #: False: dropped at the full queue; offer it again at ``retry_at``
    accepted: bool
    #: when the segment reaches the far end (absolute time); accepted only
    deliver_at: float = math.nan
    #: when it leaves the bottleneck (its last copy); accepted only
    left_at: float = math.nan
    #: copies lost on the way (each cost one more retransmission delay)
    losses: int = 0
    #: dropped only: when the sender's retransmission arrives to be offered again
    retry_at: float = math.nan
    nbytes: int = 0
    stream: Hashable = None
    #: recovery + propagation after leaving the bottleneck (s)
    after_s: float = 0.0
    #: the delivery time of the stream's previous segment when this one was offered
    floor: float = -math.inf


class Shaper:
    """One direction of a link: a bottleneck, propagation, loss, outages, a queue.

    Offers must come in non-decreasing ``now`` (one clock, one event loop).
    ``stream`` names the TCP connection a segment belongs to: delivery times within a
    stream never decrease. Call :meth:`close_stream` when a connection ends.
    """

    def __init__(
        self,
        direction: Direction,
        *,
        origin: float = 0.0,
        delay_s: float = 0.0,
        jitter_s: float = 0.0,
        loss: float = 0.0,
        outages: Sequence[tuple[float, float]] = (),
        queue_bytes: int | None = None,
        retransmit_s: float = 0.001,
        changes: Sequence[tuple[float, Direction]] = (),
        rng: random.Random | None = None,
    ) -> None:
        if retransmit_s <= 0:
            raise ValueError("retransmit_s must be > 0")
        self.origin = origin
        self.direction = direction
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self.loss = loss
        self.outages = tuple(outages)
        self.queue_bytes = queue_bytes
        self.retransmit_s = retransmit_s
        self.rng = rng if rng is not None else random.Random(0)
        self._pending = sorted(changes, key=lambda c: c[0])
        self._server = _Server(capacity_of(direction, 0.0), self.outages, 0.0)
        self._last: dict[Hashable, float] = {}
        self._queue: deque[Delivery] = deque()  # accepted, not yet left, in order
        self._now = -math.inf
        self.offered_bytes = 0
        self.accepted_bytes = 0
        self.dropped_segments = 0
        self.lost_segments = 0

    @classmethod
    def for_link(
        cls, config: LinkConfig, which: str, origin: float, rng: random.Random | None = None
    ) -> Shaper:
        """The ``"uplink"`` or ``"downlink"`` shaper of a link config."""
        if which not in ("uplink", "downlink"):
            raise ValueError(f"which={which!r}: uplink or downlink")
        changes = [(c.at_s, d) for c in config.changes if (d := _side(c, which)) is not None]
        return cls(
            getattr(config, which),
            origin=origin,
            delay_s=config.delay_ms / 1000.0,
            jitter_s=config.jitter_ms / 1000.0,
            loss=config.loss,
            outages=config.outages,
            queue_bytes=config.queue_bytes,
            retransmit_s=config.retransmit_s,
            changes=changes,
            rng=rng if rng is not None else random.Random(f"{config.seed}:{which}"),
        )

    # -- state ----------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Let the clock reach ``now``: scheduled changes due by then take effect (call it
        at a change's time so that queued segments are re-timed before they are due)."""
        self._advance(now)

    def _advance(self, now: float) -> float:
        if now < self._now:
            raise ValueError(f"time went backwards: {now!r} after {self._now!r}")
        before = self._now - self.origin
        self._now = now
        t = now - self.origin
        while self._pending and self._pending[0][0] <= t:
            at, direction = self._pending.pop(0)
            at = max(at, before)
            self._prune(self.origin + at)
            self._switch(direction, at)
        self._prune(now)
        return t

    def _prune(self, now: float) -> None:
        while self._queue and self._queue[0].left_at <= now:
            self._queue.popleft()

    def _switch(self, direction: Direction, at: float) -> None:
        # the new schedule starts at `at`; whatever has not left by then is served
        # again, in order, by the new one (its copies too), and re-timed
        self._server = _Server(capacity_of(direction, at), self.outages, at)
        self.direction = direction
        last: dict[Hashable, float] = {}
        for seg in self._queue:
            left = at
            for _ in range(1 + seg.losses):
                left = self._server.serve(at, seg.nbytes)
            seg.left_at = self.origin + left
            arrive = max(seg.left_at + seg.after_s, last.get(seg.stream, seg.floor))
            seg.deliver_at = arrive
            last[seg.stream] = arrive
        for stream, arrive in last.items():
            if stream in self._last:
                self._last[stream] = arrive

    def set_direction(self, direction: Direction, now: float) -> None:
        """Switch the bottleneck to ``direction`` from ``now`` on (a trace starts over
        from its offset at ``now``)."""
        t = self._advance(now)
        self._switch(direction, t)

    def schedule(self, at_s: float, direction: Direction) -> None:
        """Switch to ``direction`` at link time ``at_s`` (not before the last offer)."""
        self._pending.append((at_s, direction))
        self._pending.sort(key=lambda c: c[0])

    def queued_bytes(self, now: float) -> float:
        """Bytes waiting in (or being served by) the bottleneck at ``now``."""
        return self._server.backlog(self._advance(now))

    def close_stream(self, stream: Hashable) -> None:
        self._last.pop(stream, None)

    # -- the one decision -------------------------------------------------------------
    def offer(self, nbytes: int, now: float, stream: Hashable = 0, attempt: int = 0) -> Delivery:
        """``nbytes`` arrive at the bottleneck at ``now``: when do they reach the far end?

        ``attempt`` counts earlier drops of this segment at the full queue (for the
        retransmission backoff).
        """
        if nbytes <= 0:
            raise ValueError(f"nbytes={nbytes!r} must be > 0")
        t = self._advance(now)
        self.offered_bytes += nbytes
        if self.queue_bytes is not None and self._server.backlog(t) + nbytes > self.queue_bytes:
            self.dropped_segments += 1
            wait = self.retransmit_s * 2 ** min(attempt, MAX_BACKOFF_DOUBLINGS)
            return Delivery(accepted=False, retry_at=now + wait)
        losses = 0
        while losses < MAX_LOSSES and self.loss > 0 and self.rng.random() < self.loss:
            losses += 1
        left = t
        for _ in range(1 + losses):  # each lost copy used the bottleneck too
            left = self._server.serve(t, nbytes)
        self.accepted_bytes += nbytes
        self.lost_segments += losses
        recovery = sum(
            self.retransmit_s * 2 ** min(i, MAX_BACKOFF_DOUBLINGS) for i in range(losses)
        )
        propagation = self.delay_s
        if self.jitter_s > 0:
            propagation = max(0.0, propagation + self.rng.uniform(-self.jitter_s, self.jitter_s))
        floor = self._last.get(stream, -math.inf)
        seg = Delivery(
            accepted=True,
            left_at=self.origin + left,
            losses=losses,
            nbytes=nbytes,
            stream=stream,
            after_s=recovery + propagation,
            floor=floor,
        )
        seg.deliver_at = max(seg.left_at + seg.after_s, floor)
        self._last[stream] = seg.deliver_at
        if left > t:
            self._queue.append(seg)
        return seg


def _side(change: Change, which: str) -> Direction | None:
    return change.uplink if which == "uplink" else change.downlink
