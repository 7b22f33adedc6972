"""The devices' side of a fleet: request arrivals, each device's uplink estimate, and each
device's real :class:`~splitinfer.edge.chooser.CutChooser`.

**When a device decides.** The agent asks its chooser once per request
(``Pipeline.choose``) with the link estimate of the moment; the simulation asks it once
per device per decision period (``decide_every``) in which the device has requests, and
that cut serves all of them. ``min_dwell`` still counts requests: the chooser's
``since_switch`` is advanced by every request of the period.

**Asking only when the answer can change** (:meth:`Choosers.decide`). ``choose`` moves
only when another cut is predicted best (then it weighs hysteresis and dwell), or when
the cloud's load state changes. The predictions of every device and cut are computed in
numpy with :func:`~splitinfer.edge.chooser.predict`'s formula; a device whose best cut
is its current one, whose cloud is not counted overloaded and whose load state did not
just flip gets no call (its ``since_switch`` is advanced instead, before its next real
call), because ``choose`` would answer "stay" and change nothing else. Every other
device gets the real call. ``exact=True`` calls every device (the tests check both
agree).

**The uplink estimate** (:class:`LinkEstimates`) is
:class:`~splitinfer.edge.link.LinkEstimator`'s fit with the round trip known from health
checks (its branch with probes at zero bytes: intercept the RTT, slope the seconds per
bit), over every transfer with exponential weights of half-life ``link_half_life``:
``seconds per bit = sum w x (y - rtt) / sum w x^2``, ``x`` the bits uploaded and ``y``
the request's time minus the cloud's (Server-Timing) minus the download at the prior
downlink. Running sums, updated once per decision period with the answers that reached
the devices before it; the uplink stays at the prior until an upload of at least
``min_rate_sample`` bytes. The real estimator keeps its last 64 transfers; at the
default half-life that leaves out weights below 2^-6.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from splitinfer.edge.chooser import CutChooser
from splitinfer.edge.config import AdaptConfig
from splitinfer.shared.costs import CutCost
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.links import Link

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

_MIN_BPS = 1e3  # edge/link.py's clamps
_MAX_BPS = 1e11


class LinkEstimates:
    """Every device's uplink estimate (see the module docstring)."""

    def __init__(
        self, n: int, prior_bps: float, rtt_s: F64, half_life_s: float, min_rate_bytes: int
    ) -> None:
        self.spb = np.full(n, 1.0 / prior_bps)
        self.rtt = rtt_s
        self.half_life = half_life_s
        self.min_bits = 8.0 * min_rate_bytes
        self.sxy = np.zeros(n)
        self.sxx = np.zeros(n)
        self.rated = np.zeros(n, dtype=bool)
        self.at = 0.0

    @property
    def uplink_bps(self) -> F64:
        out: F64 = 1.0 / self.spb
        return out

    def update(self, dev: I64, t: F64, bits: F64, y: F64, now: float) -> None:
        """Transfers ``(bits, network seconds)`` observed at ``t`` (all ``<= now``)."""
        n = self.spb.size
        decay = 0.5 ** ((now - self.at) / self.half_life)
        self.sxy *= decay
        self.sxx *= decay
        self.at = now
        if dev.size == 0:
            return
        w = 0.5 ** ((now - t) / self.half_life)
        self.sxy += np.bincount(dev, w * bits * (y - self.rtt[dev]), minlength=n)
        self.sxx += np.bincount(dev, w * bits * bits, minlength=n)
        self.rated[dev[bits >= self.min_bits]] = True
        ok = self.rated & (self.sxx > 0)
        self.spb[ok] = np.clip(self.sxy[ok] / self.sxx[ok], 1.0 / _MAX_BPS, 1.0 / _MIN_BPS)


