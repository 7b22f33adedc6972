"""Cuts worth a look in a space too big to list: min-cuts, single-tensor cuts, depth bands.

The unit order of a :class:`~splitinfer.partitioner.cuts.CutSpace` becomes a
:class:`~splitinfer.partitioner.mincut.CutProblem` (:func:`problem`): each unit
priced on each side, each value that can cross priced once. What a cut sends
follows :meth:`CutSpace.plan`: a unit in the cloud reads the batched tensors of
edge units and the model inputs it needs directly or through shape arithmetic
(``Shape -> Gather -> Concat``); a non-batched value it needs is rebuilt in the
cloud when the analysis can rebuild it (free), and may not cross otherwise
(infinite). Shape arithmetic that could be rebuilt is taken as rebuilt; in the
rare graph where the plan computes it in the cloud instead, the min-cut's
price is off by the tensors that feed it, and the exact cost model that ranks
the candidates afterwards has the true figure.

Every candidate is planned by :meth:`CutSpace.plan_for`; an edge set the plan
refuses (a value needed on both sides, say) is dropped and counted.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from splitinfer.partitioner.costmodel import WireModel, times_vector
from splitinfer.partitioner.cuts import CutPlan, CutSpace, fp32_bytes
from splitinfer.partitioner.mincut import INPUT, OUTPUT, CutProblem, Tensor, solve
from splitinfer.shared.costs import CloudPricing, Constraints, EnergyModel
from splitinfer.shared.links import Link

#: Link speeds (bits/s) of the min-cut sweep in --list-cuts.
LIST_RATES = tuple(float(r) for r in np.geomspace(0.25e6, 100e6, 8))
#: Depth bands of the fewest-bytes cuts in --list-cuts.
DEPTH_BANDS = 10
#: Single-tensor cuts kept at most (evenly spread through the graph).
MAX_ARTICULATION = 64


@dataclass(frozen=True)
class Flow:
    """A value a cloud unit may need from the edge: a tensor of an edge unit or an input."""

    name: str
    producer: int  # unit, or INPUT
    consumers: tuple[int, ...]  # units, and OUTPUT
    crossable: bool  # batched tensor or model input; else it may not cross


_FLOWS: weakref.WeakKeyDictionary[CutSpace, tuple[Flow, ...]] = weakref.WeakKeyDictionary()


def flows_of(space: CutSpace) -> tuple[Flow, ...]:
    """Every value that crosses some cut, with the units that read it; O(V + E)."""
    cached = _FLOWS.get(space)
    if cached is not None:
        return cached
    a = space.analysis
    unit_of = space.unit_of
    memo: dict[int, tuple[str, ...]] = {}

    def sources(name: str) -> tuple[str, ...]:
        info = a.tensors.get(name)
        if info is None or info.is_initializer:
            return ()
        if info.is_input:
            return (name,)
        p = info.producer
        if p is None:
            return ()
        if p in unit_of:
            return (name,)
        if info.remat is not None:
            return ()  # shape arithmetic the cloud rebuilds
        if p not in memo:
            memo[p] = ()  # the graph is acyclic; this only guards the recursion
            found: dict[str, None] = {}
            for n in a.node_inputs[p]:
                found.update(dict.fromkeys(sources(n)))
            memo[p] = tuple(found)
        return memo[p]

    readers: dict[str, dict[int, None]] = {}
    for i in range(len(a.nodes)):
        u = unit_of.get(i)
        if u is None:
            continue
        for name in a.node_inputs[i]:
            for src in sources(name):
                p = a.tensors[src].producer
                if p is not None and unit_of.get(p) == u:
                    continue
                readers.setdefault(src, {})[u] = None
    for out in a.outputs:
        for src in sources(out):
            readers.setdefault(src, {})[OUTPUT] = None
    flows = []
    for name, who in readers.items():
        info = a.tensors[name]
        if not info.is_input and not info.batched and info.remat is not None:
            continue  # rebuilt in the cloud
        producer = INPUT if info.producer is None else unit_of[info.producer]
        crossable = info.is_input or info.batched
        flows.append(Flow(name, producer, tuple(who), crossable))
    result = tuple(flows)
    _FLOWS[space] = result
    return result


def problem(
    space: CutSpace,
    edge_unit: Sequence[float],
    cloud_unit: Sequence[float],
    tensor_cost: Callable[[Flow], float],
    *,
    forced_edge: int = 0,
    forced_cloud: int = 0,
) -> CutProblem:
    """The space as a min-cut problem; ``tensor_cost`` prices each crossable value."""
    tensors = tuple(
        Tensor(f.producer, f.consumers, tensor_cost(f) if f.crossable else math.inf)
        for f in flows_of(space)
    )
    preds = tuple(_bits(m) for m in space.pred)
    return CutProblem(
        preds, tuple(edge_unit), tuple(cloud_unit), tensors, forced_edge, forced_cloud
    )


def unit_sums(space: CutSpace, per_node: np.ndarray) -> list[float]:
    """Per unit: the sum of its nodes' values (per-node vector in analysis order)."""
    return [float(sum(per_node[i] for i in members)) for members in space.units]


