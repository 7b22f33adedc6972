"""Loaded versions and hot reload: what serves, and swapping it without dropping a request.

A reload scans the repository, picks the versions each model's policy wants
among complete packages, loads and warms the new ones in a background thread
and only then swaps them into the routing table (one dict assignment on the
event loop). A request holds the :class:`LoadedVersion` it was routed to, so it
finishes on that version however the table changes meanwhile. A version that
fails to load is recorded with its reason and retried only when its package
changes (or on a forced reload); while any wanted version of a model failed,
nothing of that model is retired, so the old version keeps serving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.cloud.config import ModelPolicy, RuntimeConfig, ServiceConfig
from splitinfer.cloud.estimate import LatencyModel
from splitinfer.cloud.metrics import Metrics
from splitinfer.cloud.overload import CircuitOpen, Rejected
from splitinfer.cloud.repository import Candidate, HashCache, scan, select_versions, version_key
from splitinfer.cloud.runtime import Runtime
from splitinfer.cloud.tensors import PadPlan, batchable, bucket, output_axes, pad_plan
from splitinfer.cloud.traffic import choose_version, stable_draw
from splitinfer.shared.breaker import CircuitBreaker
from splitinfer.shared.codecs import (
    INT4_ZSTD,
    INT8_ZSTD,
    Codec,
    Int4ZstdCodec,
    Int8ZstdCodec,
    default_codecs,
)
from splitinfer.shared.errors import ModelError, ModelNotFoundError, SplitInferError
from splitinfer.shared.manifest import Cut, Manifest, TensorSpec, resolve_file

log = logging.getLogger("splitinfer.cloud")

RuntimeFactory = Callable[[Path, RuntimeConfig], Runtime]
_uids = itertools.count(1)


@dataclass(eq=False)
class CutRunner:
    """One cut of a loaded version: its cloud segment's runtime and how to batch it."""

    cut: Cut
    runtime: Runtime
    codecs: dict[int, Codec]
    outputs: tuple[str, ...]  # the manifest's outputs, in response order
    batchable: bool
    pad: PadPlan | None
    #: Each output's batch axis (0 unless the model returns e.g. ``(T, N, C)``).
    output_axes: dict[str, int] = field(default_factory=dict)
    latency: LatencyModel = field(default_factory=LatencyModel)
    inputs: tuple[str, ...] = field(init=False)  # the cut tensors' names, read per request

    def __post_init__(self) -> None:
        self.inputs = tuple(t.name for t in self.cut.tensors)


@dataclass(eq=False)
class LoadedVersion:
    """A version loaded and warmed; requests hold it until they are answered."""

    model: str
    version: str
    path: Path
    fingerprint: str
    manifest: Manifest
    cuts: dict[str, CutRunner]
    breaker: CircuitBreaker
    uid: int = field(default_factory=lambda: next(_uids))
    load_seconds: float = 0.0

    def runner(self, cut_id: str) -> CutRunner:
        found = self.cuts.get(cut_id)
        if found is None:
            raise ModelNotFoundError(
                f"cut {cut_id!r} is not served by {self.model} version {self.version} "
                f"(cloud cuts: {', '.join(self.cuts) or 'none'})"
            )
        return found


