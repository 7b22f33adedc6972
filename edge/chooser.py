"""Choosing the cut per request: the cost model's prediction, hysteresis, cloud load.

Pure logic: no clock is read and nothing is sent. For every candidate cut with
a predicted cost (:class:`~splitinfer.shared.costs.CutCost`), the latency at the
current link estimate is :func:`~splitinfer.shared.costs.predict_latency`, with

* the edge compute replaced by the time this device measured for that cut's
  edge segment, when it has one;
* the cloud part (decode + compute) multiplied by ``load_factor`` while the
  cloud is overloaded, which moves the choice toward cuts that keep more of the
  work on the device.

The cloud's load comes with every answer. Its EWMA marks the cloud overloaded at
``load_high`` and clear again at ``load_low`` (hysteresis on the load), and
decays with half-life ``load_half_life_s`` while no answer comes (so an agent
that moved all its work to the device comes back to look).

The chooser moves from the current cut to the best one only when the best is
predicted at least ``hysteresis`` (a fraction) faster, and only after
``min_dwell`` requests on the current cut, unless the load state just changed.

It remembers why it is on its cut (:class:`Switch`: the rule, a one-line reason,
when), and :meth:`CutChooser.explain` gives, for ``GET /v1/status`` and the
status page, every candidate's prediction at a link estimate with the same
:func:`predict` the choice uses. A pinned cut or switching turned off still
gets predictions; only the choice stays put.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from splitinfer.edge.config import AdaptConfig
from splitinfer.shared.costs import CutCost, predict_latency
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.links import Link


def predict(
    cost: CutCost, link: Link, load_factor: float = 1.0, edge_s: float | None = None
) -> float:
    """Predicted seconds of one request at ``cost``'s cut over ``link``."""
    seconds = predict_latency(cost, link)
    if edge_s is not None:
        seconds += edge_s - cost.edge_s
    if cost.kind != "all":
        seconds += (load_factor - 1.0) * (cost.cloud_s + cost.decode_s)
    return seconds


@dataclass(frozen=True)
class Choice:
    """The cut for one request and why."""

    cut_id: str
    #: Predicted seconds per candidate at this choice.
    predicted: Mapping[str, float] = field(default_factory=dict)
    #: True if this choice moved to a new cut.
    switched: bool = False
    #: The cloud counted as overloaded at this choice.
    loaded: bool = False


@dataclass(frozen=True)
class Switch:
    """Why the chooser is on its cut: the rule that put it there, and when."""

    cut_id: str
    #: "start" (the cut it started on), "link" (the link estimate or the measured edge
    #: times made another cut faster) or "cloud load" (the cloud's load state changed).
    rule: str
    #: One line for people, with the numbers that decided it.
    reason: str
    #: On the chooser's clock; None: since the chooser was made.
    at: float | None = None
    from_cut: str | None = None


#: The uplink range :meth:`CutChooser.crossing` searches, bits/s.
_SEARCH_BPS = (1e3, 1e11)


