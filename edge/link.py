"""Estimating the uplink's throughput and round trip time from the agent's own traffic.

Each request is one upload of ``U`` bytes, the cloud's work, and a download of
``D`` bytes; the agent sees only the total. With the cloud's time ``S`` (from a
``Server-Timing`` header when the cloud sends one, else the cost model's
prediction for the cut) and the link model of
:class:`~splitinfer.shared.links.Link`,

    elapsed - S - D*8/downlink = rtt + U*8 / uplink,

a line in ``U``: its intercept is the RTT and its slope the time per bit.
Health checks (``GET /healthz``, nothing to carry) are points at ``U = 0``.
The estimator keeps the recent points (the last 64 transfers and 16 checks),
weighs each by its age (half-life ``half_life_s``), and fits the line by
weighted least squares. Points at two or more sizes pin both numbers; with
transfers of one size only, the RTT comes from the health checks (or stays at
the last estimate) and the slope from the transfers. Until a transfer of at
least ``min_rate_bytes`` has been seen, the uplink stays at the prior: small
uploads say little about throughput. Fitted values are clamped to sane ranges.
The downlink is not measured (answers are small); it stays at the prior.
No clock is read here: callers pass durations and the time they were taken.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitinfer.edge.config import AdaptConfig
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.links import Link, parse_duration, parse_rate

_MIN_BPS = 1e3
_MAX_BPS = 1e11
_MAX_RTT = 30.0
_TRANSFERS = 64
_PROBES = 16


@dataclass(frozen=True)
class Estimate:
    """The current estimate and how many samples fed it."""

    link: Link
    rate_samples: int
    rtt_samples: int


class LinkEstimator:
    """Weighted least-squares estimates of uplink throughput and RTT (see module doc)."""

    def __init__(
        self,
        prior: Link,
        *,
        half_life_s: float = 10.0,
        min_rate_bytes: int = 8192,
        refit_s: float = 0.05,
    ) -> None:
        if not (math.isfinite(half_life_s) and half_life_s > 0):
            raise ConfigError(f"half_life_s={half_life_s!r} must be seconds > 0")
        self.half_life_s = half_life_s
        self.min_rate_bytes = min_rate_bytes
        self._down_bps = prior.downlink_bps
        self._spb = 1.0 / prior.uplink_bps  # seconds per bit
        self._rtt = prior.rtt_s
        self._transfers: deque[tuple[float, float, float]] = deque(maxlen=_TRANSFERS)
        self._probes: deque[tuple[float, float]] = deque(maxlen=_PROBES)
        self._dirty = False
        self._cached: Estimate | None = None
        self._fit_at = -math.inf
        #: At most one refit per ``refit_s`` of the samples' clock: at hundreds of
        #: requests a second the estimate need not move with every one.
        self.refit_s = refit_s
        self._last_sample = -math.inf
        self.rate_samples = 0
        self.rtt_samples = 0

    @property
    def uplink_bps(self) -> float:
        self._refit()
        return 1.0 / self._spb

    @property
    def rtt_s(self) -> float:
        self._refit()
        return self._rtt

    def estimate(self) -> Estimate:
        if self._dirty and self._last_sample - self._fit_at >= self.refit_s:
            self._refit()
        if (
            self._cached is None
            or self._cached.link.uplink_bps != 1.0 / self._spb
            or (self._cached.link.rtt_s != self._rtt)
        ):
            link = Link(1.0 / self._spb, self._down_bps, self._rtt)
            self._cached = Estimate(link, self.rate_samples, self.rtt_samples)
        return self._cached

    def observe_rtt(self, seconds: float, now: float) -> None:
        """A round trip with nothing to carry (a health check), taken at ``now``."""
        if not (math.isfinite(seconds) and seconds >= 0 and math.isfinite(now)):
            return
        self._probes.append((now, min(seconds, _MAX_RTT)))
        self.rtt_samples += 1
        self._dirty = True
        self._last_sample = max(self._last_sample, now)

    def observe_transfer(
        self, up_bytes: int, down_bytes: int, elapsed_s: float, server_s: float, now: float
    ) -> None:
        """One request: sizes, its total seconds, the cloud's share of them, and when."""
        if not all(math.isfinite(v) for v in (elapsed_s, server_s, now)) or elapsed_s < 0:
            return
        network = elapsed_s - max(server_s, 0.0) - down_bytes * 8 / self._down_bps
        self._transfers.append((now, float(up_bytes) * 8, max(network, 0.0)))
        if up_bytes >= self.min_rate_bytes:
            self.rate_samples += 1
        self._dirty = True
        self._last_sample = max(self._last_sample, now)

    def _refit(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        self._fit_at = self._last_sample
        points = [(t, 0.0, y) for t, y in self._probes] + list(self._transfers)
        if not points:
            return
        data = np.asarray(points, dtype=np.float64)
        age = data[:, 0].max() - data[:, 0]
        w = 0.5 ** (age / self.half_life_s)
        x, y = data[:, 1], data[:, 2]
        rated = x.max() >= self.min_rate_bytes * 8
        spread = x.min() <= 0.5 * x.max()
        if rated and spread:
            xm, ym = np.average(x, weights=w), np.average(y, weights=w)
            var = float(np.sum(w * (x - xm) ** 2))
            b = float(np.sum(w * (x - xm) * (y - ym)) / var)
            a = float(ym - b * xm)
            if a < 0:
                a = 0.0
                b = float(np.sum(w * x * y) / np.sum(w * x * x))
        elif rated:
            a = self._rtt
            b = float(np.sum(w * x * (y - a)) / np.sum(w * x * x))
        else:
            b = self._spb
            a = float(np.average(y - x * b, weights=w))
        self._spb = min(max(b, 1.0 / _MAX_BPS), 1.0 / _MIN_BPS)
        self._rtt = min(max(a, 0.0), _MAX_RTT)


# -- the prior -------------------------------------------------------------------

DEFAULT_UPLINK_BPS = 10e6
DEFAULT_DOWNLINK_BPS = 50e6
DEFAULT_RTT_S = 0.05


def planned_link(planning: Mapping[str, Any]) -> tuple[float, float, float] | None:
    """(uplink bps, downlink bps, rtt s) of the package's planning link, if it has one.

    Read from the manifest's ``planning.link``: ``{"uplink_bps", "downlink_bps", "rtt_s"}``.
    """
    planned = planning.get("link")
    try:
        if isinstance(planned, Mapping):
            found = (
                float(planned["uplink_bps"]),
                float(planned["downlink_bps"]),
                float(planned["rtt_s"]),
            )
        else:
            return None
        Link(*found)
    except (KeyError, TypeError, ValueError, ConfigError):
        return None
    return found


def prior_link(planning: Mapping[str, Any], adapt: AdaptConfig) -> Link:
    """The link before any measurement: the config's, else the package's planning link."""
    up, down, rtt = planned_link(planning) or (
        DEFAULT_UPLINK_BPS,
        DEFAULT_DOWNLINK_BPS,
        DEFAULT_RTT_S,
    )
    if adapt.prior_uplink is not None:
        up = parse_rate(adapt.prior_uplink)
    if adapt.prior_downlink is not None:
        down = parse_rate(adapt.prior_downlink)
    if adapt.prior_rtt is not None:
        rtt = parse_duration(adapt.prior_rtt)
    return Link(up, down, rtt)
