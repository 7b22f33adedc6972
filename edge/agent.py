"""The local HTTP API of the edge agent: a thin aiohttp app around a pipeline.

    POST /v1/infer     the model's input as .npy (one input), .npz (by input name)
                       or JSON {"inputs": {...}}, or one picture (image/png,
                       image/jpeg, ...) when the package declares preprocessing
                       (else 415); answers an .npz of the outputs (JSON for a
                       JSON request, or with Accept: application/json)
    GET  /             the status page (HTML, read-only: edge/status.py)
    GET  /healthz      200 "ok" while the process is alive
    GET  /v1/status    JSON: cut and why, each candidate's predicted latency, link
                       estimate, cloud load, endpoints, latency, budget
    GET  /metrics      Prometheus text format

Request headers: ``X-Splitinfer-Timings: 1`` asks for per-stage timings (a
response header of the same name, Server-Timing syntax, and a ``timings``
field in JSON answers); ``X-Splitinfer-Timeout-Ms`` sets this request's
deadline; ``X-Splitinfer-Cut`` forces a cut; ``X-Splitinfer-Priority`` is
passed to the cloud. Every answer says where it was computed:
``X-Splitinfer-Local: 1`` (and ``"local": true``) when the device answered
alone, with ``X-Splitinfer-Local-Reason``.

Admission is bounded: ``queue.max_concurrency`` requests run, ``queue.max_queue``
wait, any more get 503 at once. Errors are JSON ``{"error": ..., "status": ...}``
with the status of the error tree. The aiohttp client session, the uplink, the
warm-up and the health-check loop live in ``cleanup_ctx``; state sits under
``web.AppKey`` s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from splitinfer.edge.config import EdgeConfig, parse_model
from splitinfer.edge.failover import Uplink
from splitinfer.edge.metrics import EdgeMetrics
from splitinfer.edge.model import EdgeModel, load_model
from splitinfer.edge.payload import (
    JSON_TYPE,
    NPZ_TYPES,
    BadInput,
    body_kind,
    json_bytes,
    npz_bytes,
    parse_body,
)
from splitinfer.edge.pipeline import Pipeline, Result
from splitinfer.edge.status import render_status, status_doc
from splitinfer.edge.transport import HttpTransport, Transport, make_session
from splitinfer.serving.body import BodyBudget, ClientGone, read_body
from splitinfer.shared.auth import Credential, CredentialStore, client_ssl_context, sign
from splitinfer.shared.contract import (
    HEADER_CUT,
    HEADER_DOWN_BYTES,
    HEADER_LOCAL,
    HEADER_LOCAL_REASON,
    HEADER_PRIORITY,
    HEADER_TIMEOUT,
    HEADER_TIMINGS,
    HEADER_TRACE,
    HEADER_UP_BYTES,
    HEADER_VERSION,
)
from splitinfer.shared.errors import ConfigError, OverloadError, SplitInferError
from splitinfer.shared.statuspage import PAGE_HEADERS

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest X-Splitinfer-Timeout-Ms accepted: one day (a deadline must fit the wire's u64 ms).
MAX_TIMEOUT_MS = 86_400_000


class QueueFull(OverloadError):
    """The agent's bounded queue is full (503 at once)."""


class Admission:
    """At most ``running`` requests at once and ``waiting`` more queued; beyond: 503."""

    def __init__(self, running: int, waiting: int) -> None:
        self.limit_running = running
        self.limit_waiting = waiting
        self.running = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(running)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self.running + self.waiting >= self.limit_running + self.limit_waiting:
            raise QueueFull(
                f"the edge agent is busy: {self.running} requests running and "
                f"{self.waiting} queued (queue.max_queue={self.limit_waiting}); retry shortly"
            )
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()


@dataclass
class AgentState:
    """What the handlers need; filled in by the app's startup context."""

    config: EdgeConfig
    model: EdgeModel
    metrics: EdgeMetrics
    admission: Admission
    pipeline: Pipeline | None = None
    warm: dict[str, float] = field(default_factory=dict)
    aborted: Any = None  # prometheus Counter, see _aborted
    budget: BodyBudget = field(default_factory=lambda: BodyBudget(2**62, 2**62))
    #: When the app was made, on the pipeline's clock (uptime).
    started: float = 0.0


