"""bench/bench_partition.py's report: where a failed budget's time went."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_partition.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_partition", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_partition"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_phases_run_from_each_progress_line_to_the_next_and_add_up_counted_steps(
    bench: ModuleType,
) -> None:
    child = bench.Child(
        8.5, 1, 0, "",
        [
            (0.7, "partition: loading /tmp/x/m.onnx"),
            (1.0, "partition: optimizing (ort_basic, onnxslim)"),
            (4.0, "partition: measuring the codec on 1/90 tensors"),
            (4.5, "partition: measuring the codec on 90/90 tensors"),
            (5.0, "partition: building cut 1/2: c9 (all), int8 edge"),
            (6.0, "partition: building cut 2/2: c0 (none), int8 edge"),
            (7.5, "partition: wrote pkg"),
            (7.6, "a line of its own"),
        ],
    )  # fmt: skip
    assert child.phases() == (
        "start-up 0.70, loading 0.30, optimizing 3.00, measuring the codec on 1.00, "
        "building cut 2.50, wrote pkg 1.00 (s)"
    )
    assert bench.Child(1.0, 1, 0, "").phases() == ""


def test_failed_budgets_and_auto_runs_say_where_their_time_went(bench: ModuleType) -> None:
    ok = bench.Budget("--list-cuts", "a", "s", 1.0, 5.0, 0.2, "", "start-up 0.50 (s)")
    bad = bench.Budget("--list-cuts", "b", "s", 8.0, 5.0, 0.7, "", "optimizing 3.00 (s)")
    auto = bench.Budget("--split auto", "c", "s", 9.0, 20.0, 0.7, "", "profiling 4.00 (s)")
    table = bench.budget_table([ok, bad, auto])
    assert "--list-cuts b: optimizing 3.00 (s)" in table
    assert "--split auto c: profiling 4.00 (s)" in table
    assert "--list-cuts a:" not in table
    assert "where the time" not in bench.budget_table([ok])
