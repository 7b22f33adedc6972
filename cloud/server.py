"""The aiohttp front end of the cloud service: a thin adapter over :mod:`cloud.handler`.

Every request goes to :class:`~splitinfer.cloud.handler.CloudHandler` (routes,
checks and errors as in ``docs/http-api.md``, written once for every front
end) over an :class:`~splitinfer.cloud.handler.EngineBackend`. What is left
here is aiohttp's: the engine starts and drains in ``cleanup_ctx``; on
shutdown aiohttp stops listening, the engine refuses new requests (503),
requests in flight finish, then the queues drain; and the listening socket,
behind the connection cap and header timeout of ``serving/sockets.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from splitinfer.cloud.config import ServiceConfig
from splitinfer.cloud.engine import Engine
from splitinfer.cloud.handler import NO_AUTH_WARNING, CloudHandler, EngineBackend
from splitinfer.serving.sockets import ConnectionGate, bound_url, listen
from splitinfer.shared.auth import CredentialStore, server_ssl_context
from splitinfer.shared.errors import ConfigError

log = logging.getLogger("splitinfer.cloud")

ENGINE = web.AppKey("engine", Engine)
HANDLER = web.AppKey("handler", CloudHandler)
CONFIG = web.AppKey("config", ServiceConfig)
GATE = web.AppKey("gate", ConnectionGate)


def build_app(
    config: ServiceConfig,
    *,
    engine: Engine | None = None,
    credentials: CredentialStore | None = None,
) -> web.Application:
    """The aiohttp application; the engine starts with the app and drains on cleanup."""
    if credentials is None and config.credentials:
        credentials = CredentialStore.from_file(config.credentials)
    engine = engine or Engine(config)
    handler = CloudHandler(config, EngineBackend(engine), credentials)
    app = web.Application(client_max_size=config.max_body_bytes)
    app[CONFIG] = config
    app[ENGINE] = engine
    app[HANDLER] = handler
    app.cleanup_ctx.append(_engine_ctx)
    app.on_shutdown.append(_closing)
    app.router.add_route("*", "/{path:.*}", _dispatch)
    return app


async def _dispatch(request: web.Request) -> web.StreamResponse:
    reply = await request.app[HANDLER](
        request.method, request.raw_path, request.headers, request.content, request.remote or ""
    )
    return web.Response(status=reply.status, body=reply.body, headers=reply.headers)


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE]
    if app[CONFIG].no_auth:
        log.warning(NO_AUTH_WARNING)
    await engine.start()
    yield
    log.info("draining: %d requests queued", sum(b.queued for b in engine.batchers()))
    await engine.stop()
    app[HANDLER].close()
    log.info("stopped")


async def _closing(app: web.Application) -> None:
    app[ENGINE].closing = True  # new requests get 503; those in flight finish


# -- running it -------------------------------------------------------------------------


async def serve(
    config: ServiceConfig,
    stop: asyncio.Event,
    started: Callable[[str], None] = lambda url: None,
) -> None:
    """Run the service until ``stop`` is set; ``started`` gets the URL it listens on."""
    ssl_context = None
    if config.tls_cert:
        ssl_context = server_ssl_context(config.tls_cert, config.tls_key)
    app = build_app(config)
    gate = ConnectionGate(config.max_connections, config.header_timeout_s)
    app[GATE] = gate
    runner = web.AppRunner(
        app,
        shutdown_timeout=config.drain_timeout_s,
        access_log=None,
        handle_signals=False,
        keepalive_timeout=config.keepalive_timeout_s,
        lingering_time=min(2.0, config.body_timeout_s),
    )
    await runner.setup()
    server = None
    try:
        host, port = config.host_port()
        try:
            server = await listen(runner, host, port, gate, ssl=ssl_context)
        except OSError as exc:
            raise ConfigError(f"listen={config.listen}: cannot listen: {exc.strerror}") from exc
        started(bound_url(server, "https" if ssl_context else "http"))
        await stop.wait()
    finally:
        if server is not None:
            server.close()
        await runner.cleanup()
