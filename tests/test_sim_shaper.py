"""The link's pure logic: delivery times from a fixed rate or a Mahimahi trace, delay,
jitter, loss, outages, the queue bound, changes; and the link config. No sockets,
no sleeps: every test passes its own clock."""

from __future__ import annotations

import itertools
import math
import random
import statistics
import tomllib
from pathlib import Path

import numpy as np
import pytest

from splitinfer.shared.errors import ConfigError
from splitinfer.shared.links import MahimahiTrace
from splitinfer.sim import traces
from splitinfer.sim.config import Change, Direction, LinkConfig, parse_outage
from splitinfer.sim.link import DirectionStats
from splitinfer.sim.shaper import Shaper, TraceCapacity

pytestmark = pytest.mark.unit

TRACES = traces.DIR


def rate(text: str) -> Direction:
    return Direction.rate(text)


def trace_of(timestamps: list[int]) -> Direction:
    return Direction(trace=MahimahiTrace(np.array(timestamps, dtype=np.int64)))


# -- fixed rate ---------------------------------------------------------------------


def test_fixed_rate_delivery_times_are_exact() -> None:
    # 8 Mbit/s = 1e6 bytes/s: 1000 bytes take 1 ms; 10 ms one-way delay
    shaper = Shaper(rate("8mbit"), origin=100.0, delay_s=0.010)
    got = [shaper.offer(1000, 100.0).deliver_at for _ in range(10)]
    assert got == pytest.approx([100.0 + 0.001 * k + 0.010 for k in range(1, 11)], abs=1e-12)
    # the queue drained at 100.010; a segment at 100.5 finds it idle
    late = shaper.offer(500, 100.5)
    assert late.left_at == pytest.approx(100.5005, abs=1e-12)
    assert late.deliver_at == pytest.approx(100.5105, abs=1e-12)


def test_fixed_rate_queue_builds_and_drains() -> None:
    shaper = Shaper(rate("1mbit"))  # 125000 bytes/s: 1500 bytes take 12 ms
    for _ in range(4):
        shaper.offer(1500, 0.0)
    assert shaper.queued_bytes(0.0) == pytest.approx(6000)
    assert shaper.queued_bytes(0.018) == pytest.approx(6000 - 0.018 * 125000)
    assert shaper.queued_bytes(0.048) == 0
    # offered while 1500 bytes are still queued: waits behind them
    shaper2 = Shaper(rate("1mbit"))
    shaper2.offer(3000, 0.0)
    assert shaper2.offer(1500, 0.012).left_at == pytest.approx(0.036)


# -- Mahimahi traces -------------------------------------------------------------------


def test_trace_opportunities_carry_1500_bytes_each() -> None:
    # opportunities at 0, 0, 5, 10 ms; the trace repeats every 10 ms
    shaper = Shaper(trace_of([0, 0, 5, 10]))
    first = [shaper.offer(1500, 0.0).left_at for _ in range(5)]
    assert first == pytest.approx([0.0, 0.0, 0.005, 0.010, 0.010])


def test_trace_segments_share_an_opportunity_but_idle_capacity_is_lost() -> None:
    shaper = Shaper(trace_of([0, 0, 5, 10]))
    # three 500-byte segments fit in the opportunity at 0 ms
    assert [shaper.offer(500, 0.0).left_at for _ in range(3)] == [0.0, 0.0, 0.0]
    # a 2000-byte one takes the second at 0 ms and part of the one at 5 ms
    assert shaper.offer(2000, 0.0).left_at == pytest.approx(0.005)
    # arriving at 6 ms: the rest of the 5 ms opportunity has gone unused
    assert shaper.offer(100, 0.006).left_at == pytest.approx(0.010)


def test_trace_repeats_from_its_start() -> None:
    shaper = Shaper(trace_of([2, 4]))  # period 4 ms: opportunities at 2, 4, 6, 8, ...
    times = [shaper.offer(1500, 0.0).left_at for _ in range(6)]
    assert times == pytest.approx([0.002, 0.004, 0.006, 0.008, 0.010, 0.012])


