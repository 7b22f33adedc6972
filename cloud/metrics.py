"""Prometheus metrics of one service, in its own registry (never the global one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

#: label value for requests whose model is not served (keeps label cardinality bounded)
UNKNOWN = "_unknown"

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)  # fmt: skip
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class ModelSeries:
    """The labelled series of one model, looked up once (``labels()`` is not free)."""

    queue_seconds: Any
    in_flight: Any
    queued: Any
    expired: Any


@dataclass(frozen=True)
class VersionSeries:
    """The labelled series of one model version."""

    compute_seconds: Any
    request_seconds: Any
    batch_size: Any
    inferences: Any
    executions: Any
    breaker_open: Any


class Metrics:
    """Every metric the service exports; ``render()`` gives the text format."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "splitinfer_requests",
            "Inference requests by model, served version and HTTP status",
            ["model", "version", "status"],
            registry=r,
        )
        self.rejections = Counter(
            "splitinfer_rejections",
            "Requests refused, by model and reason (the error's kind)",
            ["model", "reason"],
            registry=r,
        )
        self.expired = Counter(
            "splitinfer_expired",
            "Requests refused while queued: their deadline could no longer be met",
            ["model"],
            registry=r,
        )
        self.auth_failures = Counter(
            "splitinfer_auth_failures",
            "Requests refused by device authentication (401), by kind",
            ["kind"],
            registry=r,
        )
        self.queue_seconds = Histogram(
            "splitinfer_queue_seconds",
            "Time from admission to the start of the request's batch",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_seconds = Histogram(
            "splitinfer_compute_seconds",
            "Time one batch spends in the runtime",
            ["model", "version"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "splitinfer_request_seconds",
            "End-to-end time of a successful request inside the service",
            ["model", "version"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "splitinfer_batch_size",
            "Samples per executed batch",
            ["model", "version"],
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.inferences = Counter(
            "splitinfer_inferences",
            "Samples computed (batch efficiency = inferences / executions)",
            ["model", "version"],
            registry=r,
        )
        self.executions = Counter(
            "splitinfer_executions",
            "Batches executed",
            ["model", "version"],
            registry=r,
        )
        self.in_flight = Gauge(
            "splitinfer_in_flight",
            "Requests admitted and not yet answered",
            ["model"],
            registry=r,
        )
        self.queued = Gauge(
            "splitinfer_queued_samples", "Samples waiting in the queues", ["model"], registry=r
        )
        self.loads = Counter(
            "splitinfer_model_loads",
            "Version loads by result (success, failure)",
            ["model", "version", "result"],
            registry=r,
        )
        self.load_seconds = Histogram(
            "splitinfer_model_load_seconds",
            "Time to load and warm a version",
            ["model"],
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.serving_versions = Gauge(
            "splitinfer_serving_versions", "Versions taking traffic", ["model"], registry=r
        )
        self.breaker_open = Gauge(
            "splitinfer_breaker_open",
            "1 while a version's circuit breaker is open",
            ["model", "version"],
            registry=r,
        )
        self.privacy_epsilon = Histogram(
            "splitinfer_privacy_epsilon_spent",
            "A device's epsilon spent in its budget window after each charged (noised) frame",
            ["model"],
            buckets=(0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )

        self._models: dict[str, ModelSeries] = {}
        self._versions: dict[tuple[str, str], VersionSeries] = {}
        self._requests: dict[tuple[str, str, str], Any] = {}

    def request(self, model: str, version: str, status: int) -> None:
        """Count one answered request (the series are cached: this runs per request)."""
        key = (model, version, str(status))
        series = self._requests.get(key)
        if series is None:
            series = self._requests[key] = self.requests.labels(*key)
        series.inc()

    def model(self, model: str) -> ModelSeries:
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = ModelSeries(
                self.queue_seconds.labels(model),
                self.in_flight.labels(model),
                self.queued.labels(model),
                self.expired.labels(model),
            )
        return found

    def version(self, model: str, version: str) -> VersionSeries:
        found = self._versions.get((model, version))
        if found is None:
            found = self._versions[(model, version)] = VersionSeries(
                self.compute_seconds.labels(model, version),
                self.request_seconds.labels(model, version),
                self.batch_size.labels(model, version),
                self.inferences.labels(model, version),
                self.executions.labels(model, version),
                self.breaker_open.labels(model, version),
            )
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (0 if absent), for tests and the benchmark."""
        got = self.registry.get_sample_value(name, labels or {})
        return 0.0 if got is None else float(got)
