"""``edge-agent profile``: per-node latency of the package's edge segments on this device.

The partitioner's ``--edge-profile FILE`` wants the time of every node that may
run on the device, by node name, measured where the edge segments run. By
default (:func:`profile_package`, ``edge-agent profile``) that is what is
measured: each cut's edge segment, as the agent runs it (an INT8 segment at
INT8), on the model's inputs, merged into one profile (:func:`edge_segments`
picks them; a cut with no edge segment, the cloud-only cut, is skipped with a
note; a package with no edge segment at all is an error). A node that several
segments hold gets the median of its times; ``wall`` and ``unattributed`` are
the largest segment's.

``whole=True`` measures the whole optimized graph instead (what ``sim/``
scales into a slower device's profile), held whole in one of these, tried in
order (:func:`whole_model`):

1. ``full.onnx`` (``partition --edge-fallback``);
2. the cloud segment of a "none" cut (the whole model on the cloud side);
3. the edge segment of an "all" cut;
4. else the default cut's edge and cloud segments, measured one after the
   other (the cloud segment on the edge segment's outputs) and merged.

Times are measured by ``splitinfer.partitioner.profiler.measure_nodes`` (ONNX
Runtime's profiler, mapped back to the graph's nodes) on the inputs the
partitioner analysed (``manifest.analysis_shapes``).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from splitinfer.edge.config import RuntimeConfig
from splitinfer.edge.model import sample_inputs
from splitinfer.edge.runtime import available_providers, detect_device, select_providers
from splitinfer.shared.errors import PackageError
from splitinfer.shared.manifest import Manifest, Segment
from splitinfer.shared.ortsession import open_session
from splitinfer.shared.package import Package, open_package

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class ProfileResult:
    #: a ``splitinfer.shared.nodeprofile.NodeProfile``
    profile: Any
    #: what was measured ("full.onnx", "cut c0 (cloud segment)", ...)
    measured: str


def whole_model(package: Package) -> tuple[list[Segment], str]:
    """The segments that together hold the whole graph, and a description."""
    m = package.manifest
    if m.fallback is not None:
        return [m.fallback], m.fallback.file
    for cut in m.cuts:
        if cut.kind == "none" and cut.cloud is not None:
            return [cut.cloud], f"cut {cut.id} ({cut.cloud.file})"
    for cut in m.cuts:
        if cut.kind == "all" and cut.edge is not None:
            return [cut.edge], f"cut {cut.id} ({cut.edge.file})"
    cut = m.cut
    segs = list(cut.segments())
    return segs, f"cut {cut.id} ({' + '.join(s.file for s in segs)})"


def edge_segments(package: Package) -> tuple[list[tuple[str, Segment]], list[str]]:
    """Each cut's edge segment as ``(cut id, segment)``, and a note per cut without one."""
    found, notes = [], []
    for cut in package.manifest.cuts:
        if cut.edge is None:
            notes.append(f"cut {cut.id} ({cut.kind}) has no edge segment: skipped")
        else:
            found.append((cut.id, cut.edge))
    return found, notes


def _stderr(message: str) -> None:
    print(f"edge-agent profile: {message}", file=sys.stderr)


def _feeds(manifest: Manifest, batch: int, upstream: list[Any]) -> dict[str, Array]:
    feeds = sample_inputs(manifest, batch)
    for runner in upstream:
        names = [o.name for o in runner.get_outputs()]
        wanted = {i.name: feeds[i.name] for i in runner.get_inputs()}
        feeds.update(zip(names, runner.run(names, wanted), strict=True))
    return feeds


