"""Measured per-node latency: ONNX Runtime's profiler mapped back to graph nodes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from graphs import chain, f32, free_dims, make, rand
from onnx import helper
from zoo import ZOO

from splitinfer.partitioner.analysis import GraphAnalysis, analyse
from splitinfer.partitioner.flops import node_flops
from splitinfer.partitioner.pipeline import prepare
from splitinfer.partitioner.profiler import NodeProfile, host_device_name, measure_nodes
from splitinfer.partitioner.runtime_map import Attributor, RuntimeNode, node_keys
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.ortsession import open_session

pytestmark = pytest.mark.integration

THREADS = 1  # one intra-op thread: less noise, and the machine is shared


def conv_net() -> onnx.ModelProto:
    """Conv+Relu (which ONNX Runtime fuses), Conv, Sigmoid, Add, pooling."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Sigmoid", ["c2"], ["s"], name="sig"),
        helper.make_node("Add", ["s", "c2"], ["a"], name="add"),
        helper.make_node("GlobalAveragePool", ["a"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["y"], name="flat"),
    ]
    inits = {"w1": rand(16, 3, 3, 3), "b1": rand(16), "w2": rand(16, 16, 3, 3, seed=1)}
    inits["b2"] = rand(16, seed=2)
    return make(nodes, [f32("x", ["N", 3, 24, 24])], [f32("y", ["N", 16])], inits)


def conv_feeds(batch: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(batch).standard_normal((batch, 3, 24, 24), np.float32)}


@pytest.fixture(scope="module")
def conv_analysis() -> GraphAnalysis:
    return analyse(conv_net(), {})


@pytest.fixture(scope="module")
def conv_profile(conv_analysis: GraphAnalysis) -> NodeProfile:
    return measure_nodes(
        conv_net(),
        conv_feeds,
        (1, 8),
        runs=10,
        warmup=2,
        intra_op_threads=THREADS,
        analysis=conv_analysis,
        source_sha256="ab" * 32,
    )


# -- the measurement --------------------------------------------------------


def test_every_node_gets_a_non_negative_time(
    conv_profile: NodeProfile, conv_analysis: GraphAnalysis
) -> None:
    assert conv_profile.batch_sizes == (1, 8)
    for b in conv_profile.batch_sizes:
        assert list(conv_profile.times[b]) == node_keys(conv_analysis)
        assert all(t >= 0 for t in conv_profile.times[b].values())
        assert conv_profile.unattributed_s[b] >= 0
    assert conv_profile.runtime == "onnxruntime-cpu"
    assert conv_profile.source_sha256 == "ab" * 32
    assert conv_profile.precision == "fp32"
    assert conv_profile.meta["runtime_graph"] is True


def test_node_times_add_up_to_no_more_than_the_wall_time(conv_profile: NodeProfile) -> None:
    for b in conv_profile.batch_sizes:
        total = sum(conv_profile.times[b].values())
        assert 0 < total <= conv_profile.wall[b]
        assert conv_profile.overhead_s[b] == pytest.approx(conv_profile.wall[b] - total)


def test_batch_8_costs_more_than_batch_1_for_convs(conv_profile: NodeProfile) -> None:
    for conv in ("conv1", "conv2"):
        assert conv_profile.times[8][conv] > conv_profile.times[1][conv] > 0


def test_fused_conv_relu_is_split_by_flops(
    conv_profile: NodeProfile, conv_analysis: GraphAnalysis, tmp_path: Path
) -> None:
    # the session really fuses: no Relu kernel runs, and nothing is named relu1
    open_session(conv_net(), optimized_path=tmp_path / "runtime.onnx")
    runtime = onnx.load(str(tmp_path / "runtime.onnx")).graph.node
    assert "Relu" not in {n.op_type for n in runtime}
    assert "relu1" not in {n.name for n in runtime}

    keys = node_keys(conv_analysis)
    flops = {k: node_flops(conv_analysis, i) for i, k in enumerate(keys)}
    for b in conv_profile.batch_sizes:
        times = conv_profile.times[b]
        assert times["relu1"] > 0, "the fused Relu gets its FLOP share of the kernel"
        assert times["relu1"] / times["conv1"] == pytest.approx(
            flops["relu1"] / flops["conv1"], rel=1e-9
        )
        assert conv_profile.unattributed_s[b] <= 0.1 * conv_profile.wall[b]


