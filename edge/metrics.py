"""The agent's Prometheus metrics, in a registry of its own (never the global one).

Request outcomes and latencies, per-stage seconds, the queue, the chosen cut,
the link estimate, the cloud's load, each endpoint's breaker state and
attempts, local answers by reason, and the privacy budget spent. Gauges that
mirror the pipeline's state are refreshed at each scrape (:meth:`refresh`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from splitinfer.edge.pipeline import Pipeline, Result

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_STATES = {"closed": 0, "half-open": 1, "open": 2}


class EdgeMetrics:
    """Every metric of one agent."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "splitinfer_edge_requests",
            "Requests answered by the local API, by outcome and where they were computed.",
            ["outcome", "where"],
            registry=r,
        )
        self.latency = Histogram(
            "splitinfer_edge_request_seconds",
            "End-to-end seconds of answered requests (local API in to out).",
            buckets=_BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "splitinfer_edge_stage_seconds",
            "Seconds per pipeline stage (edge, privacy, encode, uplink, decode, local).",
            ["stage"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.bytes_up = Counter(
            "splitinfer_edge_uplink_bytes", "Request frame bytes sent to the cloud.", registry=r
        )
        self.local = Counter(
            "splitinfer_edge_local_answers",
            "Requests answered on the device, by reason (cut, cloud_unavailable, privacy).",
            ["reason"],
            registry=r,
        )
        for reason in ("cut", "cloud_unavailable", "privacy"):
            # at 0 from the start, so that increase() in an alert counts the first one
            self.local.labels(reason)
        self.rejected = Counter(
            "splitinfer_edge_rejected", "Requests refused at once: the queue was full.", registry=r
        )
        self.queued = Gauge(
            "splitinfer_edge_queue_depth", "Requests waiting for a processing slot.", registry=r
        )
        self.in_flight = Gauge("splitinfer_edge_in_flight", "Requests being processed.", registry=r)
        self.cut = Gauge(
            "splitinfer_edge_cut",
            "1 for the cut the chooser uses now, 0 for others.",
            ["cut"],
            registry=r,
        )
        self.switches = Gauge(
            "splitinfer_edge_cut_switches", "Cut switches since start.", registry=r
        )
        self.uplink_bps = Gauge(
            "splitinfer_edge_uplink_estimate_bps", "Estimated uplink throughput.", registry=r
        )
        self.rtt = Gauge("splitinfer_edge_rtt_estimate_seconds", "Estimated RTT.", registry=r)
        self.load = Gauge(
            "splitinfer_edge_cloud_load",
            "The cloud's load estimate (EWMA of the load in its answers, 0..1).",
            registry=r,
        )
        self.overloaded = Gauge(
            "splitinfer_edge_cloud_overloaded",
            "1 while the cloud counts as overloaded.",
            registry=r,
        )
        self.endpoint = Gauge(
            "splitinfer_edge_endpoint_state",
            "Circuit breaker per cloud endpoint: 0 closed, 1 half-open, 2 open.",
            ["endpoint"],
            registry=r,
        )
        self.attempts = Counter(
            "splitinfer_edge_attempts",
            "Uplink attempts by endpoint and outcome (ok, timeout, error, overloaded, refused).",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.epsilon = Gauge(
            "splitinfer_edge_privacy_epsilon_spent",
            "Privacy budget (epsilon) spent in the current window; 0 without a budget.",
            registry=r,
        )

    def attempt(self, endpoint: str, outcome: str, seconds: float) -> None:
        self.attempts.labels(endpoint, outcome).inc()

    def answered(self, result: Result, seconds: float) -> None:
        where = "local" if result.local else "cloud"
        self.requests.labels("ok", where).inc()
        self.latency.observe(seconds)
        for stage, value in result.timings.items():
            if stage != "total":
                self.stage.labels(stage).observe(value)
        self.bytes_up.inc(result.up_bytes)
        if result.local:
            reason = result.reason.split(":")[0].replace(" ", "_")
            self.local.labels({"privacy_budget": "privacy"}.get(reason, reason)).inc()

    def failed(self, status: int) -> None:
        self.requests.labels(f"error_{status}", "none").inc()

    def refresh(self, pipeline: Pipeline) -> None:
        """Copy the pipeline's state into the gauges (called at each scrape)."""
        for cut_id in pipeline.cuts:
            self.cut.labels(cut_id).set(1.0 if cut_id == pipeline.current_cut else 0.0)
        self.switches.set(pipeline.chooser.switches)
        link = pipeline.estimate().link
        self.uplink_bps.set(link.uplink_bps)
        self.rtt.set(link.rtt_s)
        self.load.set(pipeline.chooser.load(pipeline.now()))
        self.overloaded.set(1.0 if pipeline.chooser.loaded else 0.0)
        if pipeline.uplink is not None:
            for name, state in pipeline.uplink.states().items():
                self.endpoint.labels(name).set(_STATES[state])
        if pipeline.gate is not None and pipeline.gate.enforced:
            self.epsilon.set(pipeline.gate.spent)

    def render(self) -> bytes:
        return generate_latest(self.registry)
