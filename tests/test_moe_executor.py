"""The numpy MoE executor against the dense torch reference of models/moe.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitinfer.cloud.moe.cache import CacheConfig, ExpertCache, MoEMetrics, SyncExecutor
from splitinfer.cloud.moe.executor import (
    MoEExecutor,
    MoELayerParams,
    group_by_expert,
    moe_reference,
    route,
)
from splitinfer.cloud.moe.store import ExpertStore
from splitinfer.models.moe import MoEConfig, moe_layer
from splitinfer.partitioner.moe_export import layer_arrays
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.moe import MoESpec, write_layer_shard

pytestmark = pytest.mark.unit

TOKENS, D = 8, 32
CONFIGS = {
    "switch": MoEConfig(top_k=1, routing="switch"),
    "mixtral": MoEConfig(top_k=2, routing="mixtral"),
    "switch-cap": MoEConfig(top_k=1, routing="switch", capacity_factor=0.5),
    "mixtral-cap": MoEConfig(top_k=2, routing="mixtral", capacity_factor=1.0),
}


def spec_of(cfg: MoEConfig) -> MoESpec:
    return MoESpec(
        cfg.d_model, cfg.hidden, cfg.n_experts, cfg.top_k, cfg.routing, cfg.capacity_factor
    )


class Layer:
    """A torch MoE layer, its arrays, its shard on disk."""

    def __init__(self, cfg: MoEConfig, folder: Path, router: np.ndarray | None = None) -> None:
        import torch

        self.cfg, self.spec = cfg, spec_of(cfg)
        self.torch = moe_layer(cfg, seed=1)
        if router is not None:
            with torch.no_grad():
                self.torch.router.weight.copy_(torch.from_numpy(router))
        self.router, self.experts = layer_arrays(self.torch)
        self.path = write_layer_shard(
            folder / "layer0.safetensors", self.router, self.experts, json.dumps({})
        )

    def reference(self, u: np.ndarray) -> np.ndarray:
        import torch

        with torch.no_grad():
            out: np.ndarray = self.torch(torch.from_numpy(u)).numpy()
        return out

    def executor(self, budget: int | None = None, **kw: Any) -> tuple[MoEExecutor, ExpertCache]:
        store = ExpertStore({0: self.path}, {0: self.spec.expert_tensors})
        full = sum(store.nbytes(0, e) for e in range(self.spec.n_experts))
        cache = ExpertCache(store, CacheConfig(budget or full, **kw), prefetcher=SyncExecutor())
        return MoEExecutor([MoELayerParams(self.spec, store.routers[0])], cache), cache


@pytest.fixture(scope="module")
def layers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Layer]:
    return {name: Layer(cfg, tmp_path_factory.mktemp(name)) for name, cfg in CONFIGS.items()}


def tokens(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, TOKENS, D)).astype(np.float32)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("batch", [1, 2, 7, 64])
def test_fast_and_dense_numpy_equal_torch(layers: dict[str, Layer], name: str, batch: int) -> None:
    layer = layers[name]
    u = tokens(batch, seed=batch)
    want = layer.reference(u)
    np.testing.assert_allclose(
        moe_reference(u, layer.router, layer.experts, layer.spec), want, atol=1e-5, rtol=0
    )
    executor, cache = layer.executor()
    np.testing.assert_allclose(executor.forward(0, u), want, atol=1e-5, rtol=0)
    assert cache.peak_bytes <= cache.config.budget_bytes


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batch=st.integers(1, 64),
    seed=st.integers(0, 2**16),
    name=st.sampled_from(list(CONFIGS)),
    experts_held=st.integers(1, 8),
)
def test_any_batch_any_budget_equals_torch(
    layers: dict[str, Layer], batch: int, seed: int, name: str, experts_held: int
) -> None:
    layer = layers[name]
    u = tokens(batch, seed)
    one = ExpertStore({0: layer.path}, {0: layer.spec.expert_tensors}).nbytes(0, 0)
    executor, cache = layer.executor(experts_held * one)
    np.testing.assert_allclose(executor.forward(0, u), layer.reference(u), atol=1e-5, rtol=0)
    assert cache.peak_bytes <= experts_held * one


def test_experts_with_no_tokens_are_never_loaded(tmp_path: Path) -> None:
    # Only experts 2 and 5 can win: their rows are +v and -v, every other row is zero.
    router = np.zeros((8, D), dtype=np.float32)
    v = np.random.default_rng(3).standard_normal(D).astype(np.float32)
    router[2], router[5] = v, -v
    layer = Layer(CONFIGS["switch"], tmp_path, router)
    u = tokens(16, seed=4)
    executor, cache = layer.executor()
    np.testing.assert_allclose(executor.forward(0, u), layer.reference(u), atol=1e-5, rtol=0)
    assert {e for _, e in cache.resident()} == {2, 5}
    assert cache.metrics.total("paged") == 2 * cache.store.nbytes(0, 0)


@pytest.mark.parametrize("name", ["switch", "mixtral"])
def test_ties_go_to_the_lowest_expert(tmp_path: Path, name: str) -> None:
    # Rows 3 and 6 are equal and the only positive ones for positive tokens.
    router = -np.ones((8, D), dtype=np.float32)
    router[3] = router[6] = 1.0
    layer = Layer(CONFIGS[name], tmp_path, router)
    u = np.abs(tokens(4, seed=5))
    r = route(u.reshape(-1, D), layer.router, layer.spec)
    expected = [3] if name == "switch" else [3, 6]
    assert (r.experts == np.array(expected)).all()
    if name == "mixtral":
        np.testing.assert_allclose(r.gates, 0.5)
    executor, _ = layer.executor()
    np.testing.assert_allclose(executor.forward(0, u), layer.reference(u), atol=1e-5, rtol=0)


def test_all_zero_router_ties_every_expert(tmp_path: Path) -> None:
    layer = Layer(CONFIGS["mixtral"], tmp_path, np.zeros((8, D), dtype=np.float32))
    u = tokens(3, seed=6)
    executor, cache = layer.executor()
    np.testing.assert_allclose(executor.forward(0, u), layer.reference(u), atol=1e-5, rtol=0)
    assert {e for _, e in cache.resident()} == {0, 1}


def test_capacity_overflow_passes_tokens_through_with_zero(tmp_path: Path) -> None:
    # Every token picks expert 0 (tie of zeros); capacity 0.25 * 24 * 1 / 8 -> 1 token.
    cfg = MoEConfig(top_k=1, routing="switch", capacity_factor=0.25)
    layer = Layer(cfg, tmp_path, np.zeros((8, D), dtype=np.float32))
    u = tokens(3, seed=7)
    out = layer.executor()[0].forward(0, u).reshape(-1, D)
    assert layer.spec.capacity(24) == 1
    assert np.abs(out[0]).max() > 0
    assert not out[1:].any()
    np.testing.assert_allclose(out, layer.reference(u).reshape(-1, D), atol=1e-5, rtol=0)


def test_each_needed_expert_runs_once_per_batch_even_in_waves(layers: dict[str, Layer]) -> None:
    layer = layers["mixtral"]
    u = tokens(64, seed=8)
    one = ExpertStore({0: layer.path}, {0: layer.spec.expert_tensors}).nbytes(0, 0)
    executor, cache = layer.executor(2 * one)
    calls: list[int] = []
    forward = cache.expert_forward

    def counting(x: np.ndarray, w: Any, kind: str) -> np.ndarray:
        calls.append(x.shape[0])
        return forward(x, w, kind)

    cache.expert_forward = counting  # type: ignore[method-assign]
    executor.forward(0, u)
    groups = group_by_expert(route(u.reshape(-1, D), layer.router, layer.spec))
    assert len(calls) == len(groups) == 8  # 512 tokens, top-2 of 8: all experts used
    assert sorted(calls) == sorted(len(t) for t, _ in groups.values())
    assert sum(calls) == 64 * TOKENS * 2


def test_spec_and_budget_are_validated(layers: dict[str, Layer]) -> None:
    with pytest.raises(ConfigError, match="top_k 3"):
        MoESpec(32, 64, 8, 3, "switch")
    with pytest.raises(ConfigError, match="below the largest expert"):
        layers["switch"].executor(100)
    with pytest.raises(ConfigError, match="d_model"):
        layers["switch"].executor()[0].forward(0, np.zeros((1, 4, 16), np.float32))


def test_metrics_reach_the_registry(layers: dict[str, Layer]) -> None:
    executor, cache = layers["switch"].executor()
    executor.forward(0, tokens(2))
    executor.forward(0, tokens(2))
    m: MoEMetrics = cache.metrics
    hits = m.registry.get_sample_value(
        "splitinfer_moe_expert_requests_total", {"layer": "0", "result": "hit"}
    )
    misses = m.registry.get_sample_value(
        "splitinfer_moe_expert_requests_total", {"layer": "0", "result": "miss"}
    )
    assert (hits, misses) == (m.total("hit"), m.total("miss"))
    assert misses > 0
    assert hits >= misses  # the same batch twice: the second is all hits
    assert m.registry.get_sample_value("splitinfer_moe_tokens_total", {"layer": "0"}) == 32
