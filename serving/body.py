"""Reading a request body on either daemon: bounded in bytes, in time, and in bytes
in flight.

:func:`read_body` reads a request body incrementally under a size limit and a
deadline (a slow sender is cut off, not waited for), and turns a client that
goes away mid-body into :class:`ClientGone`, after releasing what was read.
:class:`BodyBudget` bounds the body bytes being read at once, per client and
overall: a sized body reserves its Content-Length before the first byte is
read, an unsized one grows its reservation chunk by chunk, and a reservation
that does not fit is refused with :class:`InFlightFull` (503 + Retry-After);
it is released as soon as the request is done, whatever happened to it.
Only asyncio and duck-typed streams (:class:`~splitinfer.shared.contract.BodyStream`:
aiohttp's ``request.content``, Starlette's stream, a body in memory).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from splitinfer.shared.contract import BodyStream
from splitinfer.shared.errors import OverloadError, ProtocolError, SplitInferError


class ClientGone(SplitInferError):
    """The client closed its connection before its request body was complete.

    Its own doing: no traceback, not a 5xx. The daemons count it apart
    (``splitinfer_aborted_uploads``) and answer nothing (no one is listening).
    """

    http_status = 499


class BodyTimeout(ProtocolError):
    """The request body did not arrive within the body read timeout (HTTP 408)."""

    http_status = 408


class BodyTooLarge(SplitInferError):
    http_status = 413


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


async def read_body(
    content: BodyStream,
    *,
    declared: int | None,
    limit: int,
    timeout_s: float,
    grow: Callable[[int], None] | None = None,
) -> bytes:
    """The whole body, at most ``limit`` bytes, within ``timeout_s`` seconds.

    ``declared`` is the Content-Length (None when chunked): a body declared
    over the limit is refused before a byte is read; the chunks are joined once
    at the end (a body that came in one chunk is not copied; one the stream
    holds whole already is taken without a timer). ``grow(n)`` is called before each chunk of an
    unsized body is kept, so that the caller can account for (and refuse) it.
    ``content`` is any :class:`~splitinfer.shared.contract.BodyStream` (aiohttp's
    ``request.content``, Starlette's stream, a body in memory). A client gone
    mid-body raises :class:`ClientGone`; too slow a one :class:`BodyTimeout`; in
    both cases what was read is released first.
    """
    if declared is not None and declared > limit:
        raise BodyTooLarge(f"request body of {declared} bytes is over the limit of {limit} bytes")
    buf = _Chunks(limit, None if declared is not None else grow)
    try:
        if _complete(content):  # all of it is here already: no timer to arm
            buf.add(content.read_nowait(-1))  # type: ignore[attr-defined]
        else:
            async with asyncio.timeout(timeout_s):
                while True:
                    chunk = await content.readany()
                    if not chunk:
                        break
                    buf.add(chunk)
    except TimeoutError:
        buf.clear()
        raise BodyTimeout(
            f"request body not received within {timeout_s:g} s (body_timeout)"
        ) from None
    except (ConnectionError, OSError) as exc:
        buf.clear()
        raise ClientGone(f"client went away mid-body: {type(exc).__name__}") from None
    except BaseException as exc:
        buf.clear()
        if _is_payload_error(exc):  # aiohttp's RequestPayloadError (truncated body)
            raise ClientGone(f"client went away mid-body: {exc}") from None
        raise
    if declared is not None and buf.size != declared:
        buf.clear()
        raise ClientGone(f"client sent {buf.size} of its {declared} bytes")
    return buf.join()


class _Chunks:
    """A body's chunks as they came, joined once at the end (one chunk: no copy at all)."""

    def __init__(self, limit: int, grow: Callable[[int], None] | None) -> None:
        self.limit = limit
        self.grow = grow  # called before each chunk of an unsized body is kept
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, chunk: bytes) -> None:
        if self.size + len(chunk) > self.limit:
            raise BodyTooLarge(f"request body is over the limit of {self.limit} bytes")
        if self.grow is not None and chunk:
            self.grow(len(chunk))
        self.parts.append(chunk)
        self.size += len(chunk)

    def clear(self) -> None:
        self.parts.clear()

    def join(self) -> bytes:
        return b"".join(self.parts)


def _complete(content: BodyStream) -> bool:
    """Whether the stream already holds its whole body (aiohttp's ``StreamReader`` once
    the parser has seen the body's end, as for any body that came with its headers):
    then it is taken at once, with no timer armed for a read that cannot wait."""
    is_eof = getattr(content, "is_eof", None)
    return is_eof is not None and hasattr(content, "read_nowait") and bool(is_eof())


def _is_payload_error(exc: BaseException) -> bool:
    # aiohttp's truncated body; Starlette's ClientDisconnect (the Ray Serve ingress)
    return type(exc).__name__ in ("RequestPayloadError", "ContentLengthError", "ClientDisconnect")
