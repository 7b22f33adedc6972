"""Models as exported: a declared batch of 1, a batch axis that is not the first,
unknown sizes written as -1, declared output shapes that lie.

A batch axis declared 1 is freed where the model runs batched (checked by
running it), else kept at 1 and served one request per run; an output batched
on axis k is carried with the batch symbol at k and split there by the cloud.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from cloudkit import frame
from graphs import f32, make, rand
from onnx import helper
from ortutil import run

from splitinfer.cloud.config import BatchingConfig
from splitinfer.cloud.engine import Engine
from splitinfer.cloud.tensors import split
from splitinfer.partitioner.batch import batch_axis_of, free_batch
from splitinfer.partitioner.cli import main as partition
from splitinfer.partitioner.loader import dims_of
from splitinfer.partitioner.pipeline import prepare, write_package
from splitinfer.shared.frame import Limits, decode_response
from splitinfer.shared.manifest import load_manifest

pytestmark = pytest.mark.integration


def conv_batch1() -> onnx.ModelProto:
    """Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm on ``[1, 3, 8, 8]``: runs batched."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "g"], ["y"]),
    ]
    inits = {"w": rand(4, 3, 3, 3, seed=1), "g": rand(4, 5, seed=2)}
    return make(nodes, [f32("x", [1, 3, 8, 8])], [f32("y", [1, 5])], inits)


def reshape_literal() -> onnx.ModelProto:
    """Relu -> Reshape to the literal ``[1, 24]`` -> MatMul: runs at batch 1 only."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Sigmoid", ["r"], ["s"]),
        helper.make_node("Reshape", ["s", "shape"], ["f"]),
        helper.make_node("MatMul", ["f", "w"], ["m"]),
        helper.make_node("Tanh", ["m"], ["y"]),
    ]
    inits = {"shape": np.array([1, 24], np.int64), "w": rand(24, 5, seed=3)}
    return make(nodes, [f32("x", [1, 4, 6])], [f32("y", [1, 5])], inits)


def seq_first() -> onnx.ModelProto:
    """``x [1, 4, 6] -> y (6, N, 8)``: a seq-first head, the batch on axis 1 of the output,
    and the output declared ``[1, -1]`` as exporters get it wrong."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[2, 0, 1]),  # 6, N, 4
        helper.make_node("MatMul", ["t", "w"], ["m"]),  # 6, N, 8
        helper.make_node("Relu", ["m"], ["r"]),
        helper.make_node("Add", ["r", "b"], ["y"]),
    ]
    inits = {"w": rand(4, 8, seed=4), "b": rand(8, seed=5)}
    return make(nodes, [f32("x", [1, 4, 6])], [f32("y", [1, -1])], inits)


def minus_one() -> onnx.ModelProto:
    """PaddlePaddle's way of saying "unknown": ``[-1, 3, ?, ?]`` on the input."""
    model = conv_batch1()
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[0].Clear()
    dims[0].dim_value = -1
    for k in (2, 3):
        dims[k].Clear()
        dims[k].dim_param = "?"
    return model


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


# -- detection -----------------------------------------------------------------------


def test_a_declared_batch_of_one_is_freed_where_the_model_runs_batched() -> None:
    model = conv_batch1()
    batch = free_batch(model, {})
    assert batch.mode == "freed"
    assert dims_of(model.graph.input[0])[0] == "batch"
    assert "runs batched" in (batch.note or "")


def test_a_literal_batch_of_one_stays_fixed_and_says_why() -> None:
    model = reshape_literal()
    batch = free_batch(model, {})
    assert batch.mode == "fixed"
    assert batch.size == 1
    assert dims_of(model.graph.input[0])[0] == 1  # put back as it was
    assert "does not run batched" in (batch.note or "")


