"""Partition-time privacy: parameters, utility under noise, the PCA bottleneck."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from graphs import chain
from ortutil import run

from splitinfer.partitioner.dp import (
    apply_bottleneck,
    check_private_cut,
    fit_bottleneck,
    noise_batch,
    privacy_spec,
    soften_bottleneck,
    utility,
)
from splitinfer.partitioner.pipeline import artifacts_for, prepare
from splitinfer.shared.errors import ConfigError, CutError
from splitinfer.shared.manifest import PrivacySpec, TensorSpec
from splitinfer.shared.privacy import noise_multiplier_for

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0.0, 1e-5, 1.0), "--epsilon 0.0: must be a finite number > 0"),
        ((-1.0, 1e-5, 1.0), "--epsilon -1.0"),
        ((float("inf"), 1e-5, 1.0), "--epsilon inf"),
        ((1.0, 1.0, 1.0), r"--delta 1.0: must be in \(0, 1\)"),
        ((1.0, 0.0, 1.0), "--delta 0.0"),
        ((1.0, 1e-5, 0.0), "--clip 0.0: must be a finite number > 0"),
    ],
)
def test_bad_privacy_parameters_are_one_line_errors(args: tuple, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        privacy_spec(*args)


def test_noise_multiplier_is_opacus_own() -> None:
    spec = privacy_spec(4.0, 1e-5, 2.0)
    assert spec.noise_multiplier == pytest.approx(noise_multiplier_for(4.0, 1e-5))
    assert privacy_spec(1.0, 1e-5, 2.0).noise_multiplier > spec.noise_multiplier


def test_non_float_cut_tensors_cannot_be_private() -> None:
    check_private_cut([TensorSpec("h", "float32", ("N", 4))])
    with pytest.raises(CutError, match="non-float tensor\\(s\\) mask"):
        check_private_cut([TensorSpec("h", "float32", ("N", 4)), TensorSpec("mask", "int64", ())])


def test_several_tensors_are_clipped_as_one_vector() -> None:
    spec = PrivacySpec(1.0, 1e-5, clip=1.0, noise_multiplier=1e-9)  # the clip alone shows
    rng = np.random.default_rng(0)
    a = np.full((3, 2, 2), 10.0, np.float32)
    b = np.full((3, 5), 10.0, np.float32)
    na, nb = noise_batch([a, b], spec, rng)
    assert na.shape == a.shape
    assert nb.shape == b.shape
    joint = np.sqrt((na.reshape(3, -1) ** 2).sum(1) + (nb**2).sum(1))
    np.testing.assert_allclose(joint, 1.0, atol=1e-3)
    # direction is kept: every coordinate shrank by the same factor
    np.testing.assert_allclose(na.reshape(3, -1)[:, 0], nb[:, 0], rtol=1e-3)


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    tmp = tmp_path_factory.mktemp("dp")
    path = Path(tmp) / "chain.onnx"
    onnx.save(chain(6, width=12), str(path))
    prepared = prepare(path)
    plan = next(p for p in prepared.space.plans() if p.kind == "split" and len(p.crossing) == 1)
    art = artifacts_for(prepared, plan)
    return prepared, plan, art.edge, art.cloud


def test_full_rank_bottleneck_reproduces_the_model(split: tuple) -> None:
    _, plan, edge, cloud = split
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 12)).astype(np.float32)
    (t,) = plan.crossing
    acts = run(edge, {"x": x})[t]
    bn = fit_bottleneck(t, acts, k=acts.reshape(64, -1).shape[1])
    assert bn.explained == pytest.approx(1.0)
    e2, c2 = apply_bottleneck(edge, cloud, bn)
    assert [o.name for o in e2.graph.output] == [bn.projected]
    want = run(cloud, run(edge, {"x": x}))
    got = run(c2, run(e2, {"x": x}))
    np.testing.assert_allclose(got["y"], want["y"], atol=1e-4)


def test_low_rank_bottleneck_shrinks_the_wire(split: tuple) -> None:
    _, plan, edge, cloud = split
    (t,) = plan.crossing
    x = np.random.default_rng(2).standard_normal((40, 12)).astype(np.float32)
    acts = run(edge, {"x": x})[t]
    bn = fit_bottleneck(t, acts, k=3)
    assert 0 < bn.explained < 1
    e2, c2 = apply_bottleneck(edge, cloud, bn)
    proj = run(e2, {"x": x[:5]})[bn.projected]
    assert proj.shape == (5, 3)
    assert run(c2, {bn.projected: proj})["y"].shape == (5, 12)
    with pytest.raises(ConfigError, match="--bottleneck 99"):
        fit_bottleneck(t, acts, k=99)


def test_utility_falls_with_epsilon(split: tuple) -> None:
    prepared, plan, edge, cloud = split
    rng = np.random.default_rng(3)
    samples = [{"x": rng.standard_normal((1, 12)).astype(np.float32)} for _ in range(60)]
    full = prepared.optimized
    reference = [run(full, s)["y"] for s in samples]
    acts = np.concatenate([run(edge, s)[plan.crossing[0]] for s in samples])
    clip = float(np.median(np.linalg.norm(acts.reshape(60, -1), axis=1)))

    def score(eps: float | None) -> float:
        spec = None if eps is None else privacy_spec(eps, 1e-5, clip)
        return utility(
            lambda f: run(edge, dict(f)),
            lambda f: run(cloud, dict(f)),
            samples,
            plan.crossing,
            spec,
            reference,
            np.random.default_rng(4),
        )

    assert score(None) == 1.0
    assert score(0.05) < 0.5  # noise far above the signal: little better than chance (1/12)
    assert score(256.0) > score(0.05)


def test_soft_code_keeps_the_crossing_and_lands_on_the_simplex(split: tuple) -> None:
    _, plan, edge, cloud = split
    (t,) = plan.crossing
    x = np.random.default_rng(5).standard_normal((40, 12)).astype(np.float32)
    acts = run(edge, {"x": x})[t]
    bn = fit_bottleneck(t, acts, k=4)
    e2, c2 = apply_bottleneck(edge, cloud, bn)
    soft = soften_bottleneck(e2, bn.projected)
    assert [o.name for o in soft.graph.output] == [bn.projected]
    z = run(e2, {"x": x[:6]})[bn.projected]
    code = run(soft, {"x": x[:6]})[bn.projected]
    want = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True) - 0.25  # bias 0, scale 1
    np.testing.assert_allclose(code, want, atol=1e-5)
    np.testing.assert_allclose(code.sum(axis=1), 0.0, atol=1e-5)  # centred: the simplex plane
    assert run(c2, {bn.projected: code})["y"].shape == (6, 12)  # the cloud takes it unchanged
    with pytest.raises(CutError, match="does not compute 'nope'"):
        soften_bottleneck(e2, "nope")
