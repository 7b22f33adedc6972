"""The HTTP service on loopback: the contract of docs/http-api.md, and the cloud-service CLI."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestClient
from cloudkit import DEVICE, OTHER, chain_repo, cnn, config, credentials_file, frame, write
from ortutil import run

from splitinfer.cloud.cli import build_parser, config_from_args, main
from splitinfer.cloud.config import BatchingConfig, OverloadConfig, ServiceConfig
from splitinfer.cloud.engine import Engine
from splitinfer.cloud.handler import NO_AUTH_WARNING
from splitinfer.cloud.server import build_app
from splitinfer.shared.auth import Credential, CredentialStore, sign
from splitinfer.shared.contract import HEADER_VERSION
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.frame import FRAME_TYPE, Limits, decode_response
from splitinfer.shared.manifest import Manifest, load_manifest
from splitinfer.sim.daemon import start

pytestmark = pytest.mark.integration

Client = Callable[..., Awaitable[TestClient[Any, Any]]]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("built") / "repo"
    chain_repo(repo, versions=("1", "2"))
    write(cnn(), repo, "cnn", "1", cuts=("c2", "none"))
    return repo


@pytest.fixture
def repo(built: Path, tmp_path: Path) -> Path:
    out = tmp_path / "repo"
    shutil.copytree(built, out)
    return out


@pytest.fixture
def store() -> CredentialStore:
    return CredentialStore([DEVICE, OTHER])


def chain_manifest(repo: Path, version: str = "2") -> Manifest:
    return load_manifest(repo / "chain" / version)


def vec(seed: int, rows: int = 1, width: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)


async def post(
    client: TestClient[Any, Any],
    path: str,
    body: bytes,
    *,
    cred: Credential | None = DEVICE,
    content_type: str = FRAME_TYPE,
    headers: dict[str, str] | None = None,
    nonce: str | None = None,
) -> aiohttp.ClientResponse:
    h = sign("POST", path, body, cred, time.time(), nonce=nonce) if cred else {}
    h["Content-Type"] = content_type
    h.update(headers or {})
    return await client.post(path, data=body, headers=h)


async def error_of(resp: aiohttp.ClientResponse, status: int) -> str:
    assert resp.status == status, await resp.text()
    data = await resp.json()
    assert data["status"] == status
    assert "\n" not in data["error"]
    return str(data["error"])


def sample(text: str, name: str, **labels: str) -> float:
    """One sample's value from the Prometheus text format (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


INFER = "/v1/models/chain/infer"


async def test_a_signed_request_gets_its_result_frame(
    aiohttp_client: Client, repo: Path, store: CredentialStore
) -> None:
    client = await aiohttp_client(build_app(config(repo, credentials="x"), credentials=store))
    m = chain_manifest(repo)
    a = vec(1, rows=3)
    resp = await post(client, INFER, frame(m, {"x": a}))
    assert resp.status == 200, await resp.text()
    assert resp.content_type == FRAME_TYPE
    assert resp.headers[HEADER_VERSION] == "2"
    timing = resp.headers["Server-Timing"]
    assert timing.startswith("cloud;dur=")
    assert 0 < float(timing.split("=")[1]) < 10_000
    got = decode_response(await resp.read(), m, Limits())
    assert got.model_version == "2"
    assert 0.0 <= got.load <= 1.0
    want = run(repo / "chain" / "2" / "cloud.onnx", {"x": a})["y"]
    np.testing.assert_allclose(got.tensors[0].array, want, rtol=1e-6)


