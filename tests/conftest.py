from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from incloud import cloud_factory  # noqa: F401
from kinds import _unit_tests_stay_in, pytest_collection_modifyitems  # noqa: F401
from zoo import REAL, ZOO, export


@pytest.fixture(scope="session")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every small zoo model exported to ONNX once per test run."""
    out = tmp_path_factory.mktemp("zoo")
    for name, model in ZOO.items():
        export(model, out / f"{name}.onnx")
    return out


class RealZoo:
    """The real-scale zoo, each model exported on first use and kept for the session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths: dict[str, Path] = {}

    def path(self, name: str) -> Path:
        if name not in self._paths:
            self._paths[name] = export(REAL[name], self.root / name / f"{name}.onnx")
        return self._paths[name]


@pytest.fixture(scope="session")
def real_zoo(tmp_path_factory: pytest.TempPathFactory) -> RealZoo:
    """Exports of the real-scale zoo (``models/zoo.py``), once per session, lazily."""
    return RealZoo(tmp_path_factory.mktemp("real-zoo"))
