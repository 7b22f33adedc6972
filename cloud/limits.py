"""Bytes of request bodies in flight: bounded per device and overall.

A body is read only after its headers passed the signature pre-check (device,
key, window, nonce), and only into a reservation from :class:`BodyBudget`: a
sized body reserves its Content-Length before the first byte is read, an
unsized one grows its reservation chunk by chunk. A reservation that does not
fit is refused with :class:`InFlightFull` (503 + Retry-After); it is released
as soon as the request leaves the handler, whatever happened to it.
"""

from __future__ import annotations

from splitinfer.shared.errors import OverloadError


class InFlightFull(OverloadError):
    """Too many request body bytes are being read at once (HTTP 503)."""

    http_status = 503
    retry_after = 1.0


class BodyBudget:
    """At most ``total`` bytes in flight, ``per_device`` of them for one device."""

    def __init__(self, total: int, per_device: int) -> None:
        self.total = total
        self.per_device = per_device
        self.used = 0
        self.peak = 0
        self._by_device: dict[str, int] = {}

    def reservation(self, device: str) -> Reservation:
        return Reservation(self, device)

    def _take(self, device: str, n: int) -> None:
        held = self._by_device.get(device, 0)
        if held + n > self.per_device:
            raise InFlightFull(
                f"device {device!r} has {held + n} request bytes in flight, over "
                f"max_device_inflight_bytes={self.per_device}; retry shortly"
            )
        if self.used + n > self.total:
            raise InFlightFull(
                f"{self.used} request bytes are in flight, no room for {n} more "
                f"(max_inflight_bytes={self.total}); retry shortly"
            )
        self._by_device[device] = held + n
        self.used += n
        self.peak = max(self.peak, self.used)

    def _give(self, device: str, n: int) -> None:
        left = self._by_device.get(device, 0) - n
        if left > 0:
            self._by_device[device] = left
        else:
            self._by_device.pop(device, None)
        self.used -= n

    def held(self, device: str) -> int:
        return self._by_device.get(device, 0)


class Reservation:
    """One request's share of a :class:`BodyBudget`; a context manager that gives it back."""

    def __init__(self, budget: BodyBudget, device: str) -> None:
        self.budget = budget
        self.device = device
        self.size = 0

    def grow(self, n: int) -> None:
        self.budget._take(self.device, n)
        self.size += n

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.size:
            self.budget._give(self.device, self.size)
            self.size = 0
