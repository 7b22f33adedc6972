"""The status pages at ``GET /`` and the chooser's view in ``GET /v1/status``.

An in-process cloud (its engine and handler, tests/incloud.py) with device
authentication on, and an edge agent's in-process app in front of it; the
pages are rendered from their real status documents.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from incloud import CloudFactory
from statuskit import device_credential, status_package

from splitinfer.cloud.status import render_status as render_cloud
from splitinfer.edge.agent import create_app
from splitinfer.edge.chooser import predict
from splitinfer.edge.config import EdgeConfig
from splitinfer.edge.model import load_model
from splitinfer.edge.status import render_status as render_edge
from splitinfer.shared.auth import CredentialStore
from splitinfer.shared.contract import BytesBody
from splitinfer.shared.links import Link
from splitinfer.shared.statuspage import histogram_quantile

pytestmark = pytest.mark.integration

HOSTILE = "<script>alert('x')</script>&\"m\""
ESCAPED = "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&amp;&quot;m&quot;"


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return status_package(tmp_path_factory.mktemp("status"))


def secrets_of(credentials: Path) -> list[str]:
    """Every spelling of the device key a page could leak."""
    text = credentials.read_text()
    b64 = text.split('secret = "base64:')[1].split('"')[0]
    raw = base64.b64decode(b64)
    return [b64, raw.hex(), base64.urlsafe_b64encode(raw).decode().rstrip("=")]


async def started(
    aiohttp_client: Callable[..., Any], package: Path, cloud_factory: CloudFactory, tmp: Path
) -> tuple[Any, Any, Path]:
    cred, credentials = device_credential(tmp)
    cloud = await cloud_factory(package, credentials=CredentialStore([cred]))
    config = EdgeConfig(package=package, cloud=("http://cloud.invalid:1",), credentials=credentials)
    client = await aiohttp_client(create_app(config, transports=[cloud.transport()]))
    for _ in range(3):
        x = np.ones((1, 16), np.float32)
        resp = await client.post("/v1/infer", data=_npy(x))
        assert resp.status == 200, await resp.text()
    return client, cloud, credentials


def _npy(array: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


async def test_status_shows_each_candidates_prediction_and_why(
    aiohttp_client: Callable[..., Any], package: Path, cloud_factory: CloudFactory, tmp_path: Path
) -> None:
    client, _, _ = await started(aiohttp_client, package, cloud_factory, tmp_path)
    status = await (await client.get("/v1/status")).json()
    choice = status["choice"]
    assert choice["cut"] == status["cut"] == "c2"
    assert choice["rule"] == "start"
    assert choice["reason"] == "the package's default cut (the partitioner's choice)"
    assert choice["adapting"] is True
    assert choice["fallback"] is None
    assert set(choice["candidates"]) == {"c2", "c0", "c3"}
    # the predictions are the chooser's, at the link estimate and measured edge times shown
    est = status["estimate"]
    link = Link(est["uplink_bps"], est["downlink_bps"], est["rtt_ms"] / 1e3)
    costs = {k: rt.cost for k, rt in load_model(package).cuts.items()}
    for cut_id, c in choice["candidates"].items():
        cost = costs[cut_id]
        assert cost is not None
        edge = status["edge_ms"].get(cut_id)
        want = predict(cost, link, 1.0, None if edge is None else edge / 1e3)
        assert c["predicted_ms"] == pytest.approx(want * 1e3, rel=1e-9)
    assert status["latency_ms"]["count"] == 3
    assert status["latency_ms"]["p50"] > 0
    assert status["answered"] == {"cloud": 3, "local": 0}
    assert status["uptime_s"] >= 0
    assert status["version"]


async def test_the_agents_page(
    aiohttp_client: Callable[..., Any], package: Path, cloud_factory: CloudFactory, tmp_path: Path
) -> None:
    client, _, credentials = await started(aiohttp_client, package, cloud_factory, tmp_path)
    resp = await client.get("/")
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/html; charset=utf-8"
    assert "default-src 'none'" in resp.headers["Content-Security-Policy"]
    page = await resp.text()
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page
    assert "edge-agent: statusdemo" in page
    for cut_id in ("c2", "c0", "c3"):
        assert f"<td>{cut_id}</td>" in page
    assert "predicted" in page
    assert "start: the package&#x27;s default cut" in page
    assert "http://in-process" in page  # the endpoint and its breaker
    for secret in secrets_of(credentials):
        assert secret not in page
    status = await (await client.get("/v1/status")).json()
    for secret in secrets_of(credentials):
        assert secret not in str(status)
    # every string is escaped: a hostile model name and reason show as text
    status["model"] = HOSTILE
    status["choice"]["reason"] = HOSTILE
    status["endpoints"] = {HOSTILE: "closed"}
    hostile = render_edge(status)
    assert "<script" not in hostile
    assert hostile.count(ESCAPED) >= 4  # title, heading, reason, endpoint


async def test_the_clouds_page(
    aiohttp_client: Callable[..., Any], package: Path, cloud_factory: CloudFactory, tmp_path: Path
) -> None:
    _, cloud, credentials = await started(aiohttp_client, package, cloud_factory, tmp_path)
    reply = await cloud.handler("GET", "/", {}, BytesBody(b""))
    assert reply.status == 200
    assert reply.header("Content-Type") == "text/html; charset=utf-8"
    page = reply.body.decode()
    assert "<script" not in page
    assert "Model statusdemo" in page
    assert "c2, c0" in page  # the cuts with a cloud segment (the all-edge cut has none)
    assert "authentication on" in page
    assert ">closed<" in page  # the version's breaker
    for secret in secrets_of(credentials):
        assert secret not in page
    doc = cloud.handler.backend.status()
    (version,) = doc["models"][0]["versions"]
    assert version["latency_ms"]["count"] == 3
    assert version["batches"]["count"] == 3
    assert version["batches"]["mean_size"] == 1.0
    assert doc["models"][0]["queue"] == {"queued": 0, "in_flight": 0}
    doc["models"][0]["name"] = HOSTILE
    version["error"] = HOSTILE
    hostile = render_cloud(doc)
    assert "<script" not in hostile
    assert ESCAPED in hostile
    # GET / is the page; other unknown paths stay 404, and the page is GET only
    assert (await cloud.handler("GET", "/nope", {}, BytesBody(b""))).status == 404
    assert (await cloud.handler("POST", "/", {}, BytesBody(b""))).status == 405


def test_quantiles_from_histogram_buckets() -> None:
    buckets = [(0.01, 0.0), (0.1, 50.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.055)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.982)
    beyond = [(0.1, 1.0), (float("inf"), 10.0)]
    assert histogram_quantile(0.99, beyond) == 0.1  # past the last bound: that bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert histogram_quantile(0.5, []) is None