def test_zoo_resnet_every_node_measured(zoo_dir: Path) -> None:
    prepared = prepare(zoo_dir / "resnet.onnx")
    zoo = ZOO["resnet"]
    profile = measure_nodes(
        prepared.optimized,
        zoo.sample,
        (1, 8),
        runs=15,
        warmup=2,
        intra_op_threads=THREADS,
        analysis=prepared.analysis,
        source_sha256=prepared.source.sha256,
    )
    keys = node_keys(prepared.analysis)
    convs = [k for k, n in zip(keys, prepared.analysis.nodes, strict=True) if n.op_type == "Conv"]
    assert len(convs) >= 8
    for b in (1, 8):
        assert list(profile.times[b]) == keys
        assert all(t >= 0 for t in profile.times[b].values())
        total = sum(profile.times[b].values())
        assert total <= profile.wall[b]
    # compute-heavy at batch 8: nearly all of the run is inside the nodes
    assert sum(profile.times[8].values()) >= 0.6 * profile.wall[8]
    assert profile.unattributed_s[8] <= 0.05 * profile.wall[8]
    for conv in convs:
        assert profile.times[8][conv] > profile.times[1][conv]
    assert sum(profile.times[1][conv] for conv in convs) > 0


def test_bookkeeping_is_taken_off_small_kernels() -> None:
    # the cut itself, on fixed samples (comparing two timed runs was at the mercy of a
    # shared machine: CI saw the calibrated run come out slower than the raw one)
    from splitinfer.partitioner.profiler import ExecutorCosts, _bookkeeping_s, _medians

    runs, nodes, event_s = 5, 41, 2e-6  # 41 tiny kernels, one 2 us event each a run
    samples = {f"n{i}": (np.full(runs, event_s), np.ones(runs)) for i in range(nodes)}
    costs = ExecutorCosts(fixed_s=10e-6, per_node_s=0.0, trivial_event_s=1.5e-6)
    walls = [50e-6] * runs  # unprofiled: 10 us fixed + 40 us in the kernels
    cut = _bookkeeping_s(samples, walls, costs)
    assert cut == pytest.approx(event_s - 40e-6 / nodes, rel=1e-6)
    assert sum(_medians(samples, cut).values()) == pytest.approx(40e-6, rel=1e-6)
    # never inflates, and never cuts more than twice a trivial kernel's event
    assert _bookkeeping_s(samples, [200e-6] * runs, costs) == 0.0
    small = ExecutorCosts(fixed_s=10e-6, per_node_s=0.0, trivial_event_s=0.5e-6)
    assert _bookkeeping_s(samples, [11e-6] * runs, small) == pytest.approx(1e-6)
    # and on a real run of tiny nodes the calibrated times fit inside the observed wall
    model = chain(40, width=4)
    feeds = {"x": np.ones((2, 4), np.float32)}
    fixed = measure_nodes(model, lambda b: feeds, (2,), 10, 2, None, THREADS)
    assert 0 < sum(fixed.times[2].values()) <= fixed.wall[2]