def test_trace_offset_starts_the_replay_there() -> None:
    direction = Direction(
        trace=MahimahiTrace(np.array([1, 2, 3, 500, 1000], dtype=np.int64)), trace_offset_s=0.004
    )
    shaper = Shaper(direction)
    # link time 0 is trace time 4 ms: the next opportunities are at 500 and 1000 ms
    assert shaper.offer(1500, 0.0).left_at == pytest.approx(0.496)
    assert shaper.offer(1500, 0.0).left_at == pytest.approx(0.996)
    # then the next period: 1001, 1002, 1003 ms
    assert shaper.offer(1500, 0.0).left_at == pytest.approx(0.997)


def test_scalar_trace_index_agrees_with_shared_links() -> None:
    trace = MahimahiTrace(np.array([0, 0, 3, 3, 3, 9, 12, 12], dtype=np.int64))
    cap = TraceCapacity(trace)
    rng = np.random.default_rng(1)
    times = np.concatenate([rng.uniform(0, 80, 200), np.arange(0, 40, 1.0)])
    expected = trace.opportunities_before(times)
    assert [cap.count_before(float(t)) for t in times] == expected.tolist()
    assert [cap.opportunity_ms(i) for i in range(30)] == trace.opportunity_time(
        np.arange(30)
    ).tolist()


def _backlogged_run(shaper: Shaper, seconds: float, step: float = 0.005) -> list[float]:
    """A sender that keeps 150 kB queued: delivery times of its 1500-byte segments."""
    out = []
    now = 0.0
    while now < seconds:
        while shaper.queued_bytes(now) < 150_000:
            out.append(shaper.offer(1500, now).deliver_at)
        now += step
    return out


