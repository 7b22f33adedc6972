"""Hostile and broken clients against the edge agent's local API (issue 17)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import onnx
import pytest
from graphs import chain
from hostile import closed_within, one_past_the_cap, opened, read_response, request_head, served
from incloud import start_cloud

from splitinfer.edge.agent import create_app
from splitinfer.edge.cli import serve
from splitinfer.edge.config import EdgeConfig, QueueConfig
from splitinfer.partitioner.pipeline import PackageExtras, artifacts_for, prepare, write_package
from splitinfer.shared.manifest import CodecSpec

pytestmark = pytest.mark.integration

NPY = {"Content-Type": "application/x-npy"}
NPZ = {"Content-Type": "application/x-npz"}


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("hostile-edge")
    src = tmp / "m.onnx"
    onnx.save(chain(6, width=16), str(src))
    prepared = prepare(src)
    art = artifacts_for(prepared, prepared.space.plans()[2])
    art.codec = CodecSpec("raw")
    out = tmp / "pkg"
    write_package(prepared, [art], out, extras=PackageExtras(fallback=prepared.optimized))
    return out


@contextlib.asynccontextmanager
async def running(package: Path, **queue: Any) -> AsyncIterator[str]:
    cfg = EdgeConfig(
        package=package,
        cloud=("http://cloud.invalid:1",),
        listen="127.0.0.1:0",
        queue=QueueConfig(**queue),
    )
    cloud = await start_cloud(package)
    app = create_app(cfg, transports=[cloud.transport()], warm_up=False)
    try:
        async with served(lambda stop, started: serve(cfg, stop, started=started, app=app)) as url:
            yield url
    finally:
        await cloud.stop()


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


async def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/infer", data=body, headers=headers) as resp,
    ):
        raw = await resp.read()
        if resp.content_type == "application/json":
            return resp.status, json.loads(raw)
        return resp.status, {}


GOOD = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)


# -- 5. nothing is allocated from what a header claims ---------------------------------


async def test_an_npy_header_claiming_a_huge_shape_is_400_before_allocation(
    package: Path,
) -> None:
    buf = io.BytesIO()
    header = {"descr": "<f4", "fortran_order": False, "shape": (2**28, 1, 8, 8)}
    np.lib.format.write_array_header_1_0(buf, header)
    lie = buf.getvalue() + bytes(256)  # 384 bytes that claim 64 GiB
    assert len(lie) == 384
    async with running(package) as url:
        status, doc = await post(url, lie, NPY)  # before: 500 MemoryError with a traceback
        assert status == 400, doc
        assert "268435456" in doc["error"]
        assert "bytes" in doc["error"]
        assert (await post(url, npy(GOOD), NPY))[0] == 200


def _bomb(inflated: int) -> bytes:
    """An .npz whose one member inflates to ``inflated`` bytes of zeros."""
    buf = io.BytesIO()
    member = npy(np.zeros(inflated // 4, np.float32))
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        z.writestr("x.npy", member)
    return buf.getvalue()


async def test_an_npz_member_inflating_past_the_limit_is_refused_uninflated(
    package: Path,
) -> None:
    bomb = _bomb(32 * 2**20)
    assert len(bomb) < 2**20 // 4
    async with running(package, max_body_bytes=2**20) as url:
        status, doc = await post(url, bomb, NPZ)
        assert status == 400
        assert "inflate to" in doc["error"]
        assert "over the limit" in doc["error"]


def test_an_npz_that_understates_a_member_is_never_inflated_past_it(package: Path) -> None:
    from splitinfer.edge.payload import BadInput, parse_body
    from splitinfer.shared.manifest import load_manifest

    bomb = bytearray(_bomb(8 * 2**20))
    # rewrite the member's stated size (local header and central directory) to 1 KiB
    real = (8 * 2**20 // 4) * 4 + 128
    for offset in range(len(bomb) - 4):
        if int.from_bytes(bomb[offset : offset + 4], "little") == real:
            bomb[offset : offset + 4] = (1024).to_bytes(4, "little")
    assert bytes(bomb) != _bomb(8 * 2**20)
    with pytest.raises(BadInput, match="npz"):
        parse_body("npz", bytes(bomb), load_manifest(package), max_bytes=2**20)


async def test_bodies_are_decoded_off_the_event_loop(
    package: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large .npz or JSON takes a while to decode: never on the loop, where it stalls all."""
    import threading

    import splitinfer.edge.agent as agent_module

    threads: list[str] = []
    real = agent_module.parse_body

    def spy(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(agent_module, "parse_body", spy)
    body = json.dumps({"inputs": {"x": GOOD.tolist()}}).encode()
    async with running(package) as url:
        assert (await post(url, body, {"Content-Type": "application/json"}))[0] == 200
        assert (await post(url, npy(GOOD), NPY))[0] == 200
    assert len(threads) == 2
    assert threading.main_thread().name not in threads


# -- 6. the smaller ones at the edge ------------------------------------------------------


async def test_a_huge_timeout_header_is_400_at_the_edge(package: Path) -> None:
    async with running(package) as url:
        status, doc = await post(url, npy(GOOD), {**NPY, "X-Splitinfer-Timeout-Ms": "1e20"})
        assert status == 400
        assert "X-Splitinfer-Timeout-Ms" in doc["error"]


async def test_nan_input_is_refused_with_a_message_about_the_input(package: Path) -> None:
    bad = GOOD.copy()
    bad[0, 3] = np.nan
    async with running(package) as url:
        status, doc = await post(url, npy(bad), NPY)
        assert status == 400
        assert "NaN or infinity" in doc["error"]
        assert "calibration" not in doc["error"]


# -- 2 and 3 at the edge: aborted, slow and idle clients --------------------------------

TIMEOUTS = {
    "header_timeout_s": 0.3,
    "keepalive_timeout_s": 0.6,
    "body_timeout_s": 0.4,
    "max_connections": 3,
}


async def test_the_local_api_closes_idle_and_slow_sockets_and_caps_connections(
    package: Path,
) -> None:
    async with running(package, **TIMEOUTS) as url:
        async with opened(url) as (reader, _):  # idle: closed after the header timeout
            assert await closed_within(reader, 2.0)
        body = npy(GOOD)
        async with opened(url) as (reader, writer):  # a slow body: 408
            writer.write(request_head("/v1/infer", NPY, len(body)) + body[:5])
            await writer.drain()
            async with asyncio.timeout(3):
                status, _, text = await read_response(reader)
            assert status == 408
            assert b"(body_timeout)" in text
        status, _, _, closed = await one_past_the_cap(url, 3)
        assert status == 503
        assert closed


async def test_an_aborted_upload_at_the_edge_is_no_500(
    package: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    body = npy(np.zeros((64, 16), np.float32))
    async with running(package) as url:
        async with opened(url) as (_, writer):
            writer.write(request_head("/v1/infer", NPY, len(body)) + body[:100])
            await writer.drain()
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
            text = await resp.text()
        assert "splitinfer_edge_aborted_uploads_total 1.0" in text
        assert 'code="500"' not in text
        assert 'status="500"' not in text
    assert not [r for r in caplog.records if r.exc_info]
