"""INT8 QDQ quantization of edge segments and the fp32-vs-int8 agreement check (real ORT)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from graphs import f32, make, rand
from onnx import TensorProto, helper, numpy_helper
from ortutil import run

from splitinfer.partitioner.quant_recipe import tensorrt_nodes, without_pass_through
from splitinfer.partitioner.quantize import (
    CPU_INT8_OPS,
    Agreement,
    QuantConfig,
    activations_for,
    agreement,
    check_agreement,
    config_for,
    count_qdq,
    entropy_threshold,
    fp32_nodes,
    global_pool,
    output_guards,
    output_quant_params,
    pick_metric,
    quantize_model,
    runtime_for_profile,
    worst_layers,
)
from splitinfer.partitioner.trt_rules import check_tensorrt_qdq
from splitinfer.shared.errors import ConfigError, ModelError

pytestmark = pytest.mark.integration


def conv_net() -> onnx.ModelProto:
    """x[N,3,8,8] → Conv+Relu → Conv+Relu (feat, a cut tensor) → mean → Gemm → logits[N,10].

    ``feat`` is a graph output *and* feeds the head, as a cut tensor of an edge
    segment that the cloud also needs would.
    """
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Relu", ["c2"], ["feat"], name="relu2"),
        helper.make_node("ReduceMean", ["feat", "axes"], ["pooled"], keepdims=0, name="mean"),
        helper.make_node("Gemm", ["pooled", "wf", "bf"], ["logits"], transB=1, name="fc"),
    ]
    inits = {
        "w1": rand(16, 3, 3, 3, seed=1) * 0.3,
        "b1": rand(16, seed=2) * 0.1,
        "w2": rand(16, 16, 3, 3, seed=3) * 0.1,
        "b2": rand(16, seed=4) * 0.1,
        "axes": np.array([2, 3], np.int64),
        "wf": rand(10, 16, seed=5),
        "bf": rand(10, seed=6) * 0.1,
    }
    return make(
        nodes,
        [f32("x", ["N", 3, 8, 8])],
        [f32("logits", ["N", 10]), f32("feat", ["N", 16, 8, 8])],
        inits,
        opset=18,  # ReduceMean with axes as an input
    )


def feeds(n: int, seed: int = 0, shape: tuple[int, ...] = (1, 3, 8, 8)) -> list[dict]:
    return [{"x": rand(*shape, seed=seed + i)} for i in range(n)]


def qdq_nodes(model: onnx.ModelProto, op: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op]


def init(model: onnx.ModelProto, name: str) -> np.ndarray:
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def activation_zero_points(model: onnx.ModelProto) -> list[np.ndarray]:
    """Zero points of QuantizeLinear nodes on activations (not on weights)."""
    weights = {t.name for t in model.graph.initializer}
    return [
        init(model, n.input[2])
        for n in qdq_nodes(model, "QuantizeLinear")
        if n.input[0] not in weights
    ]


# --- config ------------------------------------------------------------------------------


def test_config_validation() -> None:
    assert QuantConfig("u8s8").method == "minmax"
    with pytest.raises(ConfigError, match=r"activation type 'int8' is not one of u8s8, s8s8"):
        QuantConfig("int8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"calibration method 'kl' is not one of minmax"):
        QuantConfig("u8s8", "kl")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"per_channel must be true or false, got 'yes'"):
        QuantConfig("u8s8", per_channel="yes")  # type: ignore[arg-type]


def test_activation_type_follows_the_runtime() -> None:
    assert activations_for("tensorrt") == "s8s8"
    assert activations_for("onnxruntime-cpu") == "u8s8"
    assert activations_for("CPU") == "u8s8"
    with pytest.raises(ConfigError, match=r"runtime 'tflite' has no INT8 activation type"):
        activations_for("tflite")
    assert config_for("cpu") == QuantConfig(
        "u8s8",
        reduce_range=True,
        op_types=CPU_INT8_OPS,
        fp32_stem=True,
        fp32_depthwise=True,
        global_pool=True,
    )
    assert config_for("tensorrt", "entropy") == QuantConfig("s8s8", "entropy", placement="tensorrt")
    assert activations_for("onnxruntime-tensorrt") == "s8s8"  # a profile measured via ORT's TRT EP
    with pytest.raises(ConfigError, match=r"placement 'all' is not one of ops, tensorrt"):
        QuantConfig("s8s8", placement="all")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"placement 'tensorrt' needs activations 's8s8'"):
        QuantConfig("u8s8", placement="tensorrt")
    with pytest.raises(ConfigError, match=r"op_types must be a non-empty tuple"):
        QuantConfig("u8s8", op_types=())
    with pytest.raises(ConfigError, match=r"fp32_stem must be true or false"):
        QuantConfig("u8s8", fp32_stem=1)  # type: ignore[arg-type]


# --- quantization --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def net() -> onnx.ModelProto:
    return conv_net()


@pytest.fixture(scope="module")
def u8(net: onnx.ModelProto) -> onnx.ModelProto:
    return quantize_model(net, feeds(16), QuantConfig("u8s8"))


@pytest.fixture(scope="module")
def s8(net: onnx.ModelProto) -> onnx.ModelProto:
    return quantize_model(net, feeds(16), QuantConfig("s8s8"))


@pytest.mark.parametrize("which", ["u8", "s8"])
def test_quantized_model_keeps_io_and_is_default_domain_qdq(
    which: str, net: onnx.ModelProto, request: pytest.FixtureRequest
) -> None:
    q: onnx.ModelProto = request.getfixturevalue(which)
    assert [vi.SerializeToString() for vi in q.graph.input] == [
        vi.SerializeToString() for vi in net.graph.input
    ]
    assert [vi.SerializeToString() for vi in q.graph.output] == [
        vi.SerializeToString() for vi in net.graph.output
    ]
    assert all(n.domain in ("", "ai.onnx") for n in q.graph.node)
    assert {o.domain for o in q.opset_import} <= {"", "ai.onnx"}
    counts = count_qdq(q)
    assert counts["QuantizeLinear"] >= 3  # input, both convs' outputs at least
    assert counts["DequantizeLinear"] >= 5  # ... and the weights of conv1, conv2, fc
    assert {n.op_type for n in q.graph.node} - {"QuantizeLinear", "DequantizeLinear"} <= {
        n.op_type for n in net.graph.node
    }
    onnx.checker.check_model(q)
    # graph outputs are dequantized: produced by a DequantizeLinear, fp32
    producers = {o: n.op_type for n in q.graph.node for o in n.output}
    assert producers["logits"] == "DequantizeLinear"
    assert producers["feat"] == "DequantizeLinear"


@pytest.mark.parametrize("which", ["u8", "s8"])
def test_quantized_model_runs_in_ort_close_to_fp32(
    which: str, net: onnx.ModelProto, request: pytest.FixtureRequest
) -> None:
    q: onnx.ModelProto = request.getfixturevalue(which)
    batch = {"x": rand(4, 3, 8, 8, seed=99)}  # held out, batch 4
    want, got = run(net, batch), run(q, batch)
    for name in ("logits", "feat"):
        assert got[name].dtype == np.float32
        assert got[name].shape == want[name].shape
        a, b = want[name].ravel(), got[name].ravel()
        cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        # 0.97: full-range s8s8 weights saturate ORT's int8 kernels on CPUs without VNNI
        assert cos > 0.97, (name, cos)
        assert not np.array_equal(a, b)  # really quantized


def test_u8s8_and_s8s8_zero_point_types(u8: onnx.ModelProto, s8: onnx.ModelProto) -> None:
    u8_zps = activation_zero_points(u8)
    assert u8_zps
    assert all(z.dtype == np.uint8 for z in u8_zps)
    s8_zps = activation_zero_points(s8)
    assert s8_zps
    assert all(z.dtype == np.int8 for z in s8_zps)
    assert all(np.all(z == 0) for z in s8_zps)  # symmetric: TensorRT's only form
    for q in (u8, s8):  # weights: signed, symmetric, one scale per output channel
        dq_w1 = next(n for n in qdq_nodes(q, "DequantizeLinear") if n.output[0].startswith("w1"))
        assert init(q, dq_w1.input[2]).dtype == np.int8
        assert init(q, dq_w1.input[1]).shape == (16,)


def test_s8s8_is_the_tensorrt_form(s8: onnx.ModelProto, u8: onnx.ModelProto) -> None:
    conv1 = next(n for n in s8.graph.node if n.op_type == "Conv")
    assert conv1.input[2] == "b1"  # float bias, no int32 DequantizeLinear
    assert init(s8, "b1").dtype == np.float32
    assert any(n.input[0] == "w1" for n in qdq_nodes(s8, "QuantizeLinear"))  # Q→DQ on fp32 weights
    consts = {t.name for t in u8.graph.initializer}
    dqs = [n for n in qdq_nodes(u8, "DequantizeLinear") if n.input[0] in consts]
    assert any(init(u8, n.input[0]).dtype == np.int32 for n in dqs)  # CPU form: int32 biases


def test_output_quant_params_for_the_wire_codec(u8: onnx.ModelProto, s8: onnx.ModelProto) -> None:
    u8_params = output_quant_params(u8)
    assert set(u8_params) == {"logits", "feat"}
    feat = u8_params["feat"]
    assert feat["dtype"] == "uint8"
    assert feat["axis"] is None
    assert feat["zero_point"] == [0]  # after a Relu: the range starts at 0
    assert len(feat["scale"]) == 1
    assert feat["scale"][0] > 0
    got = run(u8, {"x": rand(1, 3, 8, 8, seed=5)})["feat"]
    steps = got / feat["scale"][0]  # dequantized values sit on the quantization grid
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
    s8_params = output_quant_params(s8)
    assert s8_params["feat"]["dtype"] == "int8"
    assert s8_params["feat"]["zero_point"] == [0]
    assert output_quant_params(conv_net()) == {}


def test_reduce_range_limits_weights_to_seven_bits(net: onnx.ModelProto) -> None:
    def weight_range(q: onnx.ModelProto) -> tuple[int, int]:
        dq = next(n for n in qdq_nodes(q, "DequantizeLinear") if n.output[0].startswith("w2"))
        w = init(q, dq.input[0])
        return int(w.min()), int(w.max())

    full = weight_range(quantize_model(net, feeds(4), QuantConfig("u8s8")))
    reduced = weight_range(quantize_model(net, feeds(4), QuantConfig("u8s8", reduce_range=True)))
    assert min(full) <= -100 or max(full) >= 100
    assert reduced[0] >= -64
    assert reduced[1] <= 64


def test_histogram_methods_clip_outliers() -> None:
    """One huge value among many small ones: MinMax spans it, Percentile and Entropy do not."""
    model = make(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        [f32("x", ["N", 64, 64])],
        [f32("y", ["N", 64, 64])],
        {"w": np.eye(64, dtype=np.float32)},
    )
    rng = np.random.default_rng(0)
    # 64 x 4096 values: the 99.999th percentile leaves out the 2.6 largest, the outlier among them
    samples = [
        {"x": np.abs(rng.standard_normal((1, 64, 64))).astype(np.float32)} for _ in range(64)
    ]
    samples[7]["x"][0, 3, 5] = 1000.0
    scales = {}
    for method in ("minmax", "entropy", "percentile"):
        q = quantize_model(model, samples, QuantConfig("u8s8", method))  # type: ignore[arg-type]
        dq_y = next(n for n in qdq_nodes(q, "DequantizeLinear") if n.output[0] == "y")
        scales[method] = float(init(q, dq_y.input[1]))
    assert scales["minmax"] == pytest.approx(1000.0 / 255, rel=0.01)
    assert scales["percentile"] < scales["minmax"] / 10
    # with 2048 bins the search tries thresholds down to 1/16 of the range; with the 128
    # bins quantize_static would use, the only candidate is the whole range
    assert scales["entropy"] < scales["minmax"] / 5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_entropy_search_matches_onnxruntime(seed: int) -> None:
    from onnxruntime.quantization.calibrate import HistogramCollector

    rng = np.random.default_rng(seed)
    collector = HistogramCollector("entropy", False, 512, 128, 99.999, "same")
    for _ in range(4):
        values = rng.standard_normal((1, 3000)) * rng.uniform(0.5, 2.0)
        if seed == 2:
            values = np.abs(values)
            values[0, 0] = 40.0  # one outlier far out: the threshold must cut it off
        collector.collect_value({"t": values.astype(np.float32)})
    histogram = collector.histogram_dict["t"]
    want = collector.get_entropy_threshold(histogram, 128)
    got = entropy_threshold(histogram, 128)
    assert (float(got[0]), float(got[1])) == (float(want[0]), float(want[1]))
    assert got[1].dtype == np.float32
    if seed == 2:
        assert float(got[1]) < 20.0


def test_model_without_quantizable_ops_comes_back_unchanged() -> None:
    model = make(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Transpose", ["r"], ["y"])],
        [f32("x", ["N", 4])],
        [f32("y", [4, "N"])],
    )
    out = quantize_model(model, [{"x": rand(1, 4)}], QuantConfig("u8s8"))
    assert out.SerializeToString() == model.SerializeToString()
    assert out is not model


def test_bad_samples(net: onnx.ModelProto) -> None:
    with pytest.raises(ConfigError, match="no calibration samples"):
        quantize_model(net, [], QuantConfig("u8s8"))
    with pytest.raises(ConfigError, match=r"calibration sample 1 has no value for input 'x'"):
        quantize_model(net, [{"x": rand(1, 3, 8, 8)}, {"y": rand(1, 3, 8, 8)}], QuantConfig("u8s8"))


def test_wrongly_shaped_samples_are_a_model_error(net: onnx.ModelProto) -> None:
    with pytest.raises(ModelError, match="INT8 quantization failed"):
        quantize_model(net, [{"x": rand(1, 5, 8, 8)}], QuantConfig("u8s8"))


# --- the CPU recipe: no Q/DQ round trips around ops without int8 kernels ------------------


def mobile_block(stem_pool: bool = False) -> onnx.ModelProto:
    """x[N,3,16,16] → stem Conv → HardSwish → [MaxPool] → depthwise Conv → SE (ReduceMean
    over H,W, Conv, HardSigmoid, Mul) → Conv → Relu → MaxPool → p: the zoo mobilenet's ops.
    """
    nodes = [
        helper.make_node("Conv", ["x", "ws"], ["s"], pads=[1] * 4, name="stem"),
        helper.make_node("HardSwish", ["s"], ["h"], name="stem_act"),
        helper.make_node(
            "Conv", ["h" if not stem_pool else "hp", "wd"], ["d"], pads=[1] * 4, group=8, name="dw"
        ),
        helper.make_node("ReduceMean", ["d", "axes"], ["m"], keepdims=1, name="se_mean"),
        helper.make_node("Conv", ["m", "wse"], ["e"], name="se_conv"),
        helper.make_node("HardSigmoid", ["e"], ["g"], name="se_gate"),
        helper.make_node("Mul", ["d", "g"], ["sd"], name="se_mul"),
        helper.make_node("Conv", ["sd", "wp"], ["y"], name="project"),
        helper.make_node("Relu", ["y"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
    ]
    if stem_pool:
        nodes.insert(
            2, helper.make_node("MaxPool", ["h"], ["hp"], kernel_shape=[1, 1], name="stem_pool")
        )
    inits = {
        "ws": rand(8, 3, 3, 3, seed=1) * 0.3,
        "wd": rand(8, 1, 3, 3, seed=2) * 0.3,
        "axes": np.array([2, 3], np.int64),
        "wse": rand(8, 8, 1, 1, seed=3) * 0.3,
        "wp": rand(8, 8, 1, 1, seed=4) * 0.3,
    }
    return make(
        nodes,
        [f32("x", ["N", 3, 16, 16])],
        # (a graph output that also feeds a Relu: see output_guards and its test below)
        [f32("p", ["N", 8, 8, 8])],
        inits,
        opset=18,
    )


def consumers_of(model: onnx.ModelProto, tensor: str) -> list[str]:
    return [n.op_type for n in model.graph.node if tensor in n.input]


def producer_of(model: onnx.ModelProto, tensor: str) -> str:
    return next(n.op_type for n in model.graph.node if tensor in n.output)


def test_cpu_recipe_keeps_ops_without_int8_kernels_fp32() -> None:
    model = mobile_block()
    samples = feeds(8, shape=(1, 3, 16, 16))
    everything = quantize_model(model, samples, QuantConfig("u8s8", reduce_range=True))
    cpu = quantize_model(model, samples, config_for("cpu"))
    # quantizing every op puts a Q/DQ pair on the input and output of HardSwish etc.
    for tensor in ("h", "g", "sd"):
        assert consumers_of(everything, tensor) == ["QuantizeLinear"], tensor
    assert count_qdq(cpu)["QuantizeLinear"] < count_qdq(everything)["QuantizeLinear"]
    by_name = {n.name: n for n in cpu.graph.node}
    # the stem, its HardSwish and the depthwise conv read fp32 straight from their producer
    assert by_name["stem"].input[0] == "x"
    assert by_name["stem_act"].input[0] == "s"
    assert by_name["dw"].input[0] == "h"
    assert by_name["dw"].input[1] == "wd"  # fp32 weight, no DequantizeLinear
    # the SE gate and scale stay fp32: no QuantizeLinear on their outputs
    assert "QuantizeLinear" not in consumers_of(cpu, "g")
    assert by_name["se_mul"].input[1] == "g"
    # the spatial ReduceMean became GlobalAveragePool, quantized (a uint8 NHWC kernel in ORT)
    assert by_name["se_mean"].op_type == "GlobalAveragePool"
    assert "ReduceMean" not in {n.op_type for n in cpu.graph.node}
    assert producer_of(cpu, by_name["se_mean"].input[0]) == "DequantizeLinear"
    # the 1x1 projection, its Relu and the MaxPool are int8
    assert producer_of(cpu, by_name["project"].input[1]) == "DequantizeLinear"
    assert producer_of(cpu, by_name["pool"].input[0]) == "DequantizeLinear"
    batch = {"x": rand(2, 3, 16, 16, seed=50)}
    want, got, all8 = run(model, batch), run(cpu, batch), run(everything, batch)
    for name in ("p",):
        assert got[name].shape == want[name].shape
        assert not np.array_equal(got[name], want[name])
        err = np.abs(got[name] - want[name]).max() / np.abs(want[name]).max()
        err_all = np.abs(all8[name] - want[name]).max() / np.abs(want[name]).max()
        assert err < 0.05, (name, err)
        assert err <= err_all * 1.5, (name, err, err_all)  # fewer quantized tensors


def test_fp32_nodes_stem_depthwise_and_pools() -> None:
    cfg = config_for("cpu")
    assert fp32_nodes(mobile_block(), cfg) == ["stem", "stem_act", "dw"]
    # a stem whose result feeds a pool stays int8 (ORT would run that pool in fp32 NCHW)
    assert fp32_nodes(mobile_block(stem_pool=True), cfg) == ["dw"]
    assert fp32_nodes(mobile_block(), QuantConfig("u8s8")) == []
    assert fp32_nodes(mobile_block(), QuantConfig("u8s8", fp32_depthwise=True)) == ["dw"]
    assert config_for("tensorrt").op_types is None  # TensorRT: every op int8
    assert not config_for("tensorrt").fp32_stem


def test_global_pool_rewrites_only_spatial_means() -> None:
    from onnx import shape_inference

    nodes = [
        helper.make_node("ReduceMean", ["x", "hw"], ["a"], keepdims=1, name="hw"),
        helper.make_node("ReduceMean", ["x", "neg"], ["b"], keepdims=1, name="neg"),
        helper.make_node("ReduceMean", ["x", "hw"], ["c"], keepdims=0, name="flat"),
        helper.make_node("ReduceMean", ["x", "ch"], ["d"], keepdims=1, name="ch"),
    ]
    model = make(
        nodes,
        [f32("x", [2, 4, 5, 6])],
        [f32("a", [2, 4, 1, 1]), f32("b", [2, 4, 1, 1]), f32("c", [2, 4]), f32("d", [2, 1, 5, 6])],
        {
            "hw": np.array([2, 3], np.int64),
            "neg": np.array([-1, -2], np.int64),
            "ch": np.array([1], np.int64),
        },
        opset=18,
    )
    model = shape_inference.infer_shapes(model)
    x = {"x": rand(2, 4, 5, 6, seed=9)}
    want = run(model, x)
    assert global_pool(model) == 2
    assert [n.op_type for n in model.graph.node] == [
        "GlobalAveragePool",
        "GlobalAveragePool",
        "ReduceMean",
        "ReduceMean",
    ]
    got = run(model, x)
    for name in "abcd":
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


# --- agreement -----------------------------------------------------------------------------


def test_pick_metric() -> None:
    assert pick_metric(np.zeros((4, 10), np.float32)) == "top1"
    assert pick_metric(np.zeros((4, 1), np.float32)) == "cosine"
    assert pick_metric(np.zeros((4, 16, 8, 8), np.float32)) == "cosine"
    assert pick_metric(np.zeros((4,), np.float32)) == "max_abs"
    assert pick_metric(np.zeros((4, 10), np.int64)) == "max_abs"


def test_agreement_of_a_model_with_itself_is_perfect(net: onnx.ModelProto) -> None:
    a = agreement(net, net, feeds(5))
    assert a == Agreement("top1", 1.0, 5, a.worst_layers)
    assert all(err == 0.0 for _, err in a.worst_layers)


def test_agreement_metrics_on_the_quantized_model(
    net: onnx.ModelProto, u8: onnx.ModelProto
) -> None:
    held = feeds(12, seed=100)
    top1 = agreement(net, u8, held)
    assert top1.metric == "top1"
    assert top1.samples == 12
    assert 0.75 <= top1.value <= 1.0
    # the second output as the first: a cut tensor [N,16,8,8] → cosine
    swap = onnx.ModelProto()
    swap.CopyFrom(net)
    swap.graph.output[0].CopyFrom(net.graph.output[1])
    swap.graph.output[1].CopyFrom(net.graph.output[0])
    swap_q = onnx.ModelProto()
    swap_q.CopyFrom(u8)
    swap_q.graph.output[0].CopyFrom(u8.graph.output[1])
    swap_q.graph.output[1].CopyFrom(u8.graph.output[0])
    cos = agreement(swap, swap_q, held)
    assert cos.metric == "cosine"
    assert 0.99 < cos.value < 1.0
    err = agreement(net, u8, held, metric="max_abs")
    assert err.metric == "max_abs"
    assert 0.0 < err.value < 1.0
    ref = agreement(net, u8, held, kernels="reference")
    assert ref.metric == "top1"
    with pytest.raises(ConfigError, match="agreement metric 'l2' is not one of"):
        agreement(net, u8, held, metric="l2")
    with pytest.raises(ConfigError, match="kernels 'gpu' is not one of int8, reference"):
        agreement(net, u8, held, kernels="gpu")
    with pytest.raises(ConfigError, match="no hold-out samples"):
        agreement(net, u8, [])


def test_worst_layers_point_at_the_damaged_layer(net: onnx.ModelProto) -> None:
    damaged = onnx.ModelProto()
    damaged.CopyFrom(net)
    for t in damaged.graph.initializer:
        if t.name == "w2":  # conv2 broken: c2 and everything after it is off
            t.CopyFrom(numpy_helper.from_array(init(net, "w2") * 1.5 + 0.05, "w2"))
    worst = worst_layers(net, damaged, feeds(4))
    names = [name for name, _ in worst]
    assert len(worst) == 5
    assert "c1" not in names[:3]
    assert names[0] in {"c2", "feat", "pooled", "logits"}
    errors = [err for _, err in worst]
    assert errors == sorted(errors, reverse=True)
    assert errors[0] > 0.1


def test_worst_layers_read_quantized_tensors_after_their_qdq(
    net: onnx.ModelProto, u8: onnx.ModelProto
) -> None:
    # u8s8 drops the Relus into the zero point: "r1" in the int8 model is the raw
    # conv output; compared after its Q/DQ it is the Relu'd value again.
    worst = dict(worst_layers(net, u8, feeds(4), top=20))
    assert "r1" in worst
    assert worst["r1"] < 0.05


def test_check_agreement_passes_and_fails_with_one_line() -> None:
    good = Agreement("top1", 0.995, 400, (("conv2", 0.03),))
    check_agreement(good, 0.99)
    bad = Agreement("top1", 0.9712, 400, (("conv2", 0.12), ("fc", 0.08)))
    with pytest.raises(ModelError) as info:
        check_agreement(bad, 0.99)
    text = str(info.value)
    assert "\n" not in text
    assert "top1 = 0.9712 < minimum 0.99 on 400 held-out samples" in text
    assert "conv2 (0.12), fc (0.08)" in text
    check_agreement(Agreement("max_abs", 0.01, 10), 0.05)  # lower is better
    with pytest.raises(ModelError, match=r"max_abs = 0\.2 > maximum 0\.05"):
        check_agreement(Agreement("max_abs", 0.2, 10), 0.05)


def test_integer_inputs_and_gather_quantize(tmp_path: Path) -> None:
    """An embedding lookup (int64 ids) followed by MatMul: int inputs pass straight through."""
    model = make(
        [
            helper.make_node("Gather", ["table", "ids"], ["emb"]),
            helper.make_node("MatMul", ["emb", "w"], ["y"]),
        ],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 6])],
        [f32("y", ["N", 6, 8])],
        {"table": rand(20, 8), "w": rand(8, 8, seed=1)},
    )
    rng = np.random.default_rng(0)
    samples = [{"ids": rng.integers(0, 20, (1, 6)).astype(np.int64)} for _ in range(8)]
    q = quantize_model(model, samples, config_for("cpu"))
    assert count_qdq(q)["DequantizeLinear"] > 0
    assert q.graph.input[0].type.tensor_type.elem_type == TensorProto.INT64
    a = agreement(model, q, samples)
    assert a.metric == "cosine"
    assert a.value > 0.99


# --- the digits classifier: the INT8 acceptance check ----------------------------------------


@pytest.mark.slow
def test_digits_classifier_int8_top1_agreement(tmp_path: Path) -> None:
    from splitinfer.models.digits import export_digits, load_digits_split, train_digits_cnn

    x_train, _, x_test, y_test = load_digits_split(seed=0)
    net_t = train_digits_cnn(seed=0)
    path = export_digits(tmp_path / "digits.onnx", net=net_t)
    fp32 = onnx.load(str(path))
    rng = np.random.default_rng(0)
    calib = [{"x": x_train[i : i + 1]} for i in rng.choice(len(x_train), 300, replace=False)]
    held = [{"x": x_test[i : i + 1]} for i in range(len(x_test))]
    logits = run(fp32, {"x": x_test})["logits"]
    assert float(np.mean(logits.argmax(1) == y_test)) >= 0.95
    # TensorRT accumulates exactly: its agreement is measured on the reference path, not
    # on this CPU's int8 kernels (which saturate full-range s8s8 weights without VNNI).
    for runtime, kernels in (("cpu", "int8"), ("tensorrt", "reference")):
        q = quantize_model(fp32, calib, config_for(runtime))
        a = agreement(fp32, q, held, kernels=kernels)
        assert a.metric == "top1"
        assert a.samples == len(x_test)
        assert a.value >= 0.99, (runtime, a)
        check_agreement(a, 0.99)


@pytest.mark.parametrize("runtime", ["cpu", "tensorrt"])
def test_a_graph_output_that_feeds_a_relu_keeps_its_negative_values(runtime: str) -> None:
    # y is a cut tensor (a graph output of the edge segment) that the edge also feeds
    # on through a Relu: the quantizer folds the Relu into the Conv and would give y
    # the Relu's range [0, max], losing every negative value on the wire
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["y"], pads=[1] * 4, name="conv"),
        helper.make_node("Relu", ["y"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["z"], name="conv2"),
    ]
    model = make(
        nodes,
        [f32("x", ["N", 8, 16, 16])],  # 8 channels: not a stem, so it is quantized
        [f32("y", ["N", 8, 16, 16]), f32("z", ["N", 8, 16, 16])],
        {"w": rand(8, 8, 3, 3, seed=1) * 0.3, "w2": rand(8, 8, 1, 1, seed=2) * 0.3},
        opset=18,
    )
    assert output_guards(model) == ["relu"]
    samples = [{"x": rand(1, 8, 16, 16, seed=s)} for s in range(8)]
    q = quantize_model(model, samples, config_for(runtime))
    x = rand(2, 8, 16, 16, seed=99)
    want = run(model, {"x": x})["y"]
    got = run(q, {"x": x})["y"]
    assert (want < 0).mean() > 0.3
    assert np.abs(got - want).max() / np.abs(want).max() < 0.05


# --- the TensorRT recipe -------------------------------------------------------------------


def skip_and_mask_net() -> onnx.ModelProto:
    """conv1 → Relu → conv2, a skip Add of conv2 and the Relu, an attention-style mask Add
    (broadcast, -1e4 where masked) and a Softmax: the placement questions of a real block."""
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1] * 4, name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1] * 4, name="conv2"),
        helper.make_node("Add", ["c2", "r1"], ["skip"], name="skip"),
        helper.make_node("Add", ["skip", "mask"], ["scores"], name="masked"),
        helper.make_node("Softmax", ["scores"], ["y"], axis=-1, name="softmax"),
    ]
    return make(
        nodes,
        [f32("x", ["N", 8, 8, 8]), f32("mask", ["N", 1, 1, 8])],
        [f32("y", ["N", 8, 8, 8])],
        {"w1": rand(8, 8, 3, 3, seed=1) * 0.3, "w2": rand(8, 8, 3, 3, seed=2) * 0.3},
        opset=18,
    )


def mask_feeds(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    out = []
    for i in range(n):
        mask = np.zeros((1, 1, 1, 8), np.float32)
        mask[..., 5:] = -1e4  # the last three positions are padding
        out.append({"x": rand(1, 8, 8, 8, seed=seed + i), "mask": mask})
    return out


def test_tensorrt_places_qdq_where_tensorrt_fuses_them() -> None:
    net = skip_and_mask_net()
    assert tensorrt_nodes(onnx.shape_inference.infer_shapes(net)) == ["conv1", "conv2", "skip"]
    q = quantize_model(net, mask_feeds(8), config_for("tensorrt"))
    assert check_tensorrt_qdq(q) == []
    producer = {o: n for n in q.graph.node for o in n.output}
    # weighted ops: both inputs through DequantizeLinear, their outputs left float
    for conv in ("conv1", "conv2"):
        node = next(n for n in q.graph.node if n.name == conv)
        assert [producer[t].op_type for t in node.input[:2]] == ["DequantizeLinear"] * 2
    relu = next(n for n in q.graph.node if n.name == "relu1")
    assert producer[relu.input[0]].op_type == "Conv"
    # the skip connection: both branches quantized
    skip = next(n for n in q.graph.node if n.name == "skip")
    assert [producer[t].op_type for t in skip.input] == ["DequantizeLinear"] * 2
    # the broadcast mask Add and the Softmax stay float: a per-tensor scale over the
    # -1e4 of the mask would round every attention score to 0
    masked = next(n for n in q.graph.node if n.name == "masked")
    assert "mask" in masked.input  # read as it is: no Q/DQ on the mask
    softmax = next(n for n in q.graph.node if n.name == "softmax")
    assert producer[softmax.input[0]].op_type == "Add"
    held = mask_feeds(4, seed=50)
    batch = {k: np.concatenate([f[k] for f in held]) for k in held[0]}
    want, got = run(net, batch)["y"], run(q, batch)["y"]
    # softmax probabilities; quantizing everything (the mask Add too) gave 0.80 and 0.16
    assert np.abs(got - want).max() < 0.2
    assert np.abs(got - want).mean() < 0.01


def test_a_forwarded_graph_input_is_left_out_of_quantization() -> None:
    # an edge segment that forwards its input to the cloud (a transformer's residual
    # stream, cut inside a block): ONNX Runtime's quantizer used to wire the Q/DQ of
    # that graph output into a cycle ("Graph is not a DAG")
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1] * 4, name="conv")]
    model = make(
        nodes,
        [f32("x", ["N", 8, 8, 8])],
        [f32("x", ["N", 8, 8, 8]), f32("y", ["N", 8, 8, 8])],
        {"w": rand(8, 8, 3, 3, seed=1) * 0.3},
        opset=18,
    )
    assert [o.name for o in without_pass_through(model).graph.output] == ["y"]
    x = rand(2, 8, 8, 8, seed=7)
    for runtime in ("cpu", "tensorrt"):
        q = quantize_model(model, feeds(4, shape=(1, 8, 8, 8)), config_for(runtime))
        assert [o.name for o in q.graph.output] == ["x", "y"]
        assert count_qdq(q)["QuantizeLinear"] >= 2
        got = run(q, {"x": x})
        np.testing.assert_array_equal(got["x"], x)  # forwarded untouched
        want = run(model, {"x": x})["y"]
        assert np.abs(got["y"] - want).max() < 0.05 * np.abs(want).max()


def test_a_tensorrt_segment_that_breaks_the_rules_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from splitinfer.partitioner import quantize

    # a placement that leaves conv2 and the skip Add fp32: their inputs are not quantized
    monkeypatch.setattr(quantize, "tensorrt_nodes", lambda model: ["conv1"])
    with pytest.raises(ModelError, match=r"breaks TensorRT's rules: node 'conv2': weighted-inputs"):
        quantize_model(skip_and_mask_net(), mask_feeds(4), config_for("tensorrt"))


def test_the_edge_profile_chooses_the_recipe(tmp_path: Path) -> None:
    from splitinfer.partitioner.profiles import BUILTIN
    from splitinfer.shared.nodeprofile import NodeProfile

    trt = next(name for name, p in BUILTIN.items() if p.runtime == "tensorrt")
    cpu = next(name for name, p in BUILTIN.items() if p.runtime == "onnxruntime-cpu")
    assert runtime_for_profile(trt) == "tensorrt"
    assert runtime_for_profile(cpu) == "cpu"
    assert runtime_for_profile(None) == "cpu"
    for runtime, want in (("onnxruntime-tensorrt", "tensorrt"), ("onnxruntime-cpu", "cpu")):
        measured = NodeProfile(
            device="Jetson",
            runtime=runtime,
            batch_sizes=(1,),
            times={1: {"conv": 1e-4}},
            wall={1: 2e-4},
            unattributed_s={1: 0.0},
        )
        measured.save(tmp_path / f"{runtime}.json")
        assert runtime_for_profile(str(tmp_path / f"{runtime}.json")) == want


def test_an_opset_12_model_gets_per_tensor_weight_scales_the_checker_accepts() -> None:
    """DequantizeLinear has no ``axis`` before opset 13: per-channel would be refused."""
    model = make(
        [
            helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c1"], ["r1"]),
            helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c2"], ["r2"]),
            helper.make_node("Conv", ["r2", "w3"], ["c3"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c3"], ["y"]),
        ],
        [f32("x", [1, 3, 16, 16])],
        [f32("y", [1, 8, 16, 16])],
        {
            "w1": rand(8, 3, 3, 3, seed=1),
            "w2": rand(8, 8, 3, 3, seed=2),
            "w3": rand(8, 8, 3, 3, seed=3),
        },
        opset=12,
    )
    samples = [{"x": rand(1, 3, 16, 16, seed=s)} for s in range(4)]
    q = quantize_model(model, samples, config_for("cpu"))
    onnx.checker.check_model(q, full_check=True)
    dq = [n for n in q.graph.node if n.op_type == "DequantizeLinear"]
    assert dq
    assert count_qdq(q)["QuantizeLinear"] > 0
    scales = {i.name: i for i in q.graph.initializer}
    weight_scales = [scales[n.input[1]] for n in dq if n.input[1] in scales]
    assert all(len(s.dims) == 0 or s.dims == [1] for s in weight_scales)
    ref = run(model, samples[0])["y"]
    got = run(q, samples[0])["y"]
    assert np.abs(ref - got).max() < 0.1 * np.abs(ref).max()


def shared_bias_net() -> onnx.ModelProto:
    """Three Convs read one bias ``b``; the first one's output is named ``b0``, the name
    ONNX Runtime's quantizer gives its own copy of a shared bias."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b"], ["b0"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Sigmoid", ["b0"], ["r1"], name="sigmoid1"),
        helper.make_node("Conv", ["r1", "w2", "b"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b"], ["c3"], pads=[1, 1, 1, 1], name="conv3"),
        helper.make_node("Relu", ["c3"], ["y"], name="relu3"),
    ]
    inits = {f"w{i}": rand(8, 8, 3, 3, seed=i) * 0.2 for i in (1, 2, 3)}
    inits["b"] = rand(8, seed=4) * 0.1
    return make(nodes, [f32("x", ["N", 8, 8, 8])], [f32("y", ["N", 8, 8, 8])], inits)


@pytest.mark.parametrize("runtime", ["cpu", "tensorrt"])
def test_a_shared_bias_is_copied_apart_from_every_activation_name(runtime: str) -> None:
    model = shared_bias_net()
    samples = feeds(6, shape=(1, 8, 8, 8))
    q = quantize_model(model, samples, config_for(runtime))
    assert count_qdq(q)["QuantizeLinear"] > 0
    ref, got = run(model, samples[0])["y"], run(q, samples[0])["y"]
    assert np.abs(ref - got).max() < 0.1 * np.abs(ref).max()


def test_a_gemm_bias_of_shape_1_by_n_quantizes_per_channel() -> None:
    # onnxslim's MatMul+Add -> Gemm keeps the Add's [1, N] constant as C
    model = make(
        [helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="fc")],
        [f32("x", ["N", 16])],
        [f32("y", ["N", 10])],
        {"w": rand(16, 10, seed=1), "c": rand(1, 10, seed=2)},
    )
    samples = feeds(6, shape=(1, 16))
    q = quantize_model(model, samples, config_for("cpu"))
    assert count_qdq(q)["DequantizeLinear"] > 0
    ref, got = run(model, samples[0])["y"], run(q, samples[0])["y"]
    assert got.shape == ref.shape
    assert np.abs(ref - got).max() < 0.1 * np.abs(ref).max()


def test_the_input_of_a_log_stays_fp32() -> None:
    # log(x² + 1e-10), as basic-pitch's normalized log: an int8 x² + 1e-10 rounds the
    # small values to 0, and the Log gives -inf
    model = make(
        [
            helper.make_node("Mul", ["x", "x"], ["sq"], name="square"),
            helper.make_node("Add", ["sq", "eps"], ["pos"], name="add"),
            helper.make_node("Log", ["pos"], ["y"], name="log"),
        ],
        [f32("x", ["N", 64])],
        [f32("y", ["N", 64])],
        {"eps": np.array(1e-10, np.float32)},
    )
    samples = feeds(6, shape=(1, 64))
    for s in samples:
        s["x"][0, ::4] = 0.0
    q = quantize_model(model, samples, config_for("cpu"))
    got = run(q, samples[0])["y"]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, run(model, samples[0])["y"], rtol=1e-5)
