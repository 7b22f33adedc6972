"""The candidates ``--split auto`` costs in a space too big to list (see cutsearch).

Per link point and per constraint-adjusted weighting, the min-cut of the unit
order (:func:`auto_candidates`), priced from the measured node times and the
codec's wire figures (:class:`Pricing`); then all edge, all cloud and the
single-tensor cuts. The caller plans them and costs them exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from splitinfer.partitioner.costmodel import WireModel, times_vector
from splitinfer.partitioner.cuts import CutSpace, fp32_bytes
from splitinfer.partitioner.cutsearch import (
    Flow,
    Found,
    articulation_cuts,
    flows_of,
    problem,
    rate_label,
    unit_sums,
)
from splitinfer.partitioner.mincut import solve
from splitinfer.shared.costs import CloudPricing, Constraints, EnergyModel
from splitinfer.shared.links import Link


@dataclass(frozen=True)
class Pricing:
    """Per unit and per value figures the auto split prices min-cuts with."""

    edge_s: tuple[float, ...]  # per unit, one request on the edge
    cloud_s: tuple[float, ...]  # per unit, one request in the cloud
    cloud_sample_s: tuple[float, ...]  # per unit, per request at the best batch
    weight_bytes: tuple[float, ...]  # per unit, fp32 weights its nodes read
    wire: Mapping[str, tuple[float, float, float]]  # value -> (bytes, encode s, decode s)
    blocked: frozenset[str] = frozenset()  # values that may not cross (privacy)

    @classmethod
    def of(
        cls,
        space: CutSpace,
        edge_times: Mapping[str, float],
        cloud_times: Mapping[str, float],
        by_batch: Mapping[int, Mapping[str, float]],
        wire: WireModel,
        *,
        private: bool = False,
    ) -> Pricing:
        a = space.analysis
        names = [n.name for n in a.nodes]
        edge_t = times_vector(edge_times, names, space.flops, "edge")
        cloud_t = times_vector(cloud_times, names, space.flops, "cloud")
        sample_t = cloud_t.copy()
        for b, times in by_batch.items():
            sample_t = np.minimum(sample_t, times_vector(times, names, space.flops, "cloud") / b)
        init_bytes = np.zeros(len(names))
        for i, inputs in enumerate(a.node_inputs):
            init_bytes[i] = sum(
                float(fp32_bytes(a.tensors[n])) for n in inputs if a.tensors[n].is_initializer
            )
        figures = {f.name: wire.of(a.tensors[f.name]) for f in flows_of(space) if f.crossable}
        blocked = frozenset(
            f.name
            for f in flows_of(space)
            if private and np.dtype(a.tensors[f.name].dtype).kind != "f"
        )
        return cls(
            tuple(unit_sums(space, edge_t)),
            tuple(unit_sums(space, cloud_t)),
            tuple(unit_sums(space, sample_t)),
            tuple(unit_sums(space, init_bytes)),
            figures,
            blocked,
        )

    def weights(
        self, objective: str, rate: float, energy: EnergyModel, cloud: CloudPricing
    ) -> tuple[list[float], list[float], Callable[[Flow], float]]:
        """Per-unit edge and cloud costs and the value cost under ``objective`` at uplink
        ``rate``; what every cut but all-edge pays alike (round trip, results) left out."""
        wire, blocked = self.wire, self.blocked
        if objective == "latency":

            def cost(f: Flow) -> float:
                if f.name in blocked:
                    return math.inf
                nbytes, enc, dec = wire[f.name]
                return nbytes * 8 / rate + enc + dec

            return list(self.edge_s), list(self.cloud_s), cost
        if objective == "edge-energy":
            w = energy.edge_w

            def joules(f: Flow) -> float:
                if f.name in blocked:
                    return math.inf
                nbytes, enc, _ = wire[f.name]
                bits = nbytes * 8
                return (
                    w * enc
                    + energy.alpha_up_w_per_mbps * bits / 1e6
                    + (energy.beta_w * bits / rate)
                )

            return [w * t for t in self.edge_s], [0.0] * len(self.edge_s), joules
        per_s = cloud.usd_per_hour / 3600.0

        def dollars(f: Flow) -> float:
            return math.inf if f.name in blocked else per_s * wire[f.name][2]

        return [0.0] * len(self.edge_s), [per_s * t for t in self.cloud_sample_s], dollars


def link_points(link: Link) -> list[float]:
    """Uplink rates that stand for a link: its mean, and for a trace the quantiles of
    its capacity (5% ... 95%) and its harmonic mean (what a transfer sees on average)."""
    rates = [link.uplink_bps]
    caps = np.asarray(link.uplink_samples, dtype=np.float64)
    caps = caps[caps > 0]
    if caps.size:
        rates += [float(q) for q in np.quantile(caps, (0.05, 0.25, 0.5, 0.75, 0.95))]
        rates.append(float(1.0 / np.mean(1.0 / caps)))
    return sorted(set(rates))


def auto_candidates(
    space: CutSpace,
    pricing: Pricing,
    link: Link,
    objective: str,
    constraints: Constraints,
    sweep: Sequence[float],
    progress: Callable[[str], None],
    *,
    energy: EnergyModel | None = None,
    cloud: CloudPricing | None = None,
) -> Found:
    """The candidates ``--split auto`` costs exactly in a space too big to list.

    The min-cut under ``objective`` at each of the link's points and each rate of
    ``sweep``; with an edge memory budget, at the link's rate with each unit's
    weights priced at a range of multipliers (a Lagrangian sweep of the budget);
    with a latency bound under another objective, the objective plus a range of
    multiples of the latency. Then all edge, all cloud and the single-tensor cuts.
    """
    energy = energy or EnergyModel()
    cloud = cloud or CloudPricing()
    found = Found()
    main = link.uplink_bps
    jobs: list[tuple[str, list[float], list[float], Callable[[Flow], float]]] = []
    rates = sorted(set(link_points(link)) | {float(r) for r in sweep})
    for r in rates:
        e, c, t = pricing.weights(objective, r, energy, cloud)
        jobs.append((f"min-cut at {rate_label(r)}", e, c, t))
    found.points, found.weightings = len(rates), 1
    e0, c0, t0 = pricing.weights(objective, main, energy, cloud)
    scale = sum(e0) + sum(c0) or 1.0
    if constraints.edge_memory_bytes is not None:
        per_byte = scale / max(sum(pricing.weight_bytes), 1.0)
        for k in (0.01, 0.1, 1.0, 10.0, 100.0):
            lam = per_byte * k
            e = [x + lam * w for x, w in zip(e0, pricing.weight_bytes, strict=True)]
            jobs.append((f"min-cut at {rate_label(main)}, weights x {k:g}", e, c0, t0))
            found.weightings += 1
    if constraints.max_latency_s is not None and objective != "latency":
        le, lc, lt = pricing.weights("latency", main, energy, cloud)
        per_s = scale / max(sum(le) + sum(lc), 1e-30)
        for k in (0.1, 1.0, 10.0, 100.0):
            mu = per_s * k

            def mixed(f: Flow, mu: float = mu) -> float:
                return t0(f) + mu * lt(f)

            e = [x + mu * y for x, y in zip(e0, le, strict=True)]
            c = [x + mu * y for x, y in zip(c0, lc, strict=True)]
            jobs.append((f"min-cut at {rate_label(main)}, latency x {k:g}", e, c, mixed))
            found.weightings += 1
    for k, (why, e, c, t) in enumerate(jobs, 1):
        progress(f"max-flow {k}/{len(jobs)}: {why}")
        found.add(solve(problem(space, e, c, t)), why)
        found.runs += 1
    found.distinct = len(found.why)
    found.add(0, "all cloud")
    found.add(space.full, "all edge")
    for mask in articulation_cuts(space):
        found.add(mask, "single tensor")
    return found
