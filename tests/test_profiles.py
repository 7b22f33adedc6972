"""Device profiles, the roofline estimate and the one entry point for node times."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from graphs import chain, f32, make, rand, shape_subgraph
from onnx import helper

from splitinfer.partitioner.analysis import GraphAnalysis, analyse
from splitinfer.partitioner.flops import node_flops
from splitinfer.partitioner.profiles import NodeTimes, node_times, node_work, roofline_times
from splitinfer.partitioner.runtime_map import node_keys
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.nodeprofile import NodeProfile
from splitinfer.shared.profiles import (
    BUILTIN,
    DeviceProfile,
    NodeWork,
    TensorWork,
    resolve_profile,
    roofline_seconds,
)

pytestmark = pytest.mark.unit

TOY = DeviceProfile(
    name="toy",
    kind="edge",
    runtime="onnxruntime-cpu",
    peak_flops={"int8": 4e12, "fp16": 2e12, "fp32": 1e12},
    mem_bandwidth=1e11,
    memory_bytes=2**30,
    efficiency=0.5,
    launch_overhead_s=1e-6,
    power_w=5.0,
    cost_per_hour=None,
    source="made up for the tests",
)


def dense_net() -> GraphAnalysis:
    """A large MatMul (compute-bound) and a Relu over the same activations (memory-bound)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["y"], name="relu"),
    ]
    model = make(nodes, [f32("x", ["N", 512])], [f32("y", ["N", 512])], {"w": rand(512, 512)})
    return analyse(model, {})


def conv_net() -> GraphAnalysis:
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c"], ["y"], name="relu"),
    ]
    inits = {"w": rand(64, 64, 3, 3), "b": rand(64)}
    return analyse(
        make(nodes, [f32("x", ["N", 64, 28, 28])], [f32("y", ["N", 64, 28, 28])], inits), {}
    )


# -- the roofline ---------------------------------------------------------------


def test_compute_bound_and_memory_bound_nodes() -> None:
    analysis = dense_net()
    batch = 64
    times = roofline_times(analysis, TOY, "fp32", batch)
    mm_flops = 2 * 512 * 512 * batch
    mm_bytes = (batch * 512 * 2 + 512 * 512) * 4  # x and h activations, w weights
    compute = mm_flops / (1e12 * 0.5)
    assert compute > mm_bytes / 1e11, "the MatMul is compute-bound on this profile"
    assert times["mm"] == pytest.approx(compute + 1e-6, rel=1e-12)

    relu_bytes = batch * 512 * 4 * 2  # read h, write y
    assert relu_bytes / 1e11 > batch * 512 / (1e12 * 0.5), "the Relu is memory-bound"
    assert times["relu"] == pytest.approx(relu_bytes / 1e11 + 1e-6, rel=1e-12)


def test_int8_is_faster_than_fp32_where_its_peak_is_higher() -> None:
    analysis = dense_net()
    fp32 = roofline_times(analysis, TOY, "fp32", 64)
    int8 = roofline_times(analysis, TOY, "int8", 64)
    fp16 = roofline_times(analysis, TOY, "fp16", 64)
    assert int8["mm"] < fp16["mm"] < fp32["mm"]
    # compute-bound: a quarter of the time at four times the peak
    assert int8["mm"] - 1e-6 == pytest.approx((fp32["mm"] - 1e-6) / 4)
    # memory-bound: a quarter of the bytes
    assert int8["relu"] - 1e-6 == pytest.approx((fp32["relu"] - 1e-6) / 4)
    # a profile whose int8 peak is no higher gains only from the bytes
    flat = dataclasses.replace(TOY, peak_flops={"int8": 1e12, "fp16": 1e12, "fp32": 1e12})
    assert roofline_times(analysis, flat, "int8", 64)["mm"] > int8["mm"]


def test_larger_batches_cost_more() -> None:
    analysis = conv_net()
    one = roofline_times(analysis, BUILTIN["jetson-orin-nano"], "int8", 1)
    eight = roofline_times(analysis, BUILTIN["jetson-orin-nano"], "int8", 8)
    assert eight["conv"] > one["conv"]
    assert eight["relu"] > one["relu"]


def test_shape_arithmetic_costs_nothing_and_views_only_a_launch() -> None:
    analysis = analyse(shape_subgraph(), {})
    times = roofline_times(analysis, TOY, "fp32", 4)
    keys = node_keys(analysis)
    for i, node in enumerate(analysis.nodes):
        key = keys[i]
        if node.op_type in {"Shape", "Gather", "Unsqueeze", "Concat"}:
            assert not analysis.data_node[i]
            assert times[key] == 0.0
        elif node.op_type == "Reshape":
            assert times[key] == TOY.launch_overhead_s
        else:
            assert times[key] > TOY.launch_overhead_s
    assert set(times) == set(keys)


