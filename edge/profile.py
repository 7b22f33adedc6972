"""``edge-agent profile``: per-node latency of the package's model on this device.

The partitioner's ``--edge-profile FILE`` wants the time of every node of the
optimized graph, by node name, measured where the edge segment will run. The
package holds that graph whole in one of these, tried in order:

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

from collections.abc import Sequence
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
) -> ProfileResult:
    """Measure the package's whole graph; a merged profile when it is in two segments."""

    from splitinfer.partitioner.profiler import measure_nodes
    from splitinfer.shared.nodeprofile import NodeProfile

    package = open_package(path)
    manifest = package.manifest
    segments, measured = whole_model(package)
    available = available_providers()
    device = detect_device(want_gpu=provider != "cpu")
    config = RuntimeConfig(provider=provider)
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
        upstream.append(open_session(file, providers=names, name=seg.file))
    if not profiles:
        raise PackageError(f"{path}: no segment holds the model's nodes")
    if len(profiles) == 1:
        return ProfileResult(profiles[0], measured)
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
