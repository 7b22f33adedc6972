"""Rates and durations, Mahimahi traces, and the link model's transfer times."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitinfer.shared.errors import ConfigError
from splitinfer.shared.links import Link, MahimahiTrace, parse_duration, parse_rate
from splitinfer.sim import traces

pytestmark = pytest.mark.unit

TRACES = traces.DIR


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("5mbit", 5e6),
        ("500kbit", 5e5),
        ("1.5Mbit/s", 1.5e6),
        ("2gbit", 2e9),
        ("2GBIT", 2e9),
        ("64bit", 64.0),
        ("800kbit/s", 8e5),
        ("500kB/s", 4e6),
        ("500KB", 4e6),
        ("1MB/s", 8e6),
        ("0.5GB/s", 4e9),
        ("100B/s", 800.0),
        (" 1e3kbit ", 1e6),
        (".25mbit", 2.5e5),
    ],
)
def test_parse_rate_accepts_bit_and_byte_units(text: str, bps: float) -> None:
    assert parse_rate(text) == pytest.approx(bps, rel=1e-12)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("800kbps", "ambiguous"),
        ("5mb", "ambiguous"),
        ("5Mbps", "ambiguous"),
        ("5", "not understood"),
        ("fast", "not understood"),
        ("5 furlongs", "not understood"),
        ("5mbit/s/s", "not understood"),
        ("-1mbit", "rate must not be negative (got -1mbit)"),
        ("-0mbit", "not understood"),
        ("0mbit", "greater than zero"),
        ("", "not understood"),
    ],
)
def test_parse_rate_refuses_bad_text_in_one_line_naming_the_forms(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_rate(text)
    message = str(info.value)
    assert says in message
    assert "\n" not in message
    assert "kbit" in message or "bit" in message


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("50ms", 0.05), ("0.05s", 0.05), ("1s", 1.0), ("250us", 250e-6), ("0ms", 0.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize("text", ["50", "5m", "1h", "-1h", "ms", "1 minute"])
def test_parse_duration_refuses_bad_text(text: str) -> None:
    with pytest.raises(ConfigError, match=r"us, ms or s"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("parse", "text", "name", "message"),
    [
        (parse_duration, "-5ms", "--rtt", "--rtt: must not be negative (got -5ms)"),
        (parse_duration, " -1s ", None, "duration must not be negative (got -1s)"),
        (parse_duration, "-.5s", "--delay", "--delay: must not be negative (got -.5s)"),
        (parse_rate, "-5mbit", "--uplink", "--uplink: must not be negative (got -5mbit)"),
        (parse_rate, "-500kB/s", None, "rate must not be negative (got -500kB/s)"),
    ],
)
def test_negative_values_say_so(parse: Any, text: str, name: str | None, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(text, name)
    assert str(info.value) == message


def test_a_named_parse_names_the_flag_in_every_message() -> None:
    with pytest.raises(ConfigError, match=r"^--rtt: duration 'soon' not understood"):
        parse_duration("soon", "--rtt")
    with pytest.raises(ConfigError, match=r"^--uplink: rate '5mbps' is ambiguous"):
        parse_rate("5mbps", "--uplink")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Link.fixed(-1e6, 1e6), "uplink: must not be negative (got -1000000.0)"),
        (lambda: Link.fixed(1e6, 1e6, -0.01), "rtt: must not be negative (got -0.01)"),
        (lambda: Link.fixed("1mbit", "1mbit", "-5ms"), "rtt: must not be negative (got -5ms)"),
    ],
)
def test_link_refuses_negative_numbers(make: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        make()
    assert str(info.value) == message


# -- traces -------------------------------------------------------------------------


def readme_means() -> dict[str, float]:
    """file -> mean capacity in bits/s, from the traces' README table."""
    text = (TRACES / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\|\s*(\S+)\s*\|[^|]*\|[^|]*\|\s*([0-9.]+) Mbit/s\s*\|$", text, re.M)
    return {name: float(mbit) * 1e6 for name, mbit in rows}


def test_every_bundled_trace_loads_with_the_readme_mean_capacity() -> None:
    means = readme_means()
    files = sorted(p for p in TRACES.iterdir() if p.suffix in {".up", ".down"})
    assert files
    assert {p.name for p in files} == set(means)
    for path in files:
        trace = MahimahiTrace.load(path)
        assert trace.mean_bps == pytest.approx(means[path.name], rel=0.01), path.name
        caps = trace.capacity_bps(1.0)
        assert caps.mean() == pytest.approx(trace.mean_bps, rel=0.01), path.name
        q05, q50, q95 = trace.quantiles((0.05, 0.5, 0.95))
        assert 0 <= q05 <= q50 <= q95 <= caps.max()


def write(tmp_path: Path, text: str, name: str = "t.trace") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="ascii")
    return path


