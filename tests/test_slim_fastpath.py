"""onnxslim with the large weights held aside: the same model as with them in place."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from graphs import f32, make, rand, weight_in_branch
from onnx import helper
from ortutil import run

from splitinfer.partitioner.passes import slim
from splitinfer.partitioner.passes.beside import read_beside

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


def beside(model: onnx.ModelProto, folder: Path) -> onnx.ModelProto:
    """``model`` with its initializers of 1 KB and more in a file in ``folder``, as
    ONNX Runtime's pass leaves them (external-data references, not read)."""
    path = folder / "m.onnx"
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # saving with external data rewrites the model it is given
    onnx.save(copy, str(path), save_as_external_data=True, location="w.bin", size_threshold=1024)
    return onnx.load(str(path), load_external_data=False)


def test_weights_beside_the_graph_stay_there_and_tie_as_in_place(tmp_path: Path) -> None:
    model = three_projections()
    ref = beside(model, tmp_path)
    light, held = slim._strip(ref, slim.BesideData(tmp_path))
    assert set(held) == {"wq", "wk", "wv"}
    label = {t.name: t.doc_string for t in light.graph.initializer}
    assert label["wk"] == label["wv"] != label["wq"]
    out = slim.run(ref, tmp_path)
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in out.graph.initializer)
    read_beside(out, tmp_path)
    in_place = slim.run(model)
    assert out.SerializeToString(deterministic=True) == in_place.SerializeToString(
        deterministic=True
    )


def test_weights_beside_go_through_the_full_pass_when_onnxslim_reads_them(
    tmp_path: Path,
) -> None:
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["y"]),
    ]
    model = make(nodes, [f32("x", ["N", N])], [f32("y", ["N", N])], {"w": rand(N, N, seed=4)})
    out = slim.run(beside(model, tmp_path), tmp_path)
    read_beside(out, tmp_path)  # whatever is still a reference
    x = {"x": rand(3, N, seed=5)}
    np.testing.assert_allclose(run(out, x)["y"], run(model, x)["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("inside", [False, True], ids=["outer", "in-branch"])
def test_a_weight_only_an_if_branch_reads_keeps_its_data(tmp_path: Path, inside: bool) -> None:
    # outer: onnxslim moves the held (data-less) weight into the one branch that reads
    # it; in-branch: a weight beside the graph inside the branch is read in
    model = weight_in_branch(inside)
    out = slim.run(beside(model, tmp_path), tmp_path)
    read_beside(out, tmp_path)
    for flag in (True, False):
        feeds = {"x": rand(3, N, seed=5), "flag": np.array([flag])}
        np.testing.assert_allclose(run(out, feeds)["y"], run(model, feeds)["y"], rtol=1e-5)


def test_beside_data_refuses_a_location_outside_its_folder(tmp_path: Path) -> None:
    ref = beside(three_projections(), tmp_path)
    t = ref.graph.initializer[0]
    next(e for e in t.external_data if e.key == "location").value = "../w.bin"
    with pytest.raises(ValueError, match="outside"):
        slim.BesideData(tmp_path).bytes_of(t)