def articulation_cuts(space: CutSpace, limit: int = MAX_ARTICULATION) -> list[int]:
    """Edge sets that end at one unit every other unit is ordered with, and that
    nothing beyond reads from except that unit: cuts sending one unit's output
    (plus any model input read later). Up to ``limit``, spread through the graph."""
    n = len(space.units)
    succ_mask = [0] * n
    for u, ws in enumerate(space.succ):
        for w in ws:
            succ_mask[u] |= 1 << w
    found = []
    for u in range(n):
        below = space.below[u]
        if below | space.above[u] != space.full or below == space.full:
            continue
        m, ok = below & ~(1 << u), True
        while m and ok:
            low = m & -m
            ok = succ_mask[low.bit_length() - 1] & ~below == 0
            m ^= low
        if ok:
            found.append(below)
    found.sort(key=int.bit_count)
    if len(found) > limit:
        idx = np.linspace(0, len(found) - 1, limit).round().astype(int)
        found = [found[i] for i in sorted(set(idx.tolist()))]
    return found


def depth_band_cuts(space: CutSpace, bands: int = DEPTH_BANDS) -> list[tuple[str, int]]:
    """Per band of unit depth: the edge set that sends the fewest fp32 bytes among the
    cuts whose boundary lies in the band (shallower units on the edge, deeper ones in
    the cloud)."""
    depth = space.depths()
    top = max(depth, default=0) + 1
    edges = sorted({round(i * top / bands) for i in range(bands + 1)})
    zeros = [0.0] * len(space.units)
    a = space.analysis

    def nbytes(f: Flow) -> float:
        return float(fp32_bytes(a.tensors[f.name]))

    out = []
    for lo, hi in itertools.pairwise(edges):
        forced_edge = sum(1 << u for u, d in enumerate(depth) if d < lo)
        forced_cloud = sum(1 << u for u, d in enumerate(depth) if d > hi)
        mask = solve(problem(space, zeros, zeros, nbytes, forced_edge=forced_edge,
                             forced_cloud=forced_cloud))  # fmt: skip
        if mask is not None:
            out.append((f"fewest bytes at depth {lo}-{hi}", mask))
    return out


@dataclass
class Found:
    """Candidate edge sets with why each is there, in the order found."""

    why: dict[int, list[str]] = field(default_factory=dict)
    #: max-flows run, link points and weightings they were run at
    runs: int = 0
    points: int = 0
    weightings: int = 0
    #: distinct edge sets that came out of the max-flows
    distinct: int = 0

    def add(self, mask: int | None, reason: str) -> None:
        if mask is not None:
            self.why.setdefault(mask, []).append(reason)

    def plans(self, space: CutSpace) -> tuple[list[CutPlan], dict[str, str], int]:
        """The valid ones planned, each id's reasons, and how many the plan refused."""
        plans, reasons, refused = [], {}, 0
        for mask, why in self.why.items():
            plan = space.plan_for(mask)
            if plan is None:
                refused += 1
                continue
            plans.append(plan)
            reasons[plan.id] = "; ".join(why)
        plans.sort(key=lambda p: (p.edge_units.bit_count(), p.id))
        return plans, reasons, refused


