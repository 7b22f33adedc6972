"""The expert cache: budget, eviction order, hit rate, prefetch, stall, the store."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitinfer.cloud.moe.cache import CacheConfig, ExpertCache, MoEMetrics, SyncExecutor
from splitinfer.cloud.moe.executor import MoEExecutor, MoELayerParams, moe_reference
from splitinfer.cloud.moe.store import ExpertStore
from splitinfer.shared.errors import ConfigError, PackageError
from splitinfer.shared.moe import MoESpec, write_layer_shard

pytestmark = pytest.mark.unit

D, H, E = 8, 16, 8
SPEC = MoESpec(D, H, E, 1, "switch")
EXPERT_BYTES = 2 * D * H * 4


def _layer(rng: np.random.Generator, router: np.ndarray | None = None) -> tuple:
    r = rng.standard_normal((E, D)).astype(np.float32) if router is None else router
    experts = [
        {
            "w1": rng.standard_normal((H, D)).astype(np.float32),
            "w2": rng.standard_normal((D, H)).astype(np.float32),
        }
        for _ in range(E)
    ]
    return r, experts


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> ExpertStore:
    folder = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    paths = {}
    for layer in range(2):
        r, experts = _layer(rng)
        paths[layer] = write_layer_shard(folder / f"l{layer}.safetensors", r, experts, "{}")
    return ExpertStore(paths, {0: ("w1", "w2"), 1: ("w1", "w2")})


def cache_of(store: ExpertStore, experts: int, policy: str = "lru", **kw: object) -> ExpertCache:
    return ExpertCache(
        store, CacheConfig(experts * EXPERT_BYTES, policy), prefetcher=SyncExecutor(), **kw
    )


def use(cache: ExpertCache, layer: int, experts: list[int]) -> None:
    cache.acquire(layer, experts)
    cache.release(layer, experts)


def test_store_reads_what_safetensors_reads(store: ExpertStore) -> None:
    from safetensors import safe_open

    with safe_open(str(store.shards[1].path), framework="numpy") as f:
        np.testing.assert_array_equal(store.read(1, 3)["w2"], f.get_tensor("e3.w2"))
        np.testing.assert_array_equal(store.routers[1], f.get_tensor("router"))
    assert store.nbytes(0, 0) == EXPERT_BYTES


def test_a_truncated_shard_is_refused(tmp_path: Path, store: ExpertStore) -> None:
    data = store.shards[0].path.read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(PackageError, match="runs past the end"):
        ExpertStore({0: bad}, {0: ("w1", "w2")})


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    held=st.integers(1, 2 * E),
    policy=st.sampled_from(["lru", "lfru", "none"]),
    ops=st.lists(
        st.tuples(
            st.integers(0, 1),
            st.lists(st.integers(0, E - 1), min_size=1, max_size=E),
            st.lists(st.integers(0, E - 1), max_size=E),
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_the_budget_is_never_exceeded(
    store: ExpertStore, held: int, policy: str, ops: list[tuple[int, list[int], list[int]]]
) -> None:
    # As the executor does: each wave pinned while the other layer's experts prefetch.
    cache = cache_of(store, held, policy)
    budget = cache.config.budget_bytes
    for layer, experts, predicted in ops:
        wanted = sorted(set(experts))
        for wave in cache.waves(layer, wanted):
            got = cache.acquire(layer, wave)
            assert set(got) == set(wave)
            assert cache.resident_bytes <= budget
            cache.prefetch(1 - layer, sorted(set(predicted)), [(layer, e) for e in wanted])
            assert cache.resident_bytes <= budget
            assert all((layer, e) in cache.resident() for e in wave)
            cache.release(layer, wave)
    assert cache.peak_bytes <= budget


def test_hit_rate_accounting(store: ExpertStore) -> None:
    cache = cache_of(store, 4)
    use(cache, 0, [0, 1])  # 2 misses
    use(cache, 0, [0, 2])  # 1 hit, 1 miss
    use(cache, 1, [0])  # 1 miss, other layer
    m = cache.metrics
    assert (m.total("hit", 0), m.total("miss", 0)) == (1, 3)
    assert m.hit_rate(0) == pytest.approx(0.25)
    assert m.hit_rate(1) == 0.0
    assert m.hit_rate() == pytest.approx(1 / 5)
    assert m.total("paged") == 4 * EXPERT_BYTES


@pytest.mark.parametrize(("policy", "evicted"), [("lru", 0), ("lfru", 1)])
def test_lru_and_lfru_evict_differently(store: ExpertStore, policy: str, evicted: int) -> None:
    # Expert 0 is used often but not lately; 1 and 2 once each, more recently.
    cache = cache_of(store, 3, policy)
    for _ in range(4):
        use(cache, 0, [0])
    use(cache, 0, [1])
    use(cache, 0, [2])
    use(cache, 0, [3])
    assert {e for _, e in cache.resident()} == {0, 1, 2, 3} - {evicted}


def test_policy_none_keeps_nothing(store: ExpertStore) -> None:
    cache = cache_of(store, 8, "none")
    use(cache, 0, [0, 1])
    use(cache, 0, [0, 1])
    assert cache.resident() == set()
    assert cache.metrics.total("hit") == 0


def test_more_experts_than_the_cache_holds_runs_in_waves(store: ExpertStore) -> None:
    cache = cache_of(store, 3)
    waves = cache.waves(0, list(range(E)))
    assert [len(w) for w in waves] == [3, 3, 2]
    executor = MoEExecutor([MoELayerParams(SPEC, store.routers[0])], cache)
    u = np.random.default_rng(1).standard_normal((64, D)).astype(np.float32)
    experts = [store.read(0, e) for e in range(E)]
    np.testing.assert_allclose(
        executor.forward(0, u), moe_reference(u, store.routers[0], experts, SPEC), atol=1e-5
    )
    assert cache.peak_bytes <= 3 * EXPERT_BYTES
    # the second run starts with the experts still resident: they go in the first wave
    resident = sorted(e for _, e in cache.resident())
    assert cache.waves(0, list(range(E)))[0] == resident


def test_prefetch_precision_on_a_scripted_case(tmp_path: Path) -> None:
    # Layer 0 sends positive tokens to expert 0. Layer 1's router picks expert 1
    # for positive tokens and expert 2 for negative ones.
    rng = np.random.default_rng(2)
    r0 = np.zeros((E, D), np.float32)
    r0[0] = 1.0
    r1 = np.zeros((E, D), np.float32)
    r1[1], r1[2] = 1.0, -1.0
    paths = {}
    for layer, r in enumerate((r0, r1)):
        router, experts = _layer(rng, r)
        paths[layer] = write_layer_shard(tmp_path / f"l{layer}.safetensors", router, experts, "{}")
    store = ExpertStore(paths, {0: ("w1", "w2"), 1: ("w1", "w2")})
    cache = cache_of(store, 4)
    params = [MoELayerParams(SPEC, store.routers[i]) for i in range(2)]
    executor = MoEExecutor(params, cache)
    x = np.abs(rng.standard_normal((4, D))).astype(np.float32) + 0.1

    executor.forward(0, x)  # prefetches layer 1 expert 1
    assert (1, 1) in cache.resident()
    executor.forward(1, -x)  # needs expert 2: the prefetch was wasted
    assert cache.metrics.prefetch_precision(1) == 0.0
    executor.forward(0, x)  # expert 1 of layer 1 still resident: nothing issued
    executor.forward(1, x)
    assert cache.metrics.total("prefetch_issued", 1) == 1
    assert cache.metrics.total("prefetch_useful", 1) == 0
    cache2 = cache_of(store, 4)
    executor2 = MoEExecutor(params, cache2)
    executor2.forward(0, x)
    executor2.forward(1, x)  # the prediction was right
    assert cache2.metrics.prefetch_precision(1) == 1.0
    assert cache2.metrics.hit_rate(1) == 1.0


def test_prefetch_never_evicts_the_running_layer(store: ExpertStore) -> None:
    cache = cache_of(store, 2)
    cache.acquire(0, [0])
    cache.release(0, [0])
    use(cache, 0, [1])
    cache.prefetch(1, [5, 6], protect=[(0, 0), (0, 1)])
    assert cache.resident() == {(0, 0), (0, 1)}
    assert cache.metrics.total("prefetch_dropped") == 2


def test_stall_time_uses_the_injected_clock(store: ExpertStore) -> None:
    ticks = iter(range(0, 1000, 5))
    cache = cache_of(store, 8, clock=lambda: float(next(ticks)))
    use(cache, 0, [0, 1])  # one acquire: two clock reads, 5 apart
    use(cache, 0, [0])
    assert cache.metrics.total("stall", 0) == 10.0
    assert (
        cache.metrics.registry.get_sample_value(
            "splitinfer_moe_stall_seconds_total", {"layer": "0"}
        )
        == 10.0
    )


def test_a_thread_pool_prefetcher_gives_the_same_results(store: ExpertStore) -> None:
    params = [MoELayerParams(SPEC, store.routers[i]) for i in range(2)]
    u = np.random.default_rng(3).standard_normal((32, D)).astype(np.float32)
    want = []
    for layer in range(2):
        experts = [store.read(layer, e) for e in range(E)]
        want.append(moe_reference(u, store.routers[layer], experts, SPEC))
    with ThreadPoolExecutor(1) as pool:
        cache = ExpertCache(store, CacheConfig(3 * EXPERT_BYTES), prefetcher=pool)
        executor = MoEExecutor(params, cache)
        for _ in range(3):
            for layer in range(2):
                np.testing.assert_allclose(executor.forward(layer, u), want[layer], atol=1e-5)
                assert cache.resident_bytes <= 3 * EXPERT_BYTES
    assert cache.metrics.total("prefetch_issued") > 0


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="policy 'fifo'"):
        CacheConfig(1, "fifo")
    with pytest.raises(ConfigError, match="must be positive"):
        CacheConfig(0)
    assert json.loads(json.dumps(SPEC.to_dict()))["routing"] == "switch"


def test_the_prometheus_series_count_what_the_tallies_count(store: ExpertStore) -> None:
    metrics = MoEMetrics()
    cache = cache_of(store, 2, metrics=metrics)
    use(cache, 0, [1])  # miss
    use(cache, 0, [1])  # hit
    use(cache, 0, [2, 3])  # two misses, evicts 1
    use(cache, 1, [0])  # a miss in layer 1

    def series(name: str, **labels: str) -> float:
        value = metrics.registry.get_sample_value(name, labels)
        assert value is not None, (name, labels)
        return value

    assert series("splitinfer_moe_expert_requests_total", layer="0", result="miss") == 3
    assert series("splitinfer_moe_expert_requests_total", layer="0", result="hit") == 1
    assert series("splitinfer_moe_expert_requests_total", layer="1", result="miss") == 1
    for layer in (0, 1):
        for result in ("miss", "hit"):
            got = metrics.registry.get_sample_value(
                "splitinfer_moe_expert_requests_total", {"layer": str(layer), "result": result}
            )
            assert (got or 0.0) == metrics.total(result, layer), (layer, result)
    assert series("splitinfer_moe_paged_bytes_total", layer="0") == 3 * EXPERT_BYTES


def test_evicted_buffers_are_reused_and_hold_the_new_expert(store: ExpertStore) -> None:
    from splitinfer.cloud.moe.device import NumpyDevice

    device = NumpyDevice(spare=1)
    cache = cache_of(store, 1, "lru", device=device)
    first = cache.acquire(0, [2])[2]
    cache.release(0, [2])
    second = cache.acquire(0, [5])[5]  # evicts expert 2, pages 5 into its memory
    cache.release(0, [5])
    assert second["w1"] is first["w1"]
    for name in ("w1", "w2"):
        np.testing.assert_array_equal(second[name], store.read(0, 5)[name])
    # at most ``spare`` evicted experts wait for reuse
    device.recycle({"w1": np.zeros((H, D), np.float32), "w2": np.zeros((D, H), np.float32)})
    device.recycle({"w1": np.ones((H, D), np.float32), "w2": np.ones((D, H), np.float32)})
    reused = device.upload(store.read(1, 0))
    fresh = device.upload(store.read(1, 1))
    assert not np.shares_memory(reused["w1"], fresh["w1"])
    np.testing.assert_array_equal(fresh["w1"], store.read(1, 1)["w1"])


def test_recycling_changes_no_result(store: ExpertStore) -> None:
    from splitinfer.cloud.moe.device import NumpyDevice

    rng = np.random.default_rng(3)
    params = [MoELayerParams(SPEC, store.routers[layer]) for layer in range(2)]
    u = rng.standard_normal((12, D)).astype(np.float32)
    outs = []
    for spare in (0, 2):
        cache = cache_of(store, 1, "lfru", device=NumpyDevice(spare=spare))
        ex = MoEExecutor(params, cache, prefetch=False)
        outs.append([ex.forward(layer, u) for layer in (0, 1, 0, 1)])
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)
