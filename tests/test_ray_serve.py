"""The cloud service on Ray Serve: two replicas, the same HTTP API, a replica killed mid-run."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the optional ray extra is not installed")

import aiohttp  # noqa: E402
from cloudkit import (  # noqa: E402
    DEVICE,
    chain_repo,
    cnn,
    config,
    credentials_file,
    frame,
    load,
    policy,
    write,
)
from multidict import CIMultiDict  # noqa: E402

from splitinfer.cloud.config import BatchingConfig  # noqa: E402
from splitinfer.cloud.engine import Engine  # noqa: E402
from splitinfer.cloud.scale.config import ScaleConfig, scale_config_from_args  # noqa: E402
from splitinfer.cloud.scale.routing import VersionTable, model_key, parse_key  # noqa: E402
from splitinfer.shared.auth import sign  # noqa: E402
from splitinfer.shared.contract import HEADER_VERSION  # noqa: E402
from splitinfer.shared.errors import ConfigError, ModelNotFoundError  # noqa: E402
from splitinfer.shared.frame import (  # noqa: E402
    FRAME_TYPE,
    Limits,
    decode_response,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    # Ray's own modules use pydantic v1 idioms (deprecation warnings raised inside ray)
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*"),
]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ray") / "repo"
    chain_repo(root, versions=("1", "2"))
    write(cnn(), root, "cnn", "1", cuts=("c2", "none"))
    return root


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return credentials_file(tmp_path_factory.mktemp("creds") / "devices.toml")


def service(repo: Path, creds: Path) -> Any:
    return config(
        repo,
        credentials=str(creds),
        batching=BatchingConfig(max_batch_size=8, max_queue_delay_ms=2.0),
        models={"chain": policy(versions="all")},
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def url(repo: Path, creds: Path) -> Iterator[str]:
    from splitinfer.cloud.scale.ray_serve import deploy, shutdown

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        scale = ScaleConfig(
            service=service(repo, creds),
            min_replicas=2,
            max_replicas=2,
            num_cpus=0.5,
            ingress_num_cpus=0.25,
            retries=6,
            # two requests at a time per replica: under the test's load both replicas are
            # busy, so the replica killed mid-run is likely to have requests in flight
            max_ongoing_requests=2,
        )
        yield deploy(scale, port=free_port(), timeout_s=90)
    finally:
        shutdown()
        ray.shutdown()


# -- the pure parts -----------------------------------------------------------------------


def test_serve_run_arguments_build_the_config(repo: Path, tmp_path: Path) -> None:
    toml = tmp_path / "service.toml"
    toml.write_text("[batching]\nmax_batch_size = 4\n")
    scale = scale_config_from_args(
        {
            "repository": str(repo),
            "config": str(toml),
            "no_auth": "true",
            "models.chain.canary_percent": "10",
            "max_replicas": "4",
            "num_gpus": "1",
            "target_ongoing_requests": "8",
        }
    )
    assert scale.service.no_auth
    assert scale.service.batching.max_batch_size == 4
    assert scale.service.policy("chain").canary_percent == 10
    options = scale.replica_options()
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    auto = options["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (
        1,
        4,
        8.0,
    )
    fixed = scale_config_from_args({"repository": str(repo), "min_replicas": "2"})
    assert fixed.replica_options()["num_replicas"] == 2
    assert "autoscaling_config" not in fixed.replica_options()
    with pytest.raises(ConfigError, match="max_replicas=1: must be an integer >= 3"):
        scale_config_from_args({"repository": str(repo), "min_replicas": "3", "max_replicas": "1"})
    with pytest.raises(ConfigError, match="nope: unknown option"):
        scale_config_from_args({"repository": str(repo), "batching.nope": "1"})
    with pytest.raises(ConfigError, match="repository: missing"):
        scale_config_from_args({"max_replicas": "3"})


def test_the_version_table_routes_by_policy(repo: Path, creds: Path) -> None:
    table = VersionTable(service(repo, creds))
    report = table.rescan()
    assert {(r["model"], r["version"]) for r in report["loaded"]} == {
        ("chain", "1"),
        ("chain", "2"),
        ("cnn", "1"),
    }
    info, key = table.route("chain", "1", "cam-01")
    assert info.version == "1"
    assert parse_key(key)[:2] == ("chain", "1")
    assert key == model_key("chain", "1", info.fingerprint)
    assert table.route("chain", "", "cam-01")[0].version == "2"  # the newest
    with pytest.raises(ModelNotFoundError, match="no version '7'"):
        table.route("chain", "7", "")
    with pytest.raises(ModelNotFoundError, match="not served here"):
        table.route("nope", "", "")
    assert table.rescan() == {"loaded": [], "failed": [], "retired": []}
    assert table.ready


# -- through Ray Serve ------------------------------------------------------------------------


def vec(seed: int, rows: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 4)).astype(np.float32)


def image(seed: int, rows: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, 3, 16, 16)).astype(np.float32)


def workload(repo: Path, n: int) -> list[tuple[str, bytes]]:
    """Frames for chain versions 1, 2 and the policy's choice, and cnn at two cuts."""
    chain1, chain2 = load(repo, "chain", "1"), load(repo, "chain", "2")
    cnn1 = load(repo, "cnn", "1")
    c2 = chain2.find_cut("c2")
    assert c2 is not None
    cut_tensor = c2.tensors[0].name
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            out.append(("chain", frame(chain1, {"x": vec(i, 2)}, version="1")))
        elif kind == 1:
            out.append(("chain", frame(chain2, {"x": vec(i)}, version="2")))
        elif kind == 2:
            out.append(("chain", frame(chain2, {cut_tensor: vec(i, 3)}, cut="c2")))
        elif kind == 3:
            out.append(("cnn", frame(cnn1, {"x": image(i)}, cut="c0")))
        else:
            p1 = np.random.default_rng(i).standard_normal((1, 8, 8, 8)).astype(np.float32)
            out.append(("cnn", frame(cnn1, {"p1": p1}, cut="c2")))
    return out


