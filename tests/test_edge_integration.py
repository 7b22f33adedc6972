"""The edge agent against the real cloud service on loopback (as subprocesses).

The issue's acceptance: results equal the unsplit model within the package's
declared error (raw codec: 1e-5 relative, as every fp32 segment pair); killing
one of two cloud endpoints mid-run loses no request; with the cloud down and a
fallback model every request is answered locally and marked so; bad local
input gets a 400 with a message. The last test runs ``edge-agent`` itself.
"""

from __future__ import annotations

import asyncio
import io
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import numpy as np
import onnx
import pytest
from aiohttp.test_utils import TestClient, TestServer
from daemons import daemon
from graphs import chain
from ortutil import assert_close, run

from splitinfer.edge.agent import create_app
from splitinfer.edge.config import EdgeConfig, UplinkConfig
from splitinfer.edge.wire import batch_params, quant_axis
from splitinfer.partitioner.pipeline import PackageExtras, artifacts_for, prepare, write_package
from splitinfer.shared.auth import generate_credential, render_toml
from splitinfer.shared.codecs import dequantize, quantize
from splitinfer.shared.manifest import CodecSpec
from splitinfer.shared.package import open_package
from splitinfer.sim.daemon import Daemon, command

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _package(
    tmp: Path, name: str, cuts: tuple[int, ...], fallback: bool, codec: str = "raw"
) -> tuple[Path, Path]:
    src = tmp / f"{name}.onnx"
    onnx.save(chain(6, width=16), str(src))
    prepared = prepare(src)
    plans = prepared.space.plans()
    arts = [artifacts_for(prepared, plans[i]) for i in cuts]
    for art in arts:
        art.codec = CodecSpec(codec)
    extras = PackageExtras(fallback=prepared.optimized if fallback else None)
    out = tmp / "repo" / name / "1"
    write_package(prepared, arts, out, extras=extras)
    return src, out


class World:
    """Two packages in one cloud repository, and this device's credential file."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        # m: split, all-cloud and all-edge cuts and a fallback; k: nothing runs without a cloud
        self.src, self.pkg = _package(tmp, "m", (2, 0, -1), fallback=True)
        _, self.strict = _package(tmp, "k", (2, 0), fallback=False)
        # q: the split travels as int8 + zstd
        _, self.lossy = _package(tmp, "q", (2,), fallback=False, codec="int8+zstd")
        self.repo = tmp / "repo"
        self.creds = tmp / "credentials.toml"
        self.creds.write_text(render_toml(generate_credential("cam-01", "k1")))
        self.creds.chmod(0o600)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("integration"))


def cloud_service(world: World) -> Daemon:
    return daemon(
        "cloud-service",
        "--repository", world.repo,
        "--listen", "127.0.0.1:0",
        "--credentials", world.creds,
    )  # fmt: skip


@pytest.fixture(scope="module")
def cloud(world: World) -> Iterator[Daemon]:
    proc = cloud_service(world)
    yield proc
    proc.stop()


@pytest.fixture
async def make_agent() -> AsyncIterator[object]:
    clients: list[TestClient] = []  # type: ignore[type-arg]

    async def start(config: EdgeConfig) -> TestClient:  # type: ignore[type-arg]
        client = TestClient(TestServer(create_app(config)))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for c in clients:
        await c.close()


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def outputs(body: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(body)) as z:
        return {k: z[k] for k in z.files}


async def test_every_cut_equals_the_unsplit_model(
    world: World, cloud: Daemon, make_agent: object
) -> None:
    config = EdgeConfig(package=world.pkg, cloud=(cloud.url,), credentials=world.creds)
    client = await make_agent(config)  # type: ignore[operator]
    for cut in ("c2", "c0", "c3"):
        for batch in (1, 4):
            x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
            resp = await client.post("/v1/infer", data=npy(x), headers={"X-Splitinfer-Cut": cut})
            assert resp.status == 200, await resp.text()
            assert resp.headers["X-Splitinfer-Local"] == ("1" if cut == "c3" else "0")
            if cut != "c3":
                assert resp.headers["X-Splitinfer-Model-Version"] == "1"
            assert_close(outputs(await resp.read()), run(world.src, {"x": x}))


async def test_int8_zstd_equals_the_codec_round_trip(
    world: World, cloud: Daemon, make_agent: object
) -> None:
    """A lossy codec's declared error: the cloud sees the int8 round trip, nothing else."""
    config = EdgeConfig(package=world.lossy, cloud=(cloud.url,), credentials=world.creds)
    client = await make_agent(config)  # type: ignore[operator]
    package = open_package(world.lossy)
    cut = package.manifest.cut
    assert cut.edge is not None
    assert cut.cloud is not None
    x = np.random.default_rng(6).standard_normal((4, 16)).astype(np.float32)
    mid = run(package.file(cut.edge), {"x": x})
    (name,) = mid
    params = batch_params(mid[name], quant_axis(mid[name]))
    mid[name] = dequantize(quantize(mid[name], params), params)
    resp = await client.post("/v1/infer", data=npy(x))
    assert resp.status == 200, await resp.text()
    got = outputs(await resp.read())
    assert_close(got, run(package.file(cut.cloud), mid))
    exact = run(world.src, {"x": x})["y"]
    assert not np.array_equal(got["y"], exact)  # int8 did change something


async def test_bad_input_gets_400_through_the_whole_stack(
    world: World, cloud: Daemon, make_agent: object
) -> None:
    config = EdgeConfig(package=world.pkg, cloud=(cloud.url,), credentials=world.creds)
    client = await make_agent(config)  # type: ignore[operator]
    resp = await client.post("/v1/infer", data=npy(np.zeros((2, 15), np.float32)))
    assert resp.status == 400
    doc = await resp.json()
    assert doc == {
        "error": "input 'x': dimension 1 is 15, the model takes [N, 16]",
        "status": 400,
    }


