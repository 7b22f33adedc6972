"""The emulated link: an asyncio TCP proxy on loopback whose two directions go
through :class:`~splitinfer.sim.shaper.Shaper` s.

    async with EmulatedLink(config, target=("127.0.0.1", 8080)) as link:
        url = f"http://127.0.0.1:{link.port}/"   # clients connect here

Each accepted connection gets its own connection to the target; client -> target
bytes go through the uplink shaper, target -> client through the downlink shaper,
in segments of at most 1500 bytes, each written when the shaper says it arrives.
All connections of a link share one shaper per direction, like one bottleneck.
A new connection's first byte enters the link one round trip after the accept
(the TCP handshake).

All time is the event loop's: on :class:`~splitinfer.sim.virtual.VirtualTimeLoop`
with :meth:`EmulatedLink.in_memory` (no sockets, the target an in-process handler)
the same proxy runs on virtual time, which is how the tests drive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from splitinfer.shared.links import PACKET_BYTES
from splitinfer.sim.config import Direction, LinkConfig
from splitinfer.sim.shaper import Delivery, Shaper

Side = Literal["uplink", "downlink"]


class ByteReader(Protocol):
    """What the proxy reads from: :class:`asyncio.StreamReader` or an in-memory one."""

    async def read(self, n: int = -1) -> bytes: ...
    async def readexactly(self, n: int) -> bytes: ...


class ByteWriter(Protocol):
    """What the proxy writes to: :class:`asyncio.StreamWriter` or an in-memory one."""

    def write(self, data: bytes) -> None: ...
    async def drain(self) -> None: ...
    def can_write_eof(self) -> bool: ...
    def write_eof(self) -> None: ...
    def is_closing(self) -> bool: ...
    def close(self) -> None: ...
    async def wait_closed(self) -> None: ...


Stream = tuple[ByteReader, ByteWriter]
#: Opens the link's connection to its target.
Connector = Callable[[], Awaitable[Stream]]
#: Serves one connection (``asyncio.start_server``'s callback).
Handler = Callable[[ByteReader, ByteWriter], Awaitable[None]]
#: Bytes one direction of one connection holds between reading and delivering; past
#: it the proxy stops reading, so the sender feels back-pressure as from a full TCP
#: window (about Linux's largest autotuned receive window).
WINDOW_BYTES = 4 << 20
#: A segment is written when it is due within this much (s): the timer that wakes
#: the writer is aimed this much early, and due segments go out in one write.
COALESCE_S = 0.0005
_READ_BYTES = 64 << 10


#: Resolution of the delivered-bytes time series (s).
SERIES_BIN_S = 0.01


@dataclass
class DirectionStats:
    """Counters of one direction of a link (all its connections together)."""

    delivered_bytes: int = 0
    #: bytes delivered in each SERIES_BIN_S bin of link time, from 0
    bins: list[int] = field(default_factory=list)

    def record(self, t: float, nbytes: int) -> None:
        """``nbytes`` written to the receiving side at link time ``t``."""
        self.delivered_bytes += nbytes
        k = max(0, int(t / SERIES_BIN_S))
        if k >= len(self.bins):
            self.bins.extend([0] * (k + 1 - len(self.bins)))
        self.bins[k] += nbytes

    @property
    def series(self) -> list[tuple[float, int]]:
        """(bin start in link time s, bytes) of every bin that delivered something."""
        return [(k * SERIES_BIN_S, n) for k, n in enumerate(self.bins) if n]

    def delivered_between(self, start_s: float, end_s: float) -> int:
        """Bytes delivered in link time ``[start_s, end_s)`` (to the bin)."""
        a = max(0, round(start_s / SERIES_BIN_S))
        b = max(a, round(end_s / SERIES_BIN_S))
        return sum(self.bins[a:b])

    def goodput_bps(
        self, window_s: float, start_s: float = 0.0, end_s: float | None = None
    ) -> npt.NDArray[np.float64]:
        """Delivered bits/s in consecutive windows of ``window_s`` from ``start_s``, whole
        windows only, up to ``end_s`` (default: the last bin); to the bin."""
        if not (window_s > 0):
            raise ValueError("window_s must be > 0")
        if end_s is None:
            end_s = len(self.bins) * SERIES_BIN_S
        count = max(0, math.floor((end_s - start_s) / window_s + 1e-9))
        out = np.array(
            [
                self.delivered_between(start_s + k * window_s, start_s + (k + 1) * window_s)
                for k in range(count)
            ],
            dtype=np.float64,
        )
        result: npt.NDArray[np.float64] = out * 8 / window_s
        return result


class _Pipe:
    """Segments read and shaped, waiting for their delivery time; bounded in bytes."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.items: deque[tuple[Delivery, bytes]] = deque()
        self.bytes = 0
        self.closed = False
        self.readable = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()

    def put(self, delivery: Delivery, data: bytes) -> None:
        self.items.append((delivery, data))
        self.bytes += len(data)
        self.readable.set()
        if self.bytes >= self.window:
            self.writable.clear()

    def close(self) -> None:
        self.closed = True
        self.readable.set()

    def taken(self, nbytes: int) -> None:
        self.bytes -= nbytes
        if self.bytes < self.window:
            self.writable.set()