async def expected(repo: Path, creds: Path, requests: list[tuple[str, bytes]]) -> list[Any]:
    """What the single-process service answers (the same engine, in process)."""
    async with Engine(service(repo, creds)) as engine:
        served = [await engine.infer(model, body) for model, body in requests]
    return [
        _outputs(repo, model, s.version, s.body)
        for (model, _), s in zip(requests, served, strict=True)
    ]


def _outputs(repo: Path, model: str, version: str, body: bytes) -> dict[str, np.ndarray]:
    response = decode_response(body, load(repo, model, version), Limits())
    return {t.name: t.array for t in response.tensors}


async def send(
    session: aiohttp.ClientSession, url: str, model: str, body: bytes
) -> tuple[int, dict[str, str], bytes]:
    path = f"/v1/models/{model}/infer"
    headers = sign("POST", path, body, DEVICE, time.time())
    headers["Content-Type"] = FRAME_TYPE
    async with session.post(url + path, data=body, headers=headers) as resp:
        # HTTP headers are case-insensitive (uvicorn sends them in lower case)
        return resp.status, CIMultiDict(resp.headers), await resp.read()


async def run_all(
    url: str, requests: list[tuple[str, bytes]], concurrency: int, on_answer: Any = None
) -> list[tuple[int, dict[str, str], bytes]]:
    results: list[Any] = [None] * len(requests)
    queue = list(enumerate(requests))
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            while queue:
                i, (model, body) = queue.pop(0)
                results[i] = await send(session, url, model, body)
                if on_answer is not None:
                    await on_answer(sum(r is not None for r in results))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return results


def check(repo: Path, requests: list[Any], got: list[Any], want: list[Any]) -> None:
    for (model, _), (status, headers, body), ref in zip(requests, got, want, strict=True):
        assert status == 200, body[:300]
        assert headers["Content-Type"] == FRAME_TYPE
        assert headers["Server-Timing"].startswith("cloud;dur=")
        out = _outputs(repo, model, headers[HEADER_VERSION], body)
        assert out.keys() == ref.keys()
        for name in ref:
            np.testing.assert_allclose(out[name], ref[name], rtol=1e-5, atol=1e-6)


async def test_a_concurrent_workload_equals_the_single_process_service(
    url: str, repo: Path, creds: Path
) -> None:
    requests = workload(repo, 40)
    want = await expected(repo, creds, requests)
    got = await run_all(url, requests, concurrency=8)
    check(repo, requests, got, want)
    pairs = zip(requests, got, strict=True)
    versions = {h[HEADER_VERSION] for (m, _), (_, h, _) in pairs if m == "chain"}
    assert versions == {"1", "2"}


