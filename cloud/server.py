"""The HTTP layer around the engine (routes and errors as in ``docs/http-api.md``).

Handlers only check the transport (content type, size, signature, rate) and
await the engine. Errors become responses in one place, :func:`error_middleware`,
which also counts every inference and admin request by model, version and
status. The engine starts and drains in ``cleanup_ctx``; on shutdown aiohttp
stops listening, the engine refuses new requests (503), requests in flight
finish, then the queues drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from splitinfer.cloud.config import ServiceConfig
from splitinfer.cloud.engine import DEFAULT_PRIORITY, Engine
from splitinfer.cloud.metrics import UNKNOWN, Metrics
from splitinfer.cloud.overload import RateLimiter, retry_after_header
from splitinfer.shared.auth import (
    HEADER_DEVICE,
    AuthError,
    CredentialStore,
    Verifier,
    server_ssl_context,
)
from splitinfer.shared.errors import ConfigError, ProtocolError, SplitInferError
from splitinfer.shared.frame import FRAME_TYPE
from splitinfer.shared.nonces import NonceStore, RedisNonces
from splitinfer.shared.serving import (
    BodyBudget,
    ClientGone,
    ConnectionGate,
    bound_url,
    listen,
    read_body,
)
from splitinfer.shared.serving import BodyTooLarge as BodyTooLarge  # noqa: PLC0414 (Ray ingress)

log = logging.getLogger("splitinfer.cloud")


JSON_TYPE = "application/json"
HEADER_PRIORITY = "X-Splitinfer-Priority"
HEADER_VERSION = "X-Splitinfer-Model-Version"  # on 200s: the version that served it
NO_AUTH_WARNING = "authentication is off (--no-auth): any client may use this service"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class UnsupportedMediaType(SplitInferError):
    http_status = 415


class Guard:
    """Who may call: signature checks (or none with --no-auth) and per-device rates."""

    def __init__(
        self,
        config: ServiceConfig,
        store: CredentialStore | None,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.auth_enabled and store is None:
            raise ConfigError(
                "no device credentials configured: give --credentials FILE "
                "(see docs/auth.md), or --no-auth for development on loopback"
            )
        self.verifier: Verifier | None = None
        self.nonces: NonceStore | None = None
        if store is not None and not config.no_auth:
            if config.nonce_store:
                self.nonces = RedisNonces(config.nonce_store)
            self.verifier = Verifier(
                store,
                window_s=config.auth_window_s,
                audiences=config.audience,
                nonces=self.nonces,
            )
        ov = config.overload
        self.limiter = RateLimiter(ov.device_rate, ov.burst, ov.max_devices)
        self.budget = BodyBudget(config.max_inflight_bytes, config.max_device_inflight_bytes)
        self.wall = wall
        self.clock = clock

    def check(self, request: web.Request, body: bytes) -> str:
        """The calling device's id, or :class:`AuthError` / :class:`RateLimited`."""
        return self.check_parts(
            request.method, request.raw_path, request.headers, body, request.remote or ""
        )

    def check_parts(
        self, method: str, raw_path: str, headers: Mapping[str, str], body: bytes, remote: str
    ) -> str:
        """:meth:`check` without aiohttp: for other HTTP front ends (the Ray Serve ingress)."""
        if self.verifier is None:
            device = headers.get(HEADER_DEVICE, "")[:64]
        else:
            cred = self.verifier.verify(method, raw_path, headers, body, self.wall())
            device = cred.device_id
        self.limiter.check(device or remote, self.clock())
        return device

    @contextlib.asynccontextmanager
    async def incoming(self, request: web.Request, limit: int) -> AsyncIterator[tuple[str, bytes]]:
        """``(device, body)`` of a request, checked as far as possible before the body is read.

        The headers go through the signature pre-check (device, key, expiry,
        window, audience, nonce) before a byte of the body is read; the body is
        read into a reservation of bytes in flight for that device (503 beyond
        it), held until the handler is done; then the signature over the body
        and the rate limit are checked.
        """
        declared = request.content_length
        if declared is not None and declared > limit:  # refuse before reading anything
            raise BodyTooLarge(
                f"request body of {declared} bytes is over the limit of {limit} bytes"
            )
        checked = None
        if self.verifier is not None:
            checked = self.verifier.precheck(
                request.method, request.raw_path, request.headers, self.wall()
            )
            owner = checked.cred.device_id
        else:
            owner = request.headers.get(HEADER_DEVICE, "")[:64] or (request.remote or "")
        timeout = request.app[CONFIG].body_timeout_s
        with self.budget.reservation(owner) as held:
            if declared is not None:
                held.grow(declared)
            body = await read_body(
                request.content, declared=declared, limit=limit, timeout_s=timeout, grow=held.grow
            )
            if self.verifier is not None and checked is not None:
                cred = self.verifier.finish(
                    checked, request.method, request.raw_path, body, self.wall()
                )
                device = cred.device_id
            else:
                device = request.headers.get(HEADER_DEVICE, "")[:64]
            self.limiter.check(device or (request.remote or ""), self.clock())
            yield device, body

    def close(self) -> None:
        if isinstance(self.nonces, RedisNonces):
            self.nonces.close()