async def test_a_wrong_key_is_refused_by_the_cloud(
    world: World, cloud: Daemon, make_agent: object, tmp_path: Path
) -> None:
    stranger = tmp_path / "other.toml"
    stranger.write_text(render_toml(generate_credential("cam-01", "k1")))
    config = EdgeConfig(package=world.strict, cloud=(cloud.url,), credentials=stranger)
    client = await make_agent(config)  # type: ignore[operator]
    resp = await client.post("/v1/infer", data=npy(np.zeros((1, 16), np.float32)))
    assert resp.status == 502
    assert "401" in (await resp.json())["error"]


async def test_killing_one_of_two_endpoints_loses_no_request(
    world: World, make_agent: object
) -> None:
    first, second = cloud_service(world), cloud_service(world)
    try:
        config = EdgeConfig(
            package=world.strict,  # no local model: a lost request would be an error
            cloud=(first.url, second.url),
            credentials=world.creds,
            uplink=UplinkConfig(timeout_s=5.0, max_attempts=3, health_interval_s=0.2),
        )
        client = await make_agent(config)  # type: ignore[operator]
        x = np.random.default_rng(9).standard_normal((2, 16)).astype(np.float32)
        want = run(world.src, {"x": x})
        answered: list[str] = []
        killed = asyncio.Event()

        async def worker() -> None:
            for _ in range(25):
                resp = await client.post(
                    "/v1/infer", data=npy(x), headers={"X-Splitinfer-Timings": "1"}
                )
                assert resp.status == 200, await resp.text()
                assert resp.headers["X-Splitinfer-Local"] == "0"
                assert_close(outputs(await resp.read()), want)
                timing = resp.headers["X-Splitinfer-Timings"]
                answered.append(timing.split('endpoint;desc="')[1].split('"')[0])
                if len(answered) == 20 and not killed.is_set():
                    killed.set()
                    first.kill()  # SIGKILL mid-run: connections drop, requests in flight fail

        await asyncio.gather(*(worker() for _ in range(4)))
        assert len(answered) == 100
        assert first.url in answered[:20]  # the first endpoint served before it died
        assert set(answered[-40:]) == {second.url}
        status = await (await client.get("/v1/status")).json()
        assert status["endpoints"][first.url] != "closed"
        metrics = await (await client.get("/metrics")).text()
        failed = [
            line
            for line in metrics.splitlines()
            if line.startswith("splitinfer_edge_attempts_total")
            and f'endpoint="{first.url}"' in line
            and 'outcome="ok"' not in line
        ]
        assert failed
        assert float(failed[0].split()[-1]) >= 1
    finally:
        first.stop()
        second.stop()


async def test_cloud_down_every_request_is_answered_locally(
    world: World, make_agent: object
) -> None:
    gone = cloud_service(world)
    url = gone.url
    gone.kill()  # a port nobody listens on any more
    config = EdgeConfig(
        package=world.pkg, cloud=(url,), credentials=world.creds,
        uplink=UplinkConfig(timeout_s=1.0),
    )  # fmt: skip
    client = await make_agent(config)  # type: ignore[operator]
    x = np.random.default_rng(4).standard_normal((3, 16)).astype(np.float32)
    want = run(world.src, {"x": x})
    for _ in range(10):
        resp = await client.post("/v1/infer", data=npy(x))
        assert resp.status == 200
        assert resp.headers["X-Splitinfer-Local"] == "1"
        assert resp.headers["X-Splitinfer-Local-Reason"] == "cloud unavailable"
        assert_close(outputs(await resp.read()), want)
    # the same without a local model: a clear error, fast
    strict = EdgeConfig(package=world.strict, cloud=(url,), credentials=world.creds)
    client = await make_agent(strict)  # type: ignore[operator]
    resp = await client.post("/v1/infer", data=npy(x))
    assert resp.status == 503
    assert "no local model" in (await resp.json())["error"]


def test_the_edge_agent_command(world: World, cloud: Daemon) -> None:
    agent = daemon(
        "edge-agent",
        "--package", world.pkg,
        "--cloud", cloud.url,
        "--listen", "127.0.0.1:0",
        "--credentials", world.creds,
        "--model", "m:1",
        "--queue-max-concurrency", "2",
        "--adapt-hysteresis", "0.2",
    )  # fmt: skip
    try:
        x = np.random.default_rng(8).standard_normal((2, 16)).astype(np.float32)

        async def ask() -> tuple[int, dict[str, str], bytes]:
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{agent.url}/v1/infer", data=npy(x)) as resp,
            ):
                return resp.status, dict(resp.headers), await resp.read()

        status, headers, body = asyncio.run(ask())
        assert status == 200, body
        assert headers["X-Splitinfer-Local"] == "0"
        assert headers["X-Splitinfer-Model-Version"] == "1"
        assert_close(outputs(body), run(world.src, {"x": x}))
    finally:
        code = agent.stop()
    assert code == 0, "".join(agent.lines)
    assert any("stopping" in line for line in agent.lines)


def test_bad_flags_are_one_line_errors(world: World) -> None:
    done = subprocess.run(
        [*command("edge-agent"), "--package", str(world.pkg), "--cloud", "ftp://x"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "edge-agent: error: cloud URL 'ftp://x' is not http(s)://HOST[:PORT]; "
        "e.g. https://cloud.example:8443"
    ]