@dataclass
class ModelState:
    """One model: its policy, the versions serving now, and what failed or is incomplete."""

    name: str
    policy: ModelPolicy
    serving: dict[str, LoadedVersion] = field(default_factory=dict)
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)  # version: (fp, why)
    incomplete: dict[str, str] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return bool(self.serving)

    def route(self, requested: str, device: str, now: float, draw: float) -> LoadedVersion:
        """The version that serves a request (``requested`` empty: by traffic policy)."""
        if requested:
            lv = self.serving.get(requested)
            if lv is None:
                raise ModelNotFoundError(
                    f"model {self.name!r} has no version {requested!r} serving "
                    f"(serving: {', '.join(self.serving) or 'none'})"
                )
            if not lv.breaker.allows(now):
                raise CircuitOpen(
                    f"version {requested} of {self.name!r} keeps failing (circuit open)",
                    lv.breaker.retry_after(now),
                )
            return lv
        if not self.serving:
            why = "; ".join(f"{v}: {r}" for v, (_, r) in self.failed.items()) or "loading"
            raise Rejected(f"model {self.name!r} has no version ready ({why})", 5.0)
        if len(self.serving) == 1:  # the usual case, on every request: nothing to choose
            (lv,) = self.serving.values()
            if lv.breaker.allows(now):
                return lv
        draw = stable_draw(self.name, device) if self.policy.sticky and device else draw
        candidates = [v for v, lv in self.serving.items() if lv.breaker.available(now)]
        while candidates:
            lv = self.serving[choose_version(self.policy, candidates, draw)]
            if lv.breaker.allows(now):
                return lv
            candidates.remove(lv.version)
        wait = min(lv.breaker.retry_after(now) for lv in self.serving.values())
        raise CircuitOpen(f"every version of {self.name!r} keeps failing (circuit open)", wait)


