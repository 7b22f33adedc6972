"""Overload control: the refusals and per-device rate limits.

Pure logic: every method takes ``now`` (monotonic seconds). The number of
concurrent batches per model is bounded by the batcher itself
(``BatchingConfig.max_concurrent_batches``). Each serving version has a circuit
breaker, :class:`splitinfer.shared.breaker.CircuitBreaker` (the edge's endpoints use
the same one); :class:`CircuitOpen` is its refusal.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachetools import LRUCache

from splitinfer.shared.errors import OverloadError, SplitInferError


class Rejected(OverloadError):
    """The service refuses the request for now (503); ``retry_after`` is in seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueFull(Rejected):
    """The model's queue holds ``max_queue_size`` samples already."""


class DeadlineUnmeetable(Rejected):
    """The request cannot finish by its deadline, so it is refused instead of computed late."""


class CircuitOpen(Rejected):
    """Every version that could serve the request keeps failing."""


class ShuttingDown(Rejected):
    """The service is draining its queues before it stops."""


class RateLimited(SplitInferError):
    """A device sends faster than its rate limit (429)."""

    http_status = 429

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class _Bucket:
    tokens: float
    stamp: float


class RateLimiter:
    """A token bucket per device: ``rate`` tokens per second up to ``burst``.

    At most ``max_devices`` buckets are kept; the least recently seen one is
    dropped first (it comes back full, which only ever errs towards allowing).
    ``rate == 0`` allows everything.
    """

    def __init__(self, rate: float, burst: float, max_devices: int = 100_000) -> None:
        self.rate = rate
        self.burst = max(1.0, burst)
        self.max_devices = max_devices
        self._buckets: LRUCache[str, _Bucket] = LRUCache(maxsize=max(1, max_devices))

    def __len__(self) -> int:
        return len(self._buckets)

    def check(self, device: str, now: float, cost: float = 1.0) -> None:
        """Take ``cost`` tokens from ``device``'s bucket or raise :class:`RateLimited`."""
        if self.rate <= 0:
            return
        bucket = self._buckets.get(device)  # a hit makes it the most recent
        if bucket is None:
            bucket = self._buckets[device] = _Bucket(self.burst, now)
        bucket.tokens = min(self.burst, bucket.tokens + max(0.0, now - bucket.stamp) * self.rate)
        bucket.stamp = now
        if bucket.tokens < cost:
            wait = (cost - bucket.tokens) / self.rate
            raise RateLimited(
                f"device {device!r} is over its rate limit of {self.rate:g} requests/s; "
                f"retry in {wait:.2f} s",
                retry_after=wait,
            )
        bucket.tokens -= cost
