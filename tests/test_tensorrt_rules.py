"""TensorRT's explicit-quantization rules (partitioner/trt_rules.py), without TensorRT.

Two halves. Hand-built QDQ graphs, each broken in one way, show every rule fire
on its own (and a correct graph pass). Then the ``tensorrt`` recipe runs on every
zoo model's edge segments (the all-edge cut and cuts inside the graph) and must
break none of them.

Whether TensorRT itself builds these segments is bench/gpu_check.py's job, on a
machine with a GPU; see docs/profiles.md "INT8 for TensorRT".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from ortutil import run
from zoo import ZOO, export

from splitinfer.partitioner.pipeline import artifacts_for, prepare
from splitinfer.partitioner.quantize import config_for, count_qdq, quantize_model
from splitinfer.partitioner.trt_rules import RULES, check_tensorrt_qdq, weight_axis

pytestmark = pytest.mark.unit

Feed = dict[str, np.ndarray]


# --- hand-built graphs, one rule broken at a time ---------------------------------------


def _c(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(value, name)


def qdq_block(
    *,
    act_zero: np.ndarray | None = None,
    act_scale: np.ndarray | None = None,
    w_scale: np.ndarray | None = None,
    w_axis: int = 0,
    skip_quantized: bool = True,
    opset: int = 17,
) -> onnx.ModelProto:
    """x[N,4,6,6] → Q/DQ → Conv (weight Q/DQ per channel) → + x (skip, both quantized) → y.

    The keyword arguments break one thing at a time; the defaults follow every rule.
    """
    act_zero = np.zeros((), np.int8) if act_zero is None else act_zero
    act_scale = np.array(0.05, np.float32) if act_scale is None else act_scale
    w_scale = np.full(4, 0.01, np.float32) if w_scale is None else w_scale
    w_zero = np.zeros(w_scale.shape, np.int8)
    inits = [
        _c("w", np.random.default_rng(0).standard_normal((4, 4, 3, 3)).astype(np.float32)),
        _c("sx", act_scale),
        _c("zx", act_zero),
        _c("sw", w_scale),
        _c("zw", w_zero),
        _c("sy", np.array(0.1, np.float32)),
        _c("zy", np.zeros((), np.int8)),
    ]
    w_axis_attr = {"axis": w_axis} if w_scale.size > 1 else {}
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"], name="q_x"),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"], name="dq_x"),
        helper.make_node("QuantizeLinear", ["w", "sw", "zw"], ["wq"], name="q_w", **w_axis_attr),
        helper.make_node(
            "DequantizeLinear", ["wq", "sw", "zw"], ["wd"], name="dq_w", **w_axis_attr
        ),
        helper.make_node("Conv", ["xd", "wd"], ["c"], pads=[1] * 4, name="conv"),
        helper.make_node("QuantizeLinear", ["c", "sy", "zy"], ["cq"], name="q_c"),
        helper.make_node("DequantizeLinear", ["cq", "sy", "zy"], ["cd"], name="dq_c"),
        helper.make_node("Add", ["cd", "xd" if skip_quantized else "x"], ["y"], name="skip"),
    ]
    graph = helper.make_graph(
        nodes,
        "block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 6, 6])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def rules_fired(model: onnx.ModelProto) -> set[str]:
    found = set()
    for line in check_tensorrt_qdq(model):
        rule = line.split(": ")[1]
        assert rule in RULES, line
        found.add(rule)
    return found


def node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name)


def test_a_graph_that_follows_every_rule_passes_and_runs() -> None:
    model = qdq_block()
    onnx.checker.check_model(model)
    assert check_tensorrt_qdq(model) == []
    x = np.random.default_rng(1).standard_normal((2, 4, 6, 6)).astype(np.float32)
    assert run(model, {"x": x})["y"].shape == (2, 4, 6, 6)


def test_uint8_zero_point() -> None:
    model = qdq_block(act_zero=np.array(128, np.uint8))
    lines = check_tensorrt_qdq(model)
    assert rules_fired(model) >= {"int8", "zero-point"}
    assert any(line.startswith("node 'q_x': int8: zero point 'zx' is uint8") for line in lines)


def test_a_missing_zero_point_means_uint8() -> None:
    model = qdq_block()
    q = node(model, "q_x")
    del q.input[2:]
    assert "int8" in rules_fired(model)


def test_non_zero_zero_point() -> None:
    model = qdq_block(act_zero=np.array(3, np.int8))
    assert rules_fired(model) == {"zero-point"}


@pytest.mark.parametrize("bad", [0.0, -0.1, np.inf, np.nan])
def test_scale_must_be_finite_and_positive(bad: float) -> None:
    assert rules_fired(qdq_block(act_scale=np.array(bad, np.float32))) == {"scale"}


def test_per_tensor_weight() -> None:
    model = qdq_block(w_scale=np.array(0.01, np.float32))
    lines = check_tensorrt_qdq(model)
    assert rules_fired(model) == {"per-channel-weight"}
    assert "node 'conv': per-channel-weight: weight 'w' [4, 4, 3, 3] has one scale" in lines[0]


def test_weight_scales_on_the_wrong_axis() -> None:
    # (K=4, C=4, 3, 3): 4 scales fit axis 1 as well, but axis 1 is the input channels
    model = qdq_block(w_axis=1)
    assert rules_fired(model) == {"weight-axis"}
    assert "its output channels are axis 0" in check_tensorrt_qdq(model)[0]


def test_weight_scales_of_the_wrong_count() -> None:
    model = qdq_block(w_scale=np.full(2, 0.01, np.float32))
    assert "weight-axis" in rules_fired(model)


def test_an_unquantized_residual_branch() -> None:
    model = qdq_block(skip_quantized=False)
    lines = check_tensorrt_qdq(model)
    assert rules_fired(model) == {"residual-add"}
    assert lines == [
        "node 'skip': residual-add: input 'x' is not quantized; quantize both inputs of a "
        "skip connection so TensorRT fuses it in int8"
    ]


def test_a_broadcast_add_is_no_skip_connection() -> None:
    model = qdq_block(skip_quantized=False)
    skip = node(model, "skip")
    skip.input[1] = "bias"
    model.graph.input.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, [1, 4, 1, 1]))
    assert check_tensorrt_qdq(model) == []


def test_per_channel_activation() -> None:
    model = qdq_block()
    for name in ("q_x", "dq_x"):
        n = node(model, name)
        n.attribute.append(helper.make_attribute("axis", 1))
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "sx"))
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "zx"))
    model.graph.initializer.extend(
        [_c("sx", np.full(4, 0.05, np.float32)), _c("zx", np.zeros(4, np.int8))]
    )
    assert rules_fired(model) == {"per-tensor-activation"}


def test_a_conv_read_without_dequantize() -> None:
    model = qdq_block()
    node(model, "conv").input[0] = "x"
    fired = rules_fired(model)
    assert "weighted-inputs" in fired
    assert "input 0 ('x') is not read through a DequantizeLinear" in " ".join(
        check_tensorrt_qdq(model)
    )


def test_quantize_linear_output_must_go_to_dequantize() -> None:
    model = qdq_block()
    model.graph.node.append(helper.make_node("Identity", ["xq"], ["xq_copy"], name="leak"))
    model.graph.output.append(helper.make_tensor_value_info("xq_copy", TensorProto.INT8, None))
    assert rules_fired(model) == {"q-feeds-dq"}


def test_ops_tensorrt_does_not_parse() -> None:
    model = qdq_block()
    model.graph.node.append(
        helper.make_node("DynamicQuantizeLinear", ["y"], ["a", "b", "c"], name="dyn")
    )
    model.graph.node.append(
        helper.make_node("FusedConv", ["xd", "wd"], ["f"], name="fused", domain="com.microsoft")
    )
    lines = check_tensorrt_qdq(model)
    assert "node 'dyn': ops: TensorRT's ONNX parser does not support DynamicQuantizeLinear" in lines
    assert any(line.startswith("node 'fused': ops: com.microsoft.FusedConv") for line in lines)


def test_per_axis_needs_opset_13() -> None:
    assert "opset" in rules_fired(qdq_block(opset=12))
    assert "opset" not in rules_fired(qdq_block(opset=13))


def test_no_qdq_on_shape_tensors() -> None:
    model = qdq_block()
    inits = [
        _c("shape", np.array([0, -1], np.int64)),
        _c("ss", np.array(1.0, np.float32)),
        _c("sz", np.zeros((), np.int8)),
    ]
    model.graph.initializer.extend(inits)
    model.graph.node.extend(
        [
            helper.make_node("Shape", ["y"], ["dims"], name="shape_of"),
            helper.make_node("QuantizeLinear", ["dims", "ss", "sz"], ["dq8"], name="q_shape"),
            helper.make_node("DequantizeLinear", ["dq8", "ss", "sz"], ["dims_f"], name="dq_shape"),
            helper.make_node("Reshape", ["y", "dims_f"], ["flat"], name="reshape"),
        ]
    )
    lines = check_tensorrt_qdq(model)
    assert any(line.startswith("node 'q_shape': shape-tensor: quantizes 'dims'") for line in lines)
    assert any(line.startswith("node 'reshape': shape-tensor: input 1") for line in lines)


def test_an_int32_bias_dequantize() -> None:
    model = qdq_block()
    model.graph.initializer.extend(
        [_c("b32", np.zeros(4, np.int32)), _c("sb", np.full(4, 1e-4, np.float32))]
    )
    model.graph.node.insert(
        4, helper.make_node("DequantizeLinear", ["b32", "sb"], ["bd"], name="dq_bias", axis=0)
    )
    node(model, "conv").input.append("bd")
    lines = check_tensorrt_qdq(model)
    assert any(
        line.startswith("node 'dq_bias': int8: dequantizes 'b32' of type int32") for line in lines
    )


def test_a_float_model_has_nothing_to_check() -> None:
    model = qdq_block()
    keep = [n for n in model.graph.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear")]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    for n in model.graph.node:
        for i, name in enumerate(n.input):
            n.input[i] = {"xd": "x", "wd": "w", "cd": "c"}.get(name, name)
    assert check_tensorrt_qdq(model) == []


def test_weight_axes_of_each_weighted_op() -> None:
    assert weight_axis("Conv", 1, 4) == 0
    assert weight_axis("ConvTranspose", 1, 4) == 1  # (C_in, C_out/g, kh, kw)
    assert weight_axis("Gemm", 1, 2, trans_b=1) == 0  # (N, K)
    assert weight_axis("Gemm", 1, 2, trans_b=0) == 1  # (K, N)
    assert weight_axis("MatMul", 1, 2) == 1
    assert weight_axis("MatMul", 1, 3) == 2
    assert weight_axis("Conv", 2, 1) is None  # the bias has no channel axis to check


# --- the recipe on the zoo ------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A model to quantize: how to export it to ONNX, and sample inputs (batch, seed)."""

    name: str
    export: Callable[[Path], Path]
    sample: Callable[[int, int], Feed]


