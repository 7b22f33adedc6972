"""The agent's status: ``GET /v1/status``'s document and the page at ``GET /``.

:func:`status_doc` reads the agent's state (the pipeline, its chooser and link
estimate, the queue, the metrics); :func:`render_status` is a pure function of
that document, so the page shows exactly what ``/v1/status`` says. Why the
agent is on its cut comes from the chooser itself
(:meth:`~splitinfer.edge.chooser.CutChooser.explain`): every candidate's
predicted latency at the current link estimate, the rule that last moved it and
when. Nothing secret is in either (no key, no signature; the device id is not
shown).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from splitinfer import __version__
from splitinfer.edge.chooser import rate_text
from splitinfer.shared.statuspage import (
    Html,
    duration,
    facts,
    histogram_summary,
    number,
    page,
    sample_value,
    table,
    tag,
)
from splitinfer.shared.statuspage import state as state_word

if TYPE_CHECKING:
    from splitinfer.edge.agent import AgentState
    from splitinfer.edge.pipeline import Pipeline


def status_doc(state: AgentState, pipeline: Pipeline) -> dict[str, Any]:
    """``GET /v1/status``: the cut and why, the candidates, the link, the cloud, the queue."""
    est = pipeline.estimate()
    now = pipeline.now()
    latency = histogram_summary(state.metrics.latency)
    doc: dict[str, Any] = {
        "model": pipeline.model_name,
        "model_version": pipeline.model_version,
        "cut": pipeline.current_cut,
        "cuts": list(pipeline.cuts),
        "switches": pipeline.chooser.switches,
        "choice": pipeline.explain(),
        "estimate": {
            "uplink_bps": est.link.uplink_bps,
            "downlink_bps": est.link.downlink_bps,
            "rtt_ms": est.link.rtt_s * 1e3,
            "rate_samples": est.rate_samples,
            "rtt_samples": est.rtt_samples,
        },
        "cloud_load": pipeline.chooser.load(now),
        "cloud_overloaded": pipeline.chooser.loaded,
        "endpoints": pipeline.uplink.states() if pipeline.uplink is not None else {},
        "local_model": pipeline.local_runner() is not None,
        "emulated_device": state.model.emulated,
        "edge_ms": {k: v * 1e3 for k, v in pipeline.edge_s.items()},
        "queue": {"running": state.admission.running, "waiting": state.admission.waiting},
        "providers": sorted(
            {p for rt in state.model.cuts.values() if rt.edge for p in rt.edge.providers}
        ),
        "latency_ms": {
            "count": latency["count"],
            "p50": None if latency["p50"] is None else latency["p50"] * 1e3,
            "p99": None if latency["p99"] is None else latency["p99"] * 1e3,
        },
        "answered": {
            where: int(sample_value(state.metrics.requests, {"where": where}, "_total"))
            for where in ("cloud", "local")
        },
        "uptime_s": max(now - state.started, 0.0),
        "version": __version__,
    }
    if pipeline.gate is not None and pipeline.gate.enforced:
        doc["privacy_epsilon_spent"] = pipeline.gate.spent
    return doc


def render_status(doc: dict[str, Any]) -> str:
    """The status page (HTML) of a ``GET /v1/status`` document; every string escaped."""
    version = doc.get("model_version") or "any"
    subtitle = (
        f"model {doc.get('model')} (version {version}) · splitinfer {doc.get('version')} · "
        f"up {duration(doc.get('uptime_s'))}"
    )
    sections: list[tuple[str, object]] = [
        ("Cut", _why(doc)),
        ("Candidates", _candidates(doc)),
        ("Link estimate", _link(doc)),
        (
            "Cloud endpoints",
            table(
                ["endpoint", "circuit breaker"],
                [[u, state_word(s)] for u, s in (doc.get("endpoints") or {}).items()],
                empty="no cloud endpoint",
            ),
        ),
        ("Requests", _requests(doc)),
    ]
    return page(f"edge-agent: {doc.get('model')}", subtitle, sections)


def _why(doc: dict[str, Any]) -> Html:
    choice = doc.get("choice") or {}
    why: list[tuple[str, object]] = [
        ("current cut", doc.get("cut")),
        ("why", f"{choice.get('rule')}: {choice.get('reason')}"),
    ]
    if choice.get("since_s") is not None:
        moved = f"from {choice['from']}, " if choice.get("from") else ""
        why.append(("switched", f"{moved}{duration(choice['since_s'])} ago"))
    if choice.get("fixed_because"):
        why.append(("switching", f"off: {choice['fixed_because']}"))
    if choice.get("waiting"):
        why.append(("not yet", choice["waiting"]))
    fallback = choice.get("fallback")
    if fallback:
        ago = duration(fallback.get("since_s"))
        why.append(("last local fallback", f"{ago} ago: {fallback.get('reason')}"))
    why.append(("switches since start", doc.get("switches", 0)))
    return facts(why)


def _candidates(doc: dict[str, Any]) -> Html:
    choice = doc.get("choice") or {}
    candidates = choice.get("candidates") or {}
    rows, on = [], []
    for i, (cut_id, c) in enumerate(candidates.items()):
        marks = [
            m
            for m, yes in (
                ("current", cut_id == doc.get("cut")),
                ("best", cut_id == choice.get("best")),
            )
            if yes
        ]
        edge = _ms(c.get("edge_ms")) + (" measured" if c.get("edge_measured") else "")
        up = c.get("up_bytes", 0)
        rows.append(
            [
                cut_id,
                c.get("kind"),
                _ms(c.get("predicted_ms")),
                edge,
                _ms(c.get("transfer_ms")),
                f"{up:,}" if isinstance(up, int) else up,
                " ".join(marks),
            ]
        )
        if cut_id == doc.get("cut"):
            on.append(i)
    body = table(
        ["cut", "kind", "predicted", "edge", "network", "bytes up", ""],
        rows,
        numeric=(2, 3, 4, 5),
        highlight=on,
        empty="no candidate has a predicted cost",
    )
    note = (
        "Predicted end-to-end latency of one request at the current link estimate: the "
        "chooser's own prediction. It moves to the best cut once that one is predicted "
        f"more than {choice.get('hysteresis', 0):.0%} faster."
    )
    without = [c for c in doc.get("cuts", []) if c not in candidates]
    if without:
        note += f" Without a predicted cost: {', '.join(map(str, without))}."
    return Html(body + tag("p", note, "sub"))


def _link(doc: dict[str, Any]) -> Html:
    est = doc.get("estimate") or {}
    samples = (
        f"rate: {est.get('rate_samples', 0)} uploads big enough to time; "
        f"round trip: {est.get('rtt_samples', 0)} samples"
    )
    load = number(doc.get("cloud_load"))
    if doc.get("cloud_overloaded"):
        load += " (overloaded)"
    return facts(
        [
            ("uplink", _rate(est.get("uplink_bps"))),
            ("downlink", _rate(est.get("downlink_bps"))),
            ("round trip", _ms(est.get("rtt_ms"))),
            ("measured from", samples),
            ("cloud load", load),
        ]
    )


def _requests(doc: dict[str, Any]) -> Html:
    latency = doc.get("latency_ms") or {}
    queue = doc.get("queue") or {}
    answered = doc.get("answered") or {}
    p50, p99 = _ms(latency.get("p50")), _ms(latency.get("p99"))
    rows: list[tuple[str, object]] = [
        ("answered", f"{answered.get('cloud', 0)} by the cloud, {answered.get('local', 0)} here"),
        ("latency p50 / p99", f"{p50} / {p99} (since start)"),
        ("queue", f"{queue.get('running', 0)} running, {queue.get('waiting', 0)} waiting"),
        ("edge runtime", ", ".join(map(str, doc.get("providers") or [])) or "-"),
        ("local model", "yes" if doc.get("local_model") else "no"),
    ]
    if doc.get("emulated_device"):
        rows.append(("emulated device", doc["emulated_device"]))
    if "privacy_epsilon_spent" in doc:
        rows.append(("privacy epsilon spent", number(doc["privacy_epsilon_spent"])))
    return facts(rows)


def _ms(value: Any) -> str:
    return number(value, "ms") if isinstance(value, int | float) else "-"


def _rate(value: Any) -> str:
    return rate_text(value) if isinstance(value, int | float) else "-"