def test_a_declared_free_batch_is_left_alone() -> None:
    model = conv_batch1()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    assert free_batch(model, {}).mode == "symbolic"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("one", "two", "axis"),
    [((1, 5), (2, 5), 0), ((6, 1, 8), (6, 2, 8), 1), ((1, 1), (1, 2), 1), ((1, 24), (1, 48), None),
     ((1, 5), (1, 5), None), ((1, 5), (2, 10), None)],
)  # fmt: skip
def test_the_batch_axis_is_the_one_that_grows_from_one_to_two(
    one: tuple[int, ...], two: tuple[int, ...], axis: int | None
) -> None:
    assert batch_axis_of(one, two) == axis


# -- partitioning ----------------------------------------------------------------------


def test_a_freed_batch_composes_at_batch_three_and_is_in_the_manifest(tmp_path: Path) -> None:
    src = _save(conv_batch1(), tmp_path / "conv.onnx")
    prepared = prepare(src)
    assert prepared.analysis.batch_symbol == "batch"
    plan = prepared.space.plans()[len(prepared.space.plans()) // 2]
    manifest = write_package(prepared, plan, tmp_path / "pkg")  # verified at batch 1 and 3
    assert manifest.batch_dim == "batch"
    assert manifest.optimization["batch"]["mode"] == "freed"
    x = rand(3, 3, 8, 8, seed=9)
    want = np.concatenate([run(src, {"x": x[i : i + 1]})["y"] for i in range(3)])
    mid = run(tmp_path / "pkg" / "edge.onnx", {"x": x})
    got = run(tmp_path / "pkg" / "cloud.onnx", mid)["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_split_auto_on_a_fixed_batch_writes_a_package(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _save(reshape_literal(), tmp_path / "lit.onnx")
    code = partition([str(src), "--split", "auto", "-o", str(tmp_path / "pkg"), "--quiet"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "Traceback" not in out.err + out.out
    manifest = load_manifest(tmp_path / "pkg")
    assert manifest.batch_dim is None
    assert manifest.optimization["batch"] == {
        "mode": "fixed", "size": 1, "note": manifest.optimization["batch"]["note"]
    }  # fmt: skip


def test_every_cut_of_a_seq_first_model_composes_to_its_layout(tmp_path: Path) -> None:
    src = _save(seq_first(), tmp_path / "seq.onnx")
    prepared = prepare(src)
    assert prepared.batch.mode == "freed"
    info = prepared.analysis.tensors["y"]
    assert info.batch_axis == 1
    assert info.bytes_per_sample == 6 * 8 * 4  # one sample's share, not the analysis batch's
    x = rand(3, 4, 6, seed=7)
    want = np.concatenate([run(src, {"x": x[i : i + 1]})["y"] for i in range(3)], axis=1)
    assert want.shape == (6, 3, 8)
    for plan in prepared.space.plans():
        out = tmp_path / plan.id
        manifest = write_package(prepared, plan, out)
        assert manifest.outputs[0].shape == (6, "batch", 8), plan.id
        mid = {"x": x}
        if (out / "edge.onnx").exists():
            mid.update(run(out / "edge.onnx", mid))
        got = run(out / "cloud.onnx", mid) if (out / "cloud.onnx").exists() else mid
        np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-5, err_msg=plan.id)


def test_unknown_sizes_written_as_minus_one_partition(tmp_path: Path) -> None:
    src = _save(minus_one(), tmp_path / "m1.onnx")
    for cut in ("c0", "c1", "all"):
        code = partition([str(src), "--input-shape", "x=1x3x8x8", "--split", cut,
                          "-o", str(tmp_path / cut), "--precision", "fp32", "--quiet"])  # fmt: skip
        assert code == 0, cut
    manifest = load_manifest(tmp_path / "c1")
    assert manifest.inputs[0].shape[0] != -1


def test_list_cuts_says_a_fixed_batch_is_fixed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _save(reshape_literal(), tmp_path / "lit.onnx")
    assert partition([str(src), "--list-cuts", "--json"]) == 0
    out = capsys.readouterr()
    assert "does not run batched" in out.err
    json.loads(out.out)


# -- serving -------------------------------------------------------------------------


@pytest.mark.unit
def test_split_cuts_each_output_along_its_own_batch_axis() -> None:
    outputs = {"a": np.arange(10).reshape(5, 2), "t": np.arange(30).reshape(3, 5, 2)}
    shares = split(outputs, [2, 3], {"t": 1})
    assert shares[0]["a"].shape == (2, 2)
    assert shares[1]["t"].shape == (3, 3, 2)
    np.testing.assert_array_equal(shares[1]["t"], outputs["t"][:, 2:])


def _repo(tmp_path: Path, model: onnx.ModelProto, name: str, cut: str) -> Path:
    src = _save(model, tmp_path / f"{name}.onnx")
    prepared = prepare(src)
    write_package(prepared, prepared.space.find(cut), tmp_path / "repo" / name / "1")
    return tmp_path / "repo"


async def _serve_concurrently(
    repo: Path, name: str, arrays: list[np.ndarray]
) -> tuple[list[np.ndarray], Engine]:
    from cloudkit import config

    manifest = load_manifest(repo / name / "1")
    (tensor,) = manifest.cut.tensors
    cfg = config(repo, batching=BatchingConfig(max_batch_size=8, max_queue_delay_ms=50))
    async with Engine(cfg) as engine:
        tasks = [engine.infer(name, frame(manifest, {tensor.name: a})) for a in arrays]
        served = await asyncio.gather(*tasks)
        models = engine.registry.status()["models"]
    answers = [decode_response(s.body, manifest, Limits()).tensors[0].array for s in served]
    return answers, models


async def test_the_cloud_batches_a_seq_first_output_along_its_batch_axis(tmp_path: Path) -> None:
    repo = _repo(tmp_path, seq_first(), "seq", "c0")
    xs = [rand(1, 4, 6, seed=s) for s in range(4)]
    answers, models = await _serve_concurrently(repo, "seq", xs)
    (version,) = models[0]["versions"]
    assert version["unbatched_cuts"] == []
    for a, got in zip(xs, answers, strict=True):
        want = run(tmp_path / "seq.onnx", {"x": a})["y"]
        assert got.shape == (6, 1, 8)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


async def test_the_cloud_serves_a_fixed_batch_one_request_per_run(tmp_path: Path) -> None:
    repo = _repo(tmp_path, reshape_literal(), "lit", "c0")
    xs = [rand(1, 4, 6, seed=s) for s in range(3)]
    answers, models = await _serve_concurrently(repo, "lit", xs)
    (version,) = models[0]["versions"]
    assert version["unbatched_cuts"] == ["c0"]
    assert version["batch"]["mode"] == "fixed"
    for a, got in zip(xs, answers, strict=True):
        np.testing.assert_allclose(got, run(tmp_path / "lit.onnx", {"x": a})["y"], rtol=1e-5)


# -- as shipped: ddddocr's recogniser and detector ---------------------------------------


def _ddddocr(name: str) -> Path:
    ddddocr = pytest.importorskip("ddddocr", reason="the demo extra brings ddddocr's models")
    return Path(ddddocr.__file__).parent / name


@pytest.mark.slow
def test_every_cut_of_the_shipped_recogniser_composes_to_t_n_c() -> None:
    """ddddocr's conv+LSTM recogniser declares ``[1, 1, 64, W] -> [1, seqlen]`` and returns
    ``(T, N, 8210)``: its batch is freed, and every cut answers ``(T, 3, 8210)`` at batch 3
    as the source answers each sample."""
    from splitinfer.partitioner.segments import cloud_model, edge_model

    src = _ddddocr("common.onnx")
    prepared = prepare(src, {"input1": [1, 1, 64, 128]})
    assert prepared.batch.mode == "freed"
    x = np.random.default_rng(0).random((3, 1, 64, 128), dtype=np.float32)
    want = np.concatenate([run(src, {"input1": x[i : i + 1]})["387"] for i in range(3)], axis=1)
    assert want.shape == (16, 3, 8210)
    a = prepared.analysis
    for plan in prepared.space.plans():
        mid = {"input1": x}
        if plan.kind != "none":
            mid.update(run(edge_model(a, plan), mid))
        got = mid if plan.kind == "all" else run(cloud_model(a, plan), mid)
        assert got["387"].shape == want.shape, plan.id
        np.testing.assert_allclose(got["387"], want, rtol=1e-4, atol=1e-4, err_msg=plan.id)


@pytest.mark.slow
def test_split_auto_partitions_the_shipped_detector_at_its_fixed_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ddddocr's YOLOX detector folds its batch of 1 into the anchors (``1x7098x6`` at
    batch 2): it stays at batch 1, and ``--split auto`` prices and writes it so."""
    code = partition([str(_ddddocr("common_det.onnx")), "--split", "auto", "-o",
                      str(tmp_path / "det"), "--quiet"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "Traceback" not in out.out + out.err
    manifest = load_manifest(tmp_path / "det")
    assert manifest.batch_dim is None
    assert manifest.optimization["batch"]["mode"] == "fixed"


# -- inputs not batched along their first axis ---------------------------------------


def rnn_state(batched_state: bool) -> onnx.ModelProto:
    """``x [1, 4] + state`` where the state is ``[2, N, 4]`` (batch on axis 1) or ``[2, 1, 4]``
    fixed: the shape of a streaming RNN's inputs (silero-vad's)."""
    nodes = [
        helper.make_node("ReduceSum", ["state", "axes"], ["s"], keepdims=0),  # N, 4
        helper.make_node("Add", ["x", "s"], ["y"]),
        helper.make_node("Relu", ["y"], ["z"]),
    ]
    lead = "N" if batched_state else 1
    inputs = [f32("x", [lead, 4]), f32("state", [2, lead, 4])]
    return make(nodes, inputs, [f32("z", [lead, 4])], {"axes": np.array([0], np.int64)})


def test_an_input_batched_on_its_second_axis_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _save(rnn_state(batched_state=True), tmp_path / "rnn.onnx")
    assert partition([str(src), "--list-cuts"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 or "Traceback" not in "\n".join(err)
    assert "input 'state' (2xNx4) holds the batch dimension 'N' on axis 1" in err[-1]


def test_split_auto_refuses_a_fixed_state_input_and_fixed_cuts_still_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _save(rnn_state(batched_state=False), tmp_path / "rnn.onnx")
    code = partition([str(src), "--split", "auto", "-o", str(tmp_path / "auto"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--split auto: input 'state' (2x1x4) is not batched along its first axis" in err
    assert "Traceback" not in err
    assert partition([str(src), "--split", "c1", "-o", str(tmp_path / "c1"), "--quiet",
                      "--precision", "fp32"]) == 0  # fmt: skip


@pytest.mark.unit
def test_stacked_samples_run_one_at_a_time_on_a_fixed_model() -> None:
    """Samples stacked along axis 0, each with its own leading size (a batch of 1 and a
    state of 2), run one sample at a time; the answers join along axis 0."""
    from splitinfer.partitioner.batch import RowSession
    from splitinfer.shared.ortsession import open_session

    model = rnn_state(batched_state=False)
    sess = RowSession(open_session(model))
    xs = [rand(1, 4, seed=s) for s in range(3)]
    states = [rand(2, 1, 4, seed=10 + s) for s in range(3)]
    (got,) = sess.run(["z"], {"x": np.concatenate(xs), "state": np.concatenate(states)})
    want = np.concatenate(
        [run(model, {"x": x, "state": st})["z"] for x, st in zip(xs, states, strict=True)]
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)
