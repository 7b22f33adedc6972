"""The emulated link with no sockets, on a virtual clock.

:class:`VirtualTimeLoop` is an asyncio event loop whose ``time()`` is virtual: when
every task waits, it jumps straight to the next timer instead of sleeping, so a
20 s trace replays in a fraction of a second and a stall of this machine moves no
byte across a window edge. Nothing in it may wait on real I/O: connections are
:func:`memory_pipe` pairs (a duplex in-memory stream with a bounded buffer, so a
fast writer feels back-pressure as from a TCP window).

    async def main() -> None:
        async with EmulatedLink.in_memory(config, serve=handler) as link:
            reader, writer = await link.open_connection()
            ...

    run_virtual(main())

:class:`~splitinfer.sim.link.EmulatedLink` reads all its time from the loop, so the
same code runs on real sockets and real time (``netsim link``) or here.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

#: A writer's ``drain()`` waits while its peer holds more than this unread (bytes):
#: asyncio's default high-water mark for a socket transport.
HIGH_WATER_BYTES = 64 << 10
#: With no timer due and no ready task, the loop waits this long (real s) for a thread
#: (an executor) to call back before it calls the run a deadlock.
DEADLOCK_S = 5.0

T = TypeVar("T")


class Deadlock(RuntimeError):
    """Every task waits, no timer is due and nothing can wake them."""


class _Selector(selectors.DefaultSelector):
    """The loop's selector: real readiness only (the loop's self-pipe, threads calling
    back); a wait with a timeout moves the virtual clock instead of sleeping."""

    def __init__(self, deadlock_s: float) -> None:
        super().__init__()
        self.now = 0.0
        self.deadlock_s = deadlock_s

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # nothing scheduled: only another thread can wake us
            ready = super().select(self.deadlock_s)
            if not ready:
                raise Deadlock("every task waits and no timer is due")
            return ready
        self.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time, from 0; see the module docstring. With nothing
    ready and no timer due it waits ``deadlock_s`` real seconds for another thread,
    then raises :class:`Deadlock`."""

    def __init__(self, deadlock_s: float = DEADLOCK_S) -> None:
        self._virtual = _Selector(deadlock_s)
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now


def run_virtual(main: Coroutine[Any, Any, T], *, deadlock_s: float = DEADLOCK_S) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualTimeLoop`."""
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(deadlock_s)) as runner:
        return runner.run(main)


# -- in-memory streams -------------------------------------------------------------------


class _Channel:
    """One direction of a pipe: bytes written, not yet read."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.eof = False  # the writer is done
        self.abandoned = False  # the reader's end is closed: nobody will read
        self.changed = asyncio.Event()

    def poke(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class MemoryReader:
    """The reading half of one end (``read``, ``readexactly`` as asyncio's)."""

    def __init__(self, channel: _Channel) -> None:
        self._ch = channel

    async def _wait(self, enough: int) -> None:
        ch = self._ch
        while len(ch.buffer) < enough and not ch.eof:
            await ch.changed.wait()

    def _take(self, n: int) -> bytes:
        ch = self._ch
        data = bytes(ch.buffer[:n])
        if data:
            del ch.buffer[:n]
            ch.poke()  # a writer in drain() may go on
        return data

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes as soon as there are any (``-1``: everything up to EOF);
        ``b""`` at EOF."""
        ch = self._ch
        if n < 0:  # read as it comes, so that the writer is never held up
            out = bytearray()
            while True:
                out += self._take(len(ch.buffer))
                if ch.eof:
                    return bytes(out)
                await ch.changed.wait()
        await self._wait(1)
        return self._take(min(n, len(ch.buffer)))

    async def readexactly(self, n: int) -> bytes:
        await self._wait(n)
        if len(self._ch.buffer) < n:
            raise asyncio.IncompleteReadError(self._take(len(self._ch.buffer)), n)
        return self._take(n)

    def at_eof(self) -> bool:
        return self._ch.eof and not self._ch.buffer


class MemoryWriter:
    """The writing half of one end, shaped like :class:`asyncio.StreamWriter`."""

    def __init__(self, out: _Channel, back: _Channel) -> None:
        self._out = out
        self._back = back
        self._closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or self._out.eof:
            raise ConnectionResetError("write to a closed memory stream")
        if self._out.abandoned:
            raise BrokenPipeError("the other end is closed")
        self._out.buffer += data
        self._out.poke()

    async def drain(self) -> None:
        out = self._out
        while len(out.buffer) > HIGH_WATER_BYTES and not out.abandoned:
            await out.changed.wait()
        if out.abandoned:
            raise BrokenPipeError("the other end is closed")

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self._out.eof = True
        self._out.poke()

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Close this end both ways, as closing a socket does."""
        if self._closing:
            return
        self._closing = True
        self.write_eof()
        self._back.abandoned = True
        self._back.poke()

    async def wait_closed(self) -> None:
        return None


Pair = tuple[MemoryReader, MemoryWriter]


def memory_pipe() -> tuple[Pair, Pair]:
    """Two connected ends, each a (reader, writer): what one end writes, the other reads."""
    a_to_b, b_to_a = _Channel(), _Channel()
    a = (MemoryReader(b_to_a), MemoryWriter(a_to_b, b_to_a))
    b = (MemoryReader(a_to_b), MemoryWriter(b_to_a, a_to_b))
    return a, b