class Choosers:
    """One real :class:`CutChooser` per device, asked as the module docstring says."""

    def __init__(
        self,
        costs: Mapping[str, CutCost],
        start: str,
        config: AdaptConfig,
        edge_s: Sequence[Mapping[str, float]],
        group_of: I64,
        downlink_bps: float,
        *,
        exact: bool = False,
    ) -> None:
        self.ids = list(costs)
        self.config = config
        n = group_of.size
        self.choosers = [CutChooser(costs, start, config) for _ in range(n)]
        self.adapting = self.choosers[0].adapting if n else False
        self.edge_s = [dict(e) for e in edge_s] if config.measured_edge else None
        self.group_of = group_of
        self.downlink_bps = downlink_bps
        self.exact = exact
        self.current = np.full(n, self.ids.index(start), dtype=np.int64)
        self.loaded = np.zeros(n, dtype=bool)
        self.flipped = np.zeros(n, dtype=bool)
        self.pending = np.zeros(n, dtype=np.int64)  # requests not yet added to since_switch
        self.calls = 0
        cs = [costs[c] for c in self.ids]
        self._fixed = np.array([c.fixed_s for c in cs])
        self._edge = np.array([c.edge_s for c in cs])
        self._up = np.array([c.up_bytes for c in cs], dtype=np.float64)
        self._down = np.array([c.down_bytes for c in cs], dtype=np.float64)
        self._used = (self._up > 0) | (self._down > 0)
        self._cloud = np.array([c.cloud_s + c.decode_s for c in cs])
        self._split = np.array([c.kind != "all" for c in cs])
        measured = np.array(
            [[e.get(c, np.nan) for c in self.ids] for e in edge_s] if edge_s else [[np.nan]]
        )
        self._measured = measured if config.measured_edge else np.full_like(measured, np.nan)

    def predictions(self, dev: I64, uplink_bps: F64, rtt_s: F64) -> F64:
        """Seconds per device and cut, :func:`~splitinfer.edge.chooser.predict`'s formula."""
        up = self._up[None, :] * 8 / uplink_bps[:, None]
        net = up + rtt_s[:, None] + self._down[None, :] * 8 / self.downlink_bps
        out = self._fixed[None, :] + np.where(self._used[None, :], net, 0.0)
        meas = self._measured[self.group_of[dev]]
        out = np.where(np.isnan(meas), out, out + (meas - self._edge[None, :]))
        factor = np.where(self.loaded[dev], self.config.load_factor, 1.0)
        extra = (factor[:, None] - 1.0) * self._cloud[None, :]
        result: F64 = np.where(self._split[None, :], out + extra, out)
        return result

    def decide(self, dev: I64, requests: I64, uplink_bps: F64, rtt_s: F64, now: float) -> int:
        """Each of ``dev`` (unique) is about to send ``requests`` requests; returns how many
        switched. ``uplink_bps``/``rtt_s`` are per device in ``dev``."""
        if not self.adapting or dev.size == 0:
            return 0
        if self.exact:
            ask = np.ones(dev.size, dtype=bool)
        else:
            best = np.argmin(self.predictions(dev, uplink_bps, rtt_s), axis=1)
            ask = (best != self.current[dev]) | self.loaded[dev] | self.flipped[dev]
        self.pending[dev[~ask]] += requests[~ask]
        switched = 0
        edge_s = self.edge_s
        group = self.group_of
        for k in np.flatnonzero(ask).tolist():
            d = int(dev[k])
            ch = self.choosers[d]
            ch.since_switch += int(self.pending[d])
            self.pending[d] = 0
            link = Link(float(uplink_bps[k]), self.downlink_bps, float(rtt_s[k]))
            choice = ch.choose(link, now, None if edge_s is None else edge_s[group[d]])
            ch.since_switch += int(requests[k]) - 1
            self.calls += 1
            switched += choice.switched
            if choice.switched:
                self.current[d] = self.ids.index(choice.cut_id)
            self.loaded[d] = ch.loaded
            self.flipped[d] = False
        return switched

    def observe_load(self, dev: I64, load: F64, at: F64) -> None:
        """The load of each device's latest answer (devices unique)."""
        for d, value, t in zip(dev.tolist(), load.tolist(), at.tolist(), strict=True):
            ch = self.choosers[d]
            was = ch.loaded
            ch.observe_load(value, t)
            if ch.loaded != was:
                self.flipped[d] = True
                self.loaded[d] = ch.loaded

    def flush(self) -> None:
        for d in np.flatnonzero(self.pending).tolist():
            self.choosers[d].since_switch += int(self.pending[d])
        self.pending[:] = 0

    @property
    def switches(self) -> int:
        return sum(ch.switches for ch in self.choosers)