async def test_the_http_contract_is_the_daemons(url: str, repo: Path) -> None:
    chain2 = load(repo, "chain", "2")
    body = frame(chain2, {"x": vec(1)})
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/healthz") as resp:
            assert (resp.status, await resp.text()) == (200, "ok")
        async with session.get(url + "/readyz") as resp:
            ready = await resp.json()
            assert resp.status == 200
            assert set(ready["models"]) == {"chain", "cnn"}
        async with session.get(url + "/v1/models") as resp:
            names = [m["name"] for m in (await resp.json())["models"]]
            assert sorted(names) == ["chain", "cnn"]
        path = "/v1/models/chain/infer"
        # unsigned: 401, the JSON error of the daemon
        async with session.post(url + path, data=body, headers={"Content-Type": FRAME_TYPE}) as r:
            assert r.status == 401
            err = await r.json()
            assert err["status"] == 401
        cases = [
            ("/v1/models/chain/infer", body, "text/plain", 415),
            ("/v1/models/nope/infer", frame(chain2, {"x": vec(1)}, model="nope"), FRAME_TYPE, 404),
            ("/v1/models/cnn/infer", body, FRAME_TYPE, 400),  # frame.model != URL
            ("/v1/models/chain/infer", b"SPLT garbage", FRAME_TYPE, 400),
            ("/v1/models/chain/infer", frame(chain2, {"x": vec(1)}, version="9"), FRAME_TYPE, 404),
        ]
        for p, b, ctype, status in cases:
            h = sign("POST", p, b, DEVICE, time.time())
            h["Content-Type"] = ctype
            async with session.post(url + p, data=b, headers=h) as r:
                data = await r.json()
                assert r.status == status, data
                assert data["status"] == status
                assert "\n" not in data["error"]
        # the JSON debugging path
        p = "/v1/models/chain/infer.json"
        b = json.dumps({"cut_id": "c0", "model_version": "1", "inputs": {"x": vec(5).tolist()}})
        h = sign("POST", p, b.encode(), DEVICE, time.time())
        h["Content-Type"] = "application/json"
        async with session.post(url + p, data=b, headers=h) as r:
            data = await r.json()
            assert r.status == 200, data
            assert data["model_version"] == "1"
            assert r.headers[HEADER_VERSION] == "1"
            assert np.asarray(data["outputs"]["y"]).shape == (1, 4)


async def test_killing_a_replica_mid_run_loses_no_request(
    url: str, repo: Path, creds: Path
) -> None:
    from ray.util import list_named_actors

    requests = workload(repo, 120)
    want = await expected(repo, creds, requests)
    replicas = [
        a["name"]
        for a in list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and "CloudReplica" in a["name"]
    ]
    assert len(replicas) == 2, replicas
    killed: list[str] = []

    async def kill_once(answered: int) -> None:
        if answered >= 20 and not killed:
            killed.append(replicas[0])
            ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=True)

    got = await run_all(url, requests, concurrency=12, on_answer=kill_once)
    assert killed
    check(repo, requests, got, want)  # every request answered, and right
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    retried = sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("splitinfer_ingress_retries_total")
    )
    # Requests in flight on the dead replica are sent again, by the ingress (counted here)
    # or, when the replica died before taking them, by Serve's router; either way none is lost.
    print(f"requests the ingress retried after the kill: {retried:g}")


def test_the_kuberay_manifest_deploys_this_application(repo: Path, creds: Path) -> None:
    """The RayService's serveConfigV2 names a real builder whose args build a valid config."""
    import importlib

    yaml = pytest.importorskip("yaml", reason="PyYAML (dev extra) is not installed")
    folder = Path(__file__).resolve().parent.parent / "deploy" / "kuberay"
    docs = {p.name: list(yaml.safe_load_all(p.read_text())) for p in folder.glob("*.yaml")}
    assert set(docs) == {"rayservice.yaml", "service.yaml"}
    [service_doc] = docs["rayservice.yaml"]
    assert (service_doc["apiVersion"], service_doc["kind"]) == ("ray.io/v1", "RayService")
    serve_config = yaml.safe_load(service_doc["spec"]["serveConfigV2"])
    [app] = serve_config["applications"]
    module, _, attr = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), attr)
    from splitinfer.cloud.scale.ray_serve import app_builder

    assert builder is app_builder
    args = {**app["args"], "repository": str(repo), "credentials": str(creds)}
    scale = scale_config_from_args(args)
    options = scale.replica_options()
    assert options["ray_actor_options"]["num_gpus"] == 1
    assert options["autoscaling_config"]["max_replicas"] == 4
    assert scale.service.runtime.providers == ("tensorrt", "cuda", "cpu")
    cluster = service_doc["spec"]["rayClusterConfig"]
    # the cluster's image runs the Ray this package was tested with (the ray extra's floor
    # admits newer ones here; the major version must agree for the Serve config format)
    assert cluster["rayVersion"].split(".")[0] == ray.__version__.split(".")[0]
    [workers] = cluster["workerGroupSpecs"]
    [container] = workers["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert workers["maxReplicas"] >= scale.max_replicas
