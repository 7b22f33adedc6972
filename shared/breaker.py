"""One circuit breaker for both halves: the cloud's per-version breakers and the edge's
per-endpoint ones.

Pure logic on an injected clock: every call that depends on time takes ``now``
(monotonic seconds, from whatever clock the caller runs on).

* **closed**: everything goes. ``failures_to_open`` consecutive failures open it.
* **open**: nothing goes for ``cooldown_s`` after the failure that opened it.
* **half-open** (the cooldown has passed): exactly one trial at a time. The first
  :meth:`~CircuitBreaker.allows` takes the trial; everything else is refused until
  it reports. Its success closes the breaker; its failure opens it again, for a
  new cooldown. A trial that never reports (refused before it ran, or answered
  with something that is neither) is replaced by a new one after another
  ``cooldown_s``.

:meth:`~CircuitBreaker.available` asks the same question as ``allows`` without
taking the trial, for callers that choose among several breakers first.
"""

from __future__ import annotations

import math
from typing import Literal

from splitinfer.shared.errors import ConfigError

BreakerState = Literal["closed", "open", "half-open"]


class CircuitBreaker:
    """See the module docstring."""

    def __init__(self, failures_to_open: int = 5, cooldown_s: float = 10.0) -> None:
        if isinstance(failures_to_open, bool) or not (
            isinstance(failures_to_open, int) and failures_to_open >= 1
        ):
            raise ConfigError(f"breaker failures={failures_to_open!r} must be an integer >= 1")
        if not (math.isfinite(cooldown_s) and cooldown_s >= 0):
            raise ConfigError(f"breaker cooldown={cooldown_s!r} s must be >= 0, e.g. 10")
        self.failures_to_open = failures_to_open
        self.cooldown_s = float(cooldown_s)
        #: consecutive failures since the last success
        self.failures = 0
        #: when the breaker (last) opened; None while closed
        self.opened_at: float | None = None
        #: when the half-open trial in flight was let through; None: no trial out
        self.trial_at: float | None = None
        #: how many times it went from closed to open
        self.trips = 0

    @property
    def closed(self) -> bool:
        return self.opened_at is None

    def state(self, now: float) -> BreakerState:
        if self.opened_at is None:
            return "closed"
        return "half-open" if now - self.opened_at >= self.cooldown_s else "open"

    def _trial_free(self, now: float) -> bool:
        return self.trial_at is None or now - self.trial_at >= self.cooldown_s

    def available(self, now: float) -> bool:
        """Whether :meth:`allows` would let a request through now (takes nothing)."""
        state = self.state(now)
        return state == "closed" or (state == "half-open" and self._trial_free(now))

    def allows(self, now: float) -> bool:
        """Whether a request may go now; in half-open, the one that may is the trial."""
        if not self.available(now):
            return False
        if self.opened_at is not None:
            self.trial_at = now
        return True

    def retry_after(self, now: float) -> float:
        """Seconds until :meth:`available` may say yes (0: it does now)."""
        if self.opened_at is None:
            return 0.0
        start = self.opened_at if self.trial_at is None else max(self.opened_at, self.trial_at)
        return max(0.0, start + self.cooldown_s - now)

    def record(self, ok: bool, now: float) -> None:
        """The outcome of a request this breaker let through."""
        if ok:
            self.failures = 0
            self.opened_at = None
            self.trial_at = None
            return
        self.failures += 1
        if self.opened_at is not None:  # a failure while open or half-open: a new cooldown
            self.opened_at = now
            self.trial_at = None
        elif self.failures >= self.failures_to_open:
            self.opened_at = now
            self.trips += 1