def _torch_case(name: str, build: Callable[[], object], shape: tuple[int, ...]) -> Case:
    def export_it(path: Path) -> Path:
        import torch

        from splitinfer.partitioner.torch_export import export_onnx

        torch.manual_seed(0)
        net = build()
        net.eval()  # type: ignore[attr-defined]
        example = (torch.randn(2, *shape),)
        return export_onnx(net, example, path, ["x"], ["y"])

    def sample(batch: int, seed: int) -> Feed:
        rng = np.random.default_rng(seed)
        return {"x": rng.standard_normal((batch, *shape)).astype(np.float32)}

    return Case(name, export_it, sample)


def _resnet_stage() -> object:
    """A ResNet-50 stage at real width: 7x7 stem, max pool, two bottlenecks with skip adds."""
    import torch
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, c: int, mid: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(c, mid, 1, bias=False),
                nn.BatchNorm2d(mid),
                nn.ReLU(),
                nn.Conv2d(mid, mid, 3, padding=1, bias=False),
                nn.BatchNorm2d(mid),
                nn.ReLU(),
                nn.Conv2d(mid, c, 1, bias=False),
                nn.BatchNorm2d(c),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x + self.body(x))

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2d(3, 64, 7, 2, 3, bias=False),
                nn.BatchNorm2d(64),
                nn.ReLU(),
                nn.MaxPool2d(3, 2, 1),
            )
            self.blocks = nn.Sequential(Bottleneck(256, 64), Bottleneck(256, 64))
            self.widen = nn.Conv2d(64, 256, 1, bias=False)
            self.fc = nn.Linear(256, 1000)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.blocks(self.widen(self.stem(x)))
            return self.fc(y.mean((2, 3)))

    return Stage()