@pytest.mark.parametrize(("name", "offset_s"), [("ATT-LTE-driving-2016.up", 37.5)])
def test_trace_delivers_its_capacity_over_10s_windows(name: str, offset_s: float) -> None:
    path = TRACES / name
    raw = np.loadtxt(path, dtype=np.int64)  # read independently of MahimahiTrace
    period = int(raw[-1])
    replay = np.concatenate([raw, raw + period])  # two periods: the run wraps around
    shaper = Shaper(Direction.from_trace(path, offset_s))
    seconds = 130.0  # past the end of the trace (120 s) from a 37.5 s offset
    delivered = np.array(_backlogged_run(shaper, seconds + 1))
    for k in range(int(seconds // 10)):
        a, b = 10.0 * k, 10.0 * (k + 1)
        got = np.count_nonzero((delivered >= a) & (delivered < b)) * 1500
        lo, hi = (a + offset_s) * 1000, (b + offset_s) * 1000
        capacity = np.count_nonzero((replay >= lo) & (replay < hi)) * 1500
        assert got == pytest.approx(capacity, rel=0.01), f"window {a:g}-{b:g} s"


# -- delay, jitter, loss ---------------------------------------------------------------


def test_delay_and_jitter_keep_each_stream_in_order() -> None:
    shaper = Shaper(rate("100mbit"), delay_s=0.020, jitter_s=0.005, rng=random.Random(3))
    per_stream: dict[str, list[float]] = {"a": [], "b": []}
    flight = []
    for i in range(2000):
        now = i * 0.0005
        stream = "a" if i % 2 else "b"
        d = shaper.offer(1500, now, stream)
        per_stream[stream].append(d.deliver_at)
        flight.append(d.deliver_at - d.left_at)
    for times in per_stream.values():
        assert all(x <= y for x, y in itertools.pairwise(times))
    assert min(flight) >= 0.015 - 1e-12
    assert max(flight) <= 0.025 + 0.005  # an in-order hold never exceeds the jitter span
    assert statistics.pstdev(flight) > 0.001  # the jitter is there
    assert statistics.mean(flight) == pytest.approx(0.020, abs=0.002)


def test_streams_do_not_hold_each_other_back() -> None:
    shaper = Shaper(rate("100mbit"), loss=0.5, retransmit_s=0.2, rng=random.Random(0))
    lost = next(d for i in range(100) if (d := shaper.offer(100, i * 0.01, stream=("x", i))).losses)
    same = shaper.offer(100, lost.left_at + 0.001, stream=lost.stream)
    assert same.deliver_at >= lost.deliver_at  # TCP hands bytes over in order
    other = next(
        d
        for j in range(50)
        if not (d := shaper.offer(100, lost.left_at + 0.001 * (j + 2), stream=("o", j))).losses
    )
    assert other.deliver_at < lost.deliver_at  # another connection is not held back


@pytest.mark.parametrize("loss", [0.0, 0.02, 0.1])
def test_loss_adds_a_retransmission_delay_at_the_configured_rate(loss: float) -> None:
    n, retransmit = 5000, 0.040
    shaper = Shaper(
        rate("12mbit"), delay_s=0.010, loss=loss, retransmit_s=retransmit, rng=random.Random(7)
    )
    late = 0
    for i in range(n):
        now = i * 0.5  # idle link between segments: no queueing
        d = shaper.offer(1500, now, stream=i)
        extra = d.deliver_at - (now + 0.001 + 0.010)
        if d.losses:
            # the lost copy used the bottleneck, then the retransmission waits
            assert extra >= d.losses * 0.001 + retransmit - 1e-9
            late += 1
        else:
            assert extra == pytest.approx(0.0, abs=1e-9)
    sigma = math.sqrt(max(loss * (1 - loss), 1e-12) / n)
    assert late / n == pytest.approx(loss, abs=4 * sigma + 1e-12)
    assert shaper.lost_segments >= late


def test_retransmission_delay_defaults_to_one_round_trip() -> None:
    assert LinkConfig(delay_ms=25).retransmit_s == pytest.approx(0.050)
    assert LinkConfig().retransmit_s > 0
    assert LinkConfig(delay_ms=25, retransmit_ms=200).retransmit_s == pytest.approx(0.2)


# -- outages and the queue ----------------------------------------------------------------


@pytest.mark.parametrize("direction", [rate("1mbit"), Direction.unlimited()])
def test_outage_delivers_nothing_and_bytes_queue(direction: Direction) -> None:
    shaper = Shaper(direction, origin=50.0, delay_s=0.005, outages=[(1.0, 0.5)])
    offered = []
    queued = {}
    for i in range(40):  # 1000 bytes every 20 ms from 0.9 s to 1.68 s
        now = 50.0 + 0.9 + i * 0.02
        offered.append((now, shaper.offer(1000, now)))
        queued[i] = shaper.queued_bytes(now)
    left = [d.left_at - 50.0 for _, d in offered]
    assert not any(1.0 <= t < 1.5 for t in left)
    assert all(d.deliver_at >= t + 0.005 for t, d in offered)
    # at 1.4 s (i = 25) everything offered since the outage began is still queued
    during = sum(1000 for t, _ in offered if 51.0 <= t <= 51.4 + 1e-9)
    assert queued[25] >= during
    after = [t for t in left if t >= 1.5]
    assert after, "the queue drains after the outage"
    assert min(after) == pytest.approx(1.5 + (0.008 if direction.rate_bps else 0.0), abs=1e-9)


def test_outage_on_a_trace_skips_its_opportunities() -> None:
    shaper = Shaper(trace_of([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), outages=[(0.0035, 0.003)])
    times = [round(shaper.offer(1500, 0.0).left_at * 1000, 6) for _ in range(6)]
    assert times == [1, 2, 3, 7, 8, 9]


def test_queue_bound_drops_then_accepts_once_it_drains() -> None:
    shaper = Shaper(rate("1mbit"), queue_bytes=15_000, retransmit_s=0.05)
    accepted = [shaper.offer(1500, 0.0) for _ in range(10)]
    assert all(d.accepted for d in accepted)
    dropped = shaper.offer(1500, 0.0)
    assert not dropped.accepted
    assert dropped.retry_at == pytest.approx(0.05)
    again = shaper.offer(1500, 0.0, attempt=2)
    assert again.retry_at == pytest.approx(0.2)  # backoff doubles per attempt
    assert shaper.queued_bytes(0.0) == pytest.approx(15_000)
    # 12 ms later one segment has left: room for one more
    assert shaper.offer(1500, 0.012).accepted
    assert not shaper.offer(1500, 0.012).accepted
    assert shaper.dropped_segments == 3


def test_a_sender_retrying_drops_never_exceeds_the_queue_bound() -> None:
    bound = 30_000
    shaper = Shaper(trace_of([0, 1, 1, 3, 4]), queue_bytes=bound, retransmit_s=0.01)
    now, attempt, sent = 0.0, 0, 0
    peak = 0.0
    while now < 2.0:
        d = shaper.offer(1500, now, attempt=attempt)
        if d.accepted:
            sent += 1
            attempt = 0
            now += 0.0001
        else:
            attempt += 1
            now = d.retry_at
        peak = max(peak, shaper.queued_bytes(now))
    assert peak <= bound
    assert shaper.dropped_segments > 0
    assert sent * 1500 >= 0.9 * 2.0 * 4 / 0.004 * 1500  # the link stayed busy


# -- changes -------------------------------------------------------------------------------


def test_scheduled_change_re_times_what_is_still_queued() -> None:
    slow = rate("1mbit")  # 1500 bytes: 12 ms
    shaper = Shaper(rate("12mbit"), changes=[(0.0025, slow)])  # 1500 bytes: 1 ms
    first = [shaper.offer(1500, 0.0) for _ in range(4)]
    assert [d.deliver_at for d in first] == pytest.approx([0.001, 0.002, 0.003, 0.004])
    shaper.tick(0.0025)
    # two had left; the third restarts at 2.5 ms at the new rate, the fourth behind it
    assert [d.deliver_at for d in first] == pytest.approx([0.001, 0.002, 0.0145, 0.0265])
    assert shaper.offer(1500, 0.003).deliver_at == pytest.approx(0.0385)


def test_runtime_switch_takes_effect_for_new_offers() -> None:
    shaper = Shaper(rate("8mbit"))
    assert shaper.offer(1000, 0.0).deliver_at == pytest.approx(0.001)
    shaper.set_direction(rate("800kbit"), 0.5)
    assert shaper.offer(1000, 0.5).deliver_at == pytest.approx(0.51)
    shaper.set_direction(trace_of([5, 10]), 1.0)  # the trace starts over at the switch
    assert shaper.offer(1000, 1.0).deliver_at == pytest.approx(1.005)


def test_time_must_not_go_backwards() -> None:
    shaper = Shaper(rate("1mbit"))
    shaper.offer(100, 1.0)
    with pytest.raises(ValueError, match="backwards"):
        shaper.offer(100, 0.5)


# -- config -------------------------------------------------------------------------------


def test_link_config_from_toml(tmp_path: Path) -> None:
    table = tomllib.loads(
        """
        [link]
        uplink = { trace = "ATT-LTE-driving-2016.up", offset = "30s" }
        downlink = "10mbit"
        delay_ms = "25ms"
        jitter_ms = 2
        loss = 0.01
        outages = [["10s", "5s"], [30, 2]]
        queue_bytes = 65536
        seed = 4
        changes = [{ at = "20s", uplink = "500kbit" }]
        """
    )
    config = LinkConfig.from_dict(table["link"], base=tmp_path)  # a bundled trace, by name
    assert config.uplink.trace is not None
    assert config.uplink.trace.packets > 1000
    assert config.uplink.trace_offset_s == 30.0
    assert config.downlink.rate_bps == 10e6
    assert (config.delay_ms, config.jitter_ms, config.loss) == (25.0, 2.0, 0.01)
    assert config.outages == ((10.0, 5.0), (30.0, 2.0))
    assert config.changes == (Change(20.0, uplink=Direction(rate_bps=500e3)),)
    uplink = Shaper.for_link(config, "uplink", origin=0.0)
    assert uplink.delay_s == 0.025
    assert "trace" in config.describe()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("5mbit", Direction(rate_bps=5e6)),
        ("500kB/s", Direction(rate_bps=4e6)),
        ("unlimited", Direction()),
        (2e6, Direction(rate_bps=2e6)),
        ({"rate": "1mbit"}, Direction(rate_bps=1e6)),
    ],
)
def test_direction_parse(value: object, expected: Direction) -> None:
    assert Direction.parse(value) == expected


def test_direction_parse_reads_a_trace_file(tmp_path: Path) -> None:
    (tmp_path / "t.up").write_text("1\n2\n2\n4\n")
    direction = Direction.parse("t.up", base=tmp_path)
    assert direction.trace is not None
    assert direction.mean_bps == pytest.approx(4 * 1500 * 8 / 0.004)


def test_a_bare_trace_name_is_the_bundled_trace_unless_a_file_is_there(tmp_path: Path) -> None:
    name = "ATT-LTE-driving-2016.up"
    bundled = Direction.parse(name, base=tmp_path)
    assert bundled.trace is not None
    assert bundled.mean_bps == pytest.approx(1.91e6, rel=0.01)  # its README row
    assert traces.path(name).parent == traces.DIR
    assert name in traces.names()
    (tmp_path / name).write_text("1\n")  # a file beside the scenario wins
    assert Direction.parse(name, base=tmp_path).mean_bps == pytest.approx(12e6)
    with pytest.raises(ConfigError, match=r"no bundled trace 'nope\.up'"):
        traces.path("nope.up")
    with pytest.raises(ConfigError, match="neither a rate nor a trace file"):
        Direction.parse("nope.up", base=tmp_path)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("5mbps", "ambiguous"),
        ("fast", "neither a rate nor a trace file"),
        ({"rate": "1mbit", "trace": "x"}, "not understood"),
        ({"trace": "/nonexistent/trace.up"}, "no such trace file"),
        (True, "not understood"),
    ],
)
def test_direction_parse_errors_name_the_value(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Direction.parse(value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"delay_ms": -1}, "delay_ms=-1"),
        ({"jitter_ms": float("nan")}, "jitter_ms"),
        ({"loss": 1.0}, r"loss=1\.0"),
        ({"queue_bytes": 100}, "queue_bytes=100"),
        ({"outages": ((5.0, 0.0),)}, "duration"),
        ({"outages": ((0.0, 10.0), (5.0, 1.0))}, "overlap"),
        ({"retransmit_ms": 0}, "retransmit_ms"),
        ({"uplink": "5mbit"}, "Direction"),
    ],
)
def test_link_config_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LinkConfig(**kwargs)  # type: ignore[arg-type]


