"""measure_nodes stops measuring a batch size once its run budget is spent."""

from __future__ import annotations

import numpy as np
import pytest
from graphs import chain

from splitinfer.partitioner import profiler
from splitinfer.partitioner.profiler import measure_nodes

pytestmark = pytest.mark.integration


def test_the_run_budget_caps_the_measured_runs_and_the_trace_still_lines_up() -> None:
    model = chain(20, width=4)
    feeds = {"x": np.ones((2, 4), np.float32)}
    spent = measure_nodes(
        model, lambda b: feeds, (1, 2), runs=12, warmup=1, intra_op_threads=1, run_budget_s=0.0
    )
    assert spent.meta["runs_by_batch"] == f"1: {profiler.MIN_RUNS}, 2: {profiler.MIN_LATER_RUNS}"
    assert set(spent.times) == {1, 2}
    assert all(t >= 0 for t in spent.times[2].values())
    full = measure_nodes(
        model, lambda b: feeds, (1, 2), runs=5, warmup=1, intra_op_threads=1, run_budget_s=None
    )
    assert full.meta["runs_by_batch"] == "1: 5, 2: 5"
    assert full.nodes == spent.nodes
