"""The score ``partition`` ranks cuts and wire codecs by, per kind of output."""

from __future__ import annotations

import numpy as np
import pytest

from splitinfer.partitioner.agreement import output_agreement, output_metric

pytestmark = pytest.mark.unit


def test_integer_outputs_are_compared_exactly() -> None:
    """Class ids or decoded tokens: one wrong id makes the answer wrong, however near."""
    ref = np.array([[3, 1, 4, 1], [5, 9, 2, 6], [5, 3, 5, 8], [9, 7, 9, 3]], np.int64)
    got = ref.copy()
    got[1, 2] = 3  # one token off in one of four answers
    assert output_metric(ref) == "exact"
    assert output_agreement("exact", ref, got) == pytest.approx(0.75)
    # cosine would have called this nearly perfect
    assert output_agreement("cosine", ref, got) > 0.99


def test_float_outputs_keep_top1_and_cosine() -> None:
    logits = np.array([[0.1, 0.9], [0.8, 0.2]], np.float32)
    assert output_metric(logits) == "top1"
    assert output_agreement("top1", logits, logits[:, ::-1]) == 0.0
    features = np.ones((2, 3, 4), np.float32)
    assert output_metric(features) == "cosine"
    assert output_agreement("cosine", features, 2 * features) == pytest.approx(1.0)
    assert output_metric(np.zeros((2, 3), bool)) == "exact"