STATE = web.AppKey("state", AgentState)


def load_credential(path: Path, device_id: str | None, now: float) -> Credential:
    """This device's signing key: the last unexpired key listed for it in the file."""
    store = CredentialStore.from_file(path)
    devices = store.devices
    if device_id is None:
        if len(devices) != 1:
            raise ConfigError(
                f"{path} holds {len(devices)} devices ({', '.join(devices)}); give --device-id ID"
            )
        device_id = devices[0]
    if not store.has_device(device_id):
        raise ConfigError(f"{path}: no device {device_id!r}; it has {', '.join(devices)}")
    usable = [c for c in store.keys_of(device_id) if not c.expired(now)]
    if not usable:
        raise ConfigError(f"{path}: every key of device {device_id!r} has expired; add a new one")
    return usable[-1]


def _compute(executor: ThreadPoolExecutor) -> Callable[[Callable[[], Any]], Any]:
    async def run(fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(executor, fn)

    return run


def create_app(
    config: EdgeConfig,
    *,
    model: EdgeModel | None = None,
    transports: Sequence[Transport] | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    warm_up: bool = True,
) -> web.Application:
    """The agent's app. ``transports`` replaces the HTTP ones (tests, simulations)."""
    model = model or load_model(config.package, config.runtime)
    credential = None
    if config.credentials is not None:
        credential = load_credential(config.credentials, config.device_id, wall())
    elif config.cloud or transports:
        log.warning("no --credentials: requests to the cloud are not signed")
    name, version = parse_model(config.model) if config.model else (None, "")
    ssl_context = None
    if any(u.startswith("https:") for u in config.cloud) or config.ca_file is not None:
        ssl_context = client_ssl_context(config.ca_file)
    q = config.queue
    state = AgentState(config, model, EdgeMetrics(), Admission(q.max_concurrency, q.max_queue))
    state.budget = BodyBudget(q.max_inflight_bytes, q.max_inflight_bytes)
    state.started = clock()
    app = web.Application(client_max_size=q.max_body_bytes, middlewares=[_errors])
    app[STATE] = state

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        executor = ThreadPoolExecutor(q.max_concurrency, thread_name_prefix="edge-compute")
        session = None
        links: list[Transport]
        if transports is not None:
            links = list(transports)
        else:
            session = make_session(
                config.uplink.max_connections, config.uplink.connect_timeout_s, ssl_context
            )
        signer = None
        per_endpoint = None
        if credential is not None:
            cred = credential
            if transports is None and config.uplink.sign_audience:
                # each endpoint signs for itself: a frame for one cloud is refused by another
                per_endpoint = lambda m, p, b, aud: sign(m, p, b, cred, wall(), audience=aud)  # noqa: E731
            else:
                signer = lambda m, p, b: sign(m, p, b, cred, wall())  # noqa: E731
        if transports is None:
            links = [
                HttpTransport(u, session, config.uplink.max_response_bytes, per_endpoint)
                for u in config.cloud
            ]
        uplink = None
        if links:
            uplink = Uplink(
                links,
                config.uplink,
                signer=signer,
                clock=clock,
                on_attempt=state.metrics.attempt,
            )
        pipeline = Pipeline(
            model,
            uplink,
            model_name=name,
            model_version=version,
            adapt=config.adapt,
            privacy=config.privacy,
            device_id=credential.device_id if credential else (config.device_id or "device"),
            request_timeout_s=q.request_timeout_s,
            clock=clock,
            wall=wall,
            compute=_compute(executor),
            inline_below_s=q.inline_below_ms / 1e3,
        )
        state.pipeline = pipeline
        if warm_up:
            state.warm = await pipeline.warm_up()
            log.info(
                "warm-up: %s", ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in state.warm.items())
            )
        probes = asyncio.create_task(_probe_loop(pipeline, config.uplink.health_interval_s))
        try:
            yield
        finally:
            probes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probes
            if session is not None:
                await session.close()  # type: ignore[attr-defined]
            executor.shutdown(wait=False, cancel_futures=True)

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/infer", infer)
    app.router.add_get("/", index)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/metrics", metrics)
    return app