class ServerCounters:
    """What the HTTP layer counts itself, in the engine's registry."""

    def __init__(self, metrics: Metrics) -> None:
        self.aborted = Counter(
            "splitinfer_aborted_uploads",
            "Requests whose client closed the connection before its body was complete",
            registry=metrics.registry,
        )


ENGINE = web.AppKey("engine", Engine)
GUARD = web.AppKey("guard", Guard)
CONFIG = web.AppKey("config", ServiceConfig)
COUNTERS = web.AppKey("counters", ServerCounters)
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
    guard = Guard(config, credentials)
    engine = engine or Engine(config)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[error_middleware])
    app[CONFIG] = config
    app[ENGINE] = engine
    app[GUARD] = guard
    app[COUNTERS] = ServerCounters(engine.metrics)
    app.cleanup_ctx.append(_engine_ctx)
    app.on_shutdown.append(_closing)
    app.router.add_post("/v1/models/{model}/infer", infer)
    app.router.add_post("/v1/models/{model}/infer.json", infer_json)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/admin/reload", reload)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE]
    if app[CONFIG].no_auth:
        log.warning(NO_AUTH_WARNING)
    await engine.start()
    yield
    log.info("draining: %d requests queued", sum(b.queued for b in engine.batchers()))
    await engine.stop()
    app[GUARD].close()
    log.info("stopped")


async def _closing(app: web.Application) -> None:
    app[ENGINE].closing = True  # new requests get 503; those in flight finish


# -- errors, in one place ---------------------------------------------------------


def _status_of(exc: BaseException) -> tuple[int, str, float | None]:
    """HTTP status, one-line message and Retry-After seconds for an exception."""
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return 413, "request body is over the size limit (max_body_bytes)", None
    if isinstance(exc, web.HTTPException):
        return exc.status, exc.reason, None
    if isinstance(exc, SplitInferError):
        message = " ".join(str(exc).split()) or type(exc).__name__
        retry = getattr(exc, "retry_after", None)
        if retry is None and exc.http_status in (429, 503):
            retry = 1.0
        return exc.http_status, message, retry
    return 500, f"internal error (a bug, please report it): {type(exc).__name__}: {exc}", None


#: Public name of the one error mapping, for other HTTP front ends (the Ray Serve ingress).
status_of = _status_of


def _auth_kind(exc: AuthError) -> str:
    text = str(exc)
    for needle, kind in (
        ("replay", "replay"),
        ("missing", "missing"),
        ("expired", "expired"),
        ("window", "stale"),
        ("unknown", "unknown"),
        ("audience", "audience"),
    ):
        if needle in text:
            return kind
    return "invalid"


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every error into ``{"error", "status"}`` JSON; count inference/admin requests."""
    counted = "model" in request.match_info or request.path == "/v1/admin/reload"
    try:
        response = await handler(request)
    except asyncio.CancelledError:
        raise
    except ClientGone as exc:  # the client's doing: counted apart, no one to answer
        log.debug("%s %s: %s", request.method, request.path, exc)
        request.app[COUNTERS].aborted.inc()
        return web.Response(status=exc.http_status)
    except Exception as exc:
        status, message, retry = _status_of(exc)
        if status >= 500 and not isinstance(exc, SplitInferError):
            log.exception("internal error on %s %s", request.method, request.path)
        headers = {"Retry-After": retry_after_header(retry)} if retry is not None else {}
        response = web.json_response(
            {"error": message, "status": status}, status=status, headers=headers
        )
        if counted:
            metrics = request.app[ENGINE].metrics
            reason = type(exc).__name__
            metrics.rejections.labels(_model_label(request), reason).inc()
            if isinstance(exc, AuthError) and status == 401:
                metrics.auth_failures.labels(_auth_kind(exc)).inc()
    if counted:
        version = response.headers.get(HEADER_VERSION, "")
        request.app[ENGINE].metrics.request(_model_label(request), version, response.status)
    return response


def _model_label(request: web.Request) -> str:
    model = request.match_info.get("model")
    if model is None:
        return "_admin"
    return model if request.app[ENGINE].registry.knows(model) else UNKNOWN


# -- handlers -----------------------------------------------------------------------


def _content_type(request: web.Request, wanted: str) -> None:
    if request.content_type != wanted:
        raise UnsupportedMediaType(
            f"Content-Type {request.content_type or '(none)'!r}: send {wanted}"
        )


def _priority(request: web.Request) -> int:
    return priority_of(request.headers.get(HEADER_PRIORITY))


def priority_of(raw: str | None) -> int:
    """The ``X-Splitinfer-Priority`` header's value (absent: the default)."""
    if raw is None:
        return DEFAULT_PRIORITY
    if not (len(raw) == 1 and raw.isdigit()):
        raise ProtocolError(f"{HEADER_PRIORITY}: {raw[:16]!r} is not a priority 0..9")
    return int(raw)


