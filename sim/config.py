"""What an emulated link is: one :class:`Direction` each way, delay, jitter, loss,
outages, a queue bound, and scheduled changes.

A direction is a fixed rate, a Mahimahi trace (replayed from an offset, cyclic),
or unlimited (delay only). Rates and durations read as :mod:`splitinfer.shared.links`
writes them (``5mbit``, ``25ms``); TOML tables go through :meth:`LinkConfig.from_dict`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitinfer.shared.errors import ConfigError
from splitinfer.shared.links import MahimahiTrace, parse_duration, parse_rate
from splitinfer.shared.units import parse_size
from splitinfer.sim import traces

#: Words that mean "no rate limit" (delay, loss and outages still apply).
UNLIMITED_WORDS = ("unlimited", "none", "inf")
#: A lost segment costs at least this much even on a link without delay (s).
MIN_RETRANSMIT_S = 0.001
DIRECTION_FORMS = (
    "a rate (5mbit, 500kB/s), a Mahimahi trace file (or a bundled trace's name, e.g. "
    "ATT-LTE-driving-2016.up), 'unlimited', or a table "
    "{rate = ...} / {trace = PATH, offset = DURATION}"
)
#: a link table's keys whose value carries its unit -> the field that names it
LINK_UNIT_KEYS = {
    "delay": "delay_ms",
    "jitter": "jitter_ms",
    "retransmit": "retransmit_ms",
    "queue": "queue_bytes",
}
_LINK_KEYS = (
    "uplink",
    "downlink",
    "delay_ms",
    "jitter_ms",
    "loss",
    "outages",
    "queue_bytes",
    "retransmit_ms",
    "seed",
    "changes",
)


@dataclass(frozen=True)
class Direction:
    """One direction's bottleneck: ``rate_bps``, or ``trace`` replayed from
    ``trace_offset_s`` (its opportunity at ``offset`` happens at link time 0), or
    neither (unlimited)."""

    rate_bps: float | None = None
    trace: MahimahiTrace | None = None
    trace_offset_s: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_bps is not None and self.trace is not None:
            raise ConfigError("a direction is a rate or a trace, not both: drop one of them")
        if self.rate_bps is not None and not (
            isinstance(self.rate_bps, (int, float))
            and math.isfinite(self.rate_bps)
            and self.rate_bps > 0
        ):
            raise ConfigError(f"rate_bps={self.rate_bps!r} must be a rate > 0 bits/s, e.g. 5e6")
        if not (math.isfinite(self.trace_offset_s) and self.trace_offset_s >= 0):
            raise ConfigError(
                f"trace offset {self.trace_offset_s!r} must be a duration >= 0, e.g. 30s"
            )
        if self.trace is None and self.trace_offset_s:
            raise ConfigError("a trace offset needs a trace: give trace = PATH")

    @classmethod
    def rate(cls, rate: float | str) -> Direction:
        """A fixed rate, in bits/s or as text (``5mbit``)."""
        return cls(rate_bps=parse_rate(rate) if isinstance(rate, str) else float(rate))

    @classmethod
    def from_trace(cls, path: str | Path, offset: float | str = 0.0) -> Direction:
        """A Mahimahi trace file replayed from ``offset`` (seconds or ``30s``)."""
        return cls(trace=MahimahiTrace.load(path), trace_offset_s=_seconds(offset, "offset"))

    @classmethod
    def unlimited(cls) -> Direction:
        return cls()

    @classmethod
    def parse(cls, value: object, base: Path | None = None) -> Direction:
        """A direction from a CLI or TOML value: see :data:`DIRECTION_FORMS`.

        A string is a rate if it reads as one, else a trace file (relative to
        ``base`` if given).
        """
        if isinstance(value, Direction):
            return value
        if isinstance(value, bool):
            raise ConfigError(f"direction {value!r} not understood: write {DIRECTION_FORMS}")
        if isinstance(value, (int, float)):
            return cls.rate(value)
        if isinstance(value, Mapping):
            keys = set(value)
            if keys == {"rate"}:
                return cls.rate(_text_or_number(value["rate"], "rate"))
            if "trace" in keys and keys <= {"trace", "offset"}:
                path = _path(value["trace"], base)
                return cls.from_trace(path, value.get("offset", 0.0))
            raise ConfigError(
                f"direction table with keys {sorted(keys)} not understood: write {DIRECTION_FORMS}"
            )
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"direction {value!r} not understood: write {DIRECTION_FORMS}")
        text = value.strip()
        if text.lower() in UNLIMITED_WORDS:
            return cls.unlimited()
        try:
            return cls.rate(text)
        except ConfigError as rate_error:
            path = _path(text, base)
            if path.is_file():
                return cls.from_trace(path)
            if text[:1].isdigit() or text[:1] in ("-", "."):
                raise  # "5mbps", "-5mbit": the rate parser's own message says how to fix it
            raise ConfigError(
                f"direction {text!r} is neither a rate nor a trace file ({path} does not "
                f"exist): write {DIRECTION_FORMS}"
            ) from rate_error

    @property
    def is_unlimited(self) -> bool:
        return self.rate_bps is None and self.trace is None

    @property
    def mean_bps(self) -> float:
        """The mean capacity: the rate, the trace's mean, or ``inf``."""
        if self.rate_bps is not None:
            return self.rate_bps
        if self.trace is not None:
            return self.trace.mean_bps
        return math.inf

    def describe(self) -> str:
        if self.rate_bps is not None:
            return f"{self.rate_bps / 1e6:.4g} Mbit/s"
        if self.trace is not None:
            where = f" from {self.trace_offset_s:g} s" if self.trace_offset_s else ""
            return f"trace {self.trace.name}{where} (mean {self.trace.mean_bps / 1e6:.3g} Mbit/s)"
        return "unlimited"


