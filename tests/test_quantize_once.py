"""INT8 ranges calibrated once on the whole model, and each weight quantized once, give
every segment cut from it the same QDQ graph as quantizing that segment on its own
(``quantize.model_ranges``, ``quantize_model(ranges=...)``, ``quant_memo``)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from test_quantize import conv_net, feeds

from splitinfer.partitioner.pipeline import artifacts_for, prepare
from splitinfer.partitioner.quant_config import QuantConfig
from splitinfer.partitioner.quant_memo import weights_once
from splitinfer.partitioner.quantize import config_for, count_qdq, model_ranges, quantize_model

pytestmark = pytest.mark.integration


def _same(a: onnx.ModelProto, b: onnx.ModelProto) -> None:
    """Node for node and initializer for initializer (shape annotations may differ)."""
    assert list(a.graph.node) == list(b.graph.node)
    assert sorted(a.graph.initializer, key=lambda t: t.name) == sorted(
        b.graph.initializer, key=lambda t: t.name
    )
    assert list(a.graph.input) == list(b.graph.input)
    assert list(a.graph.output) == list(b.graph.output)


@pytest.mark.parametrize(
    "config",
    [config_for("cpu"), config_for("tensorrt"), QuantConfig("u8s8", "entropy")],
    ids=["cpu", "tensorrt", "entropy"],
)
def test_segments_quantized_with_whole_model_ranges_match_their_own(
    config: QuantConfig, tmp_path: Path
) -> None:
    path = tmp_path / "net.onnx"
    onnx.save(conv_net(), str(path))
    prepared = prepare(path, {"x": [1, 3, 8, 8]})
    samples = feeds(12)
    ranges = model_ranges(prepared.analysis.model, samples, config)
    plans = [p for p in prepared.space.plans() if p.kind != "none"]
    assert len(plans) >= 3
    for plan in (plans[0], plans[len(plans) // 2], plans[-1]):
        edge = artifacts_for(prepared, plan).edge
        assert edge is not None
        assert ranges.subset(edge) is not None  # the shared ranges cover it: no fallback
        own = quantize_model(edge, samples, config)
        shared = quantize_model(edge, samples, config, ranges=ranges)
        _same(own, shared)
        if plan.kind == "all":
            assert count_qdq(shared)["QuantizeLinear"] >= 3
    assert any(key[0] == "weight" for key in ranges.memo) or config.placement == "tensorrt"
    # other samples than the ranges were made on: the segment calibrates itself
    other = quantize_model(edge, feeds(5, seed=50), config, ranges=ranges)
    _same(other, quantize_model(edge, feeds(5, seed=50), config))


def test_a_segment_with_a_tensor_the_model_lacks_calibrates_itself(tmp_path: Path) -> None:
    net = conv_net()
    config = config_for("cpu")
    samples = feeds(6)
    ranges = model_ranges(net, samples, config)
    renamed = onnx.ModelProto()
    renamed.CopyFrom(net)
    for node in renamed.graph.node:  # relu1's output under another name
        node.input[:] = ["r1_other" if n == "r1" else n for n in node.input]
        node.output[:] = ["r1_other" if n == "r1" else n for n in node.output]
    assert ranges.subset(renamed) is None
    _same(
        quantize_model(renamed, samples, config, ranges=ranges),
        quantize_model(renamed, samples, config),
    )


def test_the_weight_memo_is_undone_after_the_block() -> None:
    from onnxruntime.quantization import qdq_quantizer

    calc = qdq_quantizer.QDQQuantizer._calc_initializer_quant_params
    quantize_init = qdq_quantizer.quantize_onnx_initializer
    memo: dict[object, object] = {}
    with weights_once(memo):
        assert qdq_quantizer.quantize_onnx_initializer is not quantize_init
    assert qdq_quantizer.QDQQuantizer._calc_initializer_quant_params is calc
    assert qdq_quantizer.quantize_onnx_initializer is quantize_init
    with weights_once(None):
        assert qdq_quantizer.quantize_onnx_initializer is quantize_init


@pytest.mark.parametrize("runtime", ["cpu", "tensorrt"])
def test_the_whole_int8_model_screens_each_cut_as_its_own_segment_computes_it(
    runtime: str, tmp_path: Path
) -> None:
    """``--split auto`` screens its shortlist on one run of the whole model quantized
    with the shared ranges, reading each cut tensor after its Q/DQ pair: the values
    must be those the cut's own INT8 edge segment sends: on average within half a
    step, at most 5 % of elements off by more than a step (a segment's boundary tensor
    may be quantized at another point, which is why the picked cuts are built again)."""
    import numpy as np

    from splitinfer.partitioner.automeasure import dequantized_names, exposed_values, stack
    from splitinfer.shared.ortsession import open_session

    path = tmp_path / "net.onnx"
    onnx.save(conv_net(), str(path))
    prepared = prepare(path, {"x": [1, 3, 8, 8]})
    config = config_for(runtime)
    samples = feeds(12)
    ranges = model_ranges(prepared.analysis.model, samples, config)
    whole = quantize_model(prepared.analysis.model, samples, config, ranges=ranges)
    plans = [p for p in prepared.space.plans() if p.kind == "split"]
    names = sorted({t for p in plans for t in p.crossing})
    held = stack(feeds(6, seed=40))
    where = dequantized_names(whole, names)
    assert any(where[n] != n for n in names)  # some are read after their Q/DQ pair
    optimize = runtime != "tensorrt"
    (screened,) = exposed_values(prepared, whole, [held], names, optimize)
    for plan in plans:
        edge = artifacts_for(prepared, plan).edge
        assert edge is not None
        own = quantize_model(edge, samples, config, ranges=ranges)
        sess = open_session(own, optimize="all" if optimize else "none")
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, held), strict=True))
        for t in plan.crossing:
            step = float(np.abs(got[t]).max()) / 127 + 1e-6
            off = np.abs(screened[t] - got[t])
            assert off.mean() <= step / 2, (plan.id, t)
            assert np.mean(off > step) <= 0.05, (plan.id, t)


@pytest.mark.parametrize("quant_type", ["INT8", "UINT8"])
@pytest.mark.parametrize("reduce_range", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
def test_vectorized_per_channel_quantization_is_ort_bit_for_bit(
    quant_type: str, reduce_range: bool, axis: int
) -> None:
    """The memo's per-channel scales, zero points and quantized weights, every channel at
    once, against ORT's own per-channel loops: the same bits, a zero channel included."""
    import numpy as np
    from onnx import TensorProto, numpy_helper
    from onnxruntime.quantization.quant_utils import (
        compute_data_quant_params,
        quantize_onnx_initializer,
    )

    from splitinfer.partitioner.quant_memo import per_channel_params, per_channel_weight

    qtype = getattr(TensorProto, quant_type)
    rng = np.random.default_rng(axis + 2 * reduce_range)
    data = (rng.standard_normal((6, 5, 3)) * rng.uniform(1e-3, 10, (6, 1, 1))).astype(np.float32)
    data[2] = 0.0  # a degenerate channel: scale 1, zero point 0
    data = np.ascontiguousarray(np.moveaxis(data, 0, axis))
    zps, scales = [], []
    for i in range(data.shape[axis]):
        zp, sc = compute_data_quant_params(data.take(i, axis).ravel(), qtype, True, reduce_range)
        zps.append(zp)
        scales.append(sc)
    want_zp, want_sc = np.asarray(zps), np.asarray(scales)
    got_zp, got_sc = per_channel_params(data, axis, qtype, reduce_range)
    assert got_zp.dtype == want_zp.dtype
    assert got_sc.dtype == want_sc.dtype
    assert got_zp.tobytes() == want_zp.tobytes()
    assert got_sc.tobytes() == want_sc.tobytes()
    weight = numpy_helper.from_array(data, "w")
    want = quantize_onnx_initializer(weight, qtype, want_zp, want_sc, axis)
    spread = per_channel_weight(weight, qtype, want_zp, want_sc, axis)
    assert spread is not None
    got = quantize_onnx_initializer(weight, qtype, *spread, None)
    assert got == want
    # what the fast path leaves to ORT: another element type, a wrong axis
    assert per_channel_weight(weight, TensorProto.INT16, want_zp, want_sc, axis) is None
    assert per_channel_weight(weight, qtype, want_zp, want_sc, 2) is None
