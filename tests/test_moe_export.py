"""MoE models exported to a split package, loaded and run end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from splitinfer.cloud.moe.cache import CacheConfig, MoEMetrics, SyncExecutor
from splitinfer.cloud.moe.runner import MoEProgram, MoERunner
from splitinfer.models.moe import INPUT_SHAPES, moe_transformer, moe_vision, reference
from splitinfer.partitioner.moe_export import export_moe_package, moe_layer_cost
from splitinfer.shared.errors import PackageError
from splitinfer.shared.moe import MoESpec
from splitinfer.shared.ortsession import open_session
from splitinfer.shared.package import open_package

pytestmark = pytest.mark.integration

KINDS = {"transformer": moe_transformer, "vision": moe_vision}


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, Path]]:
    out = {}
    for kind, build in KINDS.items():
        model = build()
        folder = tmp_path_factory.mktemp(kind) / "pkg"
        export_moe_package(model, folder, name=f"moe_{kind}", sample_shape=INPUT_SHAPES[kind])
        out[kind] = (model, folder)
    return out


def run_split(package: Path, x: np.ndarray, budget: int, prefetch: bool = True) -> tuple:

    edge = open_session(package / "edge.onnx")
    h0, u0 = edge.run(["h0", "u0"], {"x": x})
    runner = MoERunner(package, CacheConfig(budget), prefetcher=SyncExecutor(), prefetch=prefetch)
    return runner.run({"h0": h0, "u0": u0})["logits"], runner


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("batch", [1, 5, 64])
@pytest.mark.parametrize("fraction", [1.0, 0.0])  # all experts, or one expert's worth
def test_the_package_runs_and_equals_torch(
    packages: dict[str, tuple[object, Path]], kind: str, batch: int, fraction: float
) -> None:
    model, package = packages[kind]
    x = np.random.default_rng(batch).standard_normal((batch, *INPUT_SHAPES[kind]))
    x = x.astype(np.float32)
    total = json.loads((package / "manifest.json").read_text())["planning"]["moe"]
    budget = max(*total["expert_bytes"], int(fraction * total["experts_total_bytes"]))
    got, runner = run_split(package, x, budget)
    np.testing.assert_allclose(got, reference(model, x), atol=1e-5, rtol=0)
    assert runner.cache.peak_bytes <= budget


def test_the_manifest_describes_the_split(packages: dict[str, tuple[object, Path]]) -> None:
    _, package = packages["transformer"]
    manifest = open_package(package).manifest  # verifies every file's sha256
    cut = manifest.cut
    assert cut.edge is not None
    assert cut.cloud is not None
    assert cut.edge.file == "edge.onnx"
    assert cut.cloud.file == "moe.json"
    assert [t.name for t in cut.tensors] == ["h0", "u0"]
    program = MoEProgram.load(package)
    assert [s.op for s in program.steps] == ["MoE", "onnx", "MoE", "onnx"]
    # no MoE layer in any ONNX file: the edge graph is the dense prefix only
    import onnx

    for f in package.rglob("*.onnx"):
        ops = {n.op_type for n in onnx.load(str(f)).graph.node}
        assert "TopK" not in ops, f
    assert {p.name for p in (package / "moe").iterdir()} == {
        "layer0.safetensors",
        "layer1.safetensors",
    }


def test_a_tampered_shard_is_refused(
    packages: dict[str, tuple[object, Path]], tmp_path: Path
) -> None:
    _, package = packages["vision"]
    copy = tmp_path / "pkg"
    shutil.copytree(package, copy)
    shard = copy / "moe" / "layer0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="sha256"):
        MoERunner(copy, CacheConfig(10**9))


def test_prefetch_off_gives_the_same_answer_with_more_stall_misses(
    packages: dict[str, tuple[object, Path]],
) -> None:
    _model, package = packages["transformer"]
    x = np.random.default_rng(9).standard_normal((8, *INPUT_SHAPES["transformer"]))
    x = x.astype(np.float32)
    on, r_on = run_split(package, x, 10**9, prefetch=True)
    off, r_off = run_split(package, x, 10**9, prefetch=False)
    np.testing.assert_array_equal(on, off)
    assert r_on.metrics.hit_rate(1) > r_off.metrics.hit_rate(1) == 0.0


def test_cost_counts_top_k_experts_and_expected_bytes() -> None:
    switch = MoESpec(32, 64, 8, 1, "switch")
    mixtral = MoESpec(32, 64, 8, 2, "mixtral")
    # FLOPs grow with k, not with the number of experts
    many = MoESpec(32, 64, 64, 1, "switch")
    assert moe_layer_cost(many, 10).flops - moe_layer_cost(switch, 10).flops == 10 * 2 * 32 * 56
    assert moe_layer_cost(mixtral, 1).expert_bytes == 3 * 32 * 64 * 4
    # expected distinct experts under uniform routing, against a simulation
    rng = np.random.default_rng(0)
    for tokens in (1, 4, 16):
        draws = [
            len({int(e) for _ in range(tokens) for e in rng.choice(8, 2, replace=False)})
            for _ in range(4000)
        ]
        assert moe_layer_cost(mixtral, tokens).expected_experts == pytest.approx(
            np.mean(draws), rel=0.03
        )


async def test_the_cloud_engine_serves_an_moe_package_with_a_small_cache(
    packages: dict[str, tuple[object, Path]], tmp_path: Path
) -> None:
    from cloudkit import config

    from splitinfer.cloud.engine import Engine
    from splitinfer.cloud.moe.runtime import moe_runtime_factory

    model, package = packages["transformer"]
    shutil.copytree(package, tmp_path / "moe_transformer" / "1")
    one_expert = max(
        json.loads((package / "manifest.json").read_text())["planning"]["moe"]["expert_bytes"]
    )
    metrics = MoEMetrics()
    factory = moe_runtime_factory(
        CacheConfig(2 * one_expert), prefetcher=SyncExecutor(), metrics=metrics
    )
    x = np.random.default_rng(11).standard_normal((3, *INPUT_SHAPES["transformer"]))
    x = x.astype(np.float32)
    edge = open_session(package / "edge.onnx")
    h0, u0 = edge.run(["h0", "u0"], {"x": x})
    async with Engine(config(tmp_path), runtime_factory=factory) as engine:
        outputs, version = await engine.infer_arrays(
            "moe_transformer", "moe0", {"h0": h0, "u0": u0}
        )
    assert version == "1"
    np.testing.assert_allclose(outputs["logits"], reference(model, x), atol=1e-5, rtol=0)
    assert metrics.total("miss") > 0  # the experts really were paged through the cache
