"""Network links: rates and durations as people write them, Mahimahi traces, and a
link model that gives transfer times, fixed or as a distribution.

Units. A rate is a number and a unit, no space needed, decimal (SI) prefixes:

* bits per second (unit case-insensitive, ``/s`` optional): ``bit``, ``kbit``,
  ``mbit``, ``gbit`` -- ``5mbit``, ``500kbit``, ``1.5Mbit/s``, ``2gbit``;
* bytes per second (capital ``B``, ``/s`` optional): ``B``, ``kB``, ``KB``,
  ``MB``, ``GB`` -- ``500kB/s`` is 4 Mbit/s.

``bps``/``kbps``/``mbps`` are refused: ``tc`` reads ``kbps`` as kilobytes per
second while most people mean kilobits, and a planner that is off by 8x is
worse than one that asks. Bare numbers are refused for the same reason.
A duration is a number and ``us``, ``ms`` or ``s``: ``50ms``, ``0.05s``, ``1s``.
Every function and field here works in bits per second and seconds, except the
Mahimahi trace, whose native unit is the millisecond.

Mahimahi traces (``sim/traces/README.md``): one integer per line, a
millisecond timestamp; each line is one opportunity for one 1500-byte packet.
The trace repeats with period = its last timestamp, so opportunity ``m = c*n + i``
of an ``n``-line trace happens at ``ts[i] + c * period``.

The link model (:class:`Link`) has a fixed uplink and downlink rate and a round
trip time; optionally also the uplink's capacity per window of ``window_s``
seconds, from a trace. With that distribution, an upload of ``B`` bytes that
starts at time ``s`` finishes when the cumulative capacity from ``s`` reaches
``8B`` bits (a fluid replay of the windows, cyclic; a window of zero capacity is
waited through, not divided by). Starting at evenly spaced times over the
period (:data:`MAX_STARTS` at most) gives the distribution of transfer times that
the planner averages (expected latency) and reports (p50/p95). A plan made with
the mean rate alone is late often: a transfer that starts in a dead spot waits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from splitinfer.shared.errors import ConfigError

#: Bytes one Mahimahi delivery opportunity carries.
PACKET_BYTES = 1500
#: Transfers sampled per link distribution: evenly spaced start times over the period.
MAX_STARTS = 2048
#: Capacity window of a trace-derived link: short enough to see the bursts that a
#: small upload waits through (1 s windows underestimate a 1 kB upload's mean time
#: on the ATT trace by half; 0.1 s windows are within 5% of packet replay).
TRACE_WINDOW_S = 0.1
_CHUNK_ELEMENTS = 1 << 16

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

_NUMBER = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([-+]?[0-9]+))?"
_RATE_RE = re.compile(rf"^\s*{_NUMBER}\s*([A-Za-z]+)(/s)?\s*$")
_DURATION_RE = re.compile(rf"^\s*{_NUMBER}\s*([A-Za-z]+)\s*$")
_BIT_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_BYTE_UNITS = {"B": 8.0, "kB": 8e3, "KB": 8e3, "MB": 8e6, "GB": 8e9}
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
RATE_FORMS = (
    "a number and a unit: bit, kbit, mbit, gbit (bits/s) or B, kB, MB, GB (bytes/s), "
    "optionally followed by /s, e.g. 5mbit, 1.5Mbit/s, 500kB/s"
)
DURATION_FORMS = "a number and a unit: us, ms or s, e.g. 50ms, 0.05s, 1s"


def _number(mantissa: str, exponent: str | None) -> float:
    return float(mantissa + (f"e{exponent}" if exponent else ""))


def _refuse_negative(text: object, parse: Callable[[str], float], who: str) -> None:
    """Raise ``WHO must not be negative (got TEXT)`` when ``text`` is a minus sign
    followed by what ``parse`` reads; else return (the caller says what is wrong)."""
    if not isinstance(text, str) or not text.strip().startswith("-"):
        return
    try:
        parse(text.strip()[1:])
    except ConfigError:
        return
    raise ConfigError(f"{who} must not be negative (got {text.strip()})")


def parse_rate(text: str, name: str | None = None) -> float:
    """Bits per second of a rate such as ``5mbit``; :class:`ConfigError` if not understood.

    ``name`` (a flag such as ``--uplink``) leads every message when given.
    """
    lead = f"{name}: " if name else ""
    m = _RATE_RE.match(text) if isinstance(text, str) else None
    if m is None:
        _refuse_negative(text, parse_rate, f"{name}:" if name else "rate")
        raise ConfigError(f"{lead}rate {text!r} not understood: write {RATE_FORMS}")
    value = _number(m.group(1), m.group(2))
    unit = m.group(3)
    if unit.lower() in _BIT_UNITS:
        bps = value * _BIT_UNITS[unit.lower()]
    elif unit in _BYTE_UNITS:
        bps = value * _BYTE_UNITS[unit]
    elif unit.lower().endswith("bps") or unit.lower() in {"b", "kb", "mb", "gb"}:
        prefix = unit.lower().removesuffix("ps").removesuffix("b")
        byte_prefix = prefix if prefix == "k" else prefix.upper()
        raise ConfigError(
            f"{lead}rate {text!r} is ambiguous, bits or bytes per second? (tc reads kbps as "
            f"kilobytes/s, most people as kilobits/s): write {value:g}{prefix}bit for bits/s "
            f"or {value:g}{byte_prefix}B/s for bytes/s"
        )
    else:
        raise ConfigError(f"{lead}rate {text!r} not understood: write {RATE_FORMS}")
    if not (math.isfinite(bps) and bps > 0):
        raise ConfigError(f"{lead}rate {text!r} must be greater than zero: write {RATE_FORMS}")
    return bps


def parse_duration(text: str, name: str | None = None) -> float:
    """Seconds of a duration such as ``50ms``; :class:`ConfigError` if not understood.

    ``name`` (a flag such as ``--rtt``) leads every message when given.
    """
    lead = f"{name}: " if name else ""
    m = _DURATION_RE.match(text) if isinstance(text, str) else None
    if m is None or m.group(3) not in _DURATION_UNITS:
        _refuse_negative(text, parse_duration, f"{name}:" if name else "duration")
        raise ConfigError(f"{lead}duration {text!r} not understood: write {DURATION_FORMS}")
    seconds = _number(m.group(1), m.group(2)) * _DURATION_UNITS[m.group(3)]
    if not math.isfinite(seconds):
        raise ConfigError(f"{lead}duration {text!r} is not finite: write {DURATION_FORMS}")
    return seconds


def _rate(value: float | str, name: str) -> float:
    bps = parse_rate(value, name) if isinstance(value, str) else float(value)
    if bps < 0:
        raise ConfigError(f"{name}: must not be negative (got {value!r})")
    if not (math.isfinite(bps) and bps > 0):
        raise ConfigError(f"{name}={value!r} must be a rate > 0, e.g. 5mbit")
    return bps


def _duration(value: float | str, name: str) -> float:
    seconds = parse_duration(value, name) if isinstance(value, str) else float(value)
    if seconds < 0:
        raise ConfigError(f"{name}: must not be negative (got {value!r})")
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ConfigError(f"{name}={value!r} must be a duration >= 0, e.g. 50ms")
    return seconds


# -- Mahimahi traces ------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MahimahiTrace:
    """A Mahimahi packet-delivery trace: non-decreasing millisecond timestamps.

    The trace repeats with period :attr:`duration_ms` (its last timestamp).
    """

    timestamps_ms: I64
    name: str = "trace"

    def __post_init__(self) -> None:
        ts = np.asarray(self.timestamps_ms)
        if ts.ndim != 1 or ts.size == 0:
            raise ConfigError(f"{self.name}: a trace needs at least one timestamp")
        if ts.dtype.kind not in "iu":
            raise ConfigError(f"{self.name}: timestamps must be integers (milliseconds)")
        ts = ts.astype(np.int64)
        if ts[0] < 0:
            raise ConfigError(f"{self.name}: line 1: negative timestamp {int(ts[0])}")
        drops = np.flatnonzero(np.diff(ts) < 0)
        if drops.size:
            line = int(drops[0]) + 2
            raise ConfigError(
                f"{self.name}: line {line}: timestamp {int(ts[line - 1])} is before the "
                f"previous one ({int(ts[line - 2])}); timestamps must not decrease"
            )
        if ts[-1] <= 0:
            raise ConfigError(
                f"{self.name}: the last timestamp is 0, so the trace has no duration; "
                "a fixed 12 Mbit/s link is a file holding just 1"
            )
        ts.setflags(write=False)
        object.__setattr__(self, "timestamps_ms", ts)

    @classmethod
    def load(cls, path: str | Path) -> MahimahiTrace:
        """Read a trace file; :class:`ConfigError` naming the file and line if it is bad."""
        p = Path(path)
        try:
            text = p.read_text(encoding="ascii")
        except FileNotFoundError:
            raise ConfigError(f"{p}: no such trace file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{p}: cannot read the trace: {exc}") from None
        lines = text.splitlines()
        while lines and not lines[-1].strip():
            lines.pop()
        if not lines:
            raise ConfigError(f"{p}: empty trace; expected one millisecond timestamp per line")
        try:
            ts = np.array([int(s) for s in lines], dtype=np.int64)
            bad = None
        except ValueError:
            bad = next(i for i, s in enumerate(lines) if not _is_int(s))
        if bad is not None:
            raise ConfigError(
                f"{p}: line {bad + 1}: {lines[bad].strip()[:40]!r} is not an integer "
                "millisecond timestamp"
            )
        return cls(ts, name=str(p))

    @property
    def duration_ms(self) -> int:
        """The period: the last timestamp."""
        return int(self.timestamps_ms[-1])

    @property
    def packets(self) -> int:
        """Delivery opportunities per period."""
        return int(self.timestamps_ms.size)

    @property
    def mean_bps(self) -> float:
        """Packets x 1500 bytes x 8 / duration."""
        return self.packets * PACKET_BYTES * 8 * 1000.0 / self.duration_ms

    def opportunities_before(self, t_ms: npt.ArrayLike) -> I64:
        """How many delivery opportunities happen strictly before ``t_ms`` (>= 0)."""
        t = np.asarray(t_ms, dtype=np.float64)
        ts = self.timestamps_ms
        period, n = self.duration_ms, self.packets
        c0 = np.maximum(np.floor(t / period) - 1, 0)
        total = c0 * n
        for extra in range(3):
            total = total + np.searchsorted(ts, t - (c0 + extra) * period, side="left")
        out: I64 = total.astype(np.int64)
        return out

    def opportunity_time(self, index: npt.ArrayLike) -> F64:
        """Millisecond time of opportunity number ``index`` (0-based, counting repeats)."""
        m = np.asarray(index, dtype=np.int64)
        cycle, i = np.divmod(m, self.packets)
        out: F64 = (self.timestamps_ms[i] + cycle * self.duration_ms).astype(np.float64)
        return out

    def delivery_times(self, nbytes: int, start_ms: npt.ArrayLike) -> F64:
        """When an upload of ``nbytes`` starting at each of ``start_ms`` finishes (ms).

        The upload takes ``ceil(nbytes / 1500)`` opportunities at or after its start,
        one packet each; zero bytes finish at once.
        """
        start = np.asarray(start_ms, dtype=np.float64)
        if nbytes <= 0:
            return start.copy()
        k = -(-int(nbytes) // PACKET_BYTES)
        return self.opportunity_time(self.opportunities_before(start) + k - 1)

    def delivery_time(self, nbytes: int, start_ms: float) -> float:
        """When an upload of ``nbytes`` starting at ``start_ms`` finishes (ms)."""
        return float(self.delivery_times(nbytes, np.array([start_ms]))[0])

    def capacity_bps(self, window_s: float = 1.0) -> F64:
        """Capacity of each consecutive window of ``window_s`` over one period.

        ``floor(period / window)`` windows (at least one; a window longer than the
        period counts the repeating trace). Windows are taken one period in, where the
        repeating schedule is in its steady state: a trace holding just ``1`` gives
        exactly 12 Mbit/s in every window.
        """
        if not (math.isfinite(window_s) and window_s > 0):
            raise ConfigError(f"window_s={window_s!r} must be > 0 seconds")
        w_ms = window_s * 1000.0
        count = max(1, int(self.duration_ms // w_ms))
        edges = np.arange(count + 1, dtype=np.float64) * w_ms + self.duration_ms
        n = np.diff(self.opportunities_before(edges))
        out: F64 = n * (PACKET_BYTES * 8 / window_s)
        return out

    def quantiles(self, qs: tuple[float, ...] = (0.05, 0.5, 0.95), window_s: float = 1.0) -> F64:
        """Quantiles of the per-window capacity (bits/s)."""
        out: F64 = np.quantile(self.capacity_bps(window_s), np.asarray(qs, dtype=np.float64))
        return out


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


# -- the link model -----------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """Uplink and downlink rates (bits/s), round trip time (s), and optionally the
    uplink's capacity per ``window_s`` window (bits/s, consecutive, cyclic)."""

    uplink_bps: float
    downlink_bps: float
    rtt_s: float
    uplink_samples: tuple[float, ...] = ()
    window_s: float = 1.0
    #: With a distribution: uploads move in whole packets of this size (0: fluid).
    packet_bytes: int = 0
    _caps: F64 = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("uplink_bps", "downlink_bps"):
            value = _real(getattr(self, name))
            if not (value is not None and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a rate > 0 bits/s")
            object.__setattr__(self, name, value)
        rtt = _real(self.rtt_s)
        if not (rtt is not None and math.isfinite(rtt) and rtt >= 0):
            raise ConfigError(f"rtt_s={self.rtt_s!r} must be a duration >= 0 seconds")
        object.__setattr__(self, "rtt_s", rtt)
        window = _real(self.window_s)
        if not (window is not None and math.isfinite(window) and window > 0):
            raise ConfigError(f"window_s={self.window_s!r} must be > 0 seconds")
        object.__setattr__(self, "window_s", window)
        if not (isinstance(self.packet_bytes, int) and self.packet_bytes >= 0):
            raise ConfigError(f"packet_bytes={self.packet_bytes!r} must be an integer >= 0")
        if isinstance(self.uplink_samples, tuple) and not self.uplink_samples:
            # a fixed link (the chooser builds one per candidate rate): no array to check
            object.__setattr__(self, "_caps", _NO_SAMPLES)
            return
        caps = np.asarray(self.uplink_samples, dtype=np.float64)
        if caps.size:
            if caps.ndim != 1 or not np.isfinite(caps).all() or (caps < 0).any():
                raise ConfigError("uplink_samples must be finite capacities >= 0 bits/s")
            if caps.sum() <= 0:
                raise ConfigError("uplink_samples: the capacity is zero in every window")
        caps.setflags(write=False)
        object.__setattr__(self, "uplink_samples", tuple(float(c) for c in caps))
        object.__setattr__(self, "_caps", caps)

    # -- construction -------------------------------------------------------------
    @classmethod
    def fixed(cls, uplink: float | str, downlink: float | str, rtt: float | str = 0.0) -> Link:
        """A fixed-rate link; rates in bits/s or as text (``5mbit``), RTT in s or ``50ms``."""
        return cls(_rate(uplink, "uplink"), _rate(downlink, "downlink"), _duration(rtt, "rtt"))

    @classmethod
    def from_trace(
        cls,
        up: str | Path | MahimahiTrace,
        down: str | Path | MahimahiTrace | None = None,
        *,
        rtt_s: float | str,
        window_s: float = TRACE_WINDOW_S,
        downlink_bps: float | str | None = None,
    ) -> Link:
        """A link from an uplink trace: its mean rate and per-window capacities.

        The downlink is the mean of ``down`` if given, else ``downlink_bps``, else the
        uplink's mean (downlinks are rarely slower). Only the uplink keeps its
        distribution: results going down are small.
        """
        up_trace = up if isinstance(up, MahimahiTrace) else MahimahiTrace.load(up)
        if down is not None:
            down_trace = down if isinstance(down, MahimahiTrace) else MahimahiTrace.load(down)
            down_bps = down_trace.mean_bps
        elif downlink_bps is not None:
            down_bps = _rate(downlink_bps, "downlink")
        else:
            down_bps = up_trace.mean_bps
        caps = up_trace.capacity_bps(window_s)
        return cls(
            uplink_bps=up_trace.mean_bps,
            downlink_bps=down_bps,
            rtt_s=_duration(rtt_s, "rtt"),
            uplink_samples=tuple(float(c) for c in caps),
            window_s=window_s,
            packet_bytes=PACKET_BYTES,
        )

    @property
    def has_distribution(self) -> bool:
        return bool(self.uplink_samples)

    # -- transfer times -------------------------------------------------------------
    def transfer_time(self, up_bytes: float, down_bytes: float = 0.0) -> float:
        """Seconds on the network at the fixed (mean) rates: upload + RTT + download.

        Zero when nothing crosses (an edge-only request never touches the network).
        """
        if up_bytes <= 0 and down_bytes <= 0:
            return 0.0
        return up_bytes * 8 / self.uplink_bps + self.rtt_s + down_bytes * 8 / self.downlink_bps

    def transfer_time_samples(self, up_bytes: npt.ArrayLike, down_bytes: npt.ArrayLike) -> F64:
        """Network seconds per start offset, shape ``(*broadcast(up, down), S)``.

        ``S`` is ``min(MAX_STARTS, 4 * len(uplink_samples))`` start times evenly spaced
        over the samples' period, or 1 for a fixed link.
        """
        up = np.asarray(up_bytes, dtype=np.float64)
        down = np.asarray(down_bytes, dtype=np.float64)
        up, down = np.broadcast_arrays(up, down)
        used = ((up > 0) | (down > 0))[..., None]
        if self.has_distribution:
            sent = up
            if self.packet_bytes:
                sent = np.ceil(up / self.packet_bytes) * self.packet_bytes
            starts = min(MAX_STARTS, 4 * self._caps.size)
            flat = (sent * 8).reshape(-1)
            rows = max(1, _CHUNK_ELEMENTS // starts)
            upload = np.concatenate(
                [
                    _fluid_times(self._caps, self.window_s, flat[i : i + rows], starts)
                    for i in range(0, max(flat.size, 1), rows)
                ]
            )[: flat.size].reshape((*up.shape, starts))
        else:
            upload = (up * 8 / self.uplink_bps)[..., None]
        rest = (self.rtt_s + down * 8 / self.downlink_bps)[..., None]
        out: F64 = np.where(used, upload + rest, 0.0)
        return out

    def expected_transfer_time(self, up_bytes: float, down_bytes: float = 0.0) -> float:
        """Mean network seconds over the uplink's distribution (fixed link: exact)."""
        return float(self.transfer_time_samples(up_bytes, down_bytes).mean())

    def transfer_time_quantile(self, q: float, up_bytes: float, down_bytes: float = 0.0) -> float:
        """Quantile ``q`` (0..1) of network seconds over the uplink's distribution."""
        if not 0 <= q <= 1:
            raise ConfigError(f"quantile {q!r} must be between 0 and 1")
        return float(np.quantile(self.transfer_time_samples(up_bytes, down_bytes), q))

    def at_uplink(self, uplink_bps: float) -> Link:
        """The same link at a fixed uplink rate, without a distribution."""
        return Link(uplink_bps, self.downlink_bps, self.rtt_s)

    def describe(self) -> str:
        up = f"{self.uplink_bps / 1e6:.3g} Mbit/s"
        if self.has_distribution:
            p5, p50 = np.quantile(self._caps, [0.05, 0.5]) / 1e6
            up += f" mean (p5 {p5:.3g}, p50 {p50:.3g})"
        return (
            f"uplink {up}, downlink {self.downlink_bps / 1e6:.3g} Mbit/s, "
            f"rtt {self.rtt_s * 1e3:.3g} ms"
        )


_NO_SAMPLES: F64 = np.zeros(0)
_NO_SAMPLES.setflags(write=False)


def _real(value: object) -> float | None:
    """``value`` as a float if it is a real number (not a bool), else None."""
    if type(value) is float:  # the common case, without the ABC checks below
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return None
    return float(value)


def _fluid_times(caps: F64, window_s: float, bits: Any, starts: int) -> F64:
    """Seconds to move ``bits`` (array) through cyclic windows of capacity ``caps``,
    starting at ``starts`` evenly spaced points of the period; shape ``(*bits, starts)``."""
    per_window = caps * window_s
    total = float(per_window.sum())
    cum = np.concatenate([[0.0], np.cumsum(per_window)])
    n = caps.size
    period = n * window_s
    position = (np.arange(starts) + 0.5) * (n / starts)  # in windows
    j = np.minimum(position.astype(np.int64), n - 1)
    u = position - j
    start_bits = cum[j] + per_window[j] * u
    target = start_bits + np.asarray(bits, dtype=np.float64)[..., None]
    cycles = np.floor(target / total)
    rem = target - cycles * total
    exact = rem <= total * 1e-12
    cycles = np.where(exact, cycles - 1, cycles)
    rem = np.where(exact, total, rem)
    k = np.clip(np.searchsorted(cum, rem, side="left"), 1, n)
    w = k - 1
    width = per_window[w]
    frac = np.clip((rem - cum[w]) / np.where(width > 0, width, 1.0), 0.0, 1.0)
    end_s = cycles * period + (w + frac) * window_s
    out: F64 = np.maximum(end_s - position * window_s, 0.0)
    return out