async def test_bad_input_of_every_kind_gets_its_status_and_is_counted(
    aiohttp_client: Client, repo: Path, store: CredentialStore
) -> None:
    cfg = config(repo, credentials="x", max_body_bytes=4096)
    client = await aiohttp_client(build_app(cfg, credentials=store))
    m = chain_manifest(repo)
    good = frame(m, {"x": vec(0)})
    cases: list[tuple[int, Awaitable[aiohttp.ClientResponse], str]] = [
        (415, post(client, INFER, good, content_type="application/json"), "Content-Type"),
        (413, post(client, INFER, b"\0" * 5000), "over the limit of 4096"),
        (400, post(client, INFER, b"SPLT garbage"), "frame"),
        (400, post(client, INFER, frame(m, {"x": vec(0, width=5)})), "dim 1 is 5"),
        (400, post(client, INFER, frame(m, {"x": vec(0)}, model="cnn")), "URL's model"),
        (400, post(client, INFER, good, headers={"X-Splitinfer-Priority": "high"}), "priority"),
        (404, post(client, "/v1/models/nope/infer", good), "'nope' is not served"),
        (404, post(client, INFER, frame(m, {"x": vec(0)}, version="7")), "no version '7'"),
        (401, post(client, INFER, good, cred=None), "X-Splitinfer-Device is missing"),
        (401, post(client, INFER, good, cred=Credential("cam-01", "k1", b"x" * 32)), "signature"),
        (401, post(client, INFER, good, cred=Credential("cam-99", "k1", b"x" * 32)), "unknown"),
    ]
    for status, call, words in cases:
        assert words in await error_of(await call, status)

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(8):
            yield b"\0" * 1024  # no Content-Length: refused once the limit is passed

    signed = sign("POST", INFER, b"\0" * 8192, DEVICE, time.time())
    unsized = await client.post(
        INFER, data=chunks(), headers={"Content-Type": FRAME_TYPE, **signed}
    )
    assert "over the limit of 4096" in await error_of(unsized, 413)
    # a replayed request: same nonce, same signature
    nonce = "n" * 32
    assert (await post(client, INFER, good, nonce=nonce)).status == 200
    assert "replay" in await error_of(await post(client, INFER, good, nonce=nonce), 401)
    # and the service keeps serving everyone else
    assert (await post(client, INFER, good, cred=OTHER)).status == 200

    text = await (await client.get("/metrics")).text()
    for status, count in (("400", 4), ("401", 4), ("404", 1), ("413", 2), ("415", 1)):
        assert sample(text, "splitinfer_requests_total", model="chain", status=status) == count
    assert sample(text, "splitinfer_requests_total", model="_unknown", status="404") == 1
    assert sample(text, "splitinfer_requests_total", model="chain", status="200") == 2
    assert sample(text, "splitinfer_auth_failures_total", kind="replay") == 1
    assert sample(text, "splitinfer_auth_failures_total", kind="missing") == 1
    assert sample(text, "splitinfer_rejections_total", reason="ProtocolError") == 4


async def test_rate_limits_answer_429_with_retry_after(
    aiohttp_client: Client, repo: Path, store: CredentialStore
) -> None:
    cfg = config(repo, credentials="x", overload=OverloadConfig(device_rate=0.5, device_burst=2))
    client = await aiohttp_client(build_app(cfg, credentials=store))
    good = frame(chain_manifest(repo), {"x": vec(0)})
    for _ in range(2):
        assert (await post(client, INFER, good)).status == 200
    resp = await post(client, INFER, good)
    assert "rate limit" in await error_of(resp, 429)
    assert resp.headers["Retry-After"] == "2"
    assert (await post(client, INFER, good, cred=OTHER)).status == 200  # per device


async def test_queue_limits_and_deadlines_answer_503_with_retry_after(
    aiohttp_client: Client, repo: Path
) -> None:
    import threading

    from splitinfer.cloud.runtime import Runtime

    gate = threading.Event()
    gate.set()

    class Gated(Runtime):
        def run(self, feeds: Any) -> dict[str, np.ndarray]:
            gate.wait(timeout=30)
            return super().run(feeds)

    cfg = config(repo, batching=BatchingConfig(max_batch_size=2, max_queue_size=2))
    engine = Engine(cfg, runtime_factory=Gated, inline_max_s=0)  # the gate holds a worker
    client = await aiohttp_client(build_app(cfg, engine=engine))
    m = chain_manifest(repo)
    past = int(time.time() * 1000) - 1
    resp = await post(client, INFER, frame(m, {"x": vec(0)}, deadline_ms=past), cred=None)
    assert "deadline" in await error_of(resp, 503)
    assert resp.headers["Retry-After"] == "1"
    gate.clear()
    held = [
        asyncio.create_task(post(client, INFER, frame(m, {"x": vec(i)}), cred=None))
        for i in range(3)  # one runs, two fill the queue
    ]
    deadline = time.monotonic() + 10
    metrics_text = ""
    while sample(metrics_text, "splitinfer_queued_samples", model="chain") < 2:
        assert time.monotonic() < deadline
        metrics_text = await (await client.get("/metrics")).text()
    resp = await post(client, INFER, frame(m, {"x": vec(9)}), cred=None)
    assert "queue full" in await error_of(resp, 503)
    assert int(resp.headers["Retry-After"]) >= 1
    gate.set()
    assert [r.status for r in await asyncio.gather(*held)] == [200, 200, 200]