class Registry:
    """Every model of the repository; :meth:`reload` is the only thing that changes it."""

    def __init__(
        self,
        config: ServiceConfig,
        metrics: Metrics | None = None,
        *,
        runtime_factory: RuntimeFactory = Runtime,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.runtime_factory = runtime_factory
        self.clock = clock
        self.draw = draw
        self.models: dict[str, ModelState] = {
            name: ModelState(name, config.policy(name)) for name in config.models
        }
        self.loaded_once = False
        self.on_retire: Callable[[LoadedVersion], None] = lambda lv: None
        self._hashes = HashCache()
        self._lock = asyncio.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="splitinfer-load")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- routing -----------------------------------------------------------------

    def model(self, name: str) -> ModelState:
        state = self.models.get(name)
        if state is None:
            raise ModelNotFoundError(
                f"model {name!r} is not served here (models: {', '.join(self.models) or 'none'})"
            )
        return state

    def knows(self, name: str) -> bool:
        return name in self.models

    def route(self, model: str, version: str, device: str = "") -> LoadedVersion:
        return self.model(model).route(version, device, self.clock(), self.draw())

    @property
    def ready(self) -> bool:
        return self.loaded_once and all(m.ready for m in self.models.values())

    # -- reload ------------------------------------------------------------------

    async def reload(self, force: bool = False) -> dict[str, Any]:
        """Rescan and swap in what changed; returns what was loaded, failed and retired."""
        loop = asyncio.get_running_loop()
        async with self._lock:
            found = await loop.run_in_executor(
                self._pool, scan, self.config.repository_path, self._hashes
            )
            report: dict[str, Any] = {"loaded": [], "failed": [], "retired": []}
            for name in sorted(set(found) | set(self.config.models)):
                await self._reload_model(name, found.get(name, []), force, report)
            for name in [n for n in self.models if n not in found and n not in self.config.models]:
                for lv in self.models.pop(name).serving.values():
                    self._retire(lv, report)
            self.loaded_once = True
            return report

    async def _reload_model(
        self, name: str, candidates: list[Candidate], force: bool, report: dict[str, Any]
    ) -> None:
        loop = asyncio.get_running_loop()
        state = self.models.setdefault(name, ModelState(name, self.config.policy(name)))
        complete = {c.version: c for c in candidates if c.complete}
        state.incomplete = {c.version: c.problem for c in candidates if not c.complete}
        wanted = select_versions(state.policy, list(complete))
        serving: dict[str, LoadedVersion] = {}
        any_failed = False
        for version in wanted:
            cand = complete[version]
            current = state.serving.get(version)
            if current is not None and current.fingerprint == cand.fingerprint:
                serving[version] = current
                continue
            failed = state.failed.get(version)
            if failed is not None and failed[0] == cand.fingerprint and not force:
                any_failed = True
                if current is not None:
                    serving[version] = current
                continue
            started = time.perf_counter()
            try:
                lv = await loop.run_in_executor(self._pool, self._load, cand)
            except SplitInferError as exc:
                any_failed = True
                reason = _line(exc)
                state.failed[version] = (cand.fingerprint, reason)
                self.metrics.loads.labels(name, version, "failure").inc()
                report["failed"].append({"model": name, "version": version, "error": reason})
                log.error("%s version %s failed to load: %s", name, version, reason)
                if current is not None:
                    serving[version] = current  # the old package keeps serving
                continue
            lv.load_seconds = time.perf_counter() - started
            state.failed.pop(version, None)
            serving[version] = lv
            self.metrics.loads.labels(name, version, "success").inc()
            self.metrics.load_seconds.labels(name).observe(lv.load_seconds)
            report["loaded"].append({"model": name, "version": version})
            log.info("%s version %s loaded and warmed in %.2f s", name, version, lv.load_seconds)
        for version in [v for v in state.failed if v not in wanted]:
            del state.failed[version]  # deleted (or no longer wanted): not failed any more
        if any_failed:  # retire nothing while something wanted failed
            for version, lv in state.serving.items():
                serving.setdefault(version, lv)
        for version, lv in state.serving.items():
            if serving.get(version) is not lv:
                self._retire(lv, report)
        state.serving = dict(sorted(serving.items(), key=lambda kv: version_key(kv[0])))
        self.metrics.serving_versions.labels(name).set(len(state.serving))

    def _retire(self, lv: LoadedVersion, report: dict[str, Any]) -> None:
        report["retired"].append({"model": lv.model, "version": lv.version})
        log.info("%s version %s retired (in-flight requests finish on it)", lv.model, lv.version)
        self.on_retire(lv)

    def _load(self, cand: Candidate) -> LoadedVersion:
        """Open every cloud segment and warm it; runs in the loader thread."""
        manifest = cand.manifest
        assert manifest is not None
        batching = self.config.batching_for(cand.model)
        policy = self.config.policy(cand.model)
        cuts: dict[str, CutRunner] = {}
        for cut in manifest.cuts:
            if cut.cloud is None:
                continue
            runtime = self.runtime_factory(
                resolve_file(cand.path, cut.cloud.file), self.config.runtime
            )
            runner = CutRunner(
                cut=cut,
                runtime=runtime,
                codecs=_codecs(cand.path, cut),
                outputs=tuple(o.name for o in manifest.outputs),
                batchable=batchable(cut, manifest.outputs, manifest.batch_dim),
                output_axes=output_axes(manifest.outputs, manifest.batch_dim),
                pad=pad_plan(cut, manifest.outputs, manifest.batch_dim)
                if policy.pad_buckets
                else None,
            )
            _check_io(runner, cand)
            if self.config.warmup:
                _warm(runner, manifest, batching.max_batch_size)
            cuts[cut.id] = runner
        ov = self.config.overload
        breaker = CircuitBreaker(ov.breaker_failures, ov.breaker_cooldown_s)
        return LoadedVersion(
            cand.model, cand.version, cand.path, cand.fingerprint, manifest, cuts, breaker
        )

    # -- status --------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        models = []
        for state in self.models.values():
            versions: list[dict[str, Any]] = []
            for v, lv in state.serving.items():
                versions.append(
                    {
                        "version": v,
                        "state": "serving",
                        "cuts": list(lv.cuts),
                        # cuts served one request per run (a fixed batch axis)
                        "unbatched_cuts": [c for c, r in lv.cuts.items() if not r.batchable],
                        "batch": lv.manifest.optimization.get("batch"),
                        "default_cut": lv.manifest.default_cut,
                        "providers": next(iter(lv.cuts.values())).runtime.providers,
                        "breaker": lv.breaker.state(self.clock()),
                        "load_seconds": round(lv.load_seconds, 3),
                    }
                )
            for v, (_, why) in state.failed.items():
                versions.append({"version": v, "state": "failed", "error": why})
            for v, why in state.incomplete.items():
                versions.append({"version": v, "state": "incomplete", "error": why})
            p = state.policy
            models.append(
                {
                    "name": state.name,
                    "ready": state.ready,
                    "versions": versions,
                    "policy": {
                        "versions": p.versions,
                        "latest": p.latest,
                        "version_list": list(p.version_list),
                        "weights": dict(p.weights),
                        "canary_percent": p.canary_percent,
                        "sticky": p.sticky,
                    },
                }
            )
        return {"models": models}


