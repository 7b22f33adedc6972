"""Learned estimates the batcher plans with: batch latency vs size, and arrival rate.

Both are pure: observations and times are passed in.
"""

from __future__ import annotations

import math


class LatencyModel:
    """Batch compute time as a linear function of batch size, ``t(b) = a + c*b``.

    A least-squares fit over exponentially decayed sums (each observation's
    weight shrinks by ``decay`` per newer one), so the fit follows a machine
    whose speed drifts. With a single distinct batch size seen, the estimate
    is ``t_mean * max(1, b / b_mean)``: never below what was seen, and linear
    beyond it (pessimistic for larger batches until one is observed).
    """

    def __init__(self, decay: float = 0.95) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay={decay}: must be within (0, 1)")
        self.decay = decay
        self._w = self._b = self._t = self._bb = self._bt = 0.0
        self.observations = 0

    def observe(self, batch_size: int, seconds: float) -> None:
        if batch_size < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        d = self.decay
        b = float(batch_size)
        self._w = self._w * d + 1.0
        self._b = self._b * d + b
        self._t = self._t * d + seconds
        self._bb = self._bb * d + b * b
        self._bt = self._bt * d + b * seconds
        self.observations += 1

    @property
    def known(self) -> bool:
        return self.observations > 0

    def coefficients(self) -> tuple[float, float]:
        """``(a, c)``: per-batch and per-sample seconds; (0, 0) before any observation."""
        if not self._w:
            return 0.0, 0.0
        mb, mt = self._b / self._w, self._t / self._w
        var = self._bb / self._w - mb * mb
        if var <= 1e-9 * max(1.0, mb * mb):
            return 0.0, mt / mb  # one batch size seen: proportional (see estimate)
        slope = (self._bt / self._w - mb * mt) / var
        slope = max(0.0, slope)
        return max(0.0, mt - slope * mb), slope

    def estimate(self, batch_size: int) -> float:
        """Expected compute seconds of a batch of ``batch_size`` samples (0 if unknown)."""
        if not self._w:
            return 0.0
        mb, mt = self._b / self._w, self._t / self._w
        var = self._bb / self._w - mb * mb
        if var <= 1e-9 * max(1.0, mb * mb):
            return mt * max(1.0, batch_size / mb)
        a, c = self.coefficients()
        return a + c * batch_size


class ArrivalRate:
    """EWMA of the gaps between arrivals; ``gap`` is ``inf`` until two have been seen."""

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self._last: float | None = None
        self._gap = math.inf

    def observe(self, now: float) -> None:
        if self._last is not None:
            gap = max(0.0, now - self._last)
            self._gap = gap if math.isinf(self._gap) else self._gap + self.alpha * (gap - self._gap)
        self._last = now

    @property
    def gap(self) -> float:
        """Expected seconds until the next arrival."""
        return self._gap
