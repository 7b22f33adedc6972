"""Raw-socket clients for the hostile-client tests and bench/bench_hostile.py.

They speak just enough HTTP/1.1 by hand to do what a well-behaved client never
does: stop mid-body, send one byte at a time, hold a socket open and say
nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from urllib.parse import urlsplit

#: ``serve(stop, started)``: a daemon's serve coroutine, stopped by the event, telling
#: its URL to the callback once it listens
Serve = Callable[[asyncio.Event, Callable[[str], None]], Awaitable[None]]


def request_head(path: str, headers: Mapping[str, str], length: int | None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    return await asyncio.open_connection(parts.hostname, parts.port)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one response."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionResetError("closed before a response")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the server closes the connection within ``seconds`` (data is drained)."""
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(65536):
                pass
        return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True


@contextlib.asynccontextmanager
async def opened(url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await connect(url)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@contextlib.asynccontextmanager
async def served(serve: Serve) -> AsyncIterator[str]:
    """A daemon's ``serve`` running in this loop on real sockets; its URL once it listens
    (its error, when it fails first). Stopped and awaited on the way out."""
    stop = asyncio.Event()
    listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve(stop, listening.set_result))
    try:
        await asyncio.wait({task, listening}, return_when=asyncio.FIRST_COMPLETED)
        if not listening.done():
            task.result()  # it failed: its error
            raise RuntimeError("serve() returned before it listened")
        yield listening.result()
    finally:
        stop.set()
        await task


async def one_past_the_cap(url: str, cap: int) -> tuple[int, dict[str, str], bytes, bool]:
    """Hold ``cap`` idle connections and open one more: its answer, and whether the
    held ones were then closed (their header timeout) within 2 s each."""
    async with contextlib.AsyncExitStack() as stack:
        held = [await stack.enter_async_context(opened(url)) for _ in range(cap)]
        await asyncio.sleep(0.05)  # every one accepted before the next
        async with opened(url) as (reader, _), asyncio.timeout(2):
            status, headers, body = await read_response(reader)
        closed = [await closed_within(r, 2.0) for r, _ in held]
    return status, headers, body, all(closed)
