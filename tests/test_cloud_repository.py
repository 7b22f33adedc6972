"""The model repository: complete packages, version policies, reloads, routing, runtimes."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from cloudkit import chain_repo, config, policy

from splitinfer.cloud.config import ModelPolicy, RuntimeConfig
from splitinfer.cloud.engine import Engine
from splitinfer.cloud.metrics import Metrics
from splitinfer.cloud.registry import Registry
from splitinfer.cloud.repository import HashCache, scan, select_versions, version_key
from splitinfer.cloud.runtime import Runtime, choose_providers, provider_options
from splitinfer.cloud.traffic import choose_version, stable_draw
from splitinfer.shared.errors import ConfigError, ModelError, PackageError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("built") / "repo"
    chain_repo(repo, versions=("1", "2", "10"))
    return repo


@pytest.fixture
def repo(built: Path, tmp_path: Path) -> Path:
    out = tmp_path / "repo"
    shutil.copytree(built, out)
    return out


# -- scanning ------------------------------------------------------------------------


def test_only_complete_packages_count(repo: Path) -> None:
    chain = repo / "chain"
    shutil.copytree(chain / "2", chain / "torn")
    (chain / "torn" / "cloud.onnx").write_bytes(b"half a file")
    shutil.copytree(chain / "2", chain / "gone")
    (chain / "gone" / "candidates" / "c2" / "cloud.onnx").unlink()
    (chain / "empty").mkdir()
    shutil.copytree(chain / "2", chain / ".11.tmp")  # being written: ignored
    shutil.copytree(chain / "2", repo / "other" / "1")  # manifest says "chain"
    (chain / "2" / "edge.onnx").unlink(missing_ok=True)  # the cloud needs no edge half
    found = scan(repo, HashCache())
    by = {c.version: c for c in found["chain"]}
    assert [v for v, c in by.items() if c.complete] == ["1", "2", "10"]
    assert by["torn"].problem == "cut c0: cloud.onnx does not match its sha256"
    assert by["gone"].problem == "cut c2: candidates/c2/cloud.onnx is missing"
    assert by["empty"].problem == "no manifest.json"
    assert ".11.tmp" not in by
    (other,) = found["other"]
    assert "model_name 'chain' is not the folder's 'other'" in other.problem


def test_a_bad_manifest_is_an_incomplete_version(repo: Path) -> None:
    path = repo / "chain" / "2" / "manifest.json"
    data = json.loads(path.read_text())
    data["format_version"] = 99
    path.write_text(json.dumps(data))
    (bad,) = [c for c in scan(repo, HashCache())["chain"] if c.version == "2"]
    assert not bad.complete
    assert "newer than this splitinfer understands" in bad.problem
    with pytest.raises(PackageError, match="no such folder"):
        scan(repo / "missing", HashCache())


def test_versions_sort_naturally_and_policies_select() -> None:
    names = ["10", "2", "1", "1.10", "1.9", "b", "a"]
    assert sorted(names, key=version_key) == ["1", "1.9", "1.10", "2", "10", "a", "b"]
    have = ["1", "2", "10"]
    assert select_versions(ModelPolicy(), have) == ["10"]
    assert select_versions(ModelPolicy(latest=2), have) == ["2", "10"]
    assert select_versions(ModelPolicy(versions="all"), have) == ["1", "2", "10"]
    listed = ModelPolicy(versions="list", version_list=("1", "7"))
    assert select_versions(listed, have) == ["1"]


def test_the_hash_cache_rehashes_only_changed_files(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"one")
    cache = HashCache(max_entries=2)
    first = cache.sha256(f)
    assert cache.sha256(f) == first
    f.write_bytes(b"two!")
    assert cache.sha256(f) != first


# -- routing -------------------------------------------------------------------------


def test_weights_split_traffic_among_ready_versions() -> None:
    ab = ModelPolicy(versions="all", weights={"1": 90, "2": 10})
    picks = [choose_version(ab, ["1", "2"], d / 1000) for d in range(1000)]
    assert picks.count("2") == 100
    # a weighted version that is not ready gives its share to the others
    assert {choose_version(ab, ["1", "3"], d / 10) for d in range(10)} == {"1"}
    # no weighted version ready: the newest
    assert choose_version(ab, ["3", "4"], 0.5) == "4"


def test_a_canary_gets_its_percentage_of_the_newest_two() -> None:
    canary = ModelPolicy(latest=3, canary_percent=5)
    picks = [choose_version(canary, ["1", "2", "10"], d / 1000) for d in range(1000)]
    assert picks.count("10") == 50
    assert picks.count("2") == 950
    assert choose_version(canary, ["1"], 0.0) == "1"
    with pytest.raises(ValueError, match="no ready version"):
        choose_version(canary, [], 0.5)


def test_sticky_routing_keeps_a_device_on_one_version() -> None:
    draws = [stable_draw("m", f"dev-{i}") for i in range(400)]
    assert draws == [stable_draw("m", f"dev-{i}") for i in range(400)]
    assert all(0 <= d < 1 for d in draws)
    assert 0.4 < float(np.mean(draws)) < 0.6
    assert stable_draw("m", "dev-1") != stable_draw("other", "dev-1")


# -- runtimes ------------------------------------------------------------------------


def test_providers_follow_preference_among_available_and_keep_cpu() -> None:
    gpu = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert choose_providers(("tensorrt", "cuda", "cpu"), gpu) == gpu
    assert choose_providers(("cuda", "tensorrt"), gpu) == [gpu[1], gpu[0], gpu[2]]
    assert choose_providers(("tensorrt", "cuda", "cpu"), ["CPUExecutionProvider"]) == [
        "CPUExecutionProvider"
    ]
    assert choose_providers(("cpu",), gpu) == ["CPUExecutionProvider"]
    assert choose_providers(("auto",), gpu) == gpu
    with pytest.raises(ConfigError, match="has none of them"):
        choose_providers(("cuda",), ["CPUExecutionProvider"])
    cfg = RuntimeConfig(trt_fp16=True, trt_cache_dir=Path("/cache"), gpu=1)
    assert provider_options("TensorrtExecutionProvider", cfg) == {
        "device_id": "1",
        "trt_fp16_enable": "True",
        "trt_max_workspace_size": str(2**30),
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": "/cache",
    }
    assert provider_options("CUDAExecutionProvider", cfg) == {"device_id": "1"}
    assert provider_options("CPUExecutionProvider", cfg) == {}


def test_the_runtime_runs_plainly_and_through_io_binding(repo: Path) -> None:
    rt = Runtime(repo / "chain" / "2" / "cloud.onnx", RuntimeConfig(threads=1))
    assert rt.providers == ["CPUExecutionProvider"]
    assert not rt.io_binding  # only GPU providers bind
    feeds = {"x": np.ones((3, 4), np.float32)}
    plain = rt.run(feeds)
    rt.io_binding = True  # the GPU code path, exercised on CPU memory
    bound = rt.run(feeds)
    np.testing.assert_array_equal(plain["y"], bound["y"])
    bad = repo / "bad.onnx"
    bad.write_bytes(b"nope")
    with pytest.raises(ModelError, match="ONNX Runtime cannot load it"):
        Runtime(bad, RuntimeConfig())


# -- reloads -------------------------------------------------------------------------


async def test_reload_follows_the_policy_and_replaced_packages(repo: Path) -> None:
    reg = Registry(config(repo, models={"chain": policy(latest=2)}), Metrics())
    try:
        report = await reg.reload()
        assert sorted(v["version"] for v in report["loaded"]) == ["10", "2"]
        state = reg.model("chain")
        assert list(state.serving) == ["2", "10"]
        uid = state.serving["10"].uid
        assert await reg.reload() == {"loaded": [], "failed": [], "retired": []}
        # replace version 10 in place (a new package under the same name)
        shutil.rmtree(repo / "chain" / "10")
        shutil.copytree(repo / "chain" / "1", repo / "chain" / "10")
        report = await reg.reload()
        assert report["loaded"] == [{"model": "chain", "version": "10"}]
        assert report["retired"] == [{"model": "chain", "version": "10"}]
        assert state.serving["10"].uid != uid
        # remove a version: the next one down takes its place
        shutil.rmtree(repo / "chain" / "10")
        report = await reg.reload()
        assert report["loaded"] == [{"model": "chain", "version": "1"}]
        assert list(state.serving) == ["1", "2"]
        # remove the model: nothing serves it; it is configured, so not ready
        shutil.rmtree(repo / "chain")
        report = await reg.reload()
        assert len(report["retired"]) == 2
        assert reg.knows("chain")
        assert not reg.ready
    finally:
        reg.close()


async def test_a_model_removed_from_disk_and_config_is_forgotten(repo: Path) -> None:
    reg = Registry(config(repo), Metrics())
    try:
        await reg.reload()
        assert reg.ready
        shutil.rmtree(repo / "chain")
        await reg.reload()
        assert not reg.knows("chain")
        assert reg.ready  # nothing configured is missing
    finally:
        reg.close()


async def test_a_configured_model_without_packages_is_not_ready(repo: Path) -> None:
    reg = Registry(config(repo, models={"absent": ModelPolicy()}), Metrics())
    try:
        await reg.reload()
        assert reg.knows("absent")
        assert not reg.model("absent").ready
        assert not reg.ready
        status = {m["name"]: m for m in reg.status()["models"]}
        assert status["chain"]["ready"]
        assert not status["absent"]["ready"]
    finally:
        reg.close()


async def test_a_failed_load_is_retried_when_forced_or_changed(repo: Path) -> None:
    loads = {"n": 0}

    def factory(path: Path, cfg: RuntimeConfig) -> Runtime:
        loads["n"] += 1
        if "chain/10" in path.as_posix():
            raise ModelError("simulated: out of GPU memory")
        return Runtime(path, cfg)

    reg = Registry(config(repo), Metrics(), runtime_factory=factory)
    try:
        report = await reg.reload()
        assert report["failed"] == [
            {"model": "chain", "version": "10", "error": "simulated: out of GPU memory"}
        ]
        # nothing serves yet (version 10 is the wanted one and failed); not ready
        assert not reg.model("chain").ready
        before = loads["n"]
        await reg.reload()
        assert loads["n"] == before  # unchanged package: not retried
        await reg.reload(force=True)
        assert loads["n"] == before + 1
    finally:
        reg.close()


async def test_the_watcher_picks_up_a_renamed_version(repo: Path) -> None:
    shutil.move(repo / "chain" / "10", repo / "chain" / ".10.incoming")
    async with Engine(config(repo, watch_interval_s=0.05)) as engine:
        assert list(engine.registry.model("chain").serving) == ["2"]
        (repo / "chain" / ".10.incoming").rename(repo / "chain" / "10")
        deadline = time.monotonic() + 10
        while "10" not in engine.registry.model("chain").serving:
            assert time.monotonic() < deadline, "the watcher never loaded version 10"
            await asyncio.sleep(0.01)
        assert list(engine.registry.model("chain").serving) == ["10"]
