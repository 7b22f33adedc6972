"""The emulated link: goodput follows the rate or the trace, the added delay is the
configured one, changes and outages take effect; and ``netsim link``.

Every test but the last runs the real proxy (:class:`EmulatedLink`) on virtual time
(:class:`VirtualTimeLoop`, in-memory connections): figures are read at the receiving
handler with the loop's clock, so they are exact up to a segment and a machine that
stalls cannot move a byte across a window edge. The last test is the one real-socket
smoke test: ``netsim link`` as a subprocess on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from splitinfer.sim import traces
from splitinfer.sim.cli import main
from splitinfer.sim.config import Change, Direction, LinkConfig
from splitinfer.sim.link import COALESCE_S, ByteReader, ByteWriter, EmulatedLink
from splitinfer.sim.virtual import (
    HIGH_WATER_BYTES,
    Deadlock,
    VirtualTimeLoop,
    memory_pipe,
    run_virtual,
)

pytestmark = pytest.mark.sim

BLOB = b"\x5a" * 65536

Handler = Callable[[ByteReader, ByteWriter], Awaitable[None]]
Arrivals = list[tuple[float, int]]


def now() -> float:
    return asyncio.get_running_loop().time()


async def until(link: EmulatedLink, t: float) -> None:
    """Wait to link time ``t``: virtual, so it costs no real time."""
    assert isinstance(asyncio.get_running_loop(), VirtualTimeLoop)
    await asyncio.sleep(max(0.0, link.origin + t - now()))


def sink(arrivals: Arrivals) -> Handler:
    """A handler that reads everything and notes when each read came in."""

    async def handle(reader: ByteReader, writer: ByteWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                arrivals.append((now(), len(data)))
        writer.close()

    return handle


async def source(writer: ByteWriter) -> None:
    """Write as fast as the other side takes it, until cancelled."""
    with contextlib.suppress(ConnectionError):
        while True:
            writer.write(BLOB)
            await writer.drain()


async def source_handler(reader: ByteReader, writer: ByteWriter) -> None:
    await source(writer)


async def echo(reader: ByteReader, writer: ByteWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


def goodput(arrivals: Arrivals, origin: float, a: float, b: float) -> float:
    """Bits/s received in ``[a, b)`` seconds after ``origin``."""
    return sum(n for t, n in arrivals if a <= t - origin < b) * 8 / (b - a)


def within_a_segment(expected_bps: float, window_s: float) -> object:
    """``expected_bps`` give or take two 1500-byte segments over the window."""
    return pytest.approx(expected_bps, abs=2 * 1500 * 8 / window_s)


async def saturate_uplink(config: LinkConfig, seconds: float) -> tuple[Arrivals, EmulatedLink]:
    """Keep the uplink backlogged for ``seconds`` of link time; what the target read."""
    arrivals: Arrivals = []
    async with EmulatedLink.in_memory(config, sink(arrivals)) as link:
        _, writer = await link.open_connection()
        sender = asyncio.ensure_future(source(writer))
        await until(link, seconds)
        sender.cancel()
        writer.close()
    return arrivals, link


# -- the virtual clock and the in-memory streams ------------------------------------------


def test_virtual_time_jumps_to_the_next_timer() -> None:
    async def run() -> tuple[float, float]:
        start = time.monotonic()
        await asyncio.sleep(3600)
        return now(), time.monotonic() - start

    virtual, real = run_virtual(run())
    assert virtual == pytest.approx(3600)
    assert real < 1.0


def test_a_deadlock_on_virtual_time_is_an_error_not_a_hang() -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    with pytest.raises(Deadlock, match="no timer is due"):
        run_virtual(forever(), deadlock_s=0.05)


def test_memory_pipe_carries_bytes_and_pushes_back() -> None:
    async def run() -> None:
        (a_read, a_write), (b_read, b_write) = memory_pipe()
        a_write.write(b"x" * (HIGH_WATER_BYTES + 1))
        drained = asyncio.ensure_future(a_write.drain())
        await asyncio.sleep(1)
        assert not drained.done()  # the reader is behind: the writer waits
        assert len(await b_read.read(1000)) == 1000
        await asyncio.wait_for(drained, 1)
        assert await b_read.readexactly(HIGH_WATER_BYTES - 999) == b"x" * (HIGH_WATER_BYTES - 999)
        b_write.write(b"back")
        b_write.close()  # closes both ways, as a socket does
        assert await a_read.read() == b"back"
        assert await a_read.read(10) == b""
        with pytest.raises(BrokenPipeError):
            a_write.write(b"more")
        with pytest.raises(asyncio.IncompleteReadError):
            await a_read.readexactly(1)

    run_virtual(run())


# -- goodput ------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["uplink", "downlink"])
def test_fixed_rate_goodput_matches_the_rate(side: str) -> None:
    rate = 4e6
    shaped = Direction(rate_bps=rate)

    async def downlink() -> tuple[Arrivals, EmulatedLink]:
        arrivals: Arrivals = []
        async with EmulatedLink.in_memory(LinkConfig(downlink=shaped), source_handler) as link:
            reader, writer = await link.open_connection()
            reading = asyncio.ensure_future(sink(arrivals)(reader, writer))
            await until(link, 4.6)
            reading.cancel()
            writer.close()
        return arrivals, link

    if side == "uplink":
        arrivals, link = run_virtual(saturate_uplink(LinkConfig(uplink=shaped), 4.6))
    else:
        arrivals, link = run_virtual(downlink())
    for a, b in [(0.5, 2.5), (2.5, 4.5)]:
        assert goodput(arrivals, link.origin, a, b) == within_a_segment(rate, b - a), (a, b)
        counted = link.stats(side).goodput_bps(b - a, a, b)  # type: ignore[arg-type]
        assert counted[0] == within_a_segment(rate, b - a)


def test_trace_goodput_matches_its_capacity_over_10s_windows() -> None:
    # 20 s of the ATT driving uplink from 81 s in, its most variable stretch: about 1
    # and 2.4 Mbit/s per 10 s window, from 0.01 to 9 Mbit/s in single seconds
    path, offset = traces.path("ATT-LTE-driving-2016.up"), 81.0
    ts = np.loadtxt(path, dtype=np.int64)  # read independently of the link
    config = LinkConfig(uplink=Direction.from_trace(path, offset))
    arrivals, link = run_virtual(saturate_uplink(config, 20.5))
    for a, b in [(0.25, 10.25), (10.25, 20.25)]:
        lo, hi = (a + offset) * 1000, (b + offset) * 1000
        capacity = np.count_nonzero((ts >= lo) & (ts < hi)) * 1500 * 8 / (b - a)
        assert goodput(arrivals, link.origin, a, b) == within_a_segment(capacity, b - a), (a, b)


# -- delay ------------------------------------------------------------------------------


def stamping_echo(seen: asyncio.Queue[float]) -> Handler:
    async def handle(reader: ByteReader, writer: ByteWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                data = await reader.readexactly(64)
                seen.put_nowait(now())
                writer.write(data)
                await writer.drain()
        writer.close()

    return handle


def test_added_one_way_delay_is_the_configured_one() -> None:
    delay_ms = 20.0
    config = LinkConfig(
        uplink=Direction.rate("50mbit"), downlink=Direction.rate("50mbit"), delay_ms=delay_ms
    )

    async def run() -> tuple[list[float], list[float]]:
        seen: asyncio.Queue[float] = asyncio.Queue()
        async with EmulatedLink.in_memory(config, stamping_echo(seen)) as link:
            reader, writer = await link.open_connection()
            up, down = [], []
            for i in range(12):
                sent = now()
                writer.write(b"p" * 64)
                await writer.drain()
                await reader.readexactly(64)
                back, arrived = now(), seen.get_nowait()
                if i >= 2:  # the first ones pay for the handshake
                    up.append(arrived - sent)
                    down.append(back - arrived)
                await asyncio.sleep(0.005)
            writer.close()
        return up, down

    up, down = run_virtual(run())
    serialize_ms = 64 * 8 / 50e6 * 1000
    for one_way in (up, down):
        # a segment is written up to half a millisecond early (COALESCE_S: a real timer
        # fires late, so the proxy aims early)
        assert min(one_way) >= (delay_ms / 1000) - COALESCE_S
        assert max(one_way) <= (delay_ms + serialize_ms) / 1000
    # the handshake: the first byte of a new connection enters one round trip later
    assert statistics.median(up) == pytest.approx(delay_ms / 1000, abs=0.6e-3)


# -- changes and outages -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["runtime", "scheduled"])
def test_rate_change_mid_run_takes_effect(how: str) -> None:
    fast, slow = 8e6, 1e6
    changes = (Change(2.0, uplink=Direction(rate_bps=slow)),) if how == "scheduled" else ()
    config = LinkConfig(uplink=Direction(rate_bps=fast), changes=changes)

    async def run() -> tuple[Arrivals, EmulatedLink]:
        arrivals: Arrivals = []
        async with EmulatedLink.in_memory(config, sink(arrivals)) as link:
            _, writer = await link.open_connection()
            sender = asyncio.ensure_future(source(writer))
            if how == "runtime":
                await until(link, 2.0)
                link.set_uplink("1mbit")
            await until(link, 4.3)
            sender.cancel()
            writer.close()
        return arrivals, link

    arrivals, link = run_virtual(run())
    assert goodput(arrivals, link.origin, 0.5, 2.0) == within_a_segment(fast, 1.5)
    # the queue built at 8 Mbit/s drains at 1 Mbit/s at once: no backlog at the old rate
    assert goodput(arrivals, link.origin, 2.01, 4.21) == within_a_segment(slow, 2.2)


def test_outage_holds_bytes_back_and_loses_none() -> None:
    config = LinkConfig(delay_ms=5, outages=((0.5, 1.0),))

    async def run() -> tuple[bytes, float]:
        async with EmulatedLink.in_memory(config, stamping_echo(asyncio.Queue())) as link:
            reader, writer = await link.open_connection()
            await until(link, 0.6)
            writer.write(b"q" * 64)
            await writer.drain()
            echoed = await asyncio.wait_for(reader.readexactly(64), 5.0)
            back = now() - link.origin
            writer.close()
        return echoed, back

    echoed, back = run_virtual(run())
    assert echoed == b"q" * 64
    # up: waits for the end of the outage (1.5 s) + 5 ms; down: + 5 ms; each segment
    # written half a millisecond early (see test_added_one_way_delay_is_the_configured_one)
    assert back == pytest.approx(1.5 + 2 * (0.005 - COALESCE_S))


def test_bytes_arrive_intact_under_jitter_loss_drops_and_an_outage() -> None:
    config = LinkConfig(
        uplink=Direction.rate("4mbit"),
        downlink=Direction.rate("8mbit"),
        delay_ms=5,
        jitter_ms=4,
        loss=0.02,
        queue_bytes=20_000,
        outages=((0.4, 0.3),),
        seed=11,
    )
    payloads = [np.random.default_rng(i).bytes(150_000) for i in range(3)]

    async def run() -> tuple[list[bytes], int, int]:
        async def roundtrip(link: EmulatedLink, payload: bytes) -> bytes:
            reader, writer = await link.open_connection()
            writer.write(payload)
            await writer.drain()
            writer.write_eof()
            data = await reader.read()
            writer.close()
            return data

        async with EmulatedLink.in_memory(config, echo) as link:
            echoed = await asyncio.wait_for(
                asyncio.gather(*(roundtrip(link, p) for p in payloads)), 20
            )
            up = link.shaper("uplink")
            return list(echoed), up.dropped_segments, up.lost_segments

    echoed, dropped, lost = run_virtual(run())
    assert dropped > 0  # three senders overflow the 20 kB queue
    assert lost > 0
    assert echoed == payloads


# -- netsim link --------------------------------------------------------------------------


def test_cli_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in [
        (["link", "--target", "nohost"], "HOST:PORT"),
        (["link", "--target", "127.0.0.1:1", "--uplink", "5mbps"], "ambiguous"),
        (["link", "--target", "127.0.0.1:1", "--delay", "5"], "duration"),
        (["link", "--target", "127.0.0.1:1", "--outage", "3s"], "START,DURATION"),
        (["link"], "--target"),
        ([], "COMMAND"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert err[0].startswith("netsim: error: ")
        assert message in err[0]


@pytest.mark.integration
async def test_netsim_link_command_proxies_over_real_sockets() -> None:
    """The real-socket smoke test: ``netsim link`` as a process, an echo server on
    loopback. Real time on a shared machine: only bounds a stall cannot break."""

    async def tcp_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await echo(reader, writer)

    server = await asyncio.start_server(tcp_echo, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "splitinfer.sim.cli",
            "link",
            "--uplink",
            "8mbit",
            "--downlink",
            "unlimited",
            "--delay",
            "15ms",
            "--target",
            f"127.0.0.1:{port}",
            "--duration",
            "2.5s",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None
        first = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert "listening on 127.0.0.1:" in first, first
        link_port = int(first.split("127.0.0.1:")[1].split()[0])
        reader, writer = await asyncio.open_connection("127.0.0.1", link_port)
        rtts = []
        for _ in range(5):
            sent = time.monotonic()
            writer.write(b"r" * 100)
            await writer.drain()
            assert await reader.readexactly(100) == b"r" * 100
            rtts.append(time.monotonic() - sent)
        writer.close()
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        server.close()
    assert proc.returncode == 0, err.decode()
    assert min(rtts) >= 0.0295  # never faster than the two 15 ms delays
    assert "up=500B" in out.decode()