async def infer(request: web.Request) -> web.StreamResponse:
    _content_type(request, FRAME_TYPE)
    priority = _priority(request)
    async with request.app[GUARD].incoming(request, request.app[CONFIG].max_body_bytes) as (
        device,
        body,
    ):
        served = await request.app[ENGINE].infer(
            request.match_info["model"], body, device=device, priority=priority
        )
    # Server-Timing lets the edge tell the network's share of its round trip from ours
    headers = {
        HEADER_VERSION: served.version,
        "Server-Timing": f"cloud;dur={served.service_s * 1e3:.3f}",
    }
    return web.Response(body=served.body, content_type=FRAME_TYPE, headers=headers)


def _no_constant(name: str) -> Any:
    raise ProtocolError(f"body: {name} is not JSON (inputs must be finite numbers)")


def parse_infer_json(body: bytes) -> tuple[dict[str, Any], str, str]:
    """``(inputs, cut_id, model_version)`` of a JSON debugging request (see http-api.md)."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"body: not JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("inputs"), dict):
        raise ProtocolError('body: expected {"cut_id": ..., "inputs": {name: nested lists}}')
    cut_id, version = data.get("cut_id", ""), data.get("model_version", "")
    if not isinstance(cut_id, str) or not isinstance(version, str):
        raise ProtocolError("body: cut_id and model_version must be strings")
    return data["inputs"], cut_id, version


async def infer_json(request: web.Request) -> web.StreamResponse:
    _content_type(request, JSON_TYPE)
    priority = _priority(request)
    loop = asyncio.get_running_loop()
    async with request.app[GUARD].incoming(request, request.app[CONFIG].max_json_bytes) as (
        device,
        body,
    ):
        # a large JSON body takes a while to parse: off the loop, so others are not stalled
        inputs, cut_id, version = await loop.run_in_executor(None, parse_infer_json, body)
        del body
    engine = request.app[ENGINE]
    model = request.match_info["model"]
    if not cut_id:
        cut_id = engine.registry.route(model, version, device).manifest.default_cut
    outputs, served = await engine.infer_arrays(
        model, cut_id, inputs, version=version, device=device, priority=priority
    )
    doc = {"outputs": outputs, "model_version": served}
    text = await loop.run_in_executor(None, json_answer, doc)
    return web.Response(text=text, content_type=JSON_TYPE, headers={HEADER_VERSION: served})


def json_answer(doc: Mapping[str, Any]) -> str:
    """JSON text of an answer; NaN and infinity, which JSON cannot carry, are refused."""

    def default(value: Any) -> Any:
        if hasattr(value, "tolist"):
            return value.tolist()
        raise TypeError(f"{type(value).__name__} is not JSON serialisable")

    try:
        return json.dumps(doc, default=default, allow_nan=False)
    except ValueError:
        raise ProtocolError(
            "an output holds NaN or infinity, which JSON cannot carry; use the frame "
            "endpoint /v1/models/{model}/infer"
        ) from None


async def reload(request: web.Request) -> web.StreamResponse:
    async with request.app[GUARD].incoming(request, request.app[CONFIG].max_json_bytes):
        pass
    report = await request.app[ENGINE].reload(force=True)
    return web.json_response(report)


async def models(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    status = engine.registry.status()
    for model in status["models"]:
        b = engine.config.batching_for(model["name"])
        model["batching"] = {
            "enabled": b.enabled,
            "max_batch_size": b.max_batch_size,
            "max_queue_delay_ms": b.max_queue_delay_ms,
            "max_queue_size": b.max_queue_size,
        }
        model["load"] = round(engine.load(model["name"]), 4)
    return web.json_response(status)


async def healthz(request: web.Request) -> web.StreamResponse:
    return web.Response(text="ok")


async def readyz(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body: dict[str, Any] = {
        "ready": engine.ready,
        "models": {
            m["name"]: {"ready": m["ready"], "versions": m["versions"]}
            for m in engine.registry.status()["models"]
        },
    }
    if engine.closing:
        body["closing"] = True
    if request.app[CONFIG].no_auth:
        body["warning"] = NO_AUTH_WARNING
    return web.json_response(body, status=200 if engine.ready else 503)


async def metrics(request: web.Request) -> web.StreamResponse:
    m: Metrics = request.app[ENGINE].metrics
    return web.Response(body=m.render(), headers={"Content-Type": m.content_type})


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
