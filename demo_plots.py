"""The demo's latency CDF picture (matplotlib, the ``report`` extra, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from splitinfer.shared.errors import ConfigError

if TYPE_CHECKING:
    from splitinfer.demo import Strategy


def latency_cdf(strategies: Sequence[Strategy], path: Path, title: str) -> Path:
    """One empirical CDF of the per-request latency per strategy, log-scaled time axis."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "the demo's pictures need matplotlib: pip install 'splitinfer[report]'"
        ) from None
    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.5), dpi=100)
    try:
        for s in strategies:
            if not s.latencies:
                continue
            ms = np.sort(np.asarray(s.latencies)) * 1e3
            frac = np.arange(1, len(ms) + 1) / len(ms)
            ax.step(ms, frac, where="post", label=f"{s.name} (p50 {np.median(ms):.0f} ms)")
        ax.set_xscale("log")
        ax.set_xlabel("latency per request (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.01)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"latency CDF per strategy: {title}", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path
