"""Serve MoE packages from the cloud engine, with no change to the engine.

The engine and the registry take a ``runtime_factory(path, RuntimeConfig)``
that opens a cut's cloud segment. :func:`moe_runtime_factory` returns one that
opens an MoE program (``moe.json``) as an :class:`MoERuntime` (the same
interface as :class:`~splitinfer.cloud.runtime.Runtime`: ``inputs``,
``outputs``, ``providers``, thread-safe ``run``) and any other segment as the
ordinary ONNX Runtime session::

    engine = Engine(config, runtime_factory=moe_runtime_factory(CacheConfig(budget)))
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.cloud.config import RuntimeConfig
from splitinfer.cloud.moe.cache import CacheConfig, MoEMetrics
from splitinfer.cloud.moe.runner import MoERunner
from splitinfer.cloud.runtime import Runtime, choose_providers


class MoERuntime:
    """A cloud segment that is an MoE program: dense ONNX steps and MoE layers."""

    def __init__(
        self,
        path: Path,
        config: RuntimeConfig,
        cache: CacheConfig,
        *,
        prefetcher: Executor | None = None,
        metrics: MoEMetrics | None = None,
        prefetch: bool = True,
    ) -> None:
        import onnxruntime as ort

        providers = choose_providers(config.providers, ort.get_available_providers())
        self.path = path
        self._own_pool = prefetcher is None
        self.prefetcher = prefetcher or ThreadPoolExecutor(1, thread_name_prefix="moe-prefetch")
        self.cache = cache
        self.runner = MoERunner(
            path.parent,
            cache,
            program_file=path.name,
            metrics=metrics,
            prefetcher=self.prefetcher,
            prefetch=prefetch,
            providers=tuple(providers),
        )
        first = next(iter(self.runner.sessions.values()), None)
        self.providers: list[str] = list(first.get_providers()) if first else providers
        self.inputs: tuple[str, ...] = self.runner.program.inputs
        self.outputs: tuple[str, ...] = self.runner.program.outputs
        self.io_binding = False
        self._lock = threading.Lock()  # one batch at a time: the cache is shared state

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            return self.runner.run(feeds)

    def close(self) -> None:
        if self._own_pool:
            self.prefetcher.shutdown(wait=False)


def moe_runtime_factory(
    cache: CacheConfig,
    *,
    prefetcher: Executor | None = None,
    metrics: MoEMetrics | None = None,
) -> Callable[[Path, RuntimeConfig], Any]:
    """A runtime factory for the engine: MoE programs by :class:`MoERuntime`, ONNX as usual."""

    def make(path: Path, config: RuntimeConfig) -> Any:
        if path.suffix == ".json":
            return MoERuntime(path, config, cache, prefetcher=prefetcher, metrics=metrics)
        return Runtime(path, config)

    return make


#: the budget of ``expert_cache_bytes = 0``: no bound
UNBOUNDED = 1 << 62


def cache_config(config: RuntimeConfig) -> CacheConfig:
    """The expert cache a service's ``[runtime]`` section asks for."""
    return CacheConfig(config.expert_cache_bytes or UNBOUNDED, config.expert_cache_policy)


def moe_service_factory(registry: Any = None) -> Callable[[Path, RuntimeConfig], Any]:
    """The service's factory for MoE programs: each loaded version gets its own cache of
    ``expert_cache_bytes``; all of them count in one :class:`MoEMetrics` in ``registry``."""
    metrics = MoEMetrics(registry)

    def make(path: Path, config: RuntimeConfig) -> Any:
        return MoERuntime(
            path, config, cache_config(config), metrics=metrics, prefetch=config.expert_prefetch
        )

    return make