async def test_health_readiness_models_and_metrics(aiohttp_client: Client, repo: Path) -> None:
    shutil.copytree(repo / "chain" / "2", repo / "chain" / "3")
    (repo / "chain" / "3" / "cloud.onnx").write_bytes(b"torn")
    client = await aiohttp_client(build_app(config(repo)))
    assert await (await client.get("/healthz")).text() == "ok"
    ready = await client.get("/readyz")
    assert ready.status == 200
    body = await ready.json()
    assert body["ready"] is True
    assert body["warning"] == NO_AUTH_WARNING
    assert body["models"]["cnn"]["ready"] is True
    models = {m["name"]: m for m in (await (await client.get("/v1/models")).json())["models"]}
    versions = {v["version"]: v for v in models["chain"]["versions"]}
    assert versions["2"]["state"] == "serving"
    assert versions["2"]["cuts"] == ["c0", "c2"]
    assert versions["3"] == {
        "version": "3",
        "state": "incomplete",
        "error": "cut c0: cloud.onnx does not match its sha256",
    }
    assert models["chain"]["batching"]["max_batch_size"] == 32
    assert models["chain"]["policy"]["versions"] == "latest"
    resp = await client.get("/metrics")
    assert resp.content_type == "text/plain"
    text = await resp.text()
    for name in (
        "splitinfer_model_loads_total",
        "splitinfer_serving_versions",
        "splitinfer_requests_total",
        "splitinfer_batch_size",
    ):
        assert name in text
    assert sample(text, "splitinfer_model_loads_total", model="cnn", result="success") == 1


async def test_readyz_is_503_until_every_configured_model_serves(
    aiohttp_client: Client, repo: Path
) -> None:
    from cloudkit import policy

    client = await aiohttp_client(build_app(config(repo, models={"absent": policy()})))
    resp = await client.get("/readyz")
    assert resp.status == 503
    assert (await resp.json())["models"]["absent"]["ready"] is False


async def test_the_json_endpoint_and_the_signed_reload(
    aiohttp_client: Client, repo: Path, store: CredentialStore
) -> None:
    client = await aiohttp_client(build_app(config(repo, credentials="x"), credentials=store))
    a = vec(2, rows=2)
    body = json.dumps({"cut_id": "c0", "inputs": {"x": a.tolist()}}).encode()
    resp = await post(client, "/v1/models/chain/infer.json", body, content_type="application/json")
    assert resp.status == 200, await resp.text()
    data = await resp.json()
    want = run(repo / "chain" / "2" / "cloud.onnx", {"x": a})["y"]
    np.testing.assert_allclose(np.array(data["outputs"]["y"], np.float32), want, rtol=1e-6)
    assert data["model_version"] == "2"
    bad = json.dumps({"inputs": {"x": [[1, 2]]}}).encode()
    resp = await post(client, "/v1/models/chain/infer.json", bad, content_type="application/json")
    assert "dim 1 is 2" in await error_of(resp, 400)

    shutil.copytree(repo / "chain" / "2", repo / "chain" / "5")
    assert (await post(client, "/v1/admin/reload", b"", cred=None)).status == 401
    resp = await post(client, "/v1/admin/reload", b"", content_type="application/json")
    assert resp.status == 200
    report = await resp.json()
    assert report["loaded"] == [{"model": "chain", "version": "5"}]
    assert report["retired"] == [{"model": "chain", "version": "2"}]


