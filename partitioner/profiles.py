"""Per-node times of an analysed graph: the roofline estimate or a measured profile.

The device profiles, the measured profile format and the roofline formula live in
:mod:`splitinfer.shared.profiles` and :mod:`splitinfer.shared.nodeprofile` (the
edge agent reads them too); this module gives them a graph: :func:`node_work`
describes each node of a :class:`GraphAnalysis` (FLOPs from
:mod:`~splitinfer.partitioner.flops`, tensors from the analysis) and
:func:`node_times` is the partitioner's one entry point for either source. The
names re-exported here keep ``from splitinfer.partitioner.profiles import
BUILTIN, DeviceProfile, resolve_profile`` working.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from splitinfer.partitioner.analysis import GraphAnalysis
from splitinfer.partitioner.flops import node_flops
from splitinfer.partitioner.runtime_map import node_keys
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.nodeprofile import NodeProfile
from splitinfer.shared.profiles import (
    BUILTIN,
    ELEMENT_BYTES,
    KINDS,
    MATRIX_OPS,
    RUNTIMES,
    VIEW_OPS,
    DeviceProfile,
    NodeWork,
    TensorWork,
    check_precision,
    resolve_profile,
    roofline_seconds,
)

__all__ = [
    "BUILTIN",
    "ELEMENT_BYTES",
    "KINDS",
    "MATRIX_OPS",
    "MAX_MISSING",
    "RUNTIMES",
    "VIEW_OPS",
    "DeviceProfile",
    "NodeProfile",
    "NodeTimes",
    "node_times",
    "node_work",
    "resolve_profile",
    "roofline_times",
]

#: Share of missing nodes a measured profile may lack before it is refused.
MAX_MISSING = 0.05


def _tensor_work(analysis: GraphAnalysis, name: str) -> TensorWork:
    info = analysis.tensors[name]
    dtype = np.dtype(info.dtype)
    return TensorWork(math.prod(info.sample_shape), dtype.itemsize, dtype.kind == "f", info.batched)


def node_work(analysis: GraphAnalysis) -> list[NodeWork]:
    """Each analysed node as the roofline sees it (keys by :func:`node_keys`)."""
    work = []
    for i, (key, node) in enumerate(zip(node_keys(analysis), analysis.nodes, strict=True)):
        if not analysis.data_node[i]:
            work.append(NodeWork(key, node.op_type, False, 0))
            continue
        names = [n for n in node.input if n in analysis.tensors]
        names += [n for n in node.output if n in analysis.tensors]
        tensors = tuple(_tensor_work(analysis, n) for n in names)
        work.append(NodeWork(key, node.op_type, True, node_flops(analysis, i), tensors))
    return work


def roofline_times(
    analysis: GraphAnalysis, profile: DeviceProfile, precision: str, batch: int = 1
) -> dict[str, float]:
    """Estimated seconds per node (by key) for one forward pass of ``batch`` samples."""
    check_precision(precision)
    if batch < 1:
        raise ConfigError(f"batch {batch}: must be a positive integer")
    return roofline_seconds(node_work(analysis), profile, precision, batch)


@dataclass(frozen=True)
class NodeTimes:
    """Seconds per node (by key) for one forward pass, where they came from, caveats."""

    times: dict[str, float]
    source: str
    notes: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return sum(self.times.values())


def node_times(
    analysis: GraphAnalysis,
    source: DeviceProfile | NodeProfile,
    precision: str,
    batch: int = 1,
    *,
    fallback: DeviceProfile | None = None,
    model_sha256: str | None = None,
) -> NodeTimes:
    """Seconds per node of ``analysis`` for ``batch`` samples on ``source``.

    A :class:`DeviceProfile` gives the roofline estimate. A measured
    :class:`NodeProfile` gives its times at that batch (interpolated between
    measured batch sizes). A measured profile that lacks nodes of this graph
    was measured on another graph: up to :data:`MAX_MISSING` of the nodes are
    filled in (from ``fallback``'s roofline, or else at the profile's own
    seconds per FLOP) and said so in ``notes``; more is a :class:`ConfigError`.
    """
    check_precision(precision)
    if isinstance(source, DeviceProfile):
        return NodeTimes(
            roofline_times(analysis, source, precision, batch),
            f"roofline estimate for {source.name} at {precision}",
        )
    measured, note = source.times_at(batch)
    notes = [note] if note else []
    if source.precision is not None and source.precision != precision:
        notes.append(f"measured at {source.precision}, asked for {precision}: used as measured")
    keys = node_keys(analysis)
    missing = [k for k in keys if k not in measured]
    if missing:
        if len(missing) >= MAX_MISSING * len(keys):
            theirs = source.source_sha256 or "unknown"
            ours = model_sha256 or "unknown"
            raise ConfigError(
                f"the measured profile from {source.device} lacks {len(missing)} of this "
                f"graph's {len(keys)} nodes (e.g. {missing[0]!r}): it was measured on another "
                f"model (profile source_sha256 {theirs[:12]}, model {ours[:12]}); "
                "measure it again on this model"
            )
        fill, how = _fill(analysis, keys, measured, missing, precision, batch, fallback)
        measured.update(fill)
        notes.append(f"{len(missing)} of {len(keys)} nodes not in the measured profile: {how}")
    times = {k: measured[k] for k in keys}
    return NodeTimes(times, f"measured on {source.device} ({source.runtime})", tuple(notes))


def _fill(
    analysis: GraphAnalysis,
    keys: list[str],
    measured: dict[str, float],
    missing: list[str],
    precision: str,
    batch: int,
    fallback: DeviceProfile | None,
) -> tuple[dict[str, float], str]:
    if fallback is not None:
        estimate = roofline_times(analysis, fallback, precision, batch)
        return {k: estimate[k] for k in missing}, f"estimated with the {fallback.name} roofline"
    flops = {k: node_flops(analysis, i) * batch for i, k in enumerate(keys)}
    known = [k for k in keys if k in measured and flops[k] > 0]
    total_flops = sum(flops[k] for k in known)
    per_flop = sum(measured[k] for k in known) / total_flops if total_flops else 0.0
    return (
        {k: flops[k] * per_flop for k in missing},
        "estimated at the profile's own seconds per FLOP",
    )
