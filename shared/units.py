"""Sizes, and durations and sizes written back the way people write them.

Every splitinfer tool takes a quantity as a value with its unit (``--rtt 50ms``,
``--edge-memory 512MB``, ``--uplink-timeout 5s``) and names no unit in the flag.
Rates and durations are parsed by :mod:`splitinfer.shared.links`
(:func:`~splitinfer.shared.links.parse_rate`, :func:`~splitinfer.shared.links.parse_duration`);
this module adds sizes and the inverse: a number of seconds or bytes printed the
shortest way the parsers read back exactly (``0.002`` -> ``2ms``, ``67108864`` -> ``64MiB``),
which is how ``--help`` and the docs show a default.

A size is a number and an optional unit: ``B``, decimal ``kB``/``KB``, ``MB``,
``GB`` or binary ``KiB``, ``MiB``, ``GiB`` (case-insensitive); a bare number is
bytes (``800000``), the one unit with no ambiguity.
"""

from __future__ import annotations

import math
import re

from splitinfer.shared.errors import ConfigError

_SIZE = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20}
_SIZE["gib"] = 2**30
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]i?[bB]|[bB])?\s*")
SIZE_FORMS = "a byte count like 512MB, 2GiB or 800000"


def parse_size(text: str, name: str) -> int:
    """Bytes of a size such as ``512MB``, ``2GiB`` or ``800000``; ``name`` is the flag."""
    m = _SIZE_RE.fullmatch(text)
    if not m:
        if text.strip().startswith("-") and _SIZE_RE.fullmatch(text.strip()[1:]):
            raise ConfigError(f"{name}: must not be negative (got {text.strip()})")
        raise ConfigError(f"{name} {text!r}: use {SIZE_FORMS}")
    return int(float(m.group(1)) * _SIZE[(m.group(2) or "").lower()])


def format_duration(seconds: float) -> str:
    """``seconds`` as ``parse_duration`` reads it back: ``5s``, ``2ms``, ``250us``, ``0``."""
    if seconds == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        value = seconds / scale
        if abs(value) >= 1 or unit == "us":
            return f"{_number(value)}{unit}"
    raise AssertionError("unreachable")


def format_size(size: float) -> str:
    """``size`` bytes as ``parse_size`` reads it back: ``64MiB``, ``100kB``, ``1500``."""
    if size == 0 or not float(size).is_integer():
        return _number(size)
    whole = int(size)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if whole % scale == 0:
            return f"{whole // scale}{unit}"
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if whole % scale == 0:
            return f"{whole // scale}{unit}"
    return str(whole)


def _number(value: float) -> str:
    if math.isfinite(value) and float(value).is_integer():
        return str(int(value))
    return f"{value:g}"