@dataclass(frozen=True)
class Change:
    """At link time ``at_s`` (seconds after the link started), switch the uplink
    and/or the downlink; ``None`` leaves a direction as it is."""

    at_s: float
    uplink: Direction | None = None
    downlink: Direction | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.at_s) and self.at_s >= 0):
            raise ConfigError(f"change at {self.at_s!r} must be a time >= 0 s after the start")
        if self.uplink is None and self.downlink is None:
            raise ConfigError(
                f"the change at {self.at_s:g} s changes nothing: give uplink or downlink"
            )


@dataclass(frozen=True)
class LinkConfig:
    """An emulated link between an edge device (client side) and the cloud."""

    #: client -> target bottleneck
    uplink: Direction = field(default_factory=Direction)
    #: target -> client bottleneck
    downlink: Direction = field(default_factory=Direction)
    #: one-way propagation delay, each direction (ms)
    delay_ms: float = 0.0
    #: each segment's delay is delay_ms + uniform(-jitter_ms, +jitter_ms), never
    #: below zero and never reordering a stream (ms)
    jitter_ms: float = 0.0
    #: probability that a segment crossing the bottleneck is lost and retransmitted
    loss: float = 0.0
    #: (start_s, duration_s) in link time: the bottleneck delivers nothing, bytes queue
    outages: tuple[tuple[float, float], ...] = ()
    #: droptail bound of each direction's queue (bytes); None: unbounded (Mahimahi's default)
    queue_bytes: int | None = None
    #: what a lost segment costs before its retransmission arrives (ms); None: one
    #: round trip (2 x delay_ms, fast retransmit), at least MIN_RETRANSMIT_S
    retransmit_ms: float | None = None
    #: seed of the jitter and loss draws (uplink and downlink draw separately)
    seed: int = 0
    #: scheduled switches of either direction, in link time
    changes: tuple[Change, ...] = ()

    def __post_init__(self) -> None:
        for name in ("uplink", "downlink"):
            if not isinstance(getattr(self, name), Direction):
                raise ConfigError(f"{name} must be a Direction: use Direction.parse({name}=...)")
        for name in ("delay_ms", "jitter_ms"):
            value = getattr(self, name)
            if not (_is_number(value) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name}={value!r} must be a duration >= 0 ms, e.g. 25")
        if not (_is_number(self.loss) and 0 <= self.loss < 1):
            raise ConfigError(f"loss={self.loss!r} must be a probability in [0, 1), e.g. 0.01")
        if self.queue_bytes is not None and not (
            isinstance(self.queue_bytes, int)
            and not isinstance(self.queue_bytes, bool)
            and self.queue_bytes >= 1500
        ):
            raise ConfigError(
                f"queue_bytes={self.queue_bytes!r} must be an integer >= 1500 (one segment), "
                "or None for an unbounded queue"
            )
        if self.retransmit_ms is not None and not (
            _is_number(self.retransmit_ms)
            and math.isfinite(self.retransmit_ms)
            and self.retransmit_ms > 0
        ):
            raise ConfigError(
                f"retransmit_ms={self.retransmit_ms!r} must be > 0 ms, or None for one round trip"
            )
        if not (isinstance(self.seed, int) and not isinstance(self.seed, bool)):
            raise ConfigError(f"seed={self.seed!r} must be an integer")
        try:
            outages = tuple((float(a), float(d)) for a, d in self.outages)
        except (TypeError, ValueError):
            raise ConfigError(
                f"outages={self.outages!r} must be (start_s, duration_s) pairs, e.g. ((10, 5),)"
            ) from None
        for change in self.changes:
            if not isinstance(change, Change):
                raise ConfigError(f"changes: {change!r} must be a Change(at_s, uplink, downlink)")
        for start, duration in outages:
            if not (math.isfinite(start) and start >= 0 and math.isfinite(duration)):
                raise ConfigError(f"outage ({start!r}, {duration!r}) must start at a time >= 0 s")
            if duration <= 0:
                raise ConfigError(f"outage at {start:g} s: duration {duration!r} must be > 0 s")
        ordered = sorted(outages)
        for (a0, d0), (a1, _) in itertools.pairwise(ordered):
            if a1 < a0 + d0:
                raise ConfigError(f"outages at {a0:g} s and {a1:g} s overlap: merge them into one")
        object.__setattr__(self, "outages", tuple(ordered))
        object.__setattr__(self, "changes", tuple(sorted(self.changes, key=lambda c: c.at_s)))

    @property
    def retransmit_s(self) -> float:
        """Seconds a lost segment waits before its retransmission is on its way."""
        if self.retransmit_ms is not None:
            return self.retransmit_ms / 1000.0
        return max(2 * self.delay_ms / 1000.0, MIN_RETRANSMIT_S)

    @classmethod
    def from_dict(
        cls,
        table: Mapping[str, Any],
        base: Path | None = None,
        warn: Callable[[str], None] | None = None,
        where: str = "link",
    ) -> LinkConfig:
        """A link from a TOML table (``[link]``); trace paths relative to ``base``.

        ``uplink``/``downlink``: see :data:`DIRECTION_FORMS`; ``delay``, ``jitter``,
        ``retransmit``: durations (``"25ms"``); ``queue``: a size (``"64KiB"``);
        ``outages``: ``[[start, duration], ...]`` in s or durations; ``changes``:
        ``[{at = "10s", uplink = "1mbit"}, ...]``. The former ``delay_ms``,
        ``jitter_ms``, ``retransmit_ms`` (a number of ms or a duration) and
        ``queue_bytes`` still read, told to ``warn``.
        """
        if not isinstance(table, Mapping):
            raise ConfigError(f"a link is a table of {', '.join(_LINK_KEYS)}; got {table!r}")
        table = with_units(table, where, LINK_UNIT_KEYS, warn)
        unknown = sorted(set(table) - set(_LINK_KEYS))
        if unknown:
            former = {old: new for new, old in LINK_UNIT_KEYS.items()}
            raise ConfigError(
                f"unknown link option(s) {', '.join(unknown)}: the options are "
                f"{', '.join(former.get(k, k) for k in _LINK_KEYS)}"
            )
        kwargs: dict[str, Any] = {}
        for name in ("uplink", "downlink"):
            if name in table:
                kwargs[name] = Direction.parse(table[name], base)
        for name in ("delay_ms", "jitter_ms", "retransmit_ms"):
            if name in table:
                kwargs[name] = _milliseconds(table[name], name)
        if "loss" in table:
            kwargs["loss"] = table["loss"]
        if "queue_bytes" in table:
            kwargs["queue_bytes"] = table["queue_bytes"]
        if "seed" in table:
            kwargs["seed"] = table["seed"]
        if "outages" in table:
            kwargs["outages"] = tuple(_outage(o) for o in _list(table["outages"], "outages"))
        if "changes" in table:
            kwargs["changes"] = tuple(_change(c, base) for c in _list(table["changes"], "changes"))
        return cls(**kwargs)

    def describe(self) -> str:
        parts = [
            f"uplink {self.uplink.describe()}",
            f"downlink {self.downlink.describe()}",
            f"delay {self.delay_ms:g} ms",
        ]
        if self.jitter_ms:
            parts.append(f"jitter ±{self.jitter_ms:g} ms")
        if self.loss:
            parts.append(f"loss {self.loss:g}")
        if self.queue_bytes is not None:
            parts.append(f"queue {self.queue_bytes} B")
        parts.extend(f"outage {a:g}+{d:g} s" for a, d in self.outages)
        return ", ".join(parts)


