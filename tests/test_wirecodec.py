"""Partition-time codec choice on real activations: calibration, dictionary, fallback."""

from __future__ import annotations

import numpy as np
import pytest

from splitinfer.partitioner.wirecodec import calibrate, plan_wire
from splitinfer.shared.codecs import Int8ZstdCodec
from splitinfer.shared.package import quant_params

pytestmark = pytest.mark.unit


def relu_features(n: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((1, *shape)).astype(np.float32)  # shared structure
    x = base + 0.3 * rng.standard_normal((n, *shape)).astype(np.float32)
    return np.maximum(x, 0)


def test_channel_axis_never_the_sequence() -> None:
    params = calibrate(
        {
            "nchw": np.ones((4, 3, 5, 5), np.float32),
            "seq": np.ones((4, 7, 16), np.float32),
            "vec": np.ones((4, 10), np.float32),
            "ids": np.ones((4, 7), np.int64),
            "wide": np.ones((4, 4096), np.float32),
        }
    )
    assert params["wide"].per_tensor  # 4096 scales would not fit a frame header
    assert set(params) == {"nchw", "seq", "vec", "wide"}
    assert (params["nchw"].axis, len(params["nchw"].scale)) == (1, 3)
    assert (params["seq"].axis, len(params["seq"].scale)) == (2, 16)
    assert len(params["vec"].scale) == 10


def test_small_activations_keep_a_dictionary_that_pays() -> None:
    acts = {"h": relu_features(64, (8, 4, 4))}
    plan = plan_wire(acts, dictionary_file="codec/c1.zdict")
    assert plan.codec.name == "int8+zstd"
    assert plan.dictionary is not None
    assert plan.codec.dictionary == "codec/c1.zdict"
    assert plan.ratio > 4.0
    # the recorded parameters and the dictionary really encode the tensor that small
    from splitinfer.shared.manifest import Cut

    cut = Cut("c1", "split", (), (), 0, 0, 0, quant=plan.quant)
    p = quant_params(cut, "h")
    assert p is not None
    with_dict = Int8ZstdCodec(plan.codec.level, plan.dictionary)
    sizes = [len(with_dict.encode(acts["h"][i : i + 1], p)) for i in range(32, 64)]
    assert np.mean(sizes) == pytest.approx(plan.wire_bytes, rel=0.01)


def test_noise_gets_no_dictionary() -> None:
    rng = np.random.default_rng(5)
    acts = {"h": rng.standard_normal((32, 4096)).astype(np.float32)}
    plan = plan_wire(acts, dictionary_file="d")
    assert plan.dictionary is None
    assert plan.codec.dictionary is None
    assert 3.0 < plan.ratio < 4.5  # int8 of gaussian noise: ~4x, zstd adds little


def test_low_agreement_falls_back_to_fp16() -> None:
    acts = {"h": relu_features(16, (32,))}
    plan = plan_wire(acts, dictionary_file="d", score=lambda _a: 0.9, min_agreement=0.99)
    assert plan.codec.name == "fp16"
    assert plan.quant == {}
    assert plan.ratio == pytest.approx(2.0)
    assert plan.agreement == 0.9
    kept = plan_wire(acts, dictionary_file="d", score=lambda _a: 1.0)
    assert kept.codec.name == "int4+zstd"  # any step keeps agreement: the coarsest, packed
    assert kept.bits == 4


def test_score_sees_int8_rounded_activations() -> None:
    acts = {"h": relu_features(16, (32,))}
    seen: list[np.ndarray] = []

    def score(rounded):
        seen.append(rounded["h"])
        return 1.0

    plan_wire(acts, dictionary_file="d", score=score)
    amax = np.abs(acts["h"]).max()
    # the calibrated step first, then each coarser one (8, 7, 6, 5, 4 effective bits)
    assert len(seen) == 5
    for bits, rounded in zip((8, 7, 6, 5, 4), seen, strict=True):
        err = np.abs(rounded - acts["h"]).max()
        assert 0 < err <= amax / (2 ** (bits - 1) - 1) / 2 * (1 + 1e-5), bits


def test_the_coarsest_step_that_keeps_agreement_is_chosen() -> None:
    acts = {"h": relu_features(64, (32,))}
    amax = np.abs(acts["h"]).max()

    def score(rounded):  # agreement falls with the step: 1.0 down to 6 bits, then 0.9
        step = np.abs(rounded["h"] - acts["h"]).max() * 2
        return 1.0 if step <= amax / 31 * 1.01 else 0.9

    full = plan_wire(acts, dictionary_file="d", score=lambda _a: 1.0)
    plan = plan_wire(acts, dictionary_file="d", score=score)
    assert (full.bits, plan.bits) == (4, 6)
    assert (full.codec.name, plan.codec.name) == ("int4+zstd", "int8+zstd")
    assert plan.summary()["bits"] == 6
    assert plan.quant["h"].scale[0] == pytest.approx(full.quant["h"].scale[0] * 7 / 31)
    unscored = plan_wire(acts, dictionary_file="d")
    assert unscored.bits == 8
    assert unscored.ratio < plan.ratio < full.ratio  # fewer levels, fewer bytes


def test_non_float_cuts_travel_raw() -> None:
    plan = plan_wire({"ids": np.ones((4, 7), np.int64)}, dictionary_file="d")
    assert plan.codec.name == "raw"
    assert plan.ratio == 1.0