async def _probe_loop(pipeline: Pipeline, interval: float) -> None:
    while True:
        try:
            await pipeline.probe()
        except Exception:  # a probe must never stop the loop
            log.exception("health check failed")
        await asyncio.sleep(interval)


def _pipeline(request: web.Request) -> tuple[AgentState, Pipeline]:
    state = request.app[STATE]
    if state.pipeline is None:
        raise OverloadError("the agent is starting")
    return state, state.pipeline


def _timeout(request: web.Request) -> float | None:
    text = request.headers.get(HEADER_TIMEOUT)
    if text is None:
        return None
    try:
        ms = float(text)
    except ValueError:
        raise BadInput(f"{HEADER_TIMEOUT}: {text!r} is not a number of milliseconds") from None
    if not (math.isfinite(ms) and 0 < ms <= MAX_TIMEOUT_MS):
        raise BadInput(
            f"{HEADER_TIMEOUT}: {text[:32]!r} must be milliseconds in (0, {MAX_TIMEOUT_MS}]"
        )
    return ms / 1e3


async def infer(request: web.Request) -> web.StreamResponse:
    state, pipeline = _pipeline(request)
    started = pipeline.now()
    timeout = _timeout(request)
    deadline = started + (timeout if timeout is not None else state.config.queue.request_timeout_s)
    q = state.config.queue
    declared = request.content_length
    with state.budget.reservation("local") as held:
        if declared is not None and declared <= q.max_body_bytes:
            held.grow(declared)
        body = await read_body(
            request.content,
            declared=declared,
            limit=q.max_body_bytes,
            timeout_s=q.body_timeout_s,
            grow=held.grow,
        )
    return await _infer(request, state, pipeline, body, started, deadline)


async def _infer(
    request: web.Request,
    state: AgentState,
    pipeline: Pipeline,
    body: bytes,
    started: float,
    deadline: float,
) -> web.StreamResponse:
    q = state.config.queue
    kind = body_kind(request.headers.get("Content-Type", ""), body)
    loop = asyncio.get_running_loop()
    # bodies are decoded off the event loop (a large .npz or JSON takes a while, and a
    # good request must not wait behind it); a picture, decoded and resized, only once
    # admitted, so the admission bound covers that work too
    raw = None
    if kind != "image":
        raw = await loop.run_in_executor(
            None, parse_body, kind, body, state.model.manifest, q.max_body_bytes
        )
    headers = {}
    if HEADER_PRIORITY in request.headers:
        headers[HEADER_PRIORITY] = request.headers[HEADER_PRIORITY]
    state.metrics.queued.set(state.admission.waiting + 1)
    async with state.admission.slot():
        state.metrics.queued.set(state.admission.waiting)
        state.metrics.in_flight.set(state.admission.running)
        try:
            if raw is None:
                raw = await loop.run_in_executor(
                    None, parse_body, kind, body, state.model.manifest, q.max_body_bytes
                )
            result = await pipeline.infer(
                raw,
                deadline=deadline,
                cut=request.headers.get(HEADER_CUT),
                trace_id=request.headers.get(HEADER_TRACE, "")[:128],
                headers=headers,
            )
        finally:
            state.metrics.in_flight.set(state.admission.running - 1)
    state.metrics.answered(result, pipeline.now() - started)
    return _answer(request, result, kind, pipeline)


def _wants_json(request: web.Request, kind: str) -> bool:
    accept = request.headers.get("Accept", "")
    if any(t in accept for t in NPZ_TYPES):
        return False
    return kind == "json" or JSON_TYPE in accept


def timing_header(result: Result, pipeline: Pipeline) -> str:
    """Per-stage milliseconds, the cut, the estimates, in Server-Timing syntax."""
    parts = [f"{k};dur={v * 1e3:.3f}" for k, v in result.timings.items()]
    link = result.link or pipeline.estimate().link
    parts += [
        f'cut;desc="{result.cut_id}"',
        f'local;desc="{int(result.local)}"',
        f'est-uplink-bps;desc="{link.uplink_bps:.4g}"',
        f"est-rtt;dur={link.rtt_s * 1e3:.3f}",
    ]
    if result.load is not None:
        parts.append(f'cloud-load;desc="{result.load:.3g}"')
    if result.endpoint:
        parts.append(f'endpoint;desc="{result.endpoint}";attempts={result.attempts}')
    return ", ".join(parts)


