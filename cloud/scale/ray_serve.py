"""The cloud service as Ray Serve deployments: engine replicas behind one HTTP ingress.

    serve run splitinfer.cloud.scale.ray_serve:app_builder repository=DIR no_auth=true

- :class:`CloudReplica` (``num_replicas`` or ``autoscaling_config`` on queue
  depth, ``ray_actor_options`` with ``num_gpus``): each replica owns in-process
  :class:`~splitinfer.cloud.engine.Engine` s (repository, batcher, runtimes, the
  MoE runtime when ``moe_cache_bytes`` is set), one per model version it holds,
  loaded on demand through Serve's model multiplexing (``@serve.multiplexed``;
  the id is ``model:version:fingerprint``), least recently used unloaded.
- :class:`Ingress`: the HTTP API of ``cloud-service``, through the same
  handler (``cloud/handler.py``: paths, content types, status codes, headers,
  error JSON; the signature headers checked before the body is read): it
  picks the version by the model's traffic policy and sends the frame to a
  replica holding that version
  (``handle.options(multiplexed_model_id=...)``). When a replica dies
  mid-request the request is sent again (inference is idempotent) and reaches
  another replica.

:func:`app_builder` is the import path for ``serve run`` / KubeRay;
:func:`deploy` runs the application on a local (or connected) Ray for tests
and benchmarks. Nothing outside this package imports Ray.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from multidict import CIMultiDict
from prometheus_client import Counter
from ray import serve
from ray.exceptions import TaskCancelledError
from starlette.requests import ClientDisconnect

from splitinfer.cloud.config import ServiceConfig
from splitinfer.cloud.engine import Engine
from splitinfer.cloud.handler import NO_AUTH_WARNING, CloudHandler
from splitinfer.cloud.overload import Rejected
from splitinfer.cloud.scale.config import ScaleConfig, scale_config_from_args
from splitinfer.cloud.scale.routing import (
    ReplicaBackend,
    VersionEngine,
    VersionTable,
    infer_json_reply,
    infer_reply,
    open_version,
    reply_for,
)
from splitinfer.serving.body import ClientGone
from splitinfer.shared.auth import CredentialStore
from splitinfer.shared.contract import Reply

log = logging.getLogger("splitinfer.cloud")

APP_NAME = "splitinfer"


def _engine_factory(config: ScaleConfig) -> Any:
    """Engines as ``cloud-service`` builds them, with the MoE runtime when asked for."""
    if not config.moe_cache_bytes:
        return Engine
    from splitinfer.cloud.moe.cache import CacheConfig
    from splitinfer.cloud.moe.runtime import moe_runtime_factory

    runtime = moe_runtime_factory(CacheConfig(config.moe_cache_bytes, config.moe_cache_policy))

    def make(service: ServiceConfig) -> Engine:
        return Engine(service, runtime_factory=runtime)

    return make


class CloudReplica:
    """One engine replica: the versions it holds, each in its own started engine."""

    def __init__(self, config: ScaleConfig) -> None:
        self.config = config
        factory = _engine_factory(config)

        async def load(key: str) -> VersionEngine:
            log.info("replica: loading %s", key)
            return await open_version(config.service, key, factory)

        # built per instance, so the number of versions held is configurable
        self._version = serve.multiplexed(
            max_num_models_per_replica=config.max_versions_per_replica
        )(load)

    async def infer(self, model: str, body: bytes, device: str, priority: int) -> Reply:
        async def work() -> Reply:
            held = await self._version(serve.get_multiplexed_model_id())
            return await infer_reply(held.engine, model, body, device, priority)

        return await reply_for(work())

    async def infer_json(
        self, model: str, data: dict[str, Any], device: str, priority: int
    ) -> Reply:
        async def work() -> Reply:
            held = await self._version(serve.get_multiplexed_model_id())
            return await infer_json_reply(held.engine, model, data, device, priority)

        return await reply_for(work())

    def ping(self) -> str:
        return "ok"


def _retriable() -> tuple[type[BaseException], ...]:
    from ray import exceptions as rex

    return (rex.RayActorError, rex.ActorUnavailableError, rex.WorkerCrashedError)


class Ingress:
    """The HTTP API of ``cloud-service`` in front of the engine replicas.

    A Starlette adapter over :class:`~splitinfer.cloud.handler.CloudHandler`
    (the daemon's own handler) with a :class:`ReplicaBackend`: the signature
    headers are checked before the body stream is read.
    """

    def __init__(self, config: ScaleConfig, replicas: Any) -> None:
        self.config = config
        self.service = config.service
        self.replicas = replicas
        store = None
        if self.service.credentials:
            store = CredentialStore.from_file(self.service.credentials)
        self.table = VersionTable(self.service)
        self.table.rescan()
        self.backend = ReplicaBackend(self.service, self.table, self._call)
        self.handler = CloudHandler(self.service, self.backend, store)
        self.retries = Counter(
            "splitinfer_ingress_retries",
            "Requests sent again because a replica died",
            ["model"],
            registry=self.backend.registry,
        )
        if self.service.no_auth:
            log.warning(NO_AUTH_WARNING)
        self._watcher: asyncio.Task[None] | None = None
        self._handles: dict[tuple[str, str], Any] = {}

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import Response

        if self.service.watch_interval_s > 0 and self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(self.service.watch_interval_s))
        scope = request.scope
        raw = scope.get("raw_path") or request.url.path.encode()
        path = raw.decode("latin-1") if isinstance(raw, bytes) else str(raw)
        query = scope.get("query_string", b"")
        if query and "?" not in path:
            path += "?" + query.decode("latin-1")
        headers: Mapping[str, str] = CIMultiDict(request.headers.items())
        remote = request.client.host if request.client else ""
        body = StarletteBody(request.stream())
        try:
            reply = await self.handler(request.method, path, headers, body, remote)
        except asyncio.CancelledError:
            # Serve cancels a request whose client left; mid-body, that is an aborted upload
            if body.cut_off:
                self.backend.aborted()
            raise
        return Response(content=reply.body, status_code=reply.status, headers=dict(reply.headers))

    async def _call(self, model: str, key: str, method: str, *args: Any) -> Reply:
        """Send to a replica holding ``key``; again (another replica) if that one died."""
        retriable = _retriable()
        wait = self.config.retry_backoff_s
        for attempt in range(self.config.retries + 1):
            handle = self._handles.get((key, method))
            if handle is None:  # one handle per version: they share the router, cheap to keep
                handle = getattr(self.replicas.options(multiplexed_model_id=key), method)
                self._handles[(key, method)] = handle
            try:
                reply: Reply = await handle.remote(*args)
                return reply
            except retriable as exc:
                if attempt == self.config.retries:
                    raise Rejected(
                        f"no replica answered after {attempt + 1} tries: {type(exc).__name__}"
                    ) from exc
                self.retries.labels(model).inc()
                log.warning("replica lost (%s), retrying %s", type(exc).__name__, key)
                await asyncio.sleep(wait)
                wait *= 2
        raise AssertionError("unreachable")

    async def _watch(self, interval: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            try:
                await loop.run_in_executor(None, self.table.rescan)
            except Exception:  # a bad scan must not stop the watcher
                log.exception("repository rescan failed")


class StarletteBody:
    """Starlette's ``request.stream()`` as the handler's body stream (``readany``).

    Read only when the handler asks: after the signature headers pass, into the
    guard's reservation of bytes in flight (what Serve's proxy forwards before
    that waits in Serve's receive queue, dropped with the request; see
    docs/scale-out.md). A client gone mid-body reaches the ingress as Starlette's
    ``ClientDisconnect``, as Ray's ``TaskCancelledError`` (Serve's proxy dropped
    the request while the ingress was fetching its next chunk), or as the
    ingress's own cancellation; the first two become
    :class:`~splitinfer.serving.body.ClientGone`, the last sets ``cut_off``.
    """

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self.cut_off = False

    async def readany(self) -> bytes:
        try:
            return await anext(self._chunks)
        except StopAsyncIteration:
            return b""
        except (ClientDisconnect, TaskCancelledError) as exc:
            raise ClientGone(f"client went away mid-body: {type(exc).__name__}") from None
        except asyncio.CancelledError:
            self.cut_off = True
            raise


# -- building and running -----------------------------------------------------------------


def build_app(config: ScaleConfig) -> Any:
    """The Serve application: the ingress bound to the engine replicas."""
    deployment: Any = serve.deployment
    replicas = (
        deployment(CloudReplica, name="CloudReplica")
        .options(**config.replica_options())
        .bind(config)
    )
    ingress = deployment(Ingress, name="Ingress").options(
        num_replicas=config.ingress_replicas,
        max_ongoing_requests=max(256, config.max_ongoing_requests * config.max_replicas),
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
    )
    return ingress.bind(config, replicas)


def app_builder(args: dict[str, str]) -> Any:
    """``serve run splitinfer.cloud.scale.ray_serve:app_builder repository=DIR key=value ...``."""
    return build_app(scale_config_from_args(args))


def deploy(
    config: ScaleConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    name: str = APP_NAME,
    timeout_s: float = 120.0,
) -> str:
    """Run the application on the Ray this process is connected to; its base URL.

    Starts Serve's HTTP proxy on ``host:port`` if Serve is not running yet, and
    waits until the application is running and its replicas answer.
    """
    serve.start(http_options={"host": host, "port": port})
    handle = serve.run(build_app(config), name=name, route_prefix="/", blocking=False)
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(name)
        if status is not None and str(status.status).endswith("RUNNING"):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve application {name!r} not running after {timeout_s} s")
        time.sleep(0.2)
    del handle
    return f"http://{host}:{port}"


def shutdown() -> None:
    """Stop Serve (the application, its replicas and the HTTP proxy)."""
    serve.shutdown()  # type: ignore[no-untyped-call]
