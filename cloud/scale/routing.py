"""What the Ray Serve deployment does, without Ray: version routing and per-version engines.

:class:`VersionTable` (the ingress): scans the repository as the daemon does and
picks the version of each request by the model's traffic policy (A/B weights,
canary, newest, sticky per device), so that the request can be sent to a
replica holding that version. Its key is ``model:version:fingerprint``: a
package replaced under the same version name gets a new key, never a stale
engine.

:class:`VersionEngines` (each replica): one in-process
:class:`~splitinfer.cloud.engine.Engine` per model version it was asked for,
over a one-version view of the repository (a folder of symlinks), built from
the same :class:`~splitinfer.cloud.config.ServiceConfig` as ``cloud-service``.

:class:`ReplicaBackend` (the ingress's backend of
:class:`~splitinfer.cloud.handler.CloudHandler`, the one request handler of
``cloud-service`` too): the handler checks content type, size, signature (its
headers before the body is read) and rate, then this picks the version and
calls a replica, whose engine decodes and checks the frame (the cut's codec
included) as the daemon's does. The ingress answers what the daemon answers,
so an edge agent cannot tell the two apart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from splitinfer.cloud.config import ModelPolicy, ServiceConfig
from splitinfer.cloud.engine import Engine
from splitinfer.cloud.handler import (
    auth_kind,
    infer_frame,
    infer_json_on,
    readiness_doc,
    reply_of,
)
from splitinfer.cloud.metrics import UNKNOWN
from splitinfer.cloud.repository import HashCache, scan, select_versions
from splitinfer.cloud.traffic import choose_version, stable_draw
from splitinfer.shared.contract import SERVER_TIMING, Reply
from splitinfer.shared.errors import (
    AuthError,
    ConfigError,
    ModelNotFoundError,
    OverloadError,
    ProtocolError,
)
from splitinfer.shared.frame import peek_request


def model_key(model: str, version: str, fingerprint: str) -> str:
    """The multiplexed model id of one version of one package."""
    return f"{model}:{version}:{fingerprint[:16]}"


def parse_key(key: str) -> tuple[str, str, str]:
    model, sep, rest = key.partition(":")
    version, sep2, fingerprint = rest.partition(":")
    if not (sep and sep2 and model and version and fingerprint):
        raise ConfigError(f"multiplexed model id {key!r}: expected model:version:fingerprint")
    return model, version, fingerprint


@dataclass(frozen=True)
class VersionInfo:
    version: str
    fingerprint: str
    path: Path
    cuts: tuple[str, ...]
    default_cut: str


class VersionTable:
    """The ingress's view of the repository: which versions serve, and the traffic policy."""

    def __init__(self, config: ServiceConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self._hashes = HashCache()
        self._rng = rng or random.Random()
        self.models: dict[str, dict[str, VersionInfo]] = {}
        self.problems: dict[str, dict[str, str]] = {}

    def rescan(self) -> dict[str, Any]:
        """Scan the repository (blocking: run it off the event loop); report what changed."""
        found = scan(self.config.repository_path, self._hashes)
        before = {m: {v: i.fingerprint for v, i in vs.items()} for m, vs in self.models.items()}
        models: dict[str, dict[str, VersionInfo]] = {}
        problems: dict[str, dict[str, str]] = {}
        for name, candidates in found.items():
            complete = {c.version: c for c in candidates if c.complete}
            problems[name] = {c.version: c.problem for c in candidates if not c.complete}
            wanted = select_versions(self.config.policy(name), list(complete))
            served: dict[str, VersionInfo] = {}
            for v in wanted:
                c = complete[v]
                assert c.manifest is not None
                cuts = tuple(cut.id for cut in c.manifest.cuts if cut.cloud is not None)
                served[v] = VersionInfo(v, c.fingerprint, c.path, cuts, c.manifest.default_cut)
            models[name] = served
        self.models, self.problems = models, problems
        after = {m: {v: i.fingerprint for v, i in vs.items()} for m, vs in models.items()}
        loaded = [
            {"model": m, "version": v}
            for m, vs in after.items()
            for v, fp in vs.items()
            if before.get(m, {}).get(v) != fp
        ]
        retired = [
            {"model": m, "version": v}
            for m, vs in before.items()
            for v in vs
            if v not in after.get(m, {})
        ]
        return {"loaded": loaded, "failed": [], "retired": retired}

    def route(self, model: str, requested: str, device: str) -> tuple[VersionInfo, str]:
        """The version that serves a request and its multiplexed model id."""
        versions = self.models.get(model)
        if versions is None:
            raise ModelNotFoundError(
                f"model {model!r} is not served here (models: {', '.join(self.models) or 'none'})"
            )
        if requested:
            info = versions.get(requested)
            if info is None:
                raise ModelNotFoundError(
                    f"model {model!r} has no version {requested!r} serving "
                    f"(serving: {', '.join(versions) or 'none'})"
                )
        else:
            if not versions:
                why = "; ".join(f"{v}: {p}" for v, p in self.problems.get(model, {}).items())
                raise OverloadError(f"model {model!r} has no version ready ({why or 'none'})")
            policy = self.config.policy(model)
            draw = self._rng.random()
            if policy.sticky and device:
                draw = stable_draw(model, device)
            info = versions[choose_version(policy, list(versions), draw)]
        return info, model_key(model, info.version, info.fingerprint)

    def status(self) -> dict[str, Any]:
        """``GET /v1/models`` as the daemon answers it, from the ingress's view."""
        out = []
        for name, versions in self.models.items():
            policy = self.config.policy(name)
            b = self.config.batching_for(name)
            out.append(
                {
                    "name": name,
                    "ready": bool(versions),
                    "versions": [
                        {
                            "version": v,
                            "state": "serving",
                            "cuts": list(i.cuts),
                            "default_cut": i.default_cut,
                        }
                        for v, i in versions.items()
                    ],
                    "incomplete": self.problems.get(name, {}),
                    "policy": {
                        "versions": policy.versions,
                        "weights": dict(policy.weights),
                        "canary_percent": policy.canary_percent,
                        "sticky": policy.sticky,
                    },
                    "batching": {
                        "enabled": b.enabled,
                        "max_batch_size": b.max_batch_size,
                        "max_queue_delay_ms": b.max_queue_delay_ms,
                        "max_queue_size": b.max_queue_size,
                    },
                }
            )
        return {"models": out}

    @property
    def ready(self) -> bool:
        wanted = set(self.config.models) | set(self.models)
        return bool(wanted) and all(self.models.get(m) for m in wanted)


# -- replicas ---------------------------------------------------------------------------


def version_config(config: ServiceConfig, model: str, version: str, view: Path) -> ServiceConfig:
    """The service config of one version alone: the view repository, the version listed."""
    policy = config.policy(model)
    only = ModelPolicy(
        versions="list",
        version_list=(version,),
        pad_buckets=policy.pad_buckets,
        batching=policy.batching,
    )
    return dataclasses.replace(
        config, repository=str(view), models={model: only}, watch_interval_s=0.0
    )


class VersionEngine:
    """One started engine serving one version; ``close`` stops it (also on unload)."""

    def __init__(self, engine: Engine, view: Path, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.view = view
        self._loop = loop
        self._closed = False

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.engine.stop()
        finally:
            shutil.rmtree(self.view, ignore_errors=True)

    def __del__(self) -> None:
        # Ray Serve calls this (in a thread) when the version is unloaded (LRU)
        if not self._closed and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.close()))


