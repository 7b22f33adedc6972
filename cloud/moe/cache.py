"""The expert cache: a byte budget of experts on the device, paged from the store.

Experts live memory-mapped in :class:`~splitinfer.cloud.moe.store.ExpertStore`
(host) and are copied into a bounded cache on the device (numpy arrays on a
CPU-only machine, CUDA tensors on a GPU; see ``device.py``). The budget counts
every expert resident or being loaded, so it is never exceeded; routers are
small and always resident, outside the budget.

- Eviction: ``lru`` (least recently used) or ``lfru`` (frequency and recency,
  after LRFU: each expert's combined recency-frequency value, CRF = sum over its
  accesses of 2^(-decay * age), age counted in accesses; the lowest goes;
  decay -> 0 is LFU, large decay is LRU). The CRF of every expert ever asked
  for is kept, also after eviction (a few floats per expert), so a popular
  expert that was evicted comes back with its history; without that, layers
  visited in a cycle larger than the cache would make LFRU degrade to FIFO.
  ``none`` keeps nothing after a wave: the naive on-demand baseline.
- Waves: the executor asks for a layer's needed experts in waves that each fit
  the budget (resident ones first, so they are used before anything evicts
  them); a batch needing more experts than the cache holds is split, not failed.
- Prefetch: space is reserved under the lock, the copy runs on the
  ``concurrent.futures`` executor given (a thread pool in service, a
  synchronous one in tests); the expert is pinned while it loads. A prefetch
  that finds no room (everything pinned or needed by the running layer) is
  dropped and counted.
- Stall: time the compute spent waiting for experts (synchronous misses and
  waits on prefetches in flight), by the injected clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splitinfer.cloud.moe.device import Device, NumpyDevice
from splitinfer.cloud.moe.store import ExpertStore
from splitinfer.shared.errors import ConfigError

POLICIES = ("lru", "lfru", "none")
Key = tuple[int, int]


@dataclass(frozen=True)
class CacheConfig:
    """``budget_bytes``: device bytes for experts (``--expert-cache``)."""

    budget_bytes: int
    policy: str = "lfru"
    decay: float = 0.002

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ConfigError(f"expert cache budget {self.budget_bytes} bytes must be positive")
        if self.policy not in POLICIES:
            raise ConfigError(f"expert cache policy {self.policy!r} is not one of {POLICIES}")
        if not self.decay > 0:
            raise ConfigError(f"lfru decay {self.decay} must be positive")


class MoEMetrics:
    """Prometheus series in the given registry, and the same tallies as plain numbers."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "splitinfer_moe_expert_requests", "Experts asked for", ["layer", "result"], registry=r
        )
        self.prefetch = Counter(
            "splitinfer_moe_prefetch_experts",
            "Prefetched experts",
            ["layer", "outcome"],
            registry=r,
        )
        self.paged = Counter(
            "splitinfer_moe_paged_bytes", "Bytes copied host to device", ["layer"], registry=r
        )
        self.tokens = Counter("splitinfer_moe_tokens", "Tokens routed", ["layer"], registry=r)
        self.stall = Counter(
            "splitinfer_moe_stall_seconds", "Compute waiting for experts", ["layer"], registry=r
        )
        self.distinct = Histogram(
            "splitinfer_moe_distinct_experts",
            "Distinct experts one batch needs in one layer",
            ["layer"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.tally: dict[str, dict[int, float]] = {}

    def add(self, what: str, layer: int, value: float = 1.0) -> None:
        per = self.tally.setdefault(what, {})
        per[layer] = per.get(layer, 0.0) + value

    def total(self, what: str, layer: int | None = None) -> float:
        per = self.tally.get(what, {})
        return per.get(layer, 0.0) if layer is not None else sum(per.values())

    def hit_rate(self, layer: int | None = None) -> float:
        hits, misses = self.total("hit", layer), self.total("miss", layer)
        return hits / (hits + misses) if hits + misses else float("nan")

    def prefetch_precision(self, layer: int | None = None) -> float:
        issued = self.total("prefetch_issued", layer)
        return self.total("prefetch_useful", layer) / issued if issued else float("nan")

    def bytes_per_token(self) -> float:
        """Bytes paged per token (tokens counted once, at the first MoE layer they reach)."""
        layers = self.tally.get("tokens", {})
        tokens = layers[min(layers)] if layers else 0.0
        return self.total("paged") / tokens if tokens else float("nan")


@dataclass
class _Entry:
    nbytes: int
    weights: Any = None
    future: Future[Any] | None = None
    pins: int = 0
    last: int = 0
    prefetched: bool = False


@dataclass
class _Waiting:
    misses: list[int] = field(default_factory=list)
    loading: dict[int, Future[Any]] = field(default_factory=dict)


class ExpertCache:
    """The :class:`~splitinfer.cloud.moe.executor.ExpertSource` for the executor."""

    def __init__(
        self,
        store: ExpertStore,
        config: CacheConfig,
        *,
        device: Device | None = None,
        metrics: MoEMetrics | None = None,
        prefetcher: Executor | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.store = store
        self.config = config
        self.device = device or NumpyDevice()
        self.metrics = metrics or MoEMetrics()
        self.prefetcher = prefetcher
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: dict[Key, _Entry] = {}
        self._tick = 0
        self._history: dict[Key, tuple[float, int]] = {}  # LFRU: (CRF, tick), every key seen
        self._pending_prefetch: dict[int, set[int]] = {}
        self.peak_bytes = 0
        largest = max(
            store.nbytes(layer, e) for layer in store.shards for e in range(store.n_experts(layer))
        )
        if config.budget_bytes < largest:
            raise ConfigError(
                f"expert cache budget {config.budget_bytes} bytes is below the largest expert "
                f"({largest} bytes); give --expert-cache {largest} or more"
            )

    # -- accounting -------------------------------------------------------------
    @property
    def resident_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def resident(self) -> set[Key]:
        with self._lock:
            return set(self._entries)

    def _touch(self, key: Key, entry: _Entry) -> None:
        """One access: recency for LRU; for LFRU the key's CRF, kept across evictions."""
        self._tick += 1
        crf, last = self._history.get(key, (0.0, self._tick))
        crf = 1.0 + crf * 2.0 ** (-self.config.decay * (self._tick - last))
        self._history[key] = (crf, self._tick)
        entry.last = self._tick

    def _value(self, key: Key) -> tuple[float, int, Key]:
        e = self._entries[key]
        if self.config.policy == "lfru":
            crf, last = self._history[key]
            return (crf * 2.0 ** (-self.config.decay * (self._tick - last)), e.last, key)
        return (float(e.last), e.last, key)

    def _make_room(self, need: int, protect: set[Key]) -> bool:
        """Evict until ``need`` more bytes fit; False (nothing evicted) when impossible."""
        for e in self._entries.values():
            if e.future is not None and e.future.done() and e.pins == 0:
                e.weights, e.future = e.future.result(), None
        free = self.config.budget_bytes - self.resident_bytes
        if free >= need:
            return True
        victims = [
            k
            for k, e in self._entries.items()
            if e.pins == 0 and e.future is None and k not in protect
        ]
        victims.sort(key=self._value)
        chosen = []
        for k in victims:
            if free >= need:
                break
            chosen.append(k)
            free += self._entries[k].nbytes
        if free < need:
            return False
        recycle = getattr(self.device, "recycle", None)
        for k in chosen:
            evicted = self._entries.pop(k)
            if recycle is not None and evicted.weights is not None:
                recycle(evicted.weights)
        return True

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes)

    def _load(self, layer: int, expert: int) -> Any:
        return self.device.upload(self.store.view(layer, expert))

    # -- the ExpertSource interface ---------------------------------------------
    def observe(self, layer: int, tokens: int, experts: int) -> None:
        m = self.metrics
        m.add("tokens", layer, tokens)
        m.tokens.labels(str(layer)).inc(tokens)
        m.distinct.labels(str(layer)).observe(experts)

    def waves(self, layer: int, experts: Sequence[int]) -> list[list[int]]:
        """Split ``experts`` into groups that each fit the budget, resident ones first."""
        with self._lock:
            pending = self._pending_prefetch.pop(layer, None)
            resident = [e for e in experts if (layer, e) in self._entries]
        if pending:
            useful = len(pending & set(experts))
            self.metrics.add("prefetch_useful", layer, useful)
            self.metrics.prefetch.labels(str(layer), "useful").inc(useful)
        order = resident + [e for e in experts if e not in set(resident)]
        waves: list[list[int]] = []
        size = 0
        for e in order:
            nbytes = self.store.nbytes(layer, e)
            if not waves or size + nbytes > self.config.budget_bytes:
                waves.append([])
                size = 0
            waves[-1].append(e)
            size += nbytes
        return waves

    def acquire(self, layer: int, experts: Sequence[int]) -> dict[int, Any]:
        """Pin ``experts`` (one wave) on the device, loading misses; returns their weights."""
        lbl = str(layer)
        while True:
            waiting = _Waiting()
            with self._lock:
                blocked = self._claim(layer, experts, waiting)
                if blocked is None:
                    break
            blocked.result()  # a prefetch holds the room we need: let it land, retry
        start = self.clock()
        loaded = {e: self._load(layer, e) for e in waiting.misses}
        landed = {e: f.result() for e, f in waiting.loading.items()}
        stalled = self.clock() - start
        paged = sum(self.store.nbytes(layer, e) for e in waiting.misses)
        with self._lock:
            for e, w in (loaded | landed).items():
                entry = self._entries[(layer, e)]
                entry.weights, entry.future = w, None
            out = {e: self._entries[(layer, e)].weights for e in experts}
        m = self.metrics
        m.add("stall", layer, stalled)
        m.stall.labels(lbl).inc(max(stalled, 0.0))
        m.add("paged", layer, paged)
        m.paged.labels(lbl).inc(paged)
        return out

    def _claim(self, layer: int, experts: Sequence[int], waiting: _Waiting) -> Future[Any] | None:
        """Under the lock: pin hits, reserve misses. Returns a future to wait on if blocked."""
        keys = {(layer, e) for e in experts}
        need = sum(self.store.nbytes(layer, e) for e in experts if (layer, e) not in self._entries)
        if not self._make_room(need, keys):
            loading = [e.future for e in self._entries.values() if e.future is not None]
            if loading:
                return loading[0]
            raise AssertionError("a wave larger than the budget")  # waves() prevents it
        m, lbl = self.metrics, str(layer)
        for e in experts:
            key = (layer, e)
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(nbytes=self.store.nbytes(layer, e))
                waiting.misses.append(e)
                m.add("miss", layer)
                m.requests.labels(lbl, "miss").inc()
            else:
                if entry.future is not None:
                    waiting.loading[e] = entry.future
                m.add("hit", layer)
                m.requests.labels(lbl, "hit").inc()
            entry.pins += 1
            self._touch(key, entry)
        self._note_peak()
        return None

    def release(self, layer: int, experts: Sequence[int]) -> None:
        with self._lock:
            for e in experts:
                entry = self._entries[(layer, e)]
                entry.pins -= 1
                if self.config.policy == "none" and entry.pins == 0:
                    del self._entries[(layer, e)]
                    recycle = getattr(self.device, "recycle", None)
                    if recycle is not None and entry.weights is not None:
                        recycle(entry.weights)

    def prefetch(self, layer: int, experts: Sequence[int], protect: Sequence[Key]) -> None:
        """Start loading ``layer``'s ``experts`` in the background, without evicting the
        running layer's ``protect`` experts. A no-op without a prefetcher or policy none."""
        if self.prefetcher is None or self.config.policy == "none":
            return
        m, lbl = self.metrics, str(layer)
        current = set(protect)
        issued: set[int] = set()
        with self._lock:
            for e in experts:
                key = (layer, e)
                if key in self._entries:
                    continue
                nbytes = self.store.nbytes(layer, e)
                if not self._make_room(nbytes, current):
                    m.add("prefetch_dropped", layer)
                    m.prefetch.labels(lbl, "dropped").inc()
                    continue
                entry = self._entries[key] = _Entry(nbytes=nbytes, prefetched=True)
                self._touch(key, entry)
                entry.future = self.prefetcher.submit(self._load, layer, e)
                issued.add(e)
                m.add("paged", layer, nbytes)
                m.paged.labels(lbl).inc(nbytes)
            self._note_peak()
            self._pending_prefetch[layer] = self._pending_prefetch.get(layer, set()) | issued
        m.add("prefetch_issued", layer, len(issued))
        m.prefetch.labels(lbl, "issued").inc(len(issued))

    def expert_forward(self, x: np.ndarray, weights: Any, kind: str) -> np.ndarray:
        return self.device.expert_forward(x, weights, kind)


class SyncExecutor(Executor):
    """A ``concurrent.futures`` executor that runs each task at submit (for tests)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        f: Future[Any] = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as e:
            f.set_exception(e)
        return f