# -- arrivals -----------------------------------------------------------------------------


def read_times(path: Path) -> tuple[F64, I64 | None]:
    """An arrival file: one column of seconds, or two (device, seconds); '#' comments.

    One column repeats with period = its last time (as a Mahimahi trace does; a file
    that starts at 0 and ends at the period counts that instant once)."""
    try:
        data = np.loadtxt(path, comments="#", delimiter=None, ndmin=2, dtype=np.float64)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read arrival times: {exc}") from None
    if data.size == 0 or data.shape[1] not in (1, 2) or not np.isfinite(data).all():
        raise ConfigError(f"{path}: expected one column (seconds) or two (device, seconds)")
    if data.shape[1] == 1:
        times = np.sort(data[:, 0])
        if times[0] < 0 or times[-1] <= 0:
            raise ConfigError(f"{path}: times must be >= 0 with a positive last one (the period)")
        return times, None
    order = np.lexsort((data[:, 1], data[:, 0]))
    return data[order, 1], data[order, 0].astype(np.int64)


class Arrivals:
    """Request times per decision period for a set of devices of one arrival kind."""

    def __init__(
        self,
        devices: I64,
        rng: np.random.Generator,
        rate: float = 0.0,
        times: F64 | None = None,
        owners: I64 | None = None,
    ) -> None:
        self.devices = devices
        self.rng = rng
        self.rate = rate
        self.times = times
        self.owners = owners
        if times is not None and owners is None:  # one trace, each device from its offset
            self.period = float(times[-1])
            if times[0] == 0 and times.size > 1:  # 0 and the period are one instant
                self.times = times[:-1]
            self.offset = rng.uniform(0.0, self.period, devices.size)
        if times is not None and owners is not None:  # each device its own times
            if owners.size and (owners.min() < 0 or owners.max() >= devices.size):
                raise ConfigError(
                    f"arrival file names device {int(owners.max())}; the group has "
                    f"{devices.size} devices (0..{devices.size - 1})"
                )
            order = np.argsort(times, kind="stable")
            self.times, self.owners = times[order], owners[order]

    def between(self, a: float, b: float) -> tuple[I64, F64]:
        """(device, time) of the requests in ``[a, b)``."""
        if self.times is None:
            counts = self.rng.poisson(self.rate * (b - a), self.devices.size)
            dev = np.repeat(self.devices, counts)
            return dev, self.rng.uniform(a, b, dev.size)
        if self.owners is not None:
            lo, hi = np.searchsorted(self.times, [a, b], side="left")
            return self.devices[self.owners[lo:hi]], self.times[lo:hi].copy()
        times, period, m = self.times, self.period, self.times.size

        def count(x: F64) -> I64:  # trace points (cyclic) strictly before x
            cycles = np.floor(x / period)
            out: I64 = (cycles * m + np.searchsorted(times, x - cycles * period)).astype(np.int64)
            return out

        lo = count(a + self.offset)
        hi = count(b + self.offset)
        n = hi - lo
        dev = np.repeat(self.devices, n)
        idx = np.repeat(lo - np.cumsum(n) + n, n) + np.arange(n.sum())
        cyc, j = np.divmod(idx, m)
        t = times[j] + cyc * period - np.repeat(self.offset, n)
        return dev, t
