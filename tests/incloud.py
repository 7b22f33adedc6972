"""The real cloud in process, for edge tests: no sockets, nothing faked.

:func:`start_cloud` puts a split package into a one-version repository, starts
the cloud service's :class:`~splitinfer.cloud.engine.Engine` on it (registry,
batcher, ONNX Runtime sessions of the cloud segments) and puts the service's
own request handler, :class:`~splitinfer.cloud.handler.CloudHandler`, in
front: what the edge sends is checked, decoded and answered exactly as
``cloud-service`` does. The edge reaches it through
:class:`~splitinfer.edge.transport.HandlerTransport` (``cloud.transport()``),
or through a ``FunctionTransport`` of a test's own function that calls
``await cloud(method, path, body, headers)`` (spies, held or slow answers).

The ``cloud_factory`` fixture (registered in ``conftest.py``) starts clouds and
stops them after the test.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from splitinfer.shared.contract import HEADER_VERSION, BodyStream, BytesBody, Reply
from splitinfer.shared.frame import Limits, decode_response, encode_response
from splitinfer.shared.manifest import load_manifest

if TYPE_CHECKING:  # conftest.py imports this module: the cloud loads when a test starts one
    from splitinfer.cloud.engine import Engine
    from splitinfer.cloud.handler import CloudHandler
    from splitinfer.edge.transport import HandlerTransport, Signer
    from splitinfer.shared.auth import CredentialStore


class InProcessCloud:
    """A started engine and its handler; ``requests`` counts the POSTs it was given.

    ``load``, when set, is the queue load the answers report instead of the
    engine's own (which is about 0 for one request at a time): a test's way to
    show the edge a busy cloud. Only that field of a 200 frame is rewritten.
    """

    def __init__(self, engine: Engine, handler: CloudHandler, load: float | None) -> None:
        self.engine = engine
        self.handler = handler
        self.load = load
        self.requests = 0

    async def handle(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: BodyStream,
        remote: str = "127.0.0.1",
    ) -> Reply:
        """The :data:`~splitinfer.shared.contract.ServiceHandler`: the cloud's own handler."""
        if method == "POST":
            self.requests += 1
        reply = await self.handler(method, path, headers, body, remote)
        if self.load is None or reply.status != 200 or not path.endswith("/infer"):
            return reply
        version = reply.header(HEADER_VERSION)
        model = path.split("/")[3]
        manifest = self.engine.registry.model(model).serving[version].manifest
        answer = decode_response(reply.body, manifest, Limits())
        frame = encode_response(dataclasses.replace(answer, load=self.load))
        return Reply(reply.status, reply.headers, frame)

    async def __call__(
        self, method: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> Reply:
        """``(method, path, body, headers) -> Reply``, as ``FunctionTransport`` calls it."""
        sent = {**headers, "Content-Length": str(len(body))}
        return await self.handle(method, path, sent, BytesBody(body))

    def transport(
        self, name: str = "http://in-process", signer: Signer | None = None
    ) -> HandlerTransport:
        from splitinfer.edge.transport import HandlerTransport

        return HandlerTransport(self.handle, name, signer=signer)

    async def stop(self) -> None:
        await self.engine.stop(drain_timeout=0.0)
        self.handler.close()
        shutil.rmtree(self.engine.config.repository_path, ignore_errors=True)


def repository_for(package: Path, repo: Path) -> Path:
    """``repo`` made a model repository serving ``package`` as version "1" (a symlink)."""
    manifest = load_manifest(package)
    (repo / manifest.model_name).mkdir(parents=True)
    (repo / manifest.model_name / "1").symlink_to(package.resolve(), target_is_directory=True)
    return repo


async def start_cloud(
    package: Path,
    *,
    load: float | None = None,
    credentials: CredentialStore | None = None,
    wall: Callable[[], float] | None = None,
    **options: Any,
) -> InProcessCloud:
    """The cloud service on one package (version "1"), started; ``stop()`` it after.

    ``credentials``: devices it accepts (auth on); without, auth is off.
    ``options`` are :class:`ServiceConfig` fields.
    """
    from splitinfer.cloud.config import ServiceConfig
    from splitinfer.cloud.engine import Engine
    from splitinfer.cloud.handler import CloudHandler, EngineBackend

    repo = repository_for(package, Path(tempfile.mkdtemp(prefix="splitinfer-incloud-")))
    options.setdefault("warmup", False)
    config = ServiceConfig(repository=str(repo), no_auth=credentials is None, **options)
    engine = Engine(config)
    await engine.start()
    extra = {} if wall is None else {"wall": wall}
    handler = CloudHandler(config, EngineBackend(engine), credentials, **extra)
    return InProcessCloud(engine, handler, load)


CloudFactory = Callable[..., Awaitable[InProcessCloud]]


@pytest.fixture
async def cloud_factory() -> AsyncIterator[CloudFactory]:
    """``cloud = await cloud_factory(package, load=..., ...)``; all stopped after the test."""
    started: list[InProcessCloud] = []

    async def start(package: Path, **kw: Any) -> InProcessCloud:
        cloud = await start_cloud(package, **kw)
        started.append(cloud)
        return cloud

    yield start
    for cloud in started:
        await cloud.stop()
