"""The one seam between the agent and the network.

A :class:`Transport` sends one HTTP request to one cloud endpoint and gives
back the status, headers and body, or raises :class:`TransportError` when no
answer came (refused, reset, timed out). Everything above it (signing, retries,
failover, link estimation) is the same whichever transport is plugged in:

* :class:`HttpTransport`: aiohttp, over one persistent ``ClientSession`` shared
  by all endpoints (keep-alive, a bounded connection pool, timeouts);
* :class:`HandlerTransport`: a service's request handler called in process
  (the cloud's real ``CloudHandler`` over a real engine, with no sockets), the
  way tests drive the edge against the real cloud;
* :class:`FunctionTransport`: a Python function ``(method, path, body,
  headers) -> Reply``, for tests that play a dead, slow or lying endpoint;
* ``sim/`` adds an emulated link that wraps another transport.
"""

from __future__ import annotations

import asyncio
import inspect
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from splitinfer.shared.contract import BytesBody, ServiceHandler
from splitinfer.shared.contract import Reply as Reply  # noqa: PLC0414 (the edge's name for it)
from splitinfer.shared.errors import SplitInferError


class TransportError(SplitInferError):
    """No answer from an endpoint: refused, reset, timed out, or unreadable."""

    http_status = 503

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


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


Signer = Callable[[str, str, bytes, str], Mapping[str, str]]


class HandlerTransport(FunctionTransport):
    """A transport that calls a :data:`~splitinfer.shared.contract.ServiceHandler` in process.

    The request goes to the handler as a server would pass it (raw path,
    headers with ``Content-Length``, the body as a stream, a loopback peer),
    signed like :class:`HttpTransport` signs (``signer(method, path, body,
    audience)``, the audience being ``name``) when a signer is given. A
    handler slower than the request's timeout is a :class:`TransportError`.
    ``calls`` counts the requests sent.
    """

    def __init__(
        self,
        service: ServiceHandler,
        name: str = "http://in-process",
        signer: Signer | None = None,
        remote: str = "127.0.0.1",
    ) -> None:
        super().__init__(self._send, name.rstrip("/"))
        self.service = service
        self._signer = signer
        self._remote = remote

    async def _send(self, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        sent = {**headers, "Content-Length": str(len(body))}
        if self._signer is not None and method == "POST":
            sent.update(self._signer(method, path, body, self.name))
        return await self.service(method, path, sent, BytesBody(body), self._remote)


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
        signer: Signer | None = None,
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