def _encoder_layer() -> object:
    """A BERT-base-width encoder layer (768 wide, 12 heads) with pre-norm residuals."""
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self, d: int = 768, heads: int = 12) -> None:
            super().__init__()
            self.h = heads
            self.qkv = nn.Linear(d, 3 * d)
            self.out = nn.Linear(d, d)
            self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.n1(x)).split(d, -1)
            q, k, v = (z.reshape(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
            att = ((q @ k.transpose(-1, -2)) / (d // self.h) ** 0.5).softmax(-1) @ v
            x = x + self.out(att.transpose(1, 2).reshape(b, t, d))
            return x + self.ff(self.n2(x))

    return Layer()


def _decoder() -> object:
    """A U-Net-style decoder: strided convs down, ConvTranspose up (one grouped), a skip concat."""
    import torch
    from torch import nn

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.d1 = nn.Conv2d(3, 64, 3, 2, 1)
            self.d2 = nn.Conv2d(64, 128, 3, 2, 1)
            self.u1 = nn.ConvTranspose2d(128, 64, 2, 2)
            self.u2 = nn.ConvTranspose2d(128, 32, 4, 2, 1, groups=2)
            self.head = nn.Conv2d(32, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = torch.relu(self.d1(x))
            b = torch.relu(self.d2(a))
            u = torch.cat([torch.relu(self.u1(b)), a], 1)
            return self.head(torch.relu(self.u2(u)))

    return Decoder()


def zoo_cases(zoo: Mapping[str, Any], export_fn: Callable[[Any, Path], Path]) -> dict[str, Case]:
    """Cases from a zoo (``{name: model}``, ``model.sample(batch, seed=...)``) and its export."""

    def case(name: str) -> Case:
        model = zoo[name]
        return Case(name, lambda path: export_fn(model, path), lambda b, s: model.sample(b, seed=s))

    return {name: case(name) for name in zoo}


#: Every model the rules are checked on. The real-scale zoo (models/zoo.py) joins with
#: ``**zoo_cases(models.zoo.ZOO, models.zoo.export)`` (its heavy ones added to SLOW).
CASES: dict[str, Case] = {
    **zoo_cases(ZOO, export),
    "resnet_stage": _torch_case("resnet_stage", _resnet_stage, (3, 112, 112)),
    "encoder_layer": _torch_case("encoder_layer", _encoder_layer, (64, 768)),
    "unet_decoder": _torch_case("unet_decoder", _decoder, (3, 64, 64)),
}
#: The real-size ones take seconds each to quantize on two cores.
SLOW = {"resnet_stage", "encoder_layer", "unet_decoder"}


def _param(name: str) -> object:
    return pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [])


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    folder = tmp_path_factory.mktemp("trt-rules")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = CASES[name].export(folder / f"{name}.onnx")
        return done[name]

    return get


@pytest.mark.integration
@pytest.mark.parametrize("name", [_param(n) for n in CASES])
def test_the_tensorrt_recipe_follows_the_rules_on_every_zoo_model(
    name: str, exported: Callable[[str], Path]
) -> None:
    case = CASES[name]
    prepared = prepare(exported(name))
    plans = [p for p in prepared.space.plans() if p.kind != "none"]
    # the whole model on the edge, and a cut inside the graph (a residual stream or a
    # skip connection forwarded to the cloud, where the graph has one)
    chosen = {plans[-1].id: plans[-1], plans[len(plans) // 2].id: plans[len(plans) // 2]}
    calib = [case.sample(1, seed) for seed in range(4)]
    for plan in chosen.values():
        edge = artifacts_for(prepared, plan).edge
        assert edge is not None
        q = quantize_model(edge, calib, config_for("tensorrt"))
        assert check_tensorrt_qdq(q) == [], (name, plan.id)
        assert count_qdq(q)["QuantizeLinear"] > 0, (name, plan.id)
        # every weighted op of the segment is quantized
        weighted = [n for n in q.graph.node if n.op_type in ("Conv", "ConvTranspose", "Gemm")]
        producers = {o: n.op_type for n in q.graph.node for o in n.output}
        assert all(producers.get(n.input[0]) == "DequantizeLinear" for n in weighted)
        feeds = case.sample(2, 99)
        feeds = {i.name: feeds[i.name] for i in edge.graph.input if i.name in feeds}
        want, got = run(edge, feeds), run(q, feeds)
        for out, ref in want.items():
            a, b = ref.astype(np.float64).ravel(), got[out].astype(np.float64).ravel()
            if a.dtype.kind != "f" or not np.any(a):
                continue
            cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
            assert cos > 0.9, (name, plan.id, out, cos)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(
    ("edge_profile", "tensorrt"), [("jetson-orin-nano", True), ("raspberry-pi-5", False)]
)
def test_split_auto_picks_the_recipe_by_the_edge_runtime(
    edge_profile: str, tensorrt: bool, exported: Callable[[str], Path], tmp_path: Path
) -> None:
    import json

    from splitinfer.partitioner.cli import main

    out = tmp_path / "pkg"
    argv = [str(exported("resnet")), "--split", "auto", "--edge-profile", edge_profile]
    assert main([*argv, "--cloud-profile", "l4", "-o", str(out), "-q"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    edges = [c["edge"] for c in manifest["cuts"] if c.get("edge")]
    assert edges
    assert all(e["precision"] == "int8" for e in edges)
    for edge in edges:
        model = onnx.load(str(out / edge["file"]))
        broken = check_tensorrt_qdq(model)
        if tensorrt:  # a Jetson: TensorRT's rules hold
            assert broken == [], broken
        else:  # a CPU edge: u8s8, which TensorRT would refuse
            assert any(": int8: zero point" in line and "uint8" in line for line in broken)