def parse_outage(text: str) -> tuple[float, float]:
    """``START,DURATION`` (``10s,5s``; bare numbers are seconds) as seconds."""
    parts = text.split(",") if isinstance(text, str) else []
    if len(parts) != 2:
        raise ConfigError(f"outage {text!r} not understood: write START,DURATION, e.g. 10s,5s")
    return _seconds(parts[0].strip(), "outage start"), _seconds(parts[1].strip(), "outage duration")


# -- value helpers --------------------------------------------------------------------


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text_or_number(value: object, name: str) -> float | str:
    if isinstance(value, str) or _is_number(value):
        return value  # type: ignore[return-value]
    raise ConfigError(f"{name}={value!r} must be a number or text")


def _seconds(value: object, name: str) -> float:
    """A number (seconds) or a duration string."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return parse_duration(value, name)
    if _is_number(value):
        return float(value)  # type: ignore[arg-type]
    raise ConfigError(f"{name}={value!r} must be a number of seconds or a duration, e.g. 10s")


def _milliseconds(value: object, name: str) -> float:
    if isinstance(value, str):
        return parse_duration(value, name) * 1000.0
    if _is_number(value):
        return float(value)  # type: ignore[arg-type]
    raise ConfigError(f"{name}={value!r} must be a number of ms or a duration, e.g. 25ms")


def _path(value: object, base: Path | None) -> Path:
    """A trace file: ``value`` relative to ``base``; a bare file name found nowhere
    else is the bundled trace of that name (:mod:`splitinfer.sim.traces`)."""
    if not isinstance(value, (str, Path)):
        raise ConfigError(f"trace {value!r} must be a file path")
    path = Path(value).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    bundled = traces.DIR / str(value)
    if not path.exists() and Path(value).name == str(value) and bundled.is_file():
        return bundled
    return path


def _list(value: object, name: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{name} must be a list, got {value!r}")
    return list(value)


def _outage(value: object) -> tuple[float, float]:
    if isinstance(value, str):
        return parse_outage(value)
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return _seconds(value[0], "outage start"), _seconds(value[1], "outage duration")
    raise ConfigError(f'outage {value!r} must be [start, duration], e.g. ["10s", "5s"]')


def _change(value: object, base: Path | None) -> Change:
    if not isinstance(value, Mapping) or "at" not in value:
        raise ConfigError(f"change {value!r} must be a table {{at = TIME, uplink/downlink = ...}}")
    unknown = sorted(set(value) - {"at", "uplink", "downlink"})
    if unknown:
        raise ConfigError(f"change at {value['at']!r}: unknown key(s) {', '.join(unknown)}")
    return Change(
        at_s=_seconds(value["at"], "change at"),
        uplink=Direction.parse(value["uplink"], base) if "uplink" in value else None,
        downlink=Direction.parse(value["downlink"], base) if "downlink" in value else None,
    )


def with_units(
    table: Mapping[str, Any],
    where: str,
    keys: Mapping[str, str],
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``table`` with its ``keys`` that carry units (``timeout = "2s"``) as the fields
    that name theirs (``timeout_s = 2.0``); a former key is kept, and told to ``warn``."""
    table = dict(table)
    for new, old in keys.items():
        if new in table and old in table:
            raise ConfigError(f"[{where}] {new} and {old} are one option: keep {new}")
        if old in table and warn is not None:
            warn(f"[{where}] {old} is deprecated; use {new} (with units)")
        if new in table:
            table[old] = _in_unit(table.pop(new), old, f"{where}.{new}")
    return table


def _in_unit(value: object, field_name: str, name: str) -> float | int:
    """``value`` (with units; 0 and a size's bare bytes need none) in the field's unit."""
    size = field_name.endswith("_bytes")
    if isinstance(value, str):
        if size:
            return parse_size(value, name)
        seconds = 0.0 if value.strip() == "0" else parse_duration(value, name)
        return seconds * 1000.0 if field_name.endswith("_ms") else seconds
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (value == 0 or size):
        return value
    unit = "ms" if field_name.endswith("_ms") else "s"
    raise ConfigError(f'{name}={value!r}: give it with units, e.g. "{value}{unit}"')