def test_link_config_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ConfigError, match="latency"):
        LinkConfig.from_dict({"latency": "25ms"})
    assert LinkConfig.from_dict({"delay": "25ms"}).delay_ms == 25.0  # units in the value
    with pytest.raises(ConfigError, match="changes nothing"):
        LinkConfig.from_dict({"changes": [{"at": 1}]})


def test_parse_outage() -> None:
    assert parse_outage("10s,5s") == (10.0, 5.0)
    assert parse_outage("1.5, 500ms") == (1.5, 0.5)
    with pytest.raises(ConfigError, match="START,DURATION"):
        parse_outage("10s")


def test_direction_stats_bin_deliveries_for_goodput_windows() -> None:
    stats = DirectionStats()
    for i in range(300):  # 1000 bytes every 10 ms for 3 s: 800 kbit/s
        stats.record(i * 0.01 + 0.001, 1000)
    stats.record(3.5, 5000)
    assert stats.delivered_bytes == 305_000
    assert stats.delivered_between(1.0, 2.0) == 100_000
    assert stats.goodput_bps(1.0).tolist() == pytest.approx([8e5, 8e5, 8e5])
    assert stats.goodput_bps(0.5, 2.5, 3.5).tolist() == pytest.approx([8e5, 0.0])
    assert stats.series[-1] == (pytest.approx(3.5), 5000)