def latency_sweep(
    space: CutSpace,
    edge_t: np.ndarray,
    cloud_t: np.ndarray,
    wire: Callable[[str], tuple[float, float]],
    rates: Iterable[float],
    found: Found,
    label: Callable[[float], str] = lambda r: f"min-cut at {_rate(r)}",
) -> None:
    """The latency-optimal min-cut at each uplink rate; ``wire(name)`` gives a value's
    (wire bytes, codec seconds)."""
    e, c = unit_sums(space, edge_t), unit_sums(space, cloud_t)
    for r in rates:

        def cost(f: Flow, r: float = r) -> float:
            nbytes, codec_s = wire(f.name)
            return nbytes * 8 / r + codec_s

        found.add(solve(problem(space, e, c, cost)), label(r))
        found.runs += 1


def _rate(bps: float) -> str:
    return f"{bps / 1e6:.3g} Mbit/s"


def _bits(mask: int) -> tuple[int, ...]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return tuple(out)


def roofline_weights(space: CutSpace, edge: str, cloud: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-node seconds (analysis order) from two built-in profiles' rooflines."""
    from splitinfer.partitioner.profiles import node_times, resolve_profile
    from splitinfer.partitioner.runtime_map import node_keys

    a = space.analysis
    keys = node_keys(a)
    out = []
    for spec, kind in ((edge, "edge"), (cloud, "cloud")):
        times = node_times(a, resolve_profile(spec, kind), "fp32", 1).times
        out.append(np.array([times.get(k, 0.0) for k in keys]))
    return out[0], out[1]


def list_candidates(
    space: CutSpace, edge: str, cloud: str, ratio: float
) -> tuple[list[CutPlan], Mapping[str, str], Found]:
    """What ``--list-cuts`` shows for a space too big to list: all cloud, all edge, the
    single-tensor cuts, the latency min-cuts across :data:`LIST_RATES` (rooflines of
    ``edge`` and ``cloud``, float tensors compressed ``ratio`` x) and the fewest-bytes
    cut per depth band."""
    found = Found()
    found.add(0, "all cloud")
    found.add(space.full, "all edge")
    for mask in articulation_cuts(space):
        found.add(mask, "single tensor")
    edge_t, cloud_t = roofline_weights(space, edge, cloud)
    a = space.analysis

    def wire(name: str) -> tuple[float, float]:
        info = a.tensors[name]
        raw = fp32_bytes(info)
        return (raw / ratio if np.dtype(info.dtype).kind == "f" else raw), 0.0

    latency_sweep(space, edge_t, cloud_t, wire, LIST_RATES, found)
    found.points, found.weightings = len(LIST_RATES), 1
    for why, mask in depth_band_cuts(space):
        found.add(mask, why)
    plans, reasons, _ = found.plans(space)
    return plans, reasons, found


# -- --split auto ----------------------------------------------------------------------


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
        jobs.append((f"min-cut at {_rate(r)}", e, c, t))
    found.points, found.weightings = len(rates), 1
    e0, c0, t0 = pricing.weights(objective, main, energy, cloud)
    scale = sum(e0) + sum(c0) or 1.0
    if constraints.edge_memory_bytes is not None:
        per_byte = scale / max(sum(pricing.weight_bytes), 1.0)
        for k in (0.01, 0.1, 1.0, 10.0, 100.0):
            lam = per_byte * k
            e = [x + lam * w for x, w in zip(e0, pricing.weight_bytes, strict=True)]
            jobs.append((f"min-cut at {_rate(main)}, weights x {k:g}", e, c0, t0))
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
            jobs.append((f"min-cut at {_rate(main)}, latency x {k:g}", e, c, mixed))
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