def rate_text(bps: float) -> str:
    """``2.5 Mbit/s``, ``640 kbit/s``."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


class CutChooser:
    """The run-time choice among candidate cuts; see the module docstring."""

    def __init__(
        self,
        costs: Mapping[str, CutCost],
        start: str,
        config: AdaptConfig,
        reason: str = "the starting cut",
    ) -> None:
        if start not in costs and costs:
            raise ConfigError(f"start cut {start!r} has no predicted cost")
        self.costs = dict(costs)
        self.config = config
        self.current = start
        self.since_switch = 0
        self.switches = 0
        self._load = 0.0
        self._load_at: float | None = None
        self.loaded = False
        self._load_changed = False
        self.last = Switch(start, "start", reason)

    @property
    def adapting(self) -> bool:
        """Whether :meth:`choose` may move: switching on, no cut pinned, two candidates."""
        return (
            self.config.enabled
            and self.config.cut is None
            and len(self.costs) >= 2
            and self.current in self.costs
        )

    def fixed_because(self) -> str | None:
        """Why the chooser never moves (None while it adapts)."""
        if self.config.cut is not None:
            return f"adapt.cut={self.config.cut} pins the cut"
        if not self.config.enabled:
            return "cut switching is off (adapt.enabled=false)"
        if len(self.costs) < 2 or self.current not in self.costs:
            return "fewer than two candidate cuts have a predicted cost"
        return None

    # -- cloud load --------------------------------------------------------------
    def load(self, now: float) -> float:
        """The load estimate at ``now``, decayed since the last answer."""
        if self._load_at is None:
            return 0.0
        age = max(now - self._load_at, 0.0)
        return float(self._load * 0.5 ** (age / self.config.load_half_life_s))

    def observe_load(self, load: float, now: float) -> None:
        """The ``load`` (0..1) a cloud answer carried."""
        if not math.isfinite(load):
            return
        sample = min(max(load, 0.0), 1.0)
        current = self.load(now)
        a = 1.0 if self._load_at is None else self.config.alpha
        self._load = current + a * (sample - current)
        self._load_at = now
        self._update_state(now)

    def _update_state(self, now: float) -> None:
        level = self.load(now)
        was = self.loaded
        if not self.loaded and level >= self.config.load_high:
            self.loaded = True
        elif self.loaded and level <= self.config.load_low:
            self.loaded = False
        if self.loaded != was:
            self._load_changed = True

    # -- the choice ----------------------------------------------------------------
    def predictions(
        self, link: Link, edge_s: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        factor = self.config.load_factor if self.loaded else 1.0
        measured = edge_s or {}
        return {
            cut_id: predict(cost, link, factor, measured.get(cut_id))
            for cut_id, cost in self.costs.items()
        }

    def choose(self, link: Link, now: float, edge_s: Mapping[str, float] | None = None) -> Choice:
        """The cut for the next request, given the link estimate and measured edge times."""
        self._update_state(now)
        if not self.adapting:
            self.since_switch += 1
            return Choice(self.current, {}, False, self.loaded)
        predicted = self.predictions(link, edge_s)
        best = min(predicted, key=lambda c: predicted[c])  # first of equals: input order
        switched = False
        forced = self._load_changed
        self._load_changed = False
        if best != self.current:
            dwell_ok = self.since_switch >= self.config.min_dwell or forced
            gain_ok = predicted[best] < predicted[self.current] * (1.0 - self.config.hysteresis)
            if dwell_ok and gain_ok:
                self.last = self._why(best, predicted, link, now, edge_s, forced)
                self.current = best
                self.since_switch = 0
                self.switches += 1
                switched = True
        self.since_switch += 1
        return Choice(self.current, predicted, switched, self.loaded)

    # -- why -----------------------------------------------------------------------
    def _why(
        self,
        best: str,
        predicted: Mapping[str, float],
        link: Link,
        now: float,
        edge_s: Mapping[str, float] | None,
        forced: bool,
    ) -> Switch:
        """The :class:`Switch` for a move from the current cut to ``best``."""
        old = self.current
        versus = (
            f"{best} predicted {predicted[best] * 1e3:.1f} ms against {old} "
            f"{predicted[old] * 1e3:.1f} ms"
        )
        if forced:
            level = self.load(now)
            if self.loaded:
                state = (
                    f"the cloud counts as overloaded (load {level:.2f} >= adapt.load_high "
                    f"{self.config.load_high:g}; its part of each prediction x"
                    f"{self.config.load_factor:g})"
                )
            else:
                state = (
                    f"the cloud is clear again (load {level:.2f} <= adapt.load_low "
                    f"{self.config.load_low:g})"
                )
            return Switch(best, "cloud load", f"{state}: {versus}", now, old)
        where = f"uplink estimate {rate_text(link.uplink_bps)}, rtt {link.rtt_s * 1e3:.0f} ms"
        crossing = self.crossing(best, old, link, edge_s)
        if crossing is None:
            reason = f"at the link estimate ({where}) and the measured edge times: {versus}"
        else:
            bps, below = crossing
            moved = "fell below" if below else "rose above"
            reason = f"the uplink estimate {moved} {rate_text(bps)} ({where}): {versus}"
        return Switch(best, "link", reason, now, old)

    def crossing(
        self, a: str, b: str, link: Link, edge_s: Mapping[str, float] | None = None
    ) -> tuple[float, bool] | None:
        """The uplink rate at which cut ``a`` starts or stops being ``hysteresis`` faster
        than cut ``b`` (all else as in ``link``), and whether ``a`` wins below it.

        Solved on :func:`predict` itself (bisection on a log scale between 1 kbit/s and
        100 Gbit/s); None when one cut wins, or loses, over that whole range.
        """
        factor = self.config.load_factor if self.loaded else 1.0
        measured = edge_s or {}
        keep = 1.0 - self.config.hysteresis

        def margin(bps: float) -> float:  # < 0: a wins by the hysteresis
            at = link.at_uplink(bps)
            pa = predict(self.costs[a], at, factor, measured.get(a))
            return pa - keep * predict(self.costs[b], at, factor, measured.get(b))

        lo, hi = _SEARCH_BPS
        m_lo, m_hi = margin(lo), margin(hi)
        if (m_lo < 0) == (m_hi < 0):
            return None
        for _ in range(60):
            mid = math.sqrt(lo * hi)
            if (margin(mid) < 0) == (m_lo < 0):
                lo = mid
            else:
                hi = mid
        return math.sqrt(lo * hi), m_lo < 0

    def explain(
        self, link: Link, now: float, edge_s: Mapping[str, float] | None = None
    ) -> dict[str, Any]:
        """Every candidate's prediction at ``link`` and why the current cut is used
        (JSON-ready; what ``GET /v1/status`` shows under ``choice``).

        ``edge_s`` are the measured edge times the choice would use (None: the
        package's). Pure: reads no clock and changes nothing.
        """
        predicted = self.predictions(link, edge_s)
        measured = edge_s or {}
        best = min(predicted, key=lambda c: predicted[c]) if predicted else None
        candidates = {}
        for cut_id, cost in self.costs.items():
            edge = measured.get(cut_id)
            candidates[cut_id] = {
                "kind": cost.kind,
                "predicted_ms": predicted[cut_id] * 1e3,
                "edge_ms": (cost.edge_s if edge is None else edge) * 1e3,
                "edge_measured": edge is not None,
                "transfer_ms": link.transfer_time(cost.up_bytes, cost.down_bytes) * 1e3,
                "up_bytes": cost.up_bytes,
            }
        last = self.last
        doc: dict[str, Any] = {
            "cut": self.current,
            "best": best,
            "adapting": self.adapting,
            "fixed_because": self.fixed_because(),
            "rule": last.rule,
            "reason": last.reason,
            "since_s": None if last.at is None else max(now - last.at, 0.0),
            "from": last.from_cut,
            "switches": self.switches,
            "requests_on_cut": self.since_switch,
            "hysteresis": self.config.hysteresis,
            "min_dwell": self.config.min_dwell,
            "cloud_overloaded": self.loaded,
            "candidates": candidates,
        }
        if best is not None and best != self.current and self.adapting:
            doc["waiting"] = self._waiting(best, predicted)
        return doc

    def _waiting(self, best: str, predicted: Mapping[str, float]) -> str:
        """Why a faster cut is not taken yet."""
        now = predicted[self.current]
        gain = 1.0 - predicted[best] / now if now > 0 else 0.0
        if not predicted[best] < now * (1.0 - self.config.hysteresis):  # the rule in choose()
            return (
                f"{best} is predicted {gain:.0%} faster, within adapt.hysteresis "
                f"{self.config.hysteresis:g}"
            )
        left = self.config.min_dwell - self.since_switch
        if left <= 0:
            return f"{best} is predicted {gain:.0%} faster; the next request moves there"
        return f"{best} is predicted {gain:.0%} faster; moving after {left} more request(s)"