EngineFactory = Callable[[ServiceConfig], Engine]


async def open_version(
    config: ServiceConfig, key: str, factory: EngineFactory = Engine
) -> VersionEngine:
    """Load one version (named by its multiplexed id) into a started engine."""
    model, version, fingerprint = parse_key(key)
    source = config.repository_path / model / version
    if not source.is_dir():
        raise ModelNotFoundError(f"model {model!r} has no version {version!r} in the repository")
    view = Path(tempfile.mkdtemp(prefix="splitinfer-replica-"))
    (view / model).mkdir()
    (view / model / version).symlink_to(source.resolve(), target_is_directory=True)
    engine = factory(version_config(config, model, version, view))
    try:
        await engine.start()
        state = engine.registry.model(model)
        lv = state.serving.get(version)
        if lv is None:
            why = state.failed.get(version, ("", "not loaded"))[1]
            raise ModelNotFoundError(f"{model} version {version} failed to load: {why}")
        if not lv.fingerprint.startswith(fingerprint):
            raise OverloadError(
                f"{model} version {version} changed on disk while loading; retry", 1.0
            )
    except BaseException:
        await engine.stop(drain_timeout=0.0)
        shutil.rmtree(view, ignore_errors=True)
        raise
    return VersionEngine(engine, view, asyncio.get_running_loop())


# -- replies -------------------------------------------------------------------------------


async def reply_for(work: Awaitable[Reply]) -> Reply:
    """Await a replica's reply; any error becomes the contract's JSON error."""
    try:
        return await work
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        return reply_of(exc)