def test_built_in_profiles_order_as_the_hardware_does() -> None:
    analysis = conv_net()
    for precision in ("int8", "fp16", "fp32"):
        total = {
            name: sum(roofline_times(analysis, BUILTIN[name], precision, 8).values())
            for name in ("jetson-orin-nano", "jetson-orin-nx", "a100", "h100")
        }
        assert total["jetson-orin-nano"] > total["jetson-orin-nx"] > total["a100"] > total["h100"]
    pi = sum(roofline_times(analysis, BUILTIN["raspberry-pi-5"], "int8", 8).values())
    nano = sum(roofline_times(analysis, BUILTIN["jetson-orin-nano"], "int8", 8).values())
    assert pi > nano


def test_built_in_profiles_are_sane() -> None:
    assert set(BUILTIN) == {
        "jetson-orin-nano",
        "jetson-orin-nx",
        "raspberry-pi-5",
        "x86-server",
        "l4",
        "a100",
        "h100",
    }
    for name, p in BUILTIN.items():
        assert p.name == name
        assert p.peak_flops["int8"] >= p.peak_flops["fp16"] >= p.peak_flops["fp32"]
        assert 0.2 <= p.efficiency <= 0.5
        assert "http" in p.source
        if p.kind == "cloud":
            assert p.cost_per_hour is not None
            assert "USD" in p.source
        else:
            assert p.cost_per_hour is None
        if p.runtime == "tensorrt":  # Tensor Cores: int8 is twice fp16, dense
            assert p.peak_flops["int8"] == pytest.approx(2 * p.peak_flops["fp16"], rel=0.01)
    assert {p.kind for p in BUILTIN.values()} == {"edge", "cloud"}
    # dense, not the sparse figure NVIDIA headlines
    assert BUILTIN["h100"].peak_flops["int8"] == pytest.approx(1979e12)
    assert BUILTIN["jetson-orin-nano"].peak_flops["int8"] == pytest.approx(20e12)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"efficiency": 0.0}, "efficiency"),
        ({"efficiency": 1.5}, "efficiency"),
        ({"kind": "fog"}, "kind 'fog'"),
        ({"runtime": "tflite"}, "runtime 'tflite'"),
        ({"peak_flops": {"fp32": 1e12}}, "peak_flops must give"),
        ({"mem_bandwidth": 0}, "mem_bandwidth"),
        ({"cost_per_hour": 1.0}, "cloud profiles only"),
        ({"kind": "cloud"}, "needs a positive cost_per_hour"),
    ],
)
def test_device_profile_validation(change: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        dataclasses.replace(TOY, **change)  # type: ignore[arg-type]


def test_bad_precision_and_batch() -> None:
    with pytest.raises(ConfigError, match="precision 'int4'"):
        roofline_times(dense_net(), TOY, "int4")
    with pytest.raises(ConfigError, match="batch 0"):
        roofline_times(dense_net(), TOY, "fp32", 0)


# -- resolving --------------------------------------------------------------------


def measured_for(analysis: GraphAnalysis, sha: str | None = None) -> NodeProfile:
    keys = node_keys(analysis)
    return NodeProfile(
        device="Bench CPU (4 cores)",
        batch_sizes=(1, 8),
        times={1: {k: 1e-5 for k in keys}, 8: {k: 5e-5 for k in keys}},
        wall={1: 1e-5 * len(keys) + 2e-5, 8: 5e-5 * len(keys) + 2e-5},
        unattributed_s={1: 0.0, 8: 0.0},
        source_sha256=sha,
        precision="fp32",
    )


def test_resolve_built_in_and_measured(tmp_path: Path) -> None:
    assert resolve_profile("jetson-orin-nx", "edge") is BUILTIN["jetson-orin-nx"]
    assert resolve_profile("h100", "cloud") is BUILTIN["h100"]
    profile = measured_for(dense_net())
    profile.save(tmp_path / "edge.json")
    assert resolve_profile(str(tmp_path / "edge.json"), "edge") == profile


def test_resolve_unknown_name_lists_the_built_ins() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_profile("jetson-nano-2gb", "edge")
    message = str(info.value)
    assert "unknown edge profile 'jetson-nano-2gb'" in message
    for name in BUILTIN:
        assert name in message
    assert "\n" not in message


def test_resolve_missing_or_malformed_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        resolve_profile(str(tmp_path / "absent.json"), "cloud")
    (tmp_path / "bad.json").write_text('{"format": "splitinfer.node-profile", "format_version": 1')
    with pytest.raises(ConfigError, match="not valid JSON") as info:
        resolve_profile(str(tmp_path / "bad.json"), "edge")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="profile kind 'fog'"):
        resolve_profile("l4", "fog")


# -- node_times -------------------------------------------------------------------


def test_node_times_from_a_device_profile() -> None:
    analysis = conv_net()
    result = node_times(analysis, BUILTIN["l4"], "fp16", batch=4)
    assert isinstance(result, NodeTimes)
    assert result.times == roofline_times(analysis, BUILTIN["l4"], "fp16", 4)
    assert "l4" in result.source
    assert result.notes == ()
    assert result.total == pytest.approx(sum(result.times.values()))