def test_a_trace_of_one_line_1_is_a_fixed_12_mbit_link(tmp_path: Path) -> None:
    trace = MahimahiTrace.load(write(tmp_path, "1\n"))
    assert trace.mean_bps == 12e6
    np.testing.assert_array_equal(trace.capacity_bps(0.5), [12e6])
    assert trace.delivery_time(1500 * 1000, 0.0) == 1000.0  # one packet each ms from t=1
    for start in (0.0, 3.0, 17.5):
        nbytes = 1500 * 10_000
        seconds = (trace.delivery_time(nbytes, start) - start) / 1000
        assert nbytes * 8 / seconds == pytest.approx(12e6, rel=1e-3)


def test_delivery_wraps_around_the_end_of_the_trace(tmp_path: Path) -> None:
    # opportunities at 0, 4, 4, 10 | 10, 14, 14, 20 | 20, ... (period 10)
    trace = MahimahiTrace.load(write(tmp_path, "0\n4\n4\n10\n"))
    assert trace.duration_ms == 10
    assert trace.delivery_time(1, 0) == 0  # one packet, at once
    assert trace.delivery_time(1500 * 3, 0) == 4
    assert trace.delivery_time(1500 * 4, 0) == 10
    assert trace.delivery_time(1501, 5) == 10  # two packets from t=5: 10 and 10 (repeat)
    assert trace.delivery_time(3001, 5) == 14  # three: 10, 10, 14
    assert trace.delivery_time(1500, 9) == 10
    assert trace.delivery_time(1500 * 9, 9) == 30
    assert trace.delivery_time(0, 7.5) == 7.5


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ("", None, "empty"),
        ("\n\n", None, "empty"),
        ("1\n2\nabc\n", 3, "not an integer"),
        ("1\n2.5\n", 2, "not an integer"),
        ("5\n7\n6\n", 3, "before the previous"),
        ("-3\n4\n", 1, "negative"),
        ("0\n0\n", None, "no duration"),
    ],
)
def test_a_bad_trace_is_refused_naming_file_and_line(
    tmp_path: Path, text: str, line: int | None, what: str
) -> None:
    path = write(tmp_path, text, "bad.up")
    with pytest.raises(ConfigError) as info:
        MahimahiTrace.load(path)
    message = str(info.value)
    assert "bad.up" in message
    assert what in message
    if line is not None:
        assert f"line {line}:" in message