async def infer_reply(engine: Engine, model: str, body: bytes, device: str, priority: int) -> Reply:
    """``POST /v1/models/{model}/infer`` on one replica's engine."""
    return await infer_frame(engine, model, body, device, priority)


async def infer_json_reply(
    engine: Engine, model: str, data: dict[str, Any], device: str, priority: int
) -> Reply:
    """``POST /v1/models/{model}/infer.json`` on one replica's engine (``data`` checked)."""
    version = next(iter(engine.registry.model(model).serving))
    return await infer_json_on(
        engine, model, data["cut_id"], data["inputs"], version, device, priority
    )


#: ``call(model, key, method, *args)``: a replica holding ``key`` runs ``method``.
ReplicaCall = Callable[..., Awaitable[Reply]]


class ReplicaBackend:
    """The handler's backend at the Ray Serve ingress: route by policy, call a replica.

    ``call`` sends to a replica that holds the version (Ray's handle, with its
    retries, in ``ray_serve.py``; any coroutine in tests). Its counters are in
    ``registry``, which ``GET /metrics`` renders.
    """

    def __init__(
        self,
        config: ServiceConfig,
        table: VersionTable,
        call: ReplicaCall,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.table = table
        self.call = call
        self.limits = config.limits()
        self.started = time.monotonic()
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "splitinfer_ingress_requests",
            "Requests answered by the ingress",
            ["model", "version", "status"],
            registry=self.registry,
        )
        self.rejections = Counter(
            "splitinfer_ingress_rejections",
            "Requests the ingress refused itself, by reason",
            ["model", "reason"],
            registry=self.registry,
        )
        self.auth_failures = Counter(
            "splitinfer_ingress_auth_failures",
            "Requests refused for their signature, by kind",
            ["kind"],
            registry=self.registry,
        )
        self.aborts = Counter(  # the daemon's name: one alert covers both front ends
            "splitinfer_aborted_uploads",
            "Requests whose client closed the connection before its body was complete",
            registry=self.registry,
        )

    async def infer(self, model: str, body: bytes, device: str, priority: int) -> Reply:
        started = time.perf_counter()
        if model not in self.table.models:  # 404 first, as the engine answers
            self.table.route(model, "", device)
        ids = peek_request(body, self.limits)
        if ids is not None and ids[0] != model:
            raise ProtocolError(f"frame.model: {ids[0]!r} does not match the URL's model {model!r}")
        _, key = self.table.route(model, ids[1] if ids else "", device)
        reply = await self.call(model, key, "infer", model, body, device, priority)
        if reply.status != 200:
            return reply
        # the edge subtracts our time, the replica hop included
        timing = f"cloud;dur={(time.perf_counter() - started) * 1e3:.3f}"
        return Reply(200, {**reply.headers, SERVER_TIMING: timing}, reply.body)

    async def infer_json(
        self,
        model: str,
        inputs: dict[str, Any],
        cut_id: str,
        version: str,
        device: str,
        priority: int,
    ) -> Reply:
        info, key = self.table.route(model, version, device)
        data = {"cut_id": cut_id or info.default_cut, "inputs": inputs}
        return await self.call(model, key, "infer_json", model, data, device, priority)

    async def reload(self) -> dict[str, Any]:
        return await asyncio.get_running_loop().run_in_executor(None, self.table.rescan)

    def models(self) -> dict[str, Any]:
        return self.table.status()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        ready = self.table.ready
        return ready, readiness_doc(ready, self.table.status())

    def status(self) -> dict[str, Any]:
        return {
            "service": "cloud-service (Ray Serve ingress)",
            "ready": self.table.ready,
            "uptime_s": time.monotonic() - self.started,
            "models": self.table.status()["models"],
            "note": "queues, batches and latencies are the replicas': see their metrics",
        }

    def metrics(self) -> Reply:
        return Reply(200, {"Content-Type": CONTENT_TYPE_LATEST}, generate_latest(self.registry))

    def label(self, model: str) -> str:
        return model if model in self.table.models else UNKNOWN

    def counted(self, label: str, version: str, status: int) -> None:
        self.requests.labels(label, version, str(status)).inc()

    def rejected(self, label: str, exc: BaseException, status: int) -> None:
        self.rejections.labels(label, type(exc).__name__).inc()
        if isinstance(exc, AuthError) and status == 401:
            self.auth_failures.labels(auth_kind(exc)).inc()

    def aborted(self) -> None:
        self.aborts.inc()