def _codecs(path: Path, cut: Cut) -> dict[int, Codec]:
    codecs = default_codecs()
    if cut.codec.dictionary or cut.codec.level != 3:
        dictionary = None
        if cut.codec.dictionary:
            dictionary = resolve_file(path, cut.codec.dictionary).read_bytes()
        codecs[INT8_ZSTD] = Int8ZstdCodec(level=cut.codec.level, dictionary=dictionary)
        codecs[INT4_ZSTD] = Int4ZstdCodec(level=cut.codec.level, dictionary=dictionary)
    return codecs


def _check_io(runner: CutRunner, cand: Candidate) -> None:
    """The session reads only cut tensors and yields (or passes through) every output."""
    have = set(runner.inputs)
    extra = [n for n in runner.runtime.inputs if n not in have]
    if extra:
        raise ModelError(f"cut {runner.cut.id}: the cloud segment needs {extra}, not cut tensors")
    missing = [o for o in runner.outputs if o not in runner.runtime.outputs and o not in have]
    if missing:
        raise ModelError(f"cut {runner.cut.id}: the cloud segment does not produce {missing}")


def _warm(runner: CutRunner, manifest: Manifest, max_batch: int) -> None:
    """Run batch 1 and the largest batch twice each; the second runs seed the estimate."""
    symbols: dict[str, int] = {}
    for spec in manifest.inputs:
        sample = manifest.analysis_shapes.get(spec.name, [])
        for dim, value in zip(spec.shape[1:], sample, strict=False):
            if isinstance(dim, str):
                symbols.setdefault(dim, int(value))
    if runner.pad is not None:
        symbols[runner.pad.symbol] = bucket(symbols.get(runner.pad.symbol, 1))
    sizes = sorted({1, max_batch}) if runner.batchable else [1]
    for rows in sizes:
        feeds = {}
        for spec in runner.cut.tensors:
            shape = _warm_shape(spec, rows, manifest.batch_dim, symbols, runner.cut)
            feeds[spec.name] = np.ones(shape, dtype=spec.dtype)
        try:
            runner.runtime.run(feeds)
            started = time.perf_counter()
            runner.runtime.run(feeds)
        except Exception as exc:  # ORT's errors are untyped
            raise ModelError(
                f"cut {runner.cut.id}: warm-up at batch {rows} failed: {_line(exc)[:300]}"
            ) from exc
        runner.latency.observe(rows, time.perf_counter() - started)


def _warm_shape(
    spec: TensorSpec, rows: int, batch_dim: str | None, symbols: dict[str, int], cut: Cut
) -> list[int]:
    """A cut tensor's warm-up shape: the batch, the inputs' analysed sizes, and a dimension
    of the tensor's own (NAME_dimK, say H/8 of a free H) at the size the partitioner
    analysed it at (1 would not fit a neck's Concat); 1 for a symbol nothing fixes."""
    lead = 1 if spec.shape and spec.shape[0] == batch_dim else 0
    known = cut.sample_shapes.get(spec.name)
    if known is not None and len(known) != len(spec.shape) - lead:
        known = None
    shape = []
    for k, d in enumerate(spec.shape):
        if d == batch_dim:
            shape.append(rows)
        elif isinstance(d, int):
            shape.append(d)
        elif d in symbols:
            shape.append(symbols[d])
        else:
            shape.append(1 if known is None else known[k - lead])
    return shape


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
