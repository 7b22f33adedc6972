"""The one request handler (cloud/handler.py) over its two backends, with no sockets.

The engine backend is what ``cloud-service`` serves; the replica backend is the
Ray Serve ingress's, here with its replicas in process (``open_version``, the
replicas' own loader), so that what the ingress adds (routing, the replica
hop) is tested without Ray: both answer the same requests the same way, the
signature headers are checked before the body is read, and a frame in the
wrong codec for its cut is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cloudkit import DEVICE, chain_repo, coded_frame, config, credentials_file, frame

from splitinfer.cloud.engine import Engine
from splitinfer.cloud.handler import CloudHandler, EngineBackend
from splitinfer.cloud.scale.routing import (
    ReplicaBackend,
    VersionEngine,
    VersionTable,
    infer_json_reply,
    infer_reply,
    open_version,
    reply_for,
)
from splitinfer.shared.auth import CredentialStore, sign
from splitinfer.shared.codecs import INT8_ZSTD, RAW
from splitinfer.shared.contract import (
    FRAME_TYPE,
    HEADER_VERSION,
    BytesBody,
    Reply,
    error_message,
)
from splitinfer.shared.manifest import load_manifest

pytestmark = pytest.mark.integration

INFER = "/v1/models/chain/infer"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("handler") / "repo"
    chain_repo(root)
    return root


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = credentials_file(tmp_path_factory.mktemp("creds") / "devices.toml")
    path.chmod(0o600)
    return path


@contextlib.asynccontextmanager
async def handler(kind: str, repo: Path, creds: Path, **kw: Any) -> AsyncIterator[CloudHandler]:
    """A handler over the in-process engine ("engine") or in-process replicas ("replicas")."""
    cfg = config(repo, credentials=str(creds), warmup=False, **kw)
    store = CredentialStore.from_file(creds)
    if kind == "engine":
        async with Engine(cfg) as engine:
            yield CloudHandler(cfg, EngineBackend(engine), store)
        return
    held: dict[str, VersionEngine] = {}

    async def call(model: str, key: str, method: str, *args: Any) -> Reply:
        if key not in held:
            held[key] = await open_version(cfg, key)
        work = infer_reply if method == "infer" else infer_json_reply
        return await reply_for(work(held[key].engine, *args))

    table = VersionTable(cfg)
    table.rescan()
    try:
        yield CloudHandler(cfg, ReplicaBackend(cfg, table, call), store)
    finally:
        for version in held.values():
            await version.close()


class Untouchable:
    """A body stream that must not be read."""

    async def readany(self) -> bytes:
        raise AssertionError("the body was read before the signature headers were checked")


def signed(body: bytes, path: str = INFER, **headers: str) -> dict[str, str]:
    return {
        "Content-Type": FRAME_TYPE,
        "Content-Length": str(len(body)),
        **sign("POST", path, body, DEVICE, time.time()),
        **headers,
    }


def good_frame(repo: Path) -> bytes:
    m = load_manifest(repo / "chain" / "1")
    return frame(m, {"x": np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)})


@pytest.mark.parametrize("kind", ["engine", "replicas"])
async def test_unsigned_bodies_are_refused_before_a_byte_is_read(
    kind: str, repo: Path, creds: Path
) -> None:
    async with handler(kind, repo, creds) as h:
        headers = {"Content-Type": FRAME_TYPE, "Content-Length": str(60 << 20)}
        reply = await h("POST", INFER, headers, Untouchable(), "10.0.0.9")
        assert reply.status == 401, reply.body
        assert "missing" in error_message(reply.body)
        stale = signed(b"x" * 100)
        stale["X-Splitinfer-Timestamp"] = str(int(time.time()) - 3600)
        reply = await h("POST", INFER, stale, Untouchable(), "10.0.0.9")
        assert reply.status == 401
        # over the size limit: 413 from the declared length, nothing read either
        big = {**signed(b""), "Content-Length": str(10**12)}
        reply = await h("POST", INFER, big, Untouchable(), "10.0.0.9")
        assert reply.status == 413
        assert h.guard.budget.used == 0
        text = (await h("GET", "/metrics", {}, BytesBody(b""), "")).body.decode()
        assert "auth_failures" in text


@pytest.mark.parametrize("kind", ["engine", "replicas"])
async def test_a_raw_frame_for_an_int8_zstd_cut_is_400(kind: str, repo: Path, creds: Path) -> None:
    raw, coded = coded_frame(repo, RAW), coded_frame(repo, INT8_ZSTD)
    async with handler(kind, repo, creds, accept_raw=False) as h:
        reply = await h("POST", INFER, signed(raw), BytesBody(raw), "")
        assert reply.status == 400, reply.body
        assert "not the cut's codec (int8+zstd" in error_message(reply.body)
        reply = await h("POST", INFER, signed(coded), BytesBody(coded), "")
        assert reply.status == 200, reply.body
        assert reply.header("Server-Timing").startswith("cloud;dur=")


async def test_both_backends_answer_alike(repo: Path, creds: Path) -> None:
    good = good_frame(repo)
    garbage = b"SPLT garbage"
    doc = b'{"inputs": {"x": [[0.5, 0.25, 0, 1]]}}'
    cases: list[tuple[str, str, dict[str, str], bytes]] = [
        ("GET", "/healthz", {}, b""),
        ("GET", "/nope", {}, b""),
        ("PUT", INFER, signed(good), good),
        ("GET", "/v1/models", {"Content-Type": FRAME_TYPE}, good),
        ("POST", INFER, signed(good, **{"Content-Type": "text/plain"}), good),
        ("POST", INFER, {"Content-Type": FRAME_TYPE}, good),
        ("POST", INFER, signed(good, **{"X-Splitinfer-Priority": "high"}), good),
        ("POST", INFER, signed(garbage), garbage),
        ("POST", "/v1/models/nope/infer", signed(good, "/v1/models/nope/infer"), good),
        ("POST", INFER + ".json", signed(doc, INFER + ".json", **{"Content-Type": "x/y"}), doc),
        ("POST", INFER, signed(good), good),
    ]
    answers: dict[str, list[tuple[int, str, str]]] = {}
    for kind in ("engine", "replicas"):
        async with handler(kind, repo, creds) as h:
            got = []
            for method, path, headers, body in cases:
                reply = await h(method, path, headers, BytesBody(body), "127.0.0.1")
                text = "" if reply.status == 200 else error_message(reply.body)
                got.append((reply.status, text, reply.header(HEADER_VERSION)))
            ready = await h("GET", "/readyz", {}, BytesBody(b""), "")
            assert ready.status == 200
        answers[kind] = got
    assert answers["engine"] == answers["replicas"]
    statuses = [status for status, _, _ in answers["engine"]]
    assert statuses == [200, 404, 405, 200, 415, 401, 400, 400, 404, 415, 200]
    assert answers["engine"][-1][2] == "1"
    assert "X-Splitinfer-Priority" in answers["engine"][6][1]


async def test_a_client_gone_mid_body_is_counted_not_answered(repo: Path, creds: Path) -> None:
    class Cut:
        async def readany(self) -> bytes:
            raise ConnectionResetError

    async with handler("engine", repo, creds) as h:
        body = good_frame(repo)
        reply = await h("POST", INFER, signed(body), Cut(), "")
        assert reply.status == 499
        text = (await h("GET", "/metrics", {}, BytesBody(b""), "")).body.decode()
        assert "splitinfer_aborted_uploads_total 1.0" in text
        assert h.guard.budget.used == 0


# Ray's own modules use pydantic v1 idioms (deprecation warnings raised inside ray)
@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*")
async def test_the_ray_ingress_reads_starlettes_stream() -> None:
    pytest.importorskip("ray", reason="the optional ray extra is not installed")
    from starlette.requests import ClientDisconnect

    from splitinfer.cloud.scale.ray_serve import StarletteBody
    from splitinfer.serving.body import ClientGone, read_body

    async def chunks(fail: bool) -> AsyncIterator[bytes]:
        yield b"ab"
        yield b"cd"
        if fail:
            raise ClientDisconnect
        yield b""

    body = await read_body(StarletteBody(chunks(False)), declared=4, limit=10, timeout_s=5)
    assert body == b"abcd"
    with pytest.raises(ClientGone):
        await read_body(StarletteBody(chunks(True)), declared=8, limit=10, timeout_s=5)

    from ray.exceptions import TaskCancelledError

    async def dropped() -> AsyncIterator[bytes]:  # Serve's proxy forgot the request
        yield b"ab"
        raise TaskCancelledError

    with pytest.raises(ClientGone):
        await read_body(StarletteBody(dropped()), declared=8, limit=10, timeout_s=5)

    async def stalled() -> AsyncIterator[bytes]:
        yield b"ab"
        await asyncio.Event().wait()
        yield b""

    # Serve cancels the ingress's request when its client leaves: mid-body, it is cut off
    stream = StarletteBody(stalled())
    reading = asyncio.ensure_future(read_body(stream, declared=8, limit=10, timeout_s=5))
    await asyncio.sleep(0)
    assert not stream.cut_off
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    assert stream.cut_off


async def test_a_body_the_stream_holds_whole_is_read_at_once_and_checked_alike() -> None:
    """aiohttp's stream holds a body that came with its headers whole: it is taken with no
    timer armed, one chunk is not copied, and the size checks are those of the slow path."""
    from aiohttp import StreamReader
    from aiohttp.base_protocol import BaseProtocol

    from splitinfer.serving.body import BodyTooLarge, ClientGone, read_body

    loop = asyncio.get_running_loop()

    def held(*chunks: bytes) -> StreamReader:
        stream = StreamReader(BaseProtocol(loop), 2**16, loop=loop)
        for c in chunks:
            stream.feed_data(c)
        stream.feed_eof()
        return stream

    one = b"x" * 100
    got = await read_body(held(one), declared=100, limit=1000, timeout_s=0.001)
    assert got is one  # no copy
    assert await read_body(held(b"ab", b"cd"), declared=4, limit=10, timeout_s=5) == b"abcd"
    with pytest.raises(ClientGone, match="sent 4 of its 8 bytes"):
        await read_body(held(b"ab", b"cd"), declared=8, limit=10, timeout_s=5)
    with pytest.raises(BodyTooLarge):
        await read_body(held(b"abcd"), declared=None, limit=3, timeout_s=5)
    grown: list[int] = []
    body = await read_body(held(b"abc"), declared=None, limit=10, timeout_s=5, grow=grown.append)
    assert (body, grown) == (b"abc", [3])
