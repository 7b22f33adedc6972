"""The local API on loopback: bodies, answers, errors, back-pressure, metrics.

The cloud side here is the real cloud service in process (tests/incloud.py: its
engine and request handler), behind the in-process transport, or the real
cloud-service app on loopback.
The tests against the real cloud service are in test_edge_integration.py.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from graphs import chain, late_mask
from incloud import CloudFactory, repository_for
from ortutil import assert_close, run

from splitinfer.cloud.config import ServiceConfig
from splitinfer.cloud.engine import Engine
from splitinfer.cloud.server import build_app
from splitinfer.edge.agent import create_app, load_credential, timing_header
from splitinfer.edge.config import EdgeConfig, QueueConfig, UplinkConfig
from splitinfer.edge.transport import (
    FunctionTransport,
    HttpTransport,
    Reply,
    TransportError,
    make_session,
)
from splitinfer.partitioner.pipeline import PackageExtras, artifacts_for, prepare, write_package
from splitinfer.shared.auth import generate_credential, render_toml
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.manifest import CodecSpec

pytestmark = pytest.mark.integration

ClientFactory = Callable[..., Any]


def build(tmp: Path, model: onnx.ModelProto, name: str, cuts: tuple[int, ...]) -> tuple[Path, Path]:
    src = tmp / f"{name}.onnx"
    onnx.save(model, str(src))
    prepared = prepare(src)
    plans = prepared.space.plans()
    arts = [artifacts_for(prepared, plans[i]) for i in cuts]
    for art in arts:
        art.codec = CodecSpec("raw")
    out = tmp / f"{name}-pkg"
    write_package(prepared, arts, out, extras=PackageExtras(fallback=prepared.optimized))
    return src, out


@pytest.fixture(scope="module")
def pkg(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build(tmp_path_factory.mktemp("agent"), chain(6, width=16), "m", (2, 0))


@pytest.fixture(scope="module")
def two_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build(tmp_path_factory.mktemp("mask"), late_mask(), "mask", (1,))


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def npz(**arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def outputs(body: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(body)) as z:
        return {k: z[k] for k in z.files}


async def agent(
    aiohttp_client: ClientFactory,
    package: Path,
    transports: list[Any],
    **config: Any,
) -> TestClient:  # type: ignore[type-arg]
    cfg = EdgeConfig(package=package, cloud=("http://cloud.invalid:1",), **config)
    return await aiohttp_client(create_app(cfg, transports=transports))  # type: ignore[no-any-return]


async def test_npy_npz_and_json_bodies(
    aiohttp_client: ClientFactory, pkg: tuple[Path, Path], cloud_factory: CloudFactory
) -> None:
    src, package = pkg
    client = await agent(
        aiohttp_client, package, [(await cloud_factory(package, load=0.5)).transport()]
    )
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    want = run(src, {"x": x})
    resp = await client.post(
        "/v1/infer", data=npy(x), headers={"Content-Type": "application/x-npy"}
    )
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"] == "application/x-npz"
    assert resp.headers["X-Splitinfer-Local"] == "0"
    assert resp.headers["X-Splitinfer-Cut"] == "c2"
    assert "X-Splitinfer-Timings" not in resp.headers
    assert_close(outputs(await resp.read()), want)
    # .npz keyed by input name, sniffed without a content type
    resp = await client.post("/v1/infer", data=npz(x=x), headers={"Content-Type": ""})
    assert resp.status == 200
    assert_close(outputs(await resp.read()), want)
    # JSON in, JSON out, with timings on request
    resp = await client.post(
        "/v1/infer",
        data=json.dumps({"inputs": {"x": x.tolist()}}),
        headers={"Content-Type": "application/json", "X-Splitinfer-Timings": "1"},
    )
    assert resp.status == 200
    doc = await resp.json()
    assert doc["local"] is False
    assert doc["cut"] == "c2"
    assert doc["model_version"] == "1"
    assert_close({"y": np.asarray(doc["outputs"]["y"], np.float32)}, want)
    assert {"edge_ms", "encode_ms", "uplink_ms", "decode_ms", "total_ms"} <= set(doc["timings"])
    assert doc["cloud_load"] == 0.5
    assert doc["estimate"]["uplink_bps"] > 0
    header = resp.headers["X-Splitinfer-Timings"]
    assert 'cut;desc="c2"' in header
    assert "edge;dur=" in header
    assert "est-rtt;dur=" in header
    # a forced cut, and an npz answer asked for by Accept
    resp = await client.post(
        "/v1/infer",
        data=npy(x),
        headers={"X-Splitinfer-Cut": "c0", "Accept": "application/x-npz"},
    )
    assert resp.headers["X-Splitinfer-Cut"] == "c0"
    assert_close(outputs(await resp.read()), want)


async def test_several_inputs_need_an_npz(
    aiohttp_client: ClientFactory, two_inputs: tuple[Path, Path], cloud_factory: CloudFactory
) -> None:
    src, package = two_inputs
    client = await agent(aiohttp_client, package, [(await cloud_factory(package)).transport()])
    rng = np.random.default_rng(2)
    feeds = {k: rng.standard_normal((2, 4)).astype(np.float32) for k in ("x", "mask")}
    resp = await client.post("/v1/infer", data=npz(**feeds))
    assert resp.status == 200, await resp.text()
    assert_close(outputs(await resp.read()), run(src, feeds))
    resp = await client.post("/v1/infer", data=npy(feeds["x"]))
    assert resp.status == 400
    assert "send an .npz keyed by input name" in (await resp.json())["error"]


@pytest.mark.parametrize(
    ("body", "headers", "message"),
    [
        (b"", {}, "empty body"),
        (b"hello", {"Content-Type": "text/plain"}, "is not .npy, .npz or JSON"),
        (b"\x93NUMPY garbage", {}, "not a valid .npy"),
        (b'{"inputs": [1, 2]}', {}, '{"inputs": {name: nested lists}}'),
        (b'{"inputs": {"x": [[1, 2], [3]]}}', {}, "input 'x'"),
        (b'{"inputs": {"z": [[1]]}}', {}, "unknown input 'z'; the model takes x"),
        (b'{"inputs": {"x": [1, 2, 3]}}', {}, "has rank 1, the model takes [N, 16]"),
        (b'{"inputs": {"x": [["a"]]}}', {}, "numbers"),
        (b'{"inputs": {}, "cut": "c1"}', {}, "unknown field 'cut'"),
        (None, {"X-Splitinfer-Timeout-Ms": "soon"}, "not a number of milliseconds"),
        (None, {"X-Splitinfer-Cut": "c9"}, "cut 'c9' is not usable"),
    ],
)
async def test_bad_input_gets_400_with_a_message(
    aiohttp_client: ClientFactory,
    pkg: tuple[Path, Path],
    body: bytes | None,
    headers: dict[str, str],
    message: str,
    cloud_factory: CloudFactory,
) -> None:
    _, package = pkg
    cloud = await cloud_factory(package)
    client = await agent(aiohttp_client, package, [cloud.transport()])
    data = npy(np.zeros((1, 16), np.float32)) if body is None else body
    resp = await client.post("/v1/infer", data=data, headers=headers)
    assert resp.status == 400
    doc = await resp.json()
    assert doc["status"] == 400
    assert message in doc["error"], doc
    assert "\n" not in doc["error"]
    assert cloud.requests == 0
    text = await (await client.get("/metrics")).text()
    assert 'splitinfer_edge_requests_total{outcome="error_400",where="none"} 1.0' in text


async def test_wrong_dtype_and_a_safe_cast(
    aiohttp_client: ClientFactory, pkg: tuple[Path, Path], cloud_factory: CloudFactory
) -> None:
    src, package = pkg
    client = await agent(aiohttp_client, package, [(await cloud_factory(package)).transport()])
    resp = await client.post("/v1/infer", data=npy(np.full((1, 16), "a")))
    assert resp.status == 400
    assert "dtype <U1 does not convert to the model's float32" in (await resp.json())["error"]
    resp = await client.post("/v1/infer", data=npy(np.zeros((1, 16), np.complex64)))
    assert resp.status == 400
    x64 = np.random.default_rng(3).standard_normal((2, 16))
    resp = await client.post("/v1/infer", data=npy(x64))
    assert resp.status == 200
    assert_close(outputs(await resp.read()), run(src, {"x": x64.astype(np.float32)}))


async def test_oversize_body_gets_413(
    aiohttp_client: ClientFactory, pkg: tuple[Path, Path], cloud_factory: CloudFactory
) -> None:
    _, package = pkg
    client = await agent(
        aiohttp_client,
        package,
        [(await cloud_factory(package)).transport()],
        queue=QueueConfig(max_body_bytes=2048),
    )
    resp = await client.post("/v1/infer", data=npy(np.zeros((64, 16), np.float32)))
    assert resp.status == 413
    assert (await resp.json())["status"] == 413


async def test_cloud_down_answers_locally_and_says_so(
    aiohttp_client: ClientFactory, pkg: tuple[Path, Path]
) -> None:
    src, package = pkg

    def dead(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        raise TransportError("connection refused")

    client = await agent(
        aiohttp_client, package, [FunctionTransport(dead, "a"), FunctionTransport(dead, "b")]
    )
    x = np.ones((2, 16), np.float32)
    for _ in range(5):
        resp = await client.post("/v1/infer", data=npy(x), headers={"X-Splitinfer-Timings": "1"})
        assert resp.status == 200
        assert resp.headers["X-Splitinfer-Local"] == "1"
        assert resp.headers["X-Splitinfer-Local-Reason"] == "cloud unavailable"
        assert 'local;desc="1"' in resp.headers["X-Splitinfer-Timings"]
        assert_close(outputs(await resp.read()), run(src, {"x": x}))
    resp = await client.post("/v1/infer", json={"inputs": {"x": x.tolist()}})
    doc = await resp.json()
    assert doc["local"] is True
    assert doc["reason"].startswith("cloud unavailable")
    status = await (await client.get("/v1/status")).json()
    assert set(status["endpoints"].values()) == {"open"}
    assert status["local_model"] is True
    text = await (await client.get("/metrics")).text()
    assert 'splitinfer_edge_local_answers_total{reason="cloud_unavailable"} 6.0' in text
    assert 'splitinfer_edge_endpoint_state{endpoint="a"} 2.0' in text
    assert 'splitinfer_edge_attempts_total{endpoint="a",outcome="error"}' in text


async def test_a_full_queue_refuses_at_once(
    aiohttp_client: ClientFactory, pkg: tuple[Path, Path], cloud_factory: CloudFactory
) -> None:
    _, package = pkg
    cloud = await cloud_factory(package)
    gate = asyncio.Event()
    arrived = asyncio.Event()

    async def held(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        if method == "GET":
            return await cloud(method, path, body, headers)
        arrived.set()
        await gate.wait()
        return await cloud(method, path, body, headers)

    client = await agent(
        aiohttp_client,
        package,
        [FunctionTransport(held)],
        queue=QueueConfig(max_concurrency=1, max_queue=1),
    )
    x = npy(np.ones((1, 16), np.float32))
    first = asyncio.create_task(client.post("/v1/infer", data=x))
    await arrived.wait()
    second = asyncio.create_task(client.post("/v1/infer", data=x))
    for _ in range(100):
        status = await (await client.get("/v1/status")).json()
        if status["queue"]["waiting"] == 1:
            break
        await asyncio.sleep(0)
    third = await client.post("/v1/infer", data=x)
    assert third.status == 503
    assert third.headers["Retry-After"] == "1"
    assert "busy" in (await third.json())["error"]
    gate.set()
    assert (await first).status == 200
    assert (await second).status == 200
    text = await (await client.get("/metrics")).text()
    assert "splitinfer_edge_rejected_total 1.0" in text


async def test_health_status_and_metrics(
    aiohttp_client: ClientFactory, pkg: tuple[Path, Path], cloud_factory: CloudFactory
) -> None:
    _, package = pkg
    client = await agent(
        aiohttp_client, package, [(await cloud_factory(package, load=0.9)).transport()]
    )
    assert await (await client.get("/healthz")).text() == "ok"
    await client.post("/v1/infer", data=npy(np.ones((1, 16), np.float32)))
    status = await (await client.get("/v1/status")).json()
    assert status["cut"] == "c2"
    assert status["cuts"] == ["c2", "c0"]
    assert status["providers"] == ["CPUExecutionProvider"]
    assert status["cloud_load"] == pytest.approx(0.9, abs=0.01)
    assert set(status["edge_ms"]) == {"c2"}
    resp = await client.get("/metrics")
    text = await resp.text()
    assert resp.headers["Content-Type"].startswith("text/plain")
    for metric in (
        'splitinfer_edge_requests_total{outcome="ok",where="cloud"} 1.0',
        'splitinfer_edge_cut{cut="c2"} 1.0',
        'splitinfer_edge_cut{cut="c0"} 0.0',
        'splitinfer_edge_stage_seconds_count{stage="uplink"} 1.0',
        "splitinfer_edge_uplink_estimate_bps",
        "splitinfer_edge_rtt_estimate_seconds",
    ):
        assert metric in text, metric
    load = [line for line in text.splitlines() if line.startswith("splitinfer_edge_cloud_load ")]
    assert float(load[0].split()[1]) == pytest.approx(0.9, abs=0.01)


async def test_http_transport_over_loopback_with_failover(
    aiohttp_server: Callable[..., Any], pkg: tuple[Path, Path], tmp_path: Path
) -> None:
    """Two real cloud-service apps on loopback; one goes away mid-run; no request is lost."""
    src, package = pkg
    repo = repository_for(package, tmp_path / "repo")
    engines: list[Engine] = []

    def app() -> web.Application:
        cfg = ServiceConfig(repository=str(repo), no_auth=True, warmup=False)
        engines.append(Engine(cfg))
        return build_app(cfg, engine=engines[-1])

    servers: list[TestServer] = [await aiohttp_server(app()) for _ in range(2)]
    urls = [str(s.make_url("")).rstrip("/") for s in servers]
    session = make_session(4, 1.0)
    try:
        transports = [HttpTransport(u, session, 2**20) for u in urls]
        cfg = EdgeConfig(package=package, cloud=tuple(urls), uplink=UplinkConfig(timeout_s=2.0))
        app_ = create_app(cfg, transports=transports)
        from aiohttp.test_utils import TestClient as Client

        client = Client(TestServer(app_))
        await client.start_server()
        try:
            x = np.random.default_rng(5).standard_normal((2, 16)).astype(np.float32)
            want = run(src, {"x": x})
            seen = set()

            async def one() -> None:
                resp = await client.post(
                    "/v1/infer", data=npy(x), headers={"X-Splitinfer-Timings": "1"}
                )
                assert resp.status == 200, await resp.text()
                assert resp.headers["X-Splitinfer-Local"] == "0"
                seen.add(resp.headers["X-Splitinfer-Timings"].split('endpoint;desc="')[1][:25])
                assert_close(outputs(await resp.read()), want)

            await asyncio.gather(*(one() for _ in range(8)))
            await servers[0].close()  # the first endpoint goes away
            await asyncio.gather(*(one() for _ in range(8)))
            status = await (await client.get("/v1/status")).json()
            assert status["endpoints"][urls[1]] == "closed"
            assert sum(served(e.metrics.render()) for e in engines) == 16
        finally:
            await client.close()
    finally:
        await session.close()  # type: ignore[attr-defined]


def served(metrics: bytes) -> int:
    """Inference requests a cloud answered 200, from its /metrics text."""
    return sum(
        int(float(line.split()[-1]))
        for line in metrics.decode().splitlines()
        if line.startswith("splitinfer_requests_total{") and 'status="200"' in line
    )


def test_timing_header_format() -> None:
    from splitinfer.edge.pipeline import Result
    from splitinfer.shared.links import Link

    result = Result(
        {},
        "c3",
        False,
        {"edge": 0.001, "total": 0.0125},
        load=0.25,
        endpoint="http://a:1",
        attempts=2,
        link=Link(5e6, 5e6, 0.02),
    )
    header = timing_header(result, None)  # type: ignore[arg-type]
    assert header == (
        'edge;dur=1.000, total;dur=12.500, cut;desc="c3", local;desc="0", '
        'est-uplink-bps;desc="5e+06", est-rtt;dur=20.000, cloud-load;desc="0.25", '
        'endpoint;desc="http://a:1";attempts=2'
    )


def test_credentials_pick_this_devices_last_unexpired_key(tmp_path: Path) -> None:
    old = generate_credential("cam-01", "k1", not_after=1000.0)
    new = generate_credential("cam-01", "k2")
    path = tmp_path / "creds.toml"
    path.write_text(render_toml(old) + render_toml(new))
    assert load_credential(path, None, now=2000.0).key_id == "k2"
    path.write_text(render_toml(new) + render_toml(old))
    assert load_credential(path, "cam-01", now=500.0).key_id == "k1"
    assert load_credential(path, "cam-01", now=2000.0).key_id == "k2"
    path.write_text(render_toml(old))
    with pytest.raises(ConfigError, match="every key of device 'cam-01' has expired"):
        load_credential(path, None, now=2000.0)
    path.write_text(render_toml(new) + render_toml(generate_credential("gate-7", "k1")))
    with pytest.raises(ConfigError, match="holds 2 devices"):
        load_credential(path, None, now=0.0)
    with pytest.raises(ConfigError, match="no device 'nope'"):
        load_credential(path, "nope", now=0.0)
