"""The one seam between the agent and the network.

A :class:`Transport` sends one HTTP request to one cloud endpoint and gives
back the status, headers and body, or raises :class:`TransportError` when no
answer came (refused, reset, timed out). Everything above it (signing, retries,
failover, link estimation) is the same whichever transport is plugged in:

* :class:`HttpTransport`: aiohttp, over one persistent ``ClientSession`` shared
  by all endpoints (keep-alive, a bounded connection pool, timeouts);
* :class:`FunctionTransport`: a Python function, for tests (it may run a real
  cloud segment and real frame decoding, with no sockets);
* ``sim/`` adds an emulated link that wraps another transport.
"""

from __future__ import annotations

import asyncio
import inspect
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from splitinfer.shared.errors import SplitInferError


class TransportError(SplitInferError):
    """No answer from an endpoint: refused, reset, timed out, or unreadable."""

    http_status = 503

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


@dataclass(frozen=True)
class Reply:
    """What an endpoint answered."""

    status: int
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""

    def header(self, name: str, default: str = "") -> str:
        """A header, looked up case-insensitively."""
        low = name.lower()
        for key, value in self.headers.items():
            if key.lower() == low:
                return value
        return default


class Transport(Protocol):
    """Sends requests to one endpoint."""

    #: A label for logs and metrics (the base URL).
    name: str

    async def request(
        self,
        method: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> Reply: ...


Handler = Callable[[str, str, bytes, Mapping[str, str]], Reply | Awaitable[Reply]]


class FunctionTransport:
    """A transport backed by a function ``(method, path, body, headers) -> Reply``.

    The function may be sync or async and may raise :class:`TransportError`
    to play a dead endpoint. ``calls`` counts the requests it was given.
    """

    def __init__(self, handler: Handler, name: str = "function") -> None:
        self.handler = handler
        self.name = name
        self.calls = 0

    async def request(
        self,
        method: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> Reply:
        self.calls += 1
        result = self.handler(method, path, body, headers)
        if inspect.isawaitable(result):
            try:
                result = await asyncio.wait_for(result, timeout_s)
            except TimeoutError:
                raise TransportError(
                    f"{self.name}: no answer in {timeout_s:.3g} s", timeout=True
                ) from None
        assert isinstance(result, Reply)
        return result


def make_session(
    max_connections: int,
    connect_timeout_s: float,
    ssl_context: ssl.SSLContext | None = None,
) -> object:
    """The agent's one aiohttp ``ClientSession``: keep-alive, at most ``max_connections``.

    Call inside a running event loop; close it with ``await session.close()``.
    """
    import aiohttp

    connector = aiohttp.TCPConnector(
        limit=max_connections,
        limit_per_host=max_connections,
        keepalive_timeout=30.0,
        ssl=ssl_context if ssl_context is not None else True,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
        auto_decompress=False,
        raise_for_status=False,
        skip_auto_headers=("User-Agent",),
        headers={"User-Agent": "splitinfer-edge-agent"},
    )


class HttpTransport:
    """One cloud endpoint over a shared aiohttp ``ClientSession``."""

    def __init__(
        self,
        base_url: str,
        session: object,
        max_response_bytes: int,
        signer: Callable[[str, str, bytes, str], Mapping[str, str]] | None = None,
    ) -> None:
        self.name = base_url.rstrip("/")
        self._session = session
        self._max = max_response_bytes
        # signs each POST for this endpoint: (method, path, body, audience) -> headers,
        # the audience being this endpoint's base URL (auth v2, docs/auth.md)
        self._signer = signer

    async def request(
        self,
        method: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> Reply:
        import aiohttp

        session = self._session
        assert isinstance(session, aiohttp.ClientSession)
        url = self.name + path
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        if self._signer is not None and method == "POST":
            headers = {**headers, **self._signer(method, path, body, self.name)}
        try:
            async with session.request(
                method, url, data=body or None, headers=dict(headers), timeout=timeout
            ) as resp:
                length = resp.content_length
                if length is not None and length > self._max:
                    raise TransportError(
                        f"{self.name}: response of {length} bytes exceeds "
                        f"uplink.max_response_bytes={self._max}"
                    )
                chunks: list[bytes] = []
                total = 0
                async for chunk in resp.content.iter_chunked(1 << 16):
                    total += len(chunk)
                    if total > self._max:
                        raise TransportError(
                            f"{self.name}: response exceeds uplink.max_response_bytes={self._max}"
                        )
                    chunks.append(chunk)
                return Reply(resp.status, dict(resp.headers), b"".join(chunks))
        except TimeoutError:
            raise TransportError(
                f"{self.name}: no answer in {timeout_s:.3g} s", timeout=True
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            detail = " ".join(str(exc).split()) or type(exc).__name__
            raise TransportError(f"{self.name}: {detail}") from None
