"""One circuit breaker for both halves: the cloud's per-version breakers and the edge's
per-endpoint ones.

Pure logic on an injected clock: every call that depends on time takes ``now``
(monotonic seconds, from whatever clock the caller runs on).

* **closed**: everything goes. ``failures_to_open`` consecutive failures open it.
* **open**: nothing goes for ``cooldown_s`` after the failure that opened it.
* **half-open** (the cooldown has passed): at most ``trials`` requests at a time go
  as trials (each :meth:`~CircuitBreaker.allows` that says yes takes one); the rest
  are refused until one reports. The first success closes the breaker; the first
  failure opens it again, for a new cooldown (a failure reported while it is still
  open, from a request sent before it opened, changes nothing). A caller that took a trial and got
  no verdict (it did not send after all, was cancelled, or was told to back off)
  gives it back with :meth:`~CircuitBreaker.release`; a trial that never reports
  is given back by itself after another ``cooldown_s``.

``trials`` is how much traffic a recovering dependency is trusted with: the cloud
sends one batch to a version that kept failing (``trials=1``); an edge agent lets as
many requests try a recovering endpoint as it has connections to it, since for
those requests the alternative is failing. :meth:`~CircuitBreaker.available` asks
the same question as ``allows`` without taking a trial, for callers that choose
among several breakers first.
"""

from __future__ import annotations

import math
from typing import Literal

from splitinfer.shared.errors import ConfigError

BreakerState = Literal["closed", "open", "half-open"]


class CircuitBreaker:
    """See the module docstring."""

    def __init__(
        self, failures_to_open: int = 5, cooldown_s: float = 10.0, trials: int = 1
    ) -> None:
        for name, value in (("failures", failures_to_open), ("trials", trials)):
            if isinstance(value, bool) or not (isinstance(value, int) and value >= 1):
                raise ConfigError(f"breaker {name}={value!r} must be an integer >= 1")
        if not (math.isfinite(cooldown_s) and cooldown_s >= 0):
            raise ConfigError(f"breaker cooldown={cooldown_s!r} s must be >= 0, e.g. 10")
        self.failures_to_open = failures_to_open
        self.cooldown_s = float(cooldown_s)
        self.trials = trials
        #: consecutive failures since the last success
        self.failures = 0
        #: when the breaker (last) opened; None while closed
        self.opened_at: float | None = None
        #: when each half-open trial in flight was let through
        self._out: list[float] = []
        #: how many times it went from closed to open
        self.trips = 0

    @property
    def closed(self) -> bool:
        return self.opened_at is None

    def state(self, now: float) -> BreakerState:
        if self.opened_at is None:
            return "closed"
        return "half-open" if now - self.opened_at >= self.cooldown_s else "open"

    def _trials_out(self, now: float) -> int:
        self._out = [t for t in self._out if now - t < self.cooldown_s]  # stale ones go
        return len(self._out)

    def available(self, now: float) -> bool:
        """Whether :meth:`allows` would let a request through now (takes nothing)."""
        state = self.state(now)
        return state == "closed" or (state == "half-open" and self._trials_out(now) < self.trials)

    def allows(self, now: float) -> bool:
        """Whether a request may go now; in half-open, it goes as a trial."""
        if not self.available(now):
            return False
        if self.opened_at is not None:
            self._out.append(now)
        return True

    def release(self) -> None:
        """Give back a half-open trial taken by :meth:`allows` with no verdict, so the
        next caller may try at once (nothing happens when no trial is out)."""
        if self._out:
            self._out.pop(0)

    def retry_after(self, now: float) -> float:
        """Seconds until :meth:`available` may say yes (0: it does now)."""
        if self.opened_at is None:
            return 0.0
        start = self.opened_at
        if self._trials_out(now) >= self.trials:
            start = max(start, min(self._out))
        return max(0.0, start + self.cooldown_s - now)

    def record(self, ok: bool, now: float) -> None:
        """The outcome of a request this breaker let through. A failure that reports
        while the breaker is open (a request sent before it opened) is old news: it
        does not restart the cooldown."""
        if ok:
            self.failures = 0
            self.opened_at = None
            self._out = []
            return
        self.failures += 1
        state = self.state(now)
        if state == "half-open":  # a trial failed: a new cooldown
            self.opened_at = now
            self._out = []
        elif state == "closed" and self.failures >= self.failures_to_open:
            self.opened_at = now
            self.trips += 1
