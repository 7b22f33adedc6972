"""The pieces of the daemons' read-only status pages (``GET /``), and quantiles of
Prometheus histograms.

Pure: strings in, HTML out. Every value that reaches the page goes through
:func:`esc` (``html.escape``) unless it is :class:`Html` that one of these
functions built. The page is plain server-side HTML with a little inline CSS
and a ``<meta http-equiv="refresh">``; no script. Each daemon composes its own
page from these (``edge/status.py``, ``cloud/status.py``).

:func:`histogram_summary` reads a ``prometheus_client`` histogram (any object
whose ``collect()`` yields families of samples) and interpolates its p50 and
p99 from the buckets, as PromQL's ``histogram_quantile`` does: counts since the
daemon started, not a sliding window.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: Headers of a status page: no script may run, nothing is loaded from elsewhere.
PAGE_HEADERS = {
    "Content-Type": "text/html; charset=utf-8",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em auto;max-width:1100px;color:#222;
padding:0 1em}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.4em 0 .4em;
border-bottom:1px solid #ddd}
.sub{color:#666;margin:0 0 1em}.big{font-size:1.6em;font-weight:600}
table{border-collapse:collapse;margin:.3em 0}th,td{padding:.25em .7em;text-align:left;
border-bottom:1px solid #eee}th{background:#f4f4f4;font-weight:600}
td.n{text-align:right;font-variant-numeric:tabular-nums}
tr.on td{background:#eef6ff;font-weight:600}
.ok{color:#17702a}.warn{color:#a15c00}.bad{color:#b00020}
dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1.2em;margin:.3em 0}
dt{color:#555}dd{margin:0}
"""


class Html(str):
    """Markup built here (already escaped): passed through as it is."""


def esc(value: object) -> Html:
    """``value`` as text safe anywhere in a page (markup it holds is shown, not run)."""
    if isinstance(value, Html):
        return value
    return Html(html.escape("" if value is None else str(value), quote=True))


def tag(name: str, content: object, cls: str = "") -> Html:
    attr = f' class="{esc(cls)}"' if cls else ""
    return Html(f"<{name}{attr}>{esc(content)}</{name}>")


def number(value: float | None, unit: str = "", digits: int = 3) -> str:
    """``12.3 ms``; ``-`` for None or a value that is not finite."""
    if value is None or not math.isfinite(value):
        return "-"
    text = f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:,.0f}"
    return f"{text} {unit}".rstrip()


def duration(seconds: float | None) -> str:
    """``3 d 4 h``, ``2 h 5 min``, ``7 min 3 s``, ``12 s``."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(max(seconds, 0.0))
    for big, small, bs, ss in (
        (86400, 3600, "d", "h"),
        (3600, 60, "h", "min"),
        (60, 1, "min", "s"),
    ):
        if s >= big:
            return f"{s // big} {bs} {(s % big) // small} {ss}"
    return f"{s} s"


def state(
    text: str,
    good: Iterable[str] = ("closed", "serving", "yes", "on"),
    bad: Iterable[str] = ("open", "failed", "no"),
) -> Html:
    """A state word, coloured: good, bad, or in between."""
    cls = "ok" if text in set(good) else "bad" if text in set(bad) else "warn"
    return tag("span", text, cls)


def facts(pairs: Sequence[tuple[str, object]]) -> Html:
    """A two-column list of name and value."""
    rows = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in pairs)
    return Html(f"<dl>{rows}</dl>")


def table(
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    numeric: Iterable[int] = (),
    highlight: Iterable[int] = (),
    empty: str = "none",
) -> Html:
    """A table; the columns in ``numeric`` align right, the rows in ``highlight`` stand out."""
    if not rows:
        return tag("p", empty)
    right = set(numeric)
    marked = set(highlight)
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cells = "".join(
            f'<td class="n">{esc(c)}</td>' if j in right else f"<td>{esc(c)}</td>"
            for j, c in enumerate(row)
        )
        body.append(f'<tr class="on">{cells}</tr>' if i in marked else f"<tr>{cells}</tr>")
    return Html(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")


def page(
    title: str, subtitle: str, sections: Sequence[tuple[str, object]], refresh_s: int = 5
) -> str:
    """The whole page: a title, a line under it, then ``(heading, body)`` sections."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="refresh" content="{int(refresh_s)}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>",
        tag("h1", title),
        tag("p", subtitle, "sub"),
    ]
    for heading, body in sections:
        parts.append(tag("h2", heading))
        parts.append(esc(body))
    parts.append(tag("p", f"Read-only; refreshed every {int(refresh_s)} s.", "sub"))
    parts.append("</body></html>")
    return "\n".join(parts)


# -- histograms -------------------------------------------------------------------------


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a histogram given as ``(upper bound, cumulative count)``
    pairs (the last bound ``inf``), interpolated linearly inside its bucket; the
    highest finite bound when it falls in the last one; None when it is empty."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank and count > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def histogram_buckets(
    histogram: Any, labels: Mapping[str, str] | None = None
) -> list[tuple[float, float]]:
    """The ``(le, cumulative count)`` pairs of one series of a ``prometheus_client``
    histogram (the series whose labels include ``labels``)."""
    want = dict(labels or {})
    out = []
    for family in histogram.collect():
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                continue
            if all(sample.labels.get(k) == v for k, v in want.items()):
                out.append((float(sample.labels["le"]), float(sample.value)))
    return out


def histogram_summary(histogram: Any, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``{"count", "p50", "p99"}`` of one series (the quantiles in the histogram's unit,
    None while it is empty)."""
    buckets = histogram_buckets(histogram, labels)
    count = max((c for _, c in buckets), default=0.0)
    return {
        "count": int(count),
        "p50": histogram_quantile(0.5, buckets),
        "p99": histogram_quantile(0.99, buckets),
    }


def sample_value(metric: Any, labels: Mapping[str, str] | None = None, suffix: str = "") -> float:
    """The sum of a ``prometheus_client`` metric's samples named ``<name><suffix>``
    whose labels include ``labels`` (0 when there is none)."""
    want = dict(labels or {})
    total = 0.0
    for family in metric.collect():
        for sample in family.samples:
            if suffix and not sample.name.endswith(suffix):
                continue
            if not suffix and sample.name.endswith(("_created", "_bucket", "_sum", "_count")):
                continue
            if all(sample.labels.get(k) == v for k, v in want.items()):
                total += float(sample.value)
    return total
