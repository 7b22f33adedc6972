"""What both daemons do to their listening sockets: a connection cap and a header timeout.

aiohttp already closes a connection whose next request's headers are not
complete ``keepalive_timeout`` seconds after it opened or after its previous
answer (``keepalive_timeout`` is a ``web.AppRunner`` handler argument). What it
lacks is a cap on connections and a bound on the first request's headers that
is shorter than the keep-alive: :class:`ConnectionGate` wraps aiohttp's
protocol factory with both. A connection beyond the cap gets one plain
``503`` with ``Retry-After`` and is closed before aiohttp sees it; a
connection whose first request's headers (up to the blank line) do not arrive
within ``header_timeout_s`` is aborted. Only asyncio here; aiohttp stays in the
daemons, which hand their runner's protocol factory to :func:`listen`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

_REFUSAL_BODY = b'{"error": "too many connections open; retry shortly", "status": 503}'
#: What a connection beyond the cap gets before it is closed.
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n"
    + f"Content-Length: {len(_REFUSAL_BODY)}\r\n\r\n".encode()
    + _REFUSAL_BODY
)
_HEAD_END = b"\r\n\r\n"


class _Guarded(asyncio.Protocol):
    """One connection: counted against the cap, its first request's headers timed."""

    def __init__(self, gate: ConnectionGate, inner: Any) -> None:
        self.gate = gate
        self.inner = inner
        self.admitted = False
        self.transport: asyncio.Transport | None = None
        self._tail = b""
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        gate = self.gate
        if gate.open >= gate.max_connections:
            gate.refused += 1
            transport.write(REFUSAL)  # type: ignore[attr-defined]
            transport.close()
            return
        self.admitted = True
        gate.open += 1
        gate.peak = max(gate.peak, gate.open)
        if gate.header_timeout_s > 0:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(gate.header_timeout_s, self._too_slow)
        self.inner.connection_made(transport)

    def _too_slow(self) -> None:
        self._timer = None
        self.gate.timed_out += 1
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        if self._timer is not None:
            head = self._tail + data
            if _HEAD_END in head:
                self._timer.cancel()
                self._timer = None
                self._tail = b""
            else:
                self._tail = head[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if not self.admitted:
            return None
        result: bool | None = self.inner.eof_received()
        return result

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.admitted:
            return
        self.admitted = False
        self.gate.open -= 1
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()


class ConnectionGate:
    """Wraps a protocol factory (aiohttp's ``runner.server``) with a cap and a header timeout."""

    def __init__(self, max_connections: int, header_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.peak = 0
        self.refused = 0
        self.timed_out = 0

    def wrap(self, factory: Callable[[], Any]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Guarded(self, factory())


async def listen(
    runner: Any, host: str, port: int, gate: ConnectionGate, ssl: Any = None
) -> asyncio.Server:
    """Listen on ``host:port`` with ``runner``'s aiohttp server behind ``gate``.

    Used instead of ``web.TCPSite`` (which takes aiohttp's factory as it is);
    close the returned server before ``runner.cleanup()``.
    """
    loop = asyncio.get_running_loop()
    return await loop.create_server(gate.wrap(runner.server), host, port, ssl=ssl, backlog=512)


def bound_url(server: asyncio.Server, scheme: str = "http") -> str:
    """``scheme://host:port`` of the first socket ``server`` listens on."""
    host, port = server.sockets[0].getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}"