def profile_package(
    path: Path | str,
    *,
    batch_sizes: Sequence[int] = (1,),
    runs: int = 10,
    warmup: int = 3,
    threads: int | None = None,
    provider: str = "cpu",
    whole: bool = False,
    note: Callable[[str], None] = _stderr,
) -> ProfileResult:
    """Measure each cut's edge segment (``whole``: the package's whole graph) and
    merge them into one profile; ``note`` gets one line per cut skipped."""

    from splitinfer.partitioner.profiler import measure_nodes
    from splitinfer.shared.nodeprofile import NodeProfile

    package = open_package(path)
    manifest = package.manifest
    if whole:
        segments, measured = whole_model(package)
    else:
        edges, notes = edge_segments(package)
        for line in notes:
            note(line)
        if not edges:
            raise PackageError(
                f"{path}: no cut of this package has an edge segment (nothing runs on the "
                "device); partition it with a cut that leaves work on the edge"
            )
        segments = [seg for _, seg in edges]
        ids = ", ".join(f"{cut_id} ({seg.file})" for cut_id, seg in edges)
        measured = f"the edge segment(s) of cut(s) {ids}"
    available = available_providers()
    listed = tuple(p.strip() for p in provider.split(",") if p.strip())  # --providers
    device = detect_device(want_gpu=listed != ("cpu",))
    config = RuntimeConfig(providers=listed)
    profiles = []
    upstream: list[Any] = []
    for seg in segments:
        file = package.file(seg)
        names = [n for n, _ in select_providers(available, device, config, seg, Path("."))]
        model = onnx.load(str(file))
        prior = list(upstream)

        def feeds_for(batch: int, prior: list[Any] = prior) -> dict[str, Array]:
            return _feeds(manifest, batch, prior)

        profiles.append(
            measure_nodes(
                model,
                feeds_for,
                batch_sizes=batch_sizes,
                runs=runs,
                warmup=warmup,
                providers=names,
                intra_op_threads=threads,
                source_sha256=manifest.source_sha256,
            )
        )
        if whole:  # the next segment reads this one's outputs
            upstream.append(open_session(file, providers=names, name=seg.file))
    if not profiles:
        raise PackageError(f"{path}: no segment holds the model's nodes")
    if len(profiles) == 1:
        return ProfileResult(profiles[0], measured)
    if not whole:
        return ProfileResult(_union(profiles, segments, manifest.source_sha256), measured)
    first = profiles[0]
    merged = NodeProfile(
        device=first.device,
        batch_sizes=first.batch_sizes,
        times={
            b: {k: v for p in profiles for k, v in p.times[b].items()} for b in first.batch_sizes
        },
        wall={b: sum(p.wall[b] for p in profiles) for b in first.batch_sizes},
        unattributed_s={b: sum(p.unattributed_s[b] for p in profiles) for b in first.batch_sizes},
        runtime=first.runtime,
        source_sha256=manifest.source_sha256,
        precision=None,
        meta={**first.meta, "segments": measured},
    )
    return ProfileResult(merged, measured)


def _union(profiles: Sequence[Any], segments: Sequence[Segment], sha256: str | None) -> Any:
    """One profile of segments measured apart, each on the model's inputs: every node
    they hold (the median where several hold it); ``wall`` and ``unattributed`` of
    the segment that took longest."""
    from splitinfer.shared.nodeprofile import NodeProfile

    first = profiles[0]
    batches = first.batch_sizes
    times: dict[int, dict[str, float]] = {}
    for b in batches:
        seen: dict[str, list[float]] = {}
        for p in profiles:
            for name, t in p.times[b].items():
                seen.setdefault(name, []).append(t)
        times[b] = {name: statistics.median(ts) for name, ts in seen.items()}
    longest = max(profiles, key=lambda p: p.wall[batches[0]])
    precisions = {p.precision for p in profiles}
    return NodeProfile(
        device=first.device,
        batch_sizes=batches,
        times=times,
        wall=dict(longest.wall),
        unattributed_s=dict(longest.unattributed_s),
        runtime=first.runtime,
        source_sha256=sha256,
        precision=precisions.pop() if len(precisions) == 1 else None,
        meta={**first.meta, "segments": ", ".join(s.file for s in segments)},
    )