def _answer(request: web.Request, result: Result, kind: str, pipeline: Pipeline) -> web.Response:
    headers = {
        HEADER_CUT: result.cut_id,
        HEADER_LOCAL: "1" if result.local else "0",
    }
    if result.local:
        headers[HEADER_LOCAL_REASON] = result.reason.split(":")[0]
    if result.model_version:
        headers[HEADER_VERSION] = result.model_version
    if not result.local:  # what this request put on the wire (frames, not HTTP framing)
        headers[HEADER_UP_BYTES] = str(result.up_bytes)
        headers[HEADER_DOWN_BYTES] = str(result.down_bytes)
    timed = HEADER_TIMINGS in request.headers
    if timed:
        headers[HEADER_TIMINGS] = timing_header(result, pipeline)
    if _wants_json(request, kind):
        doc: dict[str, Any] = {
            "outputs": result.outputs,
            "cut": result.cut_id,
            "local": result.local,
            "model_version": result.model_version,
        }
        if result.local:
            doc["reason"] = result.reason
        if timed:
            link = result.link or pipeline.estimate().link
            doc["timings"] = {f"{k}_ms": v * 1e3 for k, v in result.timings.items()}
            doc["estimate"] = {"uplink_bps": link.uplink_bps, "rtt_ms": link.rtt_s * 1e3}
            doc["cloud_load"] = result.load
        return web.Response(body=json_bytes(doc), content_type=JSON_TYPE, headers=headers)
    return web.Response(body=npz_bytes(result.outputs), content_type=NPZ_TYPES[0], headers=headers)


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def status(request: web.Request) -> web.Response:
    state, pipeline = _pipeline(request)
    return web.Response(body=json_bytes(status_doc(state, pipeline)), content_type=JSON_TYPE)


async def index(request: web.Request) -> web.Response:
    """The status page: ``/v1/status`` as HTML."""
    state, pipeline = _pipeline(request)
    return web.Response(text=render_status(status_doc(state, pipeline)), headers=PAGE_HEADERS)


async def metrics(request: web.Request) -> web.Response:
    state, pipeline = _pipeline(request)
    state.metrics.refresh(pipeline)
    state.metrics.queued.set(state.admission.waiting)
    state.metrics.in_flight.set(state.admission.running)
    return web.Response(
        body=state.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
    )


def _aborted(state: AgentState) -> Any:
    """The counter of uploads the client abandoned mid-body (made on first use)."""
    if state.aborted is None:
        from prometheus_client import Counter

        state.aborted = Counter(
            "splitinfer_edge_aborted_uploads",
            "Requests whose client closed the connection before its body was complete.",
            registry=state.metrics.registry,
        )
    return state.aborted


def error_response(status: int, message: str) -> web.Response:
    body = json_bytes({"error": " ".join(message.split()), "status": status})
    headers = {"Retry-After": "1"} if status in (429, 503) else {}
    return web.Response(status=status, body=body, content_type=JSON_TYPE, headers=headers)


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """The one place errors become HTTP answers."""
    state = request.app[STATE]
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except ClientGone as exc:  # the client's doing: counted apart, no one to answer
        log.debug("%s %s: %s", request.method, request.path, exc)
        _aborted(state).inc()
        return web.Response(status=exc.http_status)
    except SplitInferError as exc:
        if isinstance(exc, QueueFull):
            state.metrics.rejected.inc()
        state.metrics.failed(exc.http_status)
        return error_response(exc.http_status, str(exc) or type(exc).__name__)
    except web.HTTPException as exc:
        if exc.status >= 400:
            state.metrics.failed(exc.status)
            return error_response(exc.status, exc.text or exc.reason or "")
        raise
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("bug while answering %s %s", request.method, request.path)
        state.metrics.failed(500)
        return error_response(
            500, f"internal error (a bug in the edge agent): {type(exc).__name__}"
        )
