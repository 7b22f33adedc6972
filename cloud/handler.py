"""The cloud service's HTTP API, written once and framework-free (docs/http-api.md).

:class:`CloudHandler` answers one request, given as method, raw path, headers,
a body stream and the peer's address, with a
:class:`~splitinfer.shared.contract.Reply`. It checks the transport (route,
content type, then size, signature and rate in ``cloud/guard.py``, the
signature headers before a byte of the body is read), hands the work to a :class:`Backend`, and
turns every error into the contract's JSON error in one place
(:func:`status_of`), counting inference and admin requests by model, version
and status.

Two backends: :class:`EngineBackend`, the in-process
:class:`~splitinfer.cloud.engine.Engine` (``cloud-service`` and tests), and
``cloud/scale/routing.ReplicaBackend``, engine replicas behind the Ray Serve
ingress. Front ends only adapt their request and response objects:
``cloud/server.py`` (aiohttp), ``cloud/scale/ray_serve.py`` (Starlette), and
the edge's ``HandlerTransport`` (a function call, for tests).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol
from urllib.parse import unquote

from prometheus_client import Counter

from splitinfer import __version__
from splitinfer.cloud.config import ServiceConfig
from splitinfer.cloud.engine import DEFAULT_PRIORITY, Engine
from splitinfer.cloud.guard import Guard
from splitinfer.cloud.metrics import UNKNOWN
from splitinfer.cloud.status import engine_status, render_status
from splitinfer.serving.body import ClientGone
from splitinfer.shared.auth import CredentialStore
from splitinfer.shared.contract import (
    FRAME_TYPE,
    HEADER_PRIORITY,
    HEADER_VERSION,
    JSON_TYPE,
    MODELS_PATH,
    RELOAD_PATH,
    SERVER_TIMING,
    BodyStream,
    Reply,
    error_reply,
    one_line,
)
from splitinfer.shared.errors import (
    AuthError,
    ModelNotFoundError,
    ProtocolError,
    SplitInferError,
)
from splitinfer.shared.statuspage import PAGE_HEADERS

log = logging.getLogger("splitinfer.cloud")

NO_AUTH_WARNING = "authentication is off (--no-auth): any client may use this service"
JSON_HEADERS = {"Content-Type": f"{JSON_TYPE}; charset=utf-8"}


class UnsupportedMediaType(SplitInferError):
    http_status = 415


class MethodNotAllowed(SplitInferError):
    http_status = 405


# -- what the handler needs of what is behind it ------------------------------------------


class Backend(Protocol):
    """What answers the requests the handler has checked, and counts them."""

    async def infer(self, model: str, body: bytes, device: str, priority: int) -> Reply: ...

    async def infer_json(
        self,
        model: str,
        inputs: dict[str, Any],
        cut_id: str,
        version: str,
        device: str,
        priority: int,
    ) -> Reply: ...

    async def reload(self) -> dict[str, Any]: ...

    def models(self) -> dict[str, Any]: ...

    def readiness(self) -> tuple[bool, dict[str, Any]]: ...

    def status(self) -> dict[str, Any]:
        """What the status page at ``GET /`` shows (``cloud/status.py``)."""
        ...

    def metrics(self) -> Reply: ...

    def label(self, model: str) -> str:
        """The model's metrics label (unknown names share one, so labels stay bounded)."""
        ...

    def counted(self, label: str, version: str, status: int) -> None: ...

    def rejected(self, label: str, exc: BaseException, status: int) -> None: ...

    def aborted(self) -> None: ...


def frame_reply(body: bytes, version: str, service_s: float) -> Reply:
    """A 200 answer frame; Server-Timing lets the edge tell the network's share from ours."""
    return Reply(
        200,
        {
            "Content-Type": FRAME_TYPE,
            HEADER_VERSION: version,
            SERVER_TIMING: f"cloud;dur={service_s * 1e3:.3f}",
        },
        body,
    )


async def infer_frame(engine: Engine, model: str, body: bytes, device: str, priority: int) -> Reply:
    """A request frame on ``engine``: the 200 answer (what a Ray replica answers too)."""
    served = await engine.infer(model, body, device=device, priority=priority)
    return frame_reply(served.body, served.version, served.service_s)


async def infer_json_on(
    engine: Engine,
    model: str,
    cut_id: str,
    inputs: Mapping[str, Any],
    version: str,
    device: str,
    priority: int,
) -> Reply:
    """The JSON debugging path on ``engine``: the 200 answer (a Ray replica's too)."""
    outputs, served = await engine.infer_arrays(
        model, cut_id, inputs, version=version, device=device, priority=priority
    )
    doc = {"outputs": outputs, "model_version": served}
    # a large answer takes a while to write: off the loop, so others are not stalled
    text = await asyncio.get_running_loop().run_in_executor(None, json_answer, doc)
    return Reply(200, {**JSON_HEADERS, HEADER_VERSION: served}, text.encode())