def test_unnamed_nodes_are_keyed_by_op_and_index() -> None:
    model = free_dims()  # nodes without names, free H and W
    assert not any(n.name for n in model.graph.node)
    feeds = {"x": np.ones((1, 3, 8, 8), np.float32)}
    profile = measure_nodes(model, lambda b: feeds, runs=3, warmup=1, intra_op_threads=THREADS)
    assert profile.nodes == ["Conv_0", "Relu_1", "GlobalAveragePool_2", "Flatten_3"]
    assert profile.times[1]["Conv_0"] > 0


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"runs": 0}, "runs"),
        ({"warmup": -1}, "warmup"),
        ({"batch_sizes": (0,)}, "batch sizes"),
        ({"batch_sizes": ()}, "batch sizes"),
        ({"optimization": "max"}, "optimization level"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        measure_nodes(conv_net(), conv_feeds, **kwargs)  # type: ignore[arg-type]


def test_feeds_missing_an_input() -> None:
    with pytest.raises(ConfigError, match="lack input 'x'"):
        measure_nodes(conv_net(), lambda b: {"z": np.ones(1)}, analysis=analyse(conv_net(), {}))


def test_host_device_name() -> None:
    name = host_device_name()
    assert name.endswith("cores)")
    assert len(name) > len(" (1 cores)")


# -- attribution on hand-made runtime graphs ---------------------------------


def test_fused_conv_named_after_the_conv() -> None:
    analysis = analyse(conv_net(), {})
    runtime = [
        RuntimeNode("conv1", "FusedConv", ("x", "w1", "b1"), ("r1",)),
        RuntimeNode("conv2", "Conv", ("r1", "w2", "b2"), ("c2",)),
        RuntimeNode("sig", "Sigmoid", ("c2",), ("s",)),
        RuntimeNode("add", "Add", ("s", "c2"), ("a",)),
        RuntimeNode("gap", "GlobalAveragePool", ("a",), ("p",)),
        RuntimeNode("flat", "Flatten", ("p",), ("y",)),
    ]
    at = Attributor(analysis, [node_flops(analysis, i) for i in range(7)], runtime)
    index = {k: i for i, k in enumerate(at.keys)}
    shares = at.shares("conv1")
    assert shares is not None
    assert set(shares) == {index["conv1"], index["relu1"]}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares[index["relu1"]] == pytest.approx(1 / (1 + 2 * 27))  # Relu 1 FLOP, Conv 54
    assert at.shares("sig") == {index["sig"]: 1.0}
    assert at.shares("Cast_inserted_by_ort") is None


def test_nchwc_nodes_and_layout_reorders() -> None:
    analysis = analyse(conv_net(), {})
    runtime = [
        RuntimeNode("r1_nchwc", "Conv", ("x", "reorder", "b1"), ("reorder_token_0",)),
        RuntimeNode("c2_nchwc", "Conv", ("reorder_token_0", "w2r", "b2"), ("reorder_token_1",)),
        RuntimeNode("ReorderOutput", "ReorderOutput", ("reorder_token_1",), ("c2",)),
        RuntimeNode("sig", "Sigmoid", ("c2",), ("s",)),
        RuntimeNode("add", "Add", ("s", "c2"), ("a",)),
        RuntimeNode("ReorderInput", "ReorderInput", ("a",), ("reorder_token_2",)),
        RuntimeNode("p_nchwc", "GlobalAveragePool", ("reorder_token_2",), ("reorder_token_3",)),
        RuntimeNode("ReorderOutput_token_4", "ReorderOutput", ("reorder_token_3",), ("p",)),
        RuntimeNode("flat", "Flatten", ("p",), ("y",)),
    ]
    at = Attributor(analysis, [node_flops(analysis, i) for i in range(7)], runtime)
    index = {k: i for i, k in enumerate(at.keys)}

    def owners(name: str) -> set[str]:
        shares = at.shares(name)
        assert shares is not None, name
        return {at.keys[i] for i in shares}

    assert owners("r1_nchwc") == {"conv1", "relu1"}  # named after the Relu's output
    assert owners("c2_nchwc") == {"conv2"}  # c2 has two consumers: a real boundary
    assert at.shares("ReorderOutput") == at.shares("c2_nchwc")  # charged to its producer
    assert at.shares("ReorderInput") == at.shares("p_nchwc")  # charged to its consumer
    assert owners("p_nchwc") == {"gap"}
    assert at.shares("flat") == {index["flat"]: 1.0}


def test_pre_op_fusion_skip_layer_norm() -> None:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "bias"], ["mb"], name="bias_add"),
        helper.make_node("Add", ["x", "mb"], ["res"], name="residual"),
        helper.make_node("LayerNormalization", ["res", "g", "beta"], ["y"], axis=-1, name="ln"),
    ]
    inits = {"w": rand(8, 8), "bias": rand(8), "g": rand(8, seed=1), "beta": rand(8, seed=2)}
    analysis = analyse(make(nodes, [f32("x", ["N", 8])], [f32("y", ["N", 8])], inits), {})
    runtime = [
        RuntimeNode("mm", "MatMul", ("x", "w"), ("m",)),
        RuntimeNode("SkipLayerNormalization", "SkipLayerNormalization", ("x", "m", "g"), ("y",)),
    ]
    at = Attributor(analysis, [node_flops(analysis, i) for i in range(4)], runtime)
    shares = at.shares("SkipLayerNormalization")
    assert shares is not None
    assert {at.keys[i] for i in shares} == {"bias_add", "residual", "ln"}
    assert at.shares("mm") == {0: 1.0}


