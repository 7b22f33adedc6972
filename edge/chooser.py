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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

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


class CutChooser:
    """The run-time choice among candidate cuts; see the module docstring."""

    def __init__(self, costs: Mapping[str, CutCost], start: str, config: AdaptConfig) -> None:
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
        if not self.config.enabled or len(self.costs) < 2 or self.current not in self.costs:
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
                self.current = best
                self.since_switch = 0
                self.switches += 1
                switched = True
        self.since_switch += 1
        return Choice(self.current, predicted, switched, self.loaded)