def readiness_doc(ready: bool, status: Mapping[str, Any]) -> dict[str, Any]:
    """``GET /readyz``'s body from a ``GET /v1/models`` status."""
    return {
        "ready": ready,
        "models": {
            m["name"]: {"ready": m["ready"], "versions": m["versions"]} for m in status["models"]
        },
    }


def json_reply(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Reply:
    return Reply(status, {**JSON_HEADERS, **(headers or {})}, json_answer(data).encode())


def json_answer(doc: Any) -> str:
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


def priority_of(raw: str | None) -> int:
    """The ``X-Splitinfer-Priority`` header's value (absent: the default)."""
    if raw is None:
        return DEFAULT_PRIORITY
    if not (len(raw) == 1 and raw.isdigit()):
        raise ProtocolError(f"{HEADER_PRIORITY}: {raw[:16]!r} is not a priority 0..9")
    return int(raw)


# -- errors, in one place ---------------------------------------------------------


def status_of(exc: BaseException) -> tuple[int, str, float | None]:
    """HTTP status, one-line message and Retry-After seconds for an exception."""
    if isinstance(exc, SplitInferError):
        message = one_line(str(exc)) or type(exc).__name__
        retry = getattr(exc, "retry_after", None)
        if retry is None and exc.http_status in (429, 503):
            retry = 1.0
        return exc.http_status, message, retry
    return 500, f"internal error (a bug, please report it): {type(exc).__name__}: {exc}", None


def reply_of(exc: BaseException) -> Reply:
    """The contract's JSON error for an exception."""
    status, message, retry = status_of(exc)
    return error_reply(status, message, retry)


def auth_kind(exc: AuthError) -> str:
    """The ``kind`` label of an authentication failure."""
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


def _media_type(headers: Mapping[str, str]) -> str:
    raw = headers.get("Content-Type")
    if not raw:
        return "application/octet-stream"  # RFC 9110 8.3: what a body without one is
    return raw.split(";", 1)[0].strip().lower()


def _content_type(headers: Mapping[str, str], wanted: str) -> None:
    if headers.get("Content-Type") == wanted:  # as clients send it: nothing to normalise
        return
    got = _media_type(headers)
    if got != wanted:
        raise UnsupportedMediaType(f"Content-Type {got!r}: send {wanted}")


# -- the handler ----------------------------------------------------------------------


class CloudHandler:
    """The whole HTTP API over a :class:`Backend`: ``await handler(method, path, ...)``.

    ``path`` is the raw request target (query included): the signature covers it.
    """

    def __init__(
        self,
        config: ServiceConfig,
        backend: Backend,
        credentials: CredentialStore | None = None,
        *,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.backend = backend
        self.guard = Guard(config, credentials, wall=wall, clock=clock)

    def close(self) -> None:
        self.guard.close()

    async def __call__(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: BodyStream,
        remote: str = "",
    ) -> Reply:
        route = path.split("?", 1)[0]
        parts = route.split("/")
        model: str | None = None
        if (
            len(parts) == 5
            and parts[:3] == ["", "v1", "models"]
            and parts[4]
            in (
                "infer",
                "infer.json",
            )
        ):
            model = unquote(parts[3])
        label = "_admin" if model is None else self.backend.label(model)
        counted = model is not None or route == RELOAD_PATH
        try:
            reply = await self._route(method, path, route, model, headers, body, remote)
        except asyncio.CancelledError:
            raise
        except ClientGone as exc:  # the client's doing: counted apart, no one to answer
            log.debug("%s %s: %s", method, route, exc)
            self.backend.aborted()
            return Reply(exc.http_status)
        except Exception as exc:
            status, message, retry = status_of(exc)
            if status >= 500 and not isinstance(exc, SplitInferError):
                log.exception("internal error on %s %s", method, route)
            reply = error_reply(status, message, retry)
            if counted:
                self.backend.rejected(label, exc, status)
        if counted:
            self.backend.counted(label, reply.header(HEADER_VERSION), reply.status)
        return reply

    async def _route(
        self,
        method: str,
        path: str,
        route: str,
        model: str | None,
        headers: Mapping[str, str],
        body: BodyStream,
        remote: str,
    ) -> Reply:
        if model is not None and method == "POST":  # inference: no other route matches
            if route.endswith(".json"):
                return await self._infer_json(model, path, headers, body, remote)
            return await self._infer(model, path, headers, body, remote)
        gets = {
            "/": self._index,
            "/healthz": self._healthz,
            "/readyz": self._readyz,
            MODELS_PATH: self._models,
            "/metrics": self.backend.metrics,
        }
        if route in gets:
            if method not in ("GET", "HEAD"):
                raise MethodNotAllowed(f"{method} {route}: use GET")
            return gets[route]()
        if model is None and route != RELOAD_PATH:
            raise ModelNotFoundError(f"no route {method} {route[:200]} (see docs/http-api.md)")
        if method != "POST":
            raise MethodNotAllowed(f"{method} {route[:200]}: use POST")
        if model is None:
            return await self._reload(path, headers, body, remote)
        if route.endswith(".json"):
            return await self._infer_json(model, path, headers, body, remote)
        return await self._infer(model, path, headers, body, remote)

    async def _infer(
        self, model: str, path: str, headers: Mapping[str, str], stream: BodyStream, remote: str
    ) -> Reply:
        _content_type(headers, FRAME_TYPE)
        priority = priority_of(headers.get(HEADER_PRIORITY))
        limit = self.config.max_body_bytes
        async with self.guard.incoming("POST", path, headers, stream, remote, limit) as (
            device,
            body,
        ):
            return await self.backend.infer(model, body, device, priority)

    async def _infer_json(
        self, model: str, path: str, headers: Mapping[str, str], stream: BodyStream, remote: str
    ) -> Reply:
        _content_type(headers, JSON_TYPE)
        priority = priority_of(headers.get(HEADER_PRIORITY))
        loop = asyncio.get_running_loop()
        limit = self.config.max_json_bytes
        async with self.guard.incoming("POST", path, headers, stream, remote, limit) as (
            device,
            body,
        ):
            # a large JSON body takes a while to parse: off the loop, so others are not stalled
            inputs, cut_id, version = await loop.run_in_executor(None, parse_infer_json, body)
            del body
        return await self.backend.infer_json(model, inputs, cut_id, version, device, priority)

    async def _reload(
        self, path: str, headers: Mapping[str, str], stream: BodyStream, remote: str
    ) -> Reply:
        limit = self.config.max_json_bytes
        async with self.guard.incoming("POST", path, headers, stream, remote, limit):
            pass
        return json_reply(await self.backend.reload())

    def _healthz(self) -> Reply:
        return Reply(200, {"Content-Type": "text/plain; charset=utf-8"}, b"ok")

    def _readyz(self) -> Reply:
        ready, doc = self.backend.readiness()
        if self.config.no_auth:
            doc["warning"] = NO_AUTH_WARNING
        return json_reply(doc, status=200 if ready else 503)

    def _models(self) -> Reply:
        return json_reply(self.backend.models())

    def _index(self) -> Reply:
        doc = self.backend.status()
        doc["auth"] = not self.config.no_auth
        doc["version"] = __version__
        return Reply(200, dict(PAGE_HEADERS), render_status(doc).encode())


# -- the in-process engine --------------------------------------------------------------


class EngineBackend:
    """The handler's backend on one in-process :class:`Engine`, counting in its metrics."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.started = engine.clock()
        self.aborts = Counter(
            "splitinfer_aborted_uploads",
            "Requests whose client closed the connection before its body was complete",
            registry=engine.metrics.registry,
        )

    async def infer(self, model: str, body: bytes, device: str, priority: int) -> Reply:
        return await infer_frame(self.engine, model, body, device, priority)

    async def infer_json(
        self,
        model: str,
        inputs: dict[str, Any],
        cut_id: str,
        version: str,
        device: str,
        priority: int,
    ) -> Reply:
        if not cut_id:
            cut_id = self.engine.registry.route(model, version, device).manifest.default_cut
        return await infer_json_on(self.engine, model, cut_id, inputs, version, device, priority)

    async def reload(self) -> dict[str, Any]:
        return await self.engine.reload(force=True)

    def models(self) -> dict[str, Any]:
        engine = self.engine
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
        return status

    def status(self) -> dict[str, Any]:
        return engine_status(self.engine, self.models(), self.engine.clock() - self.started)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        engine = self.engine
        doc = readiness_doc(engine.ready, engine.registry.status())
        if engine.closing:
            doc["closing"] = True
        return engine.ready, doc

    def metrics(self) -> Reply:
        m = self.engine.metrics
        return Reply(200, {"Content-Type": m.content_type}, m.render())

    def label(self, model: str) -> str:
        return model if self.engine.registry.knows(model) else UNKNOWN

    def counted(self, label: str, version: str, status: int) -> None:
        self.engine.metrics.request(label, version, status)

    def rejected(self, label: str, exc: BaseException, status: int) -> None:
        metrics = self.engine.metrics
        metrics.rejections.labels(label, type(exc).__name__).inc()
        if isinstance(exc, AuthError) and status == 401:
            metrics.auth_failures.labels(auth_kind(exc)).inc()

    def aborted(self) -> None:
        self.aborts.inc()
