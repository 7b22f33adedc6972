"""The test model zoo: the small tier of :mod:`splitinfer.models.zoo`.

Kept as a module of its own so tests and benchmarks can ``from zoo import ZOO,
export``; the architectures live in ``models/`` (one zoo for tests and benches).
"""

from __future__ import annotations

from splitinfer.models.zoo import REAL, SMALL, InputSpec, ZooModel, export, reference

ZOO = SMALL

__all__ = ["REAL", "SMALL", "ZOO", "InputSpec", "ZooModel", "export", "reference"]