def test_a_missing_trace_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such trace file"):
        MahimahiTrace.load(tmp_path / "nope.up")


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.integers(0, 30), min_size=1, max_size=40),
    first=st.integers(0, 5),
    nbytes=st.integers(1, 200_000),
    start=st.floats(0, 500, allow_nan=False),
)
def test_delivery_is_monotone_and_matches_a_brute_force_schedule(
    gaps: list[int], first: int, nbytes: int, start: float
) -> None:
    ts = np.cumsum([first, *gaps])
    if ts[-1] == 0:
        ts[-1] = 1
    trace = MahimahiTrace(ts.astype(np.int64))
    period, n = trace.duration_ms, trace.packets
    k = math.ceil(nbytes / 1500)
    cycles = int(start // period) + k // n + 3
    schedule = np.sort(np.concatenate([ts + c * period for c in range(cycles)]))
    expected = schedule[schedule >= start][k - 1]
    assert trace.delivery_time(nbytes, start) == expected
    assert trace.delivery_time(nbytes + 1500, start) >= expected
    assert trace.delivery_time(nbytes, start + 1) >= expected


# -- the link model -------------------------------------------------------------------


def test_fixed_link_transfer_time_by_hand() -> None:
    link = Link.fixed("8mbit", "16mbit", "50ms")
    # 100 kB up at 8 Mbit/s = 0.1 s, 2 kB down at 16 Mbit/s = 1 ms, one round trip
    assert link.transfer_time(100_000, 2_000) == pytest.approx(0.1 + 0.05 + 0.001)
    assert link.transfer_time(0, 0) == 0.0  # edge only: no network at all
    assert link.expected_transfer_time(100_000, 2_000) == pytest.approx(0.151)
    assert link.transfer_time_quantile(0.95, 100_000, 2_000) == pytest.approx(0.151)
    assert not link.has_distribution


def test_distribution_by_hand_with_a_dead_window() -> None:
    # two 1-second windows: 8 Mbit/s then nothing; 8 start times at 1/8, 3/8, ... of 2 s
    link = Link(8e6, 8e6, 0.0, uplink_samples=(8e6, 0.0), window_s=1.0)
    samples = link.transfer_time_samples(10_000, 0)  # 80 kbit: 10 ms at 8 Mbit/s
    starts = (np.arange(8) + 0.5) / 4
    waits = np.where(starts < 1.0, 0.0, 2.0 - starts)
    np.testing.assert_allclose(samples, waits + 0.01, atol=1e-12)
    assert link.expected_transfer_time(10_000, 0) == pytest.approx(float((waits + 0.01).mean()))
    assert link.transfer_time_quantile(0.0, 10_000, 0) == pytest.approx(0.01)


def test_distribution_of_two_rates_by_hand() -> None:
    link = Link(6e6, 8e6, 0.05, uplink_samples=(8e6, 4e6), window_s=1.0)
    # 10 kB: 10 ms in the fast window, 20 ms in the slow one; plus 50 ms rtt, 1 ms down
    assert link.expected_transfer_time(10_000, 1_000) == pytest.approx(0.015 + 0.051)
    assert link.transfer_time_quantile(0.5, 10_000, 1_000) == pytest.approx(0.015 + 0.051)
    assert link.transfer_time_quantile(0.95, 10_000, 1_000) == pytest.approx(0.020 + 0.051)
    assert link.transfer_time(10_000, 1_000) == pytest.approx(10_000 * 8 / 6e6 + 0.051)


def test_trace_link_agrees_with_packet_replay() -> None:
    trace = MahimahiTrace.load(TRACES / "ATT-LTE-driving-2016.up")
    link = Link.from_trace(trace, rtt_s="0ms", downlink_bps="20mbit")
    assert link.uplink_bps == pytest.approx(trace.mean_bps)
    starts = np.linspace(0, trace.duration_ms, 500, endpoint=False)
    for nbytes in (2_000, 50_000, 500_000):
        replay = (trace.delivery_times(nbytes, starts) - starts).mean() / 1000
        assert link.expected_transfer_time(nbytes, 0) == pytest.approx(replay, rel=0.1)
        # the mean rate alone underestimates: dead spots are waited through
        assert link.transfer_time(nbytes, 0) < replay


def test_from_trace_downlink_choices(tmp_path: Path) -> None:
    up = write(tmp_path, "1\n", "up")
    down = write(tmp_path, "1\n2\n", "down")  # two packets per 2 ms: 12 Mbit/s too
    assert Link.from_trace(up, rtt_s=0.01).downlink_bps == pytest.approx(12e6)
    assert Link.from_trace(up, down, rtt_s=0.01).downlink_bps == pytest.approx(12e6)
    link = Link.from_trace(up, rtt_s="10ms", downlink_bps="1mbit")
    assert link.downlink_bps == 1e6
    assert link.rtt_s == pytest.approx(0.01)
    # a constant trace: the distribution is degenerate, whole packets at 12 Mbit/s
    assert link.expected_transfer_time(15_000, 0) == pytest.approx(0.01 + 0.01)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"uplink_bps": 0.0}, "uplink_bps"),
        ({"downlink_bps": -1.0}, "downlink_bps"),
        ({"rtt_s": -0.1}, "rtt_s"),
        ({"rtt_s": math.nan}, "rtt_s"),
        ({"uplink_samples": (0.0, 0.0)}, "zero in every window"),
        ({"uplink_samples": (1e6, -1.0)}, "uplink_samples"),
        ({"window_s": 0.0}, "window_s"),
    ],
)
def test_link_rejects_bad_values(kwargs: dict[str, object], says: str) -> None:
    values: dict[str, object] = {"uplink_bps": 1e6, "downlink_bps": 1e6, "rtt_s": 0.0}
    values.update(kwargs)
    with pytest.raises(ConfigError, match=says):
        Link(**values)
