"""Every device's link at once: the shaper's capacity model (``sim/shaper.py``), vectorised.

A direction of a link is a FIFO bottleneck with a cumulative capacity: ``bytes_before(t)``
(bytes it can serve strictly before link time ``t``) and ``time_of(position)`` (when
byte number ``position`` leaves). Each device has its own: a Mahimahi trace replayed
from the device's own offset (one 1500-byte opportunity per line, cyclic; capacity
nobody is queued for is lost, a transfer may use the rest of an opportunity the one
before it started, exactly :class:`splitinfer.sim.shaper.TraceCapacity`), a fixed rate
(fluid, :class:`~splitinfer.sim.shaper.RateCapacity`), or unlimited. A degradation scales
a device's capacity by a factor inside a window (0: an outage,
:class:`~splitinfer.sim.shaper.OutageCapacity` generalised).

A transfer of ``B`` bytes ready at ``t`` starts at position
``max(bytes_before(t), end of the device's previous transfer)`` and leaves at
``time_of(start + B)``: Lindley's recursion in byte positions (:func:`fifo`), the
look-ups one ``searchsorted`` per trace over all devices' transfers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from splitinfer.shared.links import PACKET_BYTES, MahimahiTrace

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]

UNLIMITED, RATE, TRACE = 0, 1, 2


class Capacities:
    """One direction of every device's link (devices by index 0..n-1)."""

    def __init__(
        self,
        kind: npt.NDArray[np.int8],
        rate_bps: F64,
        trace_of: I64,
        offset_s: F64,
        trace_list: Sequence[MahimahiTrace],
    ) -> None:
        self.kind = kind
        self.bytes_per_s = rate_bps / 8.0
        self.trace_of = trace_of
        self.offset_ms = offset_s * 1000.0
        self.traces = list(trace_list)
        self.base = np.zeros(len(kind), dtype=np.int64)  # opportunities before each offset
        for k, trace in enumerate(self.traces):
            m = (kind == TRACE) & (trace_of == k)
            self.base[m] = trace.opportunities_before(self.offset_ms[m])
        self.windows: list[tuple[Mask, float, float, float, F64, F64]] = []

    @property
    def limited(self) -> Mask:
        out: Mask = self.kind != UNLIMITED
        return out

    def degrade(self, devices: Mask, start_s: float, end_s: float, factor: float) -> None:
        """Scale ``devices``' capacity by ``factor`` inside ``[start_s, end_s)``."""
        idx = np.flatnonzero(devices)
        at_a = np.zeros(len(self.kind))
        at_b = np.zeros(len(self.kind))
        at_a[idx] = self._base_before(idx, np.full(idx.size, start_s))
        at_b[idx] = self._base_before(idx, np.full(idx.size, end_s))
        self.windows.append((devices.copy(), start_s, end_s, factor, at_a, at_b))

    # -- the base schedule ---------------------------------------------------------------
    def _base_before(self, dev: I64, t: F64) -> F64:
        out = np.zeros(t.shape)
        kind = self.kind[dev]
        r = kind == RATE
        out[r] = np.maximum(t[r], 0.0) * self.bytes_per_s[dev[r]]
        for k, trace in enumerate(self.traces):
            m = (kind == TRACE) & (self.trace_of[dev] == k)
            if m.any():
                d = dev[m]
                ms = np.maximum(t[m], 0.0) * 1000.0 + self.offset_ms[d]
                out[m] = (trace.opportunities_before(ms) - self.base[d]) * float(PACKET_BYTES)
        return out

    def _base_time(self, dev: I64, pos: F64) -> F64:
        out = np.zeros(pos.shape)
        kind = self.kind[dev]
        r = kind == RATE
        out[r] = pos[r] / self.bytes_per_s[dev[r]]
        for k, trace in enumerate(self.traces):
            m = (kind == TRACE) & (self.trace_of[dev] == k)
            if m.any():
                d = dev[m]
                index = self.base[d] + np.maximum(np.ceil(pos[m] / PACKET_BYTES) - 1, 0).astype(
                    np.int64
                )
                out[m] = (trace.opportunity_time(index) - self.offset_ms[d]) / 1000.0
        return out

    # -- with the degradations -------------------------------------------------------------
    def bytes_before(self, dev: I64, t: F64) -> F64:
        out = self._base_before(dev, t)
        for devices, a, b, f, at_a, _ in self.windows:
            m = devices[dev] & (t > a)
            if m.any():
                d = dev[m]
                inside = self._base_before(d, np.minimum(t[m], b))
                out[m] -= (1.0 - f) * (inside - at_a[d])
        return out

    def time_of(self, dev: I64, pos: F64) -> F64:
        """When byte ``pos`` of each device's schedule leaves (windows in time order)."""
        pos = pos.copy()
        lost = np.zeros(pos.shape)
        for devices, _a, _b, f, at_a, at_b in sorted(self.windows, key=lambda w: w[1]):
            m = devices[dev] & (pos + lost > at_a[dev])
            if not m.any():
                continue
            d = dev[m]
            span = at_b[d] - at_a[d]
            here = pos[m] + lost[m]
            rel = here - at_a[d]  # bytes past the window's start, at the degraded rate
            if f > 0:  # inside the window the base position is stretched by 1/f
                moved = np.where(rel <= f * span, at_a[d] + rel / f, here + (1.0 - f) * span)
            else:
                moved = here + span
            lost[m] = moved - pos[m]
        return self._base_time(dev, pos + lost)


def fifo(dev: I64, ready: F64, service: F64, carry: F64) -> tuple[F64, F64]:
    """Lindley's recursion per device: each item starts at ``max(ready, the end of the
    device's previous item)`` and ends ``service`` later. Items of one device are taken
    in order of ``ready`` (ties: in the order given); ``carry`` holds each device's last
    end and is updated. Returns (start, end) in the order given."""
    n = dev.size
    start = np.empty(n)
    end = np.empty(n)
    if n == 0:
        return start, end
    order = np.lexsort((ready, dev))
    ds = dev[order]
    first = np.ones(n, dtype=bool)
    first[1:] = ds[1:] != ds[:-1]
    head = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    rank = np.arange(n) - head
    by_rank = np.argsort(rank, kind="stable")
    counts = np.bincount(rank)
    lo = 0
    for c in counts:
        sel = order[by_rank[lo : lo + c]]
        lo += c
        d = dev[sel]
        s = np.maximum(ready[sel], carry[d])
        e = s + service[sel]
        carry[d] = e
        start[sel] = s
        end[sel] = e
    return start, end


def transfer(cap: Capacities, dev: I64, ready: F64, nbytes: F64, carry_pos: F64) -> F64:
    """When each transfer of ``nbytes`` ready at ``ready`` has left its device's
    bottleneck (FIFO per device; ``carry_pos`` holds each device's last end position)."""
    out = ready.copy()
    lim = cap.limited[dev] & (nbytes > 0)
    if lim.any():
        d = dev[lim]
        pos = cap.bytes_before(d, ready[lim])
        _, end = fifo(d, pos, nbytes[lim], carry_pos)
        out[lim] = np.maximum(cap.time_of(d, end), ready[lim])
    return out