def test_without_a_runtime_graph_only_names_match() -> None:
    analysis = analyse(conv_net(), {})
    at = Attributor(analysis, [1] * 7, None)
    assert at.shares("conv2") == {at.keys.index("conv2"): 1.0}
    assert at.shares("r1_nchwc") is None


def test_node_keys_fill_in_missing_and_repeated_names() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="n0"),
        helper.make_node("Sigmoid", ["a"], ["b"], name="n1"),
        helper.make_node("Tanh", ["b"], ["c"], name="n2"),
        helper.make_node("Relu", ["c"], ["y"], name="Tanh_2"),
    ]
    analysis = analyse(make(nodes, [f32("x", ["N", 4])], [f32("y", ["N", 4])]), {})
    # ONNX Runtime refuses repeated names, so break the names after the analysis
    analysis.nodes[0].name = "same"
    analysis.nodes[1].name = "same"
    analysis.nodes[2].name = ""
    keys = node_keys(analysis)
    assert keys == ["Relu_0", "Sigmoid_1", "Tanh_2_", "Tanh_2"]


# -- the JSON file ------------------------------------------------------------


def sample_profile() -> NodeProfile:
    return NodeProfile(
        device="Test CPU (2 cores)",
        batch_sizes=(1, 4),
        times={1: {"a": 1e-5, "b": 2.5e-6}, 4: {"a": 3e-5, "b": 0.0}},
        wall={1: 2e-5, 4: 4e-5},
        unattributed_s={1: 0.0, 4: 1e-7},
        source_sha256="0123456789abcdef" * 4,
        precision="fp32",
        meta={"runs": 10, "onnxruntime": "1.32.0"},
    )


def test_json_round_trip(tmp_path: Path) -> None:
    profile = sample_profile()
    doc = json.loads(profile.to_json())
    assert doc["format"] == "splitinfer.node-profile"
    assert doc["format_version"] == 1
    assert doc["nodes"] == {"a": [1e-5, 3e-5], "b": [2.5e-6, 0.0]}
    assert NodeProfile.from_json(profile.to_json()) == profile
    path = tmp_path / "p.json"
    profile.save(path)
    assert NodeProfile.load(path) == profile


def test_measured_profile_round_trips(conv_profile: NodeProfile, tmp_path: Path) -> None:
    conv_profile.save(tmp_path / "m.json")
    assert NodeProfile.load(tmp_path / "m.json") == conv_profile


def test_times_at_other_batch_sizes() -> None:
    profile = sample_profile()
    assert profile.times_at(4) == ({"a": 3e-5, "b": 0.0}, None)
    mid, note = profile.times_at(2)
    assert mid["a"] == pytest.approx(1e-5 + (3e-5 - 1e-5) / 3)
    assert note is not None
    assert "interpolated" in note
    big, note = profile.times_at(8)
    assert big["a"] == pytest.approx(6e-5)
    assert note is not None
    assert "scaled linearly from measured batch 4" in note