def test_node_times_from_a_measured_profile() -> None:
    analysis = conv_net()
    profile = measured_for(analysis)
    exact = node_times(analysis, profile, "fp32", batch=8)
    assert exact.times == {"conv": 5e-5, "relu": 5e-5}
    assert exact.notes == ()
    assert "Bench CPU" in exact.source
    mid = node_times(analysis, profile, "fp32", batch=4)
    assert mid.times["conv"] == pytest.approx(1e-5 + 3 / 7 * 4e-5)
    assert any("interpolated" in n for n in mid.notes)
    other = node_times(analysis, profile, "int8", batch=16)
    assert other.times["conv"] == pytest.approx(1e-4)
    assert any("measured at fp32, asked for int8" in n for n in other.notes)


def test_a_few_missing_nodes_are_filled_in() -> None:
    analysis = analyse(chain(30, width=8), {})  # 31 nodes: one missing is 3%
    keys = node_keys(analysis)
    full = measured_for(analysis)
    missing = next(k for i, k in enumerate(keys) if analysis.nodes[i].op_type == "MatMul")
    partial = dataclasses.replace(
        full,
        times={b: {k: t for k, t in ts.items() if k != missing} for b, ts in full.times.items()},
    )
    filled = node_times(analysis, partial, "fp32", batch=8, fallback=TOY)
    assert filled.times[missing] == roofline_times(analysis, TOY, "fp32", 8)[missing]
    assert any("1 of 31 nodes" in n and "toy roofline" in n for n in filled.notes)
    assert all(filled.times[k] == 5e-5 for k in keys if k != missing)

    own = node_times(analysis, partial, "fp32", batch=8)  # no fallback: own seconds per FLOP
    flops = {k: node_flops(analysis, i) for i, k in enumerate(keys)}
    measured = [k for k in keys if k != missing and flops[k] > 0]
    per_flop = sum(5e-5 for _ in measured) / sum(flops[k] * 8 for k in measured)
    assert own.times[missing] == pytest.approx(flops[missing] * 8 * per_flop)
    assert any("seconds per FLOP" in n for n in own.notes)


def test_a_profile_of_another_graph_is_refused() -> None:
    analysis = analyse(chain(30, width=8), {})
    keys = node_keys(analysis)
    other = measured_for(analysis, sha="cd" * 32)
    other = dataclasses.replace(
        other,
        times={
            b: {k: t for k, t in ts.items() if k not in keys[:2]} for b, ts in other.times.items()
        },
    )
    with pytest.raises(ConfigError) as info:
        node_times(analysis, other, "fp32", model_sha256="ef" * 32)
    message = str(info.value)
    assert "lacks 2 of this graph's 31 nodes" in message
    assert "cdcdcdcdcdcd" in message
    assert "efefefefefef" in message
    with pytest.raises(ConfigError, match="lacks 2"):
        node_times(analysis, other, "fp32", fallback=TOY)  # a fallback does not excuse 6%


def test_the_roofline_formula_runs_on_a_node_table_with_no_graph() -> None:
    # shared/: anything that can describe its nodes gets the same estimate
    act = TensorWork(1000, 4, is_float=True, batched=True)  # 1000 floats a sample
    weight = TensorWork(500, 4, is_float=True, batched=False)
    ids = TensorWork(10, 8, is_float=False, batched=True)  # int64 stays 8 bytes
    work = [
        NodeWork("mm", "MatMul", True, 10**9, (act, weight, act)),
        NodeWork("relu", "Relu", True, 1000, (act, act)),
        NodeWork("shape", "Shape", False, 0),
        NodeWork("view", "Reshape", True, 0, (act, act)),
        NodeWork("gather", "Gather", True, 0, (ids, act)),
    ]
    t = roofline_seconds(work, TOY, "int8", batch=2)
    peak = TOY.peak_flops["int8"] * TOY.efficiency
    assert t["mm"] == pytest.approx(2e9 / peak + TOY.launch_overhead_s)
    moved = 2 * 1000 * 2 * 1  # two activations of 2 samples at 1 byte (int8)
    fp32_peak = TOY.peak_flops["fp32"] * TOY.efficiency
    assert t["relu"] == pytest.approx(
        max(2000 / fp32_peak, moved / TOY.mem_bandwidth) + TOY.launch_overhead_s
    )
    assert t["shape"] == 0.0
    assert t["view"] == TOY.launch_overhead_s
    gather_bytes = 2 * 10 * 8 + 2 * 1000 * 1
    assert t["gather"] == pytest.approx(gather_bytes / TOY.mem_bandwidth + TOY.launch_overhead_s)


def test_the_partitioner_roofline_is_the_shared_formula_on_its_analysis() -> None:
    analysis = dense_net()
    for precision in ("fp32", "int8"):
        assert roofline_times(analysis, TOY, precision, 4) == roofline_seconds(
            node_work(analysis), TOY, precision, 4
        )
