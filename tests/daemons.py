"""Daemons (``cloud-service``, ``edge-agent``) for tests: the one launcher
(:mod:`splitinfer.sim.daemon`), each daemon on one OpenMP thread (two CPUs are shared
by the test and its daemons)."""

from __future__ import annotations

from pathlib import Path

from splitinfer.sim.daemon import Daemon, start


def daemon(program: str, *args: str | Path) -> Daemon:
    """``program`` serving with ``args``; the caller stops it (or uses ``with``)."""
    return start(program, args, env={"OMP_NUM_THREADS": "1"})