class EmulatedLink:
    """A TCP proxy on ``host``:``port`` (0: any free port, see :attr:`port`) to
    ``target`` through an emulated link; use as ``async with``. :meth:`in_memory`
    makes one with no sockets."""

    def __init__(
        self,
        config: LinkConfig,
        target: tuple[str, int],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        window_bytes: int = WINDOW_BYTES,
        connect: Connector | None = None,
        listen: bool = True,
    ) -> None:
        if window_bytes < PACKET_BYTES:
            raise ValueError(f"window_bytes={window_bytes!r} must be at least one segment")
        self.config = config
        self.target = target
        self.host = host
        self._listen_port = port
        self.window_bytes = window_bytes
        self._connect = connect or self._connect_tcp
        self._listen = listen
        self.uplink_stats = DirectionStats()
        self.downlink_stats = DirectionStats()
        self.connections = 0
        self.origin = math.nan
        self._shapers: dict[Side, Shaper] = {}
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self._ids = itertools.count()
        self._timers: list[asyncio.TimerHandle] = []
        #: writers asleep until a segment is due, woken early when segments are re-timed
        self._sleepers: set[asyncio.Future[None]] = set()
        self.port = 0

    @classmethod
    def in_memory(
        cls, config: LinkConfig, serve: Handler, *, window_bytes: int = WINDOW_BYTES
    ) -> EmulatedLink:
        """A link with no sockets: :meth:`open_connection` gives a client end, and each
        connection's far end is served by ``serve(reader, writer)`` in this process."""
        from splitinfer.sim.virtual import memory_pipe

        async def connect() -> Stream:
            near, far = memory_pipe()
            link._spawn(serve(*far))
            return near

        link = cls(config, ("memory", 0), window_bytes=window_bytes, connect=connect, listen=False)
        return link

    async def open_connection(self) -> Stream:
        """A client connection into the link (to :attr:`port`, or in memory)."""
        if self._listen:
            return await asyncio.open_connection(self.host, self.port)
        from splitinfer.sim.virtual import memory_pipe

        client, server = memory_pipe()
        self._spawn(self._accept(*server))
        return client

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect_tcp(self) -> Stream:
        return await asyncio.open_connection(*self.target)

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.origin = loop.time()
        for side in ("uplink", "downlink"):
            self._shapers[side] = Shaper.for_link(self.config, side, self.origin)
        for change in self.config.changes:
            self._arm(change.at_s)
        if self._listen:
            self._server = await asyncio.start_server(self._accept, self.host, self._listen_port)
            self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> EmulatedLink:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- runtime control and counters --------------------------------------------------
    def now(self) -> float:
        """Link time: seconds since the link started."""
        return asyncio.get_running_loop().time() - self.origin

    def shaper(self, side: Side) -> Shaper:
        if side not in self._shapers:
            raise RuntimeError("the link is not started: use `async with EmulatedLink(...)`")
        return self._shapers[side]

    def set_uplink(self, direction: Direction | str | float) -> None:
        """Switch the uplink now (``"1mbit"``, a trace path, a :class:`Direction`)."""
        self._set("uplink", direction)

    def set_downlink(self, direction: Direction | str | float) -> None:
        self._set("downlink", direction)

    def _set(self, side: Side, direction: Direction | str | float) -> None:
        shaper = self.shaper(side)
        shaper.set_direction(Direction.parse(direction), asyncio.get_running_loop().time())
        self._wake()

    def schedule_change(
        self,
        at_s: float,
        uplink: Direction | str | float | None = None,
        downlink: Direction | str | float | None = None,
    ) -> None:
        """Switch either direction at link time ``at_s``."""
        if uplink is not None:
            self.shaper("uplink").schedule(at_s, Direction.parse(uplink))
        if downlink is not None:
            self.shaper("downlink").schedule(at_s, Direction.parse(downlink))
        self._arm(at_s)

    def _arm(self, at_s: float) -> None:
        """At link time ``at_s``, let the shapers re-time their queues and wake writers."""
        loop = asyncio.get_running_loop()

        def fire() -> None:
            for shaper in self._shapers.values():
                shaper.tick(loop.time())
            self._wake()

        self._timers.append(loop.call_at(self.origin + at_s, fire))

    def _wake(self) -> None:
        for future in self._sleepers:
            if not future.done():
                future.set_result(None)

    async def _sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if a change of the link re-times segments."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(seconds, _resolve, future)
        self._sleepers.add(future)
        try:
            await future
        finally:
            timer.cancel()
            self._sleepers.discard(future)

    def queued_bytes(self, side: Side) -> float:
        """Bytes in the bottleneck queue of ``side`` now."""
        return self.shaper(side).queued_bytes(asyncio.get_running_loop().time())

    def stats(self, side: Side) -> DirectionStats:
        return self.uplink_stats if side == "uplink" else self.downlink_stats

    # -- the proxy --------------------------------------------------------------------
    async def _accept(self, c_reader: ByteReader, c_writer: ByteWriter) -> None:
        # asyncio's server reports a handler task that ends cancelled as an error, so
        # the connection runs in a task of its own that close() may cancel
        task = asyncio.ensure_future(self._connection(c_reader, c_writer))
        self._tasks.add(task)
        try:
            await asyncio.wait([task])
        finally:
            self._tasks.discard(task)

    async def _connection(self, c_reader: ByteReader, c_writer: ByteWriter) -> None:
        loop = asyncio.get_running_loop()
        accepted = loop.time()
        conn = next(self._ids)
        self.connections += 1
        t_writer: ByteWriter | None = None
        up: tuple[str, int] = ("up", conn)
        down: tuple[str, int] = ("down", conn)
        try:
            try:
                t_reader, t_writer = await self._connect()
            except OSError:
                return  # the client sees the connection closed, as with a refused connect
            handshake = accepted + 2 * self.config.delay_ms / 1000.0
            async with asyncio.TaskGroup() as group:
                group.create_task(self._pump(c_reader, t_writer, "uplink", up, handshake))
                group.create_task(self._pump(t_reader, c_writer, "downlink", down, accepted))
        except* (ConnectionError, OSError):
            pass  # one side reset or went away: close both
        finally:
            for w in (c_writer, t_writer):
                if w is not None:
                    w.close()
            for w in (c_writer, t_writer):
                if w is not None:
                    with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
                        await w.wait_closed()
            self._shapers["uplink"].close_stream(up)
            self._shapers["downlink"].close_stream(down)

    async def _pump(
        self,
        reader: ByteReader,
        writer: ByteWriter,
        side: Side,
        stream: tuple[str, int],
        not_before: float,
    ) -> None:
        """One direction of one connection until the reader's EOF has been passed on."""
        pipe = _Pipe(self.window_bytes)
        async with asyncio.TaskGroup() as group:
            group.create_task(self._read(reader, pipe, side, stream, not_before))
            group.create_task(self._deliver(pipe, writer, side))

    async def _read(
        self,
        reader: ByteReader,
        pipe: _Pipe,
        side: Side,
        stream: tuple[str, int],
        not_before: float,
    ) -> None:
        loop = asyncio.get_running_loop()
        shaper = self._shapers[side]
        wait = not_before - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        while True:
            data = await reader.read(_READ_BYTES)
            if not data:
                pipe.close()
                return
            for i in range(0, len(data), PACKET_BYTES):
                segment = data[i : i + PACKET_BYTES]
                attempt = 0
                while True:
                    d = shaper.offer(len(segment), loop.time(), stream, attempt)
                    if d.accepted:
                        break
                    attempt += 1
                    await asyncio.sleep(max(0.0, d.retry_at - loop.time()))
                pipe.put(d, segment)
            await pipe.writable.wait()

    async def _deliver(self, pipe: _Pipe, writer: ByteWriter, side: Side) -> None:
        loop = asyncio.get_running_loop()
        stats = self.stats(side)
        while True:
            while not pipe.items:
                if pipe.closed:
                    if writer.can_write_eof() and not writer.is_closing():
                        writer.write_eof()
                    return
                pipe.readable.clear()
                await pipe.readable.wait()
            # a timer fires up to ~1 ms late (epoll counts whole ms): aim half a ms early;
            # read the time again after waking, a change of the link may have moved it
            wait = pipe.items[0][0].deliver_at - COALESCE_S - loop.time()
            if wait > 0:
                await self._sleep(wait)
                continue
            horizon = loop.time() + COALESCE_S
            batch: list[bytes] = []
            while pipe.items and pipe.items[0][0].deliver_at <= horizon:
                batch.append(pipe.items.popleft()[1])
            data = b"".join(batch)
            writer.write(data)
            stats.record(loop.time() - self.origin, len(data))
            pipe.taken(len(data))
            await writer.drain()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
