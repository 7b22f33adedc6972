"""The service's status page at ``GET /``: its document and the HTML.

:func:`engine_status` adds to ``GET /v1/models``'s document what the engine
tracks (queue depth and requests in flight per model; per version the request
latency's p50 and p99 and the batch sizes, from the Prometheus histograms since
start); :func:`render_status` is a pure function of the document. The handler
adds the package version and whether authentication is on. Nothing secret is
in either: no credentials, no device ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from splitinfer.shared.statuspage import (
    Html,
    duration,
    facts,
    histogram_buckets,
    histogram_quantile,
    histogram_summary,
    number,
    page,
    sample_value,
    table,
    tag,
)
from splitinfer.shared.statuspage import state as state_word

if TYPE_CHECKING:
    from splitinfer.cloud.engine import Engine


def engine_status(engine: Engine, models: dict[str, Any], uptime_s: float) -> dict[str, Any]:
    """The page's document: ``models`` (``GET /v1/models``) with the engine's own counts."""
    m = engine.metrics
    for model in models.get("models", []):
        name = model["name"]
        model["queue"] = {
            "queued": int(sample_value(m.queued, {"model": name})),
            "in_flight": int(sample_value(m.in_flight, {"model": name})),
        }
        for version in model.get("versions", []):
            if version.get("state") != "serving":
                continue
            labels = {"model": name, "version": version["version"]}
            latency = histogram_summary(m.request_seconds, labels)
            version["latency_ms"] = {
                "count": latency["count"],
                "p50": None if latency["p50"] is None else latency["p50"] * 1e3,
                "p99": None if latency["p99"] is None else latency["p99"] * 1e3,
            }
            batches = sample_value(m.executions, labels, "_total")
            samples = sample_value(m.inferences, labels, "_total")
            version["batches"] = {
                "count": int(batches),
                "mean_size": samples / batches if batches else None,
                "p50_size": histogram_quantile(0.5, histogram_buckets(m.batch_size, labels)),
            }
    return {
        "service": "cloud-service",
        "ready": engine.ready,
        "closing": engine.closing,
        "uptime_s": uptime_s,
        "models": models.get("models", []),
    }


def render_status(doc: dict[str, Any]) -> str:
    """The status page (HTML) of :func:`engine_status`'s document; every string escaped."""
    ready = "ready" if doc.get("ready") else "not ready"
    if doc.get("closing"):
        ready = "stopping"
    auth = "on" if doc.get("auth") else "OFF (--no-auth)"
    subtitle = (
        f"splitinfer {doc.get('version')} · up {duration(doc.get('uptime_s'))} · {ready} · "
        f"authentication {auth}"
    )
    sections: list[tuple[str, object]] = []
    if doc.get("note"):
        sections.append(("Note", tag("p", doc["note"])))
    models = doc.get("models") or []
    if not models:
        sections.append(("Models", tag("p", "no model in the repository")))
    for model in models:
        sections.append((f"Model {model.get('name')}", _model(model)))
    return page("cloud-service", subtitle, sections)


def _model(model: dict[str, Any]) -> Html:
    batching = model.get("batching") or {}
    queue = model.get("queue")
    pairs: list[tuple[str, object]] = [
        ("state", state_word("ready" if model.get("ready") else "not ready", good=("ready",))),
    ]
    if "load" in model:
        pairs.append(("load", number(model["load"])))
    if queue is not None:
        waiting = f"{queue.get('queued', 0)} samples queued, {queue.get('in_flight', 0)} in flight"
        pairs.append(("queue", waiting))
    if batching:
        on = "on" if batching.get("enabled") else "off"
        limits = (
            f"{on}: up to {batching.get('max_batch_size')} samples, waiting up to "
            f"{batching.get('max_queue_delay_ms')} ms, {batching.get('max_queue_size')} queued"
        )
        pairs.append(("batching", limits))
    rows, serving = [], []
    for i, v in enumerate(model.get("versions") or []):
        latency = v.get("latency_ms") or {}
        batches = v.get("batches") or {}
        rows.append(
            [
                v.get("version"),
                state_word(str(v.get("state"))),
                ", ".join(map(str, v.get("cuts") or [])) or "-",
                v.get("default_cut") or "-",
                state_word(str(v.get("breaker") or "-")),
                _ms(latency.get("p50")),
                _ms(latency.get("p99")),
                latency.get("count", "-"),
                number(batches.get("mean_size")),
                ", ".join(map(str, v.get("providers") or [])) or v.get("error") or "-",
            ]
        )
        if v.get("state") == "serving":
            serving.append(i)
    versions = table(
        [
            "version",
            "state",
            "cuts",
            "default",
            "breaker",
            "p50",
            "p99",
            "requests",
            "mean batch",
            "runtime / error",
        ],
        rows,
        numeric=(5, 6, 7, 8),
        highlight=serving,
        empty="no version",
    )
    note = tag("p", "Latency inside the service per request, since start.", "sub")
    return Html(facts(pairs) + versions + note)


def _ms(value: Any) -> str:
    return number(value, "ms") if isinstance(value, int | float) else "-"
