"""Emulating an edge device slower than this machine (``runtime.emulate_device``).

The agent takes a device profile, the same names and files ``partition
--edge-profile`` reads: a built-in profile (``jetson-orin-nano``: its roofline
estimate of each node) or a measured node profile JSON (``edge-agent profile``'s
output, or one scaled to a slower device). Every edge segment run (and the local
model's) then takes at least the profile's time for the segment's nodes at the
run's batch size: :class:`EmulatedRunner` runs the segment here and sleeps the
rest. Nodes the profile does not know (the Q/DQ pairs of an int8 segment) cost
nothing. The emulated device runs one segment at a time, as one accelerator does:
the runners of one model share a lock.

Emulation only slows a segment down; a profile faster than this machine changes
nothing. It is for tests and network simulations (``netsim run``), never for
production.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from splitinfer.edge.runtime import SegmentRunner
from splitinfer.shared.errors import ConfigError, SplitInferError
from splitinfer.shared.manifest import Segment
from splitinfer.shared.nodeprofile import NodeProfile
from splitinfer.shared.profiles import BUILTIN, DeviceProfile, resolve_profile, roofline_seconds

if TYPE_CHECKING:
    import onnx

    from splitinfer.edge.model import EdgeModel

log = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]
#: Ops TensorRT and ORT fuse into their neighbours: they cost the emulated device nothing.
FREE_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


class EmulatedRunner(SegmentRunner):
    """A segment runner on a slower device: a run of ``batch`` samples takes at least
    ``seconds(batch)``; it sleeps whatever this machine did not spend. ``lock`` (shared
    by the runners of one device) makes the device run one segment at a time."""

    def __init__(
        self,
        inner: SegmentRunner,
        seconds: Callable[[int], float],
        *,
        lock: threading.Lock | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__(inner.session, inner.name)
        self.inner = inner
        self.seconds = seconds
        self._lock = lock or threading.Lock()
        self._sleep = sleep
        self._clock = clock

    def run(self, feeds: Mapping[str, Array]) -> dict[str, Array]:
        batch = next((len(v) for v in feeds.values() if np.ndim(v)), 1)
        with self._lock:
            t = self._clock()
            out = self.inner.run(feeds)
            rest = self.seconds(batch) - (self._clock() - t)
            if rest > 0:
                self._sleep(rest)
        return out


@dataclass(frozen=True)
class DeviceEmulation:
    """The emulated device: its profile and what it is called in logs and status."""

    source: DeviceProfile | NodeProfile
    name: str

    def segment_seconds(
        self, model: onnx.ModelProto, precision: str = "fp32", shapes: Mapping[str, Any] = {}
    ) -> Callable[[int], float]:
        """Seconds per run of ``model`` (one segment) by batch size, memoised."""
        names = [n.name for n in model.graph.node if n.op_type not in FREE_OPS]
        cache: dict[int, float] = {}
        if isinstance(self.source, NodeProfile):
            profile = self.source

            def measured(batch: int) -> float:
                if batch not in cache:
                    times, _ = profile.times_at(batch)
                    cache[batch] = float(sum(times.get(n, 0.0) for n in names))
                return cache[batch]

            return measured
        return _roofline(model, self.source, precision, shapes, cache)


def _roofline(
    model: onnx.ModelProto,
    device: DeviceProfile,
    precision: str,
    shapes: Mapping[str, Any],
    cache: dict[int, float],
) -> Callable[[int], float]:
    # the segment's shapes, to count its FLOPs and bytes: the partitioner's analysis
    from splitinfer.partitioner.analysis import analyse
    from splitinfer.partitioner.profiles import node_work

    inputs = {i.name for i in model.graph.input}
    overrides = {k: [1, *map(int, v)] for k, v in shapes.items() if k in inputs}
    try:
        analysis = analyse(model, overrides)
    except SplitInferError as exc:
        raise ConfigError(f"runtime.emulate_device={device.name}: {exc}") from None
    work = node_work(analysis)
    free = {w.key for w in work if w.op_type in FREE_OPS}

    def estimate(batch: int) -> float:
        if batch not in cache:
            times = roofline_seconds(work, device, precision, batch)
            cache[batch] = float(sum(t for k, t in times.items() if k not in free))
        return cache[batch]

    return estimate


def load_device(spec: str) -> DeviceEmulation:
    """A built-in edge profile by name or a measured profile JSON by path; a one-line
    ConfigError naming the value otherwise."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(
            f"runtime.emulate_device={spec!r}: give a built-in edge profile name or a profile JSON"
        )
    try:
        source = resolve_profile(spec, "edge")
    except SplitInferError as exc:
        raise ConfigError(f"runtime.emulate_device={spec!r}: {exc}") from None
    if isinstance(source, DeviceProfile):
        if source.kind != "edge":
            edge = ", ".join(p.name for p in BUILTIN.values() if p.kind == "edge")
            raise ConfigError(
                f"runtime.emulate_device={spec!r} is a cloud profile; use an edge one: {edge}"
            )
        return DeviceEmulation(source, f"{source.name} (roofline estimate)")
    return DeviceEmulation(source, f"{source.device} (measured profile {Path(spec).name})")


def emulate(
    model: EdgeModel,
    device: DeviceEmulation | str,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.perf_counter,
) -> EdgeModel:
    """``model`` with every edge segment (and the local model) stretched to ``device``."""
    import onnx

    emu = load_device(device) if isinstance(device, str) else device
    package = model.package
    shapes = model.manifest.analysis_shapes
    lock = threading.Lock()

    def wrap(runner: SegmentRunner, segment: Segment) -> EmulatedRunner:
        graph = onnx.load(str(package.file(segment)), load_external_data=False)
        seconds = emu.segment_seconds(graph, segment.precision, shapes)
        return EmulatedRunner(runner, seconds, lock=lock, sleep=sleep, clock=clock)

    cuts = {}
    for k, rt in model.cuts.items():
        edge = rt.edge
        if edge is not None and rt.cut.edge is not None:
            edge = wrap(edge, rt.cut.edge)
        cuts[k] = dataclasses.replace(rt, edge=edge)
    fallback = model.fallback
    spec = model.manifest.fallback
    if fallback is not None and spec is not None:
        fallback = wrap(fallback, spec)
    return dataclasses.replace(model, cuts=cuts, fallback=fallback, emulated=emu.name)


def describe(model: EdgeModel) -> str:
    """Per cut, the emulated edge time at batch 1 (for the start-up log)."""
    parts = []
    for k, rt in model.cuts.items():
        if isinstance(rt.edge, EmulatedRunner):
            parts.append(f"{k} {rt.edge.seconds(1) * 1e3:.2f} ms")
    if isinstance(model.fallback, EmulatedRunner):
        parts.append(f"local {model.fallback.seconds(1) * 1e3:.2f} ms")
    return ", ".join(parts) or "no edge segment"