def _doc(**changes: object) -> str:
    doc = json.loads(sample_profile().to_json())
    for key, value in changes.items():
        if value is KeyError:
            del doc[key]
        else:
            doc[key] = value
    return json.dumps(doc)


BAD_FILES = {
    "bad JSON": ("{not json", "not valid JSON"),
    "a list": ("[]", "not a JSON object"),
    "wrong format": (_doc(format="splitinfer.manifest"), "not a measured node profile"),
    "no format": (_doc(format=KeyError), "format None"),
    "newer version": (_doc(format_version=2), "format_version 2 is not supported"),
    "version as string": (_doc(format_version="1"), "format_version '1'"),
    "negative time": (_doc(nodes={"a": [-1e-6, 1e-6], "b": [0, 0]}), "node 'a' time at batch 1"),
    "string time": (_doc(nodes={"a": ["fast", 1e-6], "b": [0, 0]}), "node 'a' time at batch 1"),
    "NaN time": ('{"x": NaN}'.replace('{"x": NaN}', _doc(wall_s=[1e-5, 1e-5])), None),
    "infinite wall": (_doc(wall_s=[1e-5, 1e999]), "wall at batch 4"),
    "short list": (_doc(nodes={"a": [1e-6], "b": [0, 0]}), "node 'a': must be a list of 2"),
    "zero batch": (_doc(batch_sizes=[0, 4]), "batch sizes"),
    "decreasing batches": (_doc(batch_sizes=[4, 1]), "increasing"),
    "boolean batch": (_doc(batch_sizes=[True, 4]), "batch sizes"),
    "missing nodes": (_doc(nodes=KeyError), "missing field 'nodes'"),
    "bad sha": (_doc(source_sha256="xyz"), "source_sha256"),
    "bad precision": (_doc(precision="int4"), "precision 'int4'"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_profile_files(case: str, tmp_path: Path) -> None:
    text, needle = BAD_FILES[case]
    if needle is None:  # JSON's non-standard NaN, which Python's json accepts
        text = text.replace("1e-05, 1e-05", "NaN, 1e-05")
        needle = "wall at batch 1 is nan"
    path = tmp_path / "profile.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        NodeProfile.load(path)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    assert needle in message


def test_missing_file_and_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        NodeProfile.load(tmp_path / "absent.json")
    with pytest.raises(ConfigError, match="not a file"):
        NodeProfile.load(tmp_path)
    (tmp_path / "latin1.json").write_bytes(b'{"device": "\xff"}')
    with pytest.raises(ConfigError, match="cannot read it"):
        NodeProfile.load(tmp_path / "latin1.json")


def test_long_runs_are_measured_without_an_untimed_run_before_each(
    conv_analysis: GraphAnalysis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a run outlasts ``LONG_RUN_S`` (a real-size model) each measurement is one
    profiled and one plain run, and the trace is still split into the right runs."""
    from splitinfer.partitioner import profiler

    monkeypatch.setattr(profiler, "LONG_RUN_S", 0.0)
    prof = measure_nodes(
        conv_net(), conv_feeds, (1, 8), runs=4, warmup=1, analysis=conv_analysis,
        run_budget_s=None,
    )  # fmt: skip
    assert prof.meta["runs_per_measurement"] == "1: 1, 8: 1"
    assert prof.meta["runs_by_batch"] == "1: 4, 8: 4"
    assert all(v >= 0 for v in prof.times[8].values())
    assert sum(prof.times[8].values()) > sum(prof.times[1].values())
    monkeypatch.setattr(profiler, "LONG_RUN_S", 1e9)  # a short model keeps the warm run
    short = measure_nodes(conv_net(), conv_feeds, (1,), runs=3, warmup=1, analysis=conv_analysis)
    assert short.meta["runs_per_measurement"] == "1: 2"
