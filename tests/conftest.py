from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from kinds import _unit_tests_stay_in, pytest_collection_modifyitems  # noqa: F401
from zoo import ZOO, export


@pytest.fixture(scope="session")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every zoo model exported to ONNX once per test run."""
    out = tmp_path_factory.mktemp("zoo")
    for name, model in ZOO.items():
        export(model, out / f"{name}.onnx")
    return out
