"""onnxslim with the large weights held aside: the same model as with them in place."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from graphs import f32, make, rand
from onnx import helper
from ortutil import run

from splitinfer.partitioner.passes import slim

pytestmark = pytest.mark.unit

N = 128  # 128 x 128 float32 = 64 KiB: at the threshold, held aside


def three_projections() -> onnx.ModelProto:
    """q, k, v = x @ Wq, x @ Wk, x @ Wv with Wk == Wv in data (weights to tie) and Wq
    of the same shape but other data (which must stay apart)."""
    wq, wk = rand(N, N, seed=1), rand(N, N, seed=2)
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"]),
        helper.make_node("MatMul", ["x", "wk"], ["k"]),
        helper.make_node("MatMul", ["x", "wv"], ["v"]),
        helper.make_node("Sub", ["q", "k"], ["qk"]),
        helper.make_node("Add", ["qk", "v"], ["y"]),
    ]
    inits = {"wq": wq, "wk": wk, "wv": wk.copy()}
    return make(nodes, [f32("x", ["N", N])], [f32("y", ["N", N])], inits)


def test_fast_path_matches_the_full_pass_and_keeps_different_weights_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = three_projections()
    light, held = slim._strip(model)
    assert set(held) == {"wq", "wk", "wv"}
    assert all(not t.HasField("raw_data") for t in light.graph.initializer)
    label = {t.name: t.doc_string for t in light.graph.initializer}
    assert label["wk"] == label["wv"] != label["wq"]  # equal data, equal label; only then
    calls: list[int] = []
    real = slim._slim
    monkeypatch.setattr(slim, "_slim", lambda m: calls.append(len(m.graph.initializer)) or real(m))
    fast = slim.run(model)
    assert len(calls) == 1  # no fallback to the full pass
    monkeypatch.setattr(slim, "STRIP_BYTES", 1 << 40)
    full = slim.run(model)
    assert fast.SerializeToString(deterministic=True) == full.SerializeToString(deterministic=True)
    x = {"x": rand(2, N, seed=3)}
    np.testing.assert_allclose(run(fast, x)["y"], run(model, x)["y"], rtol=1e-5, atol=1e-5)
    # the source model is untouched
    assert {t.name: len(t.raw_data) for t in model.graph.initializer} == {
        n: N * N * 4 for n in ("wq", "wk", "wv")
    }


def test_a_pass_that_reads_a_held_weight_falls_back_to_the_full_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Transpose of a weight alone is a constant subgraph: onnxslim folds it, reading the
    # values, which the data-less copy does not have
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["y"]),
    ]
    model = make(nodes, [f32("x", ["N", N])], [f32("y", ["N", N])], {"w": rand(N, N, seed=4)})
    calls: list[int] = []
    real = slim._slim
    monkeypatch.setattr(slim, "_slim", lambda m: calls.append(len(m.graph.node)) or real(m))
    out = slim.run(model)
    assert len(calls) == 2  # the data-less copy failed, the whole model went through
    x = {"x": rand(3, N, seed=5)}
    np.testing.assert_allclose(run(out, x)["y"], run(model, x)["y"], rtol=1e-5, atol=1e-5)
    assert all(
        t.HasField("raw_data") or t.data_location == onnx.TensorProto.EXTERNAL
        for t in out.graph.initializer
    )