def test_without_credentials_the_service_refuses_to_start(repo: Path) -> None:
    with pytest.raises(ConfigError, match="--no-auth for development"):
        build_app(config(repo, no_auth=False))


# -- acceptance -------------------------------------------------------------------------


async def test_batching_under_concurrency_returns_each_caller_its_own_cnn_result(
    aiohttp_client: Client, repo: Path, store: CredentialStore
) -> None:
    client = await aiohttp_client(build_app(config(repo, credentials="x"), credentials=store))
    m = load_manifest(repo / "cnn" / "1")
    cut = m.find_cut("c2")
    assert cut is not None
    assert cut.cloud is not None
    (spec,) = cut.tensors
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((1, 8, 8, 8)).astype(np.float32) for _ in range(64)]

    async def one(a: np.ndarray) -> np.ndarray:
        resp = await post(client, "/v1/models/cnn/infer", frame(m, {spec.name: a}, cut="c2"))
        assert resp.status == 200, await resp.text()
        return decode_response(await resp.read(), m, Limits()).tensors[0].array

    got = await asyncio.gather(*(one(a) for a in inputs))
    segment = repo / "cnn" / "1" / cut.cloud.file
    for a, g in zip(inputs, got, strict=True):
        np.testing.assert_allclose(g, run(segment, {spec.name: a})["y"], rtol=1e-5, atol=1e-6)
    text = await (await client.get("/metrics")).text()
    executions = sample(text, "splitinfer_executions_total", model="cnn")
    inferences = sample(text, "splitinfer_inferences_total", model="cnn")
    assert inferences == 64
    assert executions < 64, "concurrent requests should have shared batches"


async def test_a_version_swap_under_continuous_http_load_fails_nothing(
    aiohttp_client: Client, repo: Path, store: CredentialStore
) -> None:
    (repo / "chain" / "2").rename(repo / "chain" / ".2.staged")
    client = await aiohttp_client(build_app(config(repo, credentials="x"), credentials=store))
    m = chain_manifest(repo, "1")
    stop = asyncio.Event()
    statuses: list[int] = []
    versions: list[str] = []

    async def device(seed: int) -> None:
        while not stop.is_set():
            resp = await post(client, INFER, frame(m, {"x": vec(seed)}))
            statuses.append(resp.status)
            versions.append(resp.headers.get(HEADER_VERSION, ""))
            await resp.read()

    devices = [asyncio.create_task(device(i)) for i in range(6)]
    while len(statuses) < 40:
        await asyncio.sleep(0.005)
    (repo / "chain" / ".2.staged").rename(repo / "chain" / "2")
    resp = await post(client, "/v1/admin/reload", b"", content_type="application/json")
    assert (await resp.json())["loaded"] == [{"model": "chain", "version": "2"}]
    count = len(statuses)
    while len(statuses) < count + 40:
        await asyncio.sleep(0.005)
    stop.set()
    await asyncio.gather(*devices)
    assert set(statuses) == {200}
    assert versions[0] == "1"
    assert versions[-1] == "2"


# -- the daemon ---------------------------------------------------------------------------


def test_cloud_service_runs_as_a_process_and_stops_on_sigterm(repo: Path, tmp_path: Path) -> None:
    creds = credentials_file(tmp_path / "credentials.toml")
    args = ["--repository", repo, "--listen", "127.0.0.1:0", "--credentials", creds]
    cloud = start("cloud-service", [*args, "--log-level", "warning", "--accept-raw"])
    try:
        assert any(
            ln.startswith("cloud-service: listening on http://127.0.0.1:") for ln in cloud.lines
        )
        asyncio.run(_talk_to(cloud.url, chain_manifest(repo)))
    finally:
        code = cloud.stop()  # SIGTERM
    assert code == 0, "".join(cloud.lines)


