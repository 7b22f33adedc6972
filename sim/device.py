"""A device slower than this machine: segment runners stretched to a node profile.

The runner measures the model's node profile here and multiplies it by the
scenario's slowdown; :func:`slowed` makes every edge segment of a loaded package
take that profile's time for its nodes (:class:`SlowRunner` sleeps the rest).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.edge.model import EdgeModel
from splitinfer.edge.runtime import SegmentRunner

Array = np.ndarray[Any, Any]


class SlowRunner(SegmentRunner):
    """A segment runner on a slower device: each run of ``batch`` samples takes at least
    ``target_s`` x ``batch`` seconds (the device profile's time for the segment's
    nodes); it sleeps whatever this machine did not spend."""

    def __init__(
        self,
        inner: SegmentRunner,
        target_s: float,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__(inner.session, inner.name)
        self.inner = inner
        self.target_s = target_s
        self._sleep = sleep
        self._clock = clock

    def run(self, feeds: Mapping[str, Array]) -> dict[str, Array]:
        t = self._clock()
        out = self.inner.run(feeds)
        batch = next((len(v) for v in feeds.values() if np.ndim(v)), 1)
        rest = self.target_s * batch - (self._clock() - t)
        if rest > 0:
            self._sleep(rest)
        return out


def segment_seconds(path: Path, node_times: Mapping[str, float]) -> float:
    """The profile's seconds for the nodes of the ONNX file ``path`` (nodes it does not
    know, such as the Q/DQ pairs of an int8 segment, cost nothing)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return float(sum(node_times.get(n.name, 0.0) for n in graph.node))


def slowed(model: EdgeModel, node_times: Mapping[str, float] | None) -> EdgeModel:
    """``model`` on the device whose per-sample node times are ``node_times``
    (None: this machine, unchanged)."""
    if not node_times:
        return model
    package = model.package
    cuts = {}
    for k, rt in model.cuts.items():
        edge = rt.edge
        if edge is not None and rt.cut.edge is not None:
            edge = SlowRunner(edge, segment_seconds(package.file(rt.cut.edge), node_times))
        cuts[k] = dataclasses.replace(rt, edge=edge)
    fallback = model.fallback
    spec = model.manifest.fallback
    if fallback is not None and spec is not None:
        fallback = SlowRunner(fallback, segment_seconds(package.file(spec), node_times))
    return dataclasses.replace(model, cuts=cuts, fallback=fallback)


def device_times(profile: Path | None) -> dict[str, float] | None:
    """Per-sample node seconds at batch 1 of a node profile file (None: no profile)."""
    if profile is None:
        return None
    from splitinfer.partitioner.nodeprofile import NodeProfile

    times, _ = NodeProfile.load(profile).times_at(1)
    return dict(times)
