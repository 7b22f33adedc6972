"""The Mahimahi cellular traces netsim replays, vendored from the public Mahimahi
repository (provenance and licence in ``README.md`` beside this file)."""

from __future__ import annotations

from pathlib import Path

from splitinfer.shared.errors import ConfigError

#: The folder that holds the trace files (in a checkout or an installed package).
DIR = Path(__file__).resolve().parent


def names() -> list[str]:
    """The bundled trace files, sorted: ``ATT-LTE-driving-2016.up``, ..."""
    return sorted(p.name for p in DIR.iterdir() if p.suffix in {".up", ".down"})


def path(name: str) -> Path:
    """The path of the bundled trace ``name`` (e.g. ``ATT-LTE-driving-2016.up``)."""
    found = DIR / name
    if Path(name).name != name or not found.is_file():
        raise ConfigError(f"no bundled trace {name!r}: the bundled traces are {', '.join(names())}")
    return found