async def _talk_to(url: str, m: Manifest) -> None:
    body = frame(m, {"x": vec(0)})
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/readyz") as resp:
            assert resp.status == 200
            assert "warning" not in await resp.json()
        headers = sign("POST", INFER, body, DEVICE, time.time())
        headers["Content-Type"] = FRAME_TYPE
        async with session.post(f"{url}{INFER}", data=body, headers=headers) as resp:
            assert resp.status == 200
            assert decode_response(await resp.read(), m, Limits()).model_version == "2"


def test_options_come_from_file_then_set_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "service.toml"
    path.write_text(
        """
repository = "/srv/models"
listen = "0.0.0.0:9000"
no_auth = true
[batching]
max_batch_size = 16
max_queue_delay = "5ms"
[runtime]
providers = ["cuda", "cpu"]
[models.resnet]
versions = ["1", "3"]
weights = { "1" = 90, "3" = 10 }
sticky = true
[models.resnet.batching]
max_batch_size = 8
"""
    )
    args = build_parser().parse_args(
        [
            "--config",
            str(path),
            "--max-batch-size",
            "64",
            "--set",
            "models.resnet.canary_percent=5",
            "--set",
            "batching.max_batch_size=8",
            "--providers",
            "tensorrt,cpu",
            "--no-batching",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.repository == "/srv/models"
    assert cfg.host_port() == ("0.0.0.0", 9000)
    assert cfg.batching.max_batch_size == 64  # the flag beats --set and the file
    assert cfg.batching.max_queue_delay_ms == 5.0
    assert cfg.batching.enabled is False
    assert cfg.runtime.providers == ("tensorrt", "cpu")
    resnet = cfg.policy("resnet")
    assert (resnet.versions, resnet.version_list, resnet.sticky) == ("list", ("1", "3"), True)
    assert resnet.weights == {"1": 90, "3": 10}
    assert resnet.canary_percent == 5.0
    assert cfg.batching_for("resnet").max_batch_size == 8
    assert cfg.batching_for("other").max_batch_size == 64


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "repository: missing"),
        (["--repository", "r", "--listen", "nowhere"], "listen='nowhere'"),
        (["--repository", "r", "--max-batch-size", "0"], "max_batch_size=0"),
        (["--repository", "r", "--max-batch-size", "two"], "invalid int value"),
        (["--repository", "r", "--providers", "tpu"], "providers=['tpu']"),
        (["--repository", "r", "--set", "batching.nope=1"], "nope: unknown option"),
        (["--repository", "r", "--set", "models.m.versions=7"], "versions"),
        (["--repository", "r", "--tls-cert", "c.pem"], "tls_cert and tls_key go together"),
        (["--repository", "r", "--config", "/no/such.toml"], "cannot read"),
    ],
)
def test_bad_options_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("cloud-service: error: ")
    assert message in err
    assert err.count("\n") == 1


def test_print_config_shows_the_effective_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--repository", "r", "--no-auth", "--print-config"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["repository"] == "r"
    assert data["no_auth"] is True
    assert data["batching"]["max_batch_size"] == 32
    assert ServiceConfig(repository="r").batching.max_batch_size == 32


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_serve_speaks_https_with_the_given_certificate(repo: Path, tmp_path: Path) -> None:
    from splitinfer.cloud.server import serve
    from splitinfer.shared.auth import client_ssl_context

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    cfg = config(repo, tls_cert=str(cert), tls_key=str(key))
    stop = asyncio.Event()
    urls: list[str] = []
    server = asyncio.create_task(serve(cfg, stop, started=urls.append))
    try:
        while not urls:
            assert not server.done(), server.exception()
            await asyncio.sleep(0.01)
        assert urls[0].startswith("https://127.0.0.1:")
        port = urls[0].rsplit(":", 1)[1]
        async with aiohttp.ClientSession() as http:
            ctx = client_ssl_context(cert)
            async with http.get(f"https://localhost:{port}/healthz", ssl=ctx) as resp:
                assert await resp.text() == "ok"
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await http.get(f"https://localhost:{port}/healthz", ssl=client_ssl_context())
    finally:
        stop.set()
        await server
