"""``partition --report report.png``: a Neurosurgeon-style chart of the candidate cuts.

One stacked bar per cut: edge (compute + encode), transfer (upload, round trip,
download) and cloud (decode + compute), in milliseconds, with the chosen cut
marked. With many cuts the chart shows the ``max_bars`` cheapest plus the
all-cloud and all-edge cuts, sorted by total. matplotlib (the ``report``
extra) is imported here, with the Agg backend, and nowhere else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from splitinfer.shared.errors import ConfigError

MAX_BARS = 20
_COLOURS = {"edge": "#4c72b0", "transfer": "#dd8452", "cloud": "#55a868"}


def select_rows(
    rows: Sequence[Mapping[str, Any]], chosen_id: str, max_bars: int = MAX_BARS
) -> list[Mapping[str, Any]]:
    """The rows to draw: the ``max_bars`` lowest totals, the chosen cut, and the
    none/all cuts, sorted by total (ties by cut id)."""
    ordered = sorted(rows, key=lambda r: (float(r["total_ms"]), str(r["cut"])))
    keep = ordered[:max_bars]
    for r in ordered[max_bars:]:
        if r.get("kind") in {"none", "all"} or r["cut"] == chosen_id:
            keep.append(r)
    return sorted(keep, key=lambda r: (float(r["total_ms"]), str(r["cut"])))


def draw_report(
    rows: Sequence[Mapping[str, Any]],
    chosen_id: str,
    path: str | Path,
    title: str,
    *,
    max_bars: int = MAX_BARS,
) -> Path:
    """Draw the rows of :func:`~splitinfer.partitioner.costmodel.candidate_table` to
    ``path`` (PNG, or any format matplotlib infers from the suffix)."""
    out = Path(path)
    if not rows:
        raise ConfigError("--report: there are no candidate cuts to draw")
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise ConfigError(f"--report {out}: is a folder; give a file name such as report.png")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"--report {out}: cannot write into {parent}; choose another path")
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--report needs matplotlib: pip install 'splitinfer[report]'") from None
    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot as plt

    shown = select_rows(rows, chosen_id, max_bars)
    labels = [str(r["cut"]) + _kind_suffix(r) for r in shown]
    edge = [float(r["edge_ms"]) for r in shown]
    transfer = [float(r["transfer_ms"]) for r in shown]
    cloud = [float(r["cloud_ms"]) for r in shown]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(shown) + 2.0), 4.5), dpi=100)
    try:
        xs = list(range(len(shown)))
        ax.bar(xs, edge, color=_COLOURS["edge"], label="edge (compute + encode)")
        ax.bar(xs, transfer, bottom=edge, color=_COLOURS["transfer"], label="transfer")
        bottoms = [e + t for e, t in zip(edge, transfer, strict=True)]
        ax.bar(xs, cloud, bottom=bottoms, color=_COLOURS["cloud"], label="cloud (decode + compute)")
        top = max((b + c for b, c in zip(bottoms, cloud, strict=True)), default=0.0)
        for x, r in zip(xs, shown, strict=True):
            if r["cut"] == chosen_id:
                total = float(r["total_ms"])
                ax.bar([x], [total], fill=False, edgecolor="black", linewidth=2.0)
                ax.annotate(
                    "chosen",
                    (x, total),
                    xytext=(0, 4),
                    textcoords="offset points",
                    ha="center",
                    fontweight="bold",
                )
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("predicted latency (ms)")
        ax.set_ylim(0, top * 1.12 if top > 0 else 1.0)
        hidden = len(rows) - len(shown)
        ax.set_title(title + (f"  ({hidden} more cuts not shown)" if hidden else ""), fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
        fig.tight_layout()
        try:
            fig.savefig(out)
        except OSError as exc:
            raise ConfigError(f"--report {out}: cannot write: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return out


def _kind_suffix(row: Mapping[str, Any]) -> str:
    kind = row.get("kind")
    return f" ({kind})" if kind in {"none", "all"} else ""
