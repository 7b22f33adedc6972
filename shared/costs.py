"""Predicted cost of each candidate cut, and the choice among them.

A :class:`CutCost` holds what one request costs at one cut, independent of the
link: seconds of edge compute and encoding, wire bytes up and down, seconds of
cloud decoding and compute, edge memory, FLOPs and the measured accuracy drop.
The partitioner computes them (``partitioner/costmodel.py``) and writes them
into the manifest's candidate table; the edge agent reads them back and picks
among them for its current link estimate with the same functions.

Latency (Neurosurgeon's sum, one round trip per request)::

    edge_s + encode_s + up_bytes*8/uplink + rtt + cloud_s + decode_s + down_bytes*8/downlink

with no network term at all for an edge-only cut (nothing crosses). Over a
link with a capacity distribution (:class:`~splitinfer.shared.links.Link`) the
upload time is a distribution; the planner minimises the *expected* latency and
reports p50/p95.

Objectives (``choose(..., objective=...)``, lower is better, ties broken by
expected latency, then by the order of the input):

* ``latency``: expected end-to-end seconds.
* ``edge-energy``: joules the device spends per request, see :class:`EnergyModel`.
* ``cloud-cost``: dollars of cloud accelerator time per request, see
  :class:`CloudPricing`. An edge-only cut costs nothing, so this objective is
  meant to be used with a latency or memory constraint.

Constraints (:class:`Constraints`): edge memory budget, maximum latency (at a
quantile, p95 by default) and maximum accuracy drop. A cut whose accuracy drop
is unknown (``None``) does not satisfy an accuracy constraint. When no cut is
left, :class:`CutError` names the constraint that bound.

:func:`best_across_links` picks K cuts for run-time switching; its docstring
says how.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from splitinfer.shared.errors import ConfigError, CutError, PackageError
from splitinfer.shared.links import Link

OBJECTIVES = ("latency", "edge-energy", "cloud-cost")
CUT_KINDS = ("none", "all", "split")
#: Subsets examined exhaustively by best_across_links before it turns greedy.
MAX_SUBSETS = 5_000

F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class CutCost:
    """What one request costs at one cut (batch 1), independent of the link.

    Times in seconds, sizes in bytes. ``cloud_batch_s`` optionally holds the cloud
    segment's time per *batch* at other batch sizes, ``((batch, seconds), ...)``,
    for the cloud-cost objective (the cloud batches requests).
    """

    cut_id: str
    kind: str = "split"
    edge_s: float = 0.0
    encode_s: float = 0.0
    up_bytes: int = 0
    cloud_s: float = 0.0
    decode_s: float = 0.0
    down_bytes: int = 0
    edge_memory_bytes: int = 0
    edge_flops: int = 0
    cloud_flops: int = 0
    accuracy_drop: float | None = None
    cloud_batch_s: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.cut_id, str) or not self.cut_id:
            raise ConfigError(f"cut_id={self.cut_id!r} must be a non-empty string")
        if self.kind not in CUT_KINDS:
            raise ConfigError(f"{self.cut_id}: kind={self.kind!r} is not one of {CUT_KINDS}")
        for name in ("edge_s", "encode_s", "cloud_s", "decode_s"):
            value = getattr(self, name)
            if not (_is_number(value) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{self.cut_id}: {name}={value!r} must be seconds >= 0")
        for name in ("up_bytes", "down_bytes", "edge_memory_bytes", "edge_flops", "cloud_flops"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ConfigError(f"{self.cut_id}: {name}={value!r} must be an integer >= 0")
        drop = self.accuracy_drop
        if drop is not None and not (_is_number(drop) and math.isfinite(drop)):
            raise ConfigError(f"{self.cut_id}: accuracy_drop={drop!r} must be a number or None")
        pairs = tuple((int(b), float(s)) for b, s in self.cloud_batch_s)
        for b, s in pairs:
            if b < 1 or not (math.isfinite(s) and s >= 0):
                raise ConfigError(f"{self.cut_id}: cloud_batch_s entry ({b}, {s}) is invalid")
        object.__setattr__(self, "cloud_batch_s", tuple(sorted(pairs)))

    @property
    def fixed_s(self) -> float:
        """Compute and codec seconds: everything but the network."""
        return self.edge_s + self.encode_s + self.cloud_s + self.decode_s

    @property
    def cloud_s_per_sample(self) -> float:
        """Cloud compute seconds per request at the best measured batch size."""
        best = self.cloud_s
        for batch, seconds in self.cloud_batch_s:
            best = min(best, seconds / batch)
        return best

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["cloud_batch_s"] = [list(p) for p in self.cloud_batch_s]
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "candidate") -> CutCost:
        """Read one candidate from JSON; :class:`PackageError` naming the field if bad."""
        if not isinstance(data, Mapping):
            raise PackageError(f"{where}: expected an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PackageError(f"{where}: unknown field {unknown[0]!r}")
        if "cut_id" not in data:
            raise PackageError(f"{where}: missing field 'cut_id'")
        values = dict(data)
        try:
            if "cloud_batch_s" in values:
                values["cloud_batch_s"] = tuple(tuple(p) for p in values["cloud_batch_s"])
            return cls(**values)
        except (ConfigError, TypeError, ValueError) as exc:
            raise PackageError(f"{where}: {exc}") from None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class LatencyStats(NamedTuple):
    """End-to-end seconds over the link's distribution."""

    mean_s: float
    p50_s: float
    p95_s: float


def predict_latency(cost: CutCost, link: Link) -> float:
    """End-to-end seconds at the link's fixed (mean) rates."""
    return cost.fixed_s + link.transfer_time(cost.up_bytes, cost.down_bytes)


def latency_distribution(cost: CutCost, link: Link) -> LatencyStats:
    """Mean, median and 95th percentile seconds over the link's capacity samples."""
    samples = cost.fixed_s + link.transfer_time_samples(cost.up_bytes, cost.down_bytes)
    p50, p95 = np.quantile(samples, [0.5, 0.95])
    return LatencyStats(float(samples.mean()), float(p50), float(p95))


def latency_table(costs: Sequence[CutCost], link: Link, quantile: float = 0.95) -> F64:
    """Per cut: ``[mean, p50, p95, quantile]`` end-to-end seconds, shape ``(len(costs), 4)``."""
    up = np.array([c.up_bytes for c in costs], dtype=np.float64)
    down = np.array([c.down_bytes for c in costs], dtype=np.float64)
    fixed = np.array([c.fixed_s for c in costs], dtype=np.float64)
    out = np.empty((len(costs), 4))
    step = 256
    for i in range(0, len(costs), step):
        net = link.transfer_time_samples(up[i : i + step], down[i : i + step])
        out[i : i + step, 0] = net.mean(axis=-1)
        out[i : i + step, 1:] = np.quantile(net, [0.5, 0.95, quantile], axis=-1).T
    out += fixed[:, None]
    return out


# -- objectives ---------------------------------------------------------------------


@dataclass(frozen=True)
class EnergyModel:
    """Device energy per request: compute power x compute time + LTE radio energy.

    Radio: the LTE power model of Huang et al., "A Close Examination of Performance
    and Power Characteristics of 4G LTE Networks" (MobiSys 2012): while sending at
    throughput ``r`` Mbit/s the radio draws ``alpha_up * r + beta`` watts, so a
    transfer costs ``alpha_up`` joules per megabit plus ``beta`` watts for as long
    as it lasts; likewise downlink with ``alpha_down``. The radio is taken to be
    in its active state (``beta``) for the round trip as well. LTE's tail energy
    after a burst is not charged: it is paid once per burst, not per request of a
    stream. ``edge_w`` is an assumption: a mid-range embedded board running
    inference (between the 7 W and 15 W modes of a Jetson Orin Nano); set it for
    your device.
    """

    edge_w: float = 10.0
    alpha_up_w_per_mbps: float = 0.43839
    alpha_down_w_per_mbps: float = 0.05197
    beta_w: float = 1.28804

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (_is_number(value) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"energy model: {f.name}={value!r} must be a number >= 0")


@dataclass(frozen=True)
class CloudPricing:
    """Dollars per hour of the cloud accelerator a request's cloud segment runs on.

    Default: on-demand list price of a single NVIDIA L4 instance (about 0.80 $/h,
    e.g. AWS g6.xlarge, 2024); set it for your cloud. Cloud time per request is
    the best per-sample time over the measured batch sizes (the cloud batches),
    plus the decode time.
    """

    usd_per_hour: float = 0.80

    def __post_init__(self) -> None:
        if not (_is_number(self.usd_per_hour) and math.isfinite(self.usd_per_hour)) or (
            self.usd_per_hour < 0
        ):
            raise ConfigError(f"usd_per_hour={self.usd_per_hour!r} must be a number >= 0")


@dataclass(frozen=True)
class Constraints:
    """Limits a chosen cut must respect; ``None`` leaves one off."""

    #: Edge memory budget in bytes.
    edge_memory_bytes: int | None = None
    #: Maximum latency in seconds, at ``latency_quantile`` of the link's distribution.
    max_latency_s: float | None = None
    latency_quantile: float = 0.95
    #: Maximum accuracy drop (same unit as CutCost.accuracy_drop, e.g. top-1 points).
    max_accuracy_drop: float | None = None

    def __post_init__(self) -> None:
        budget = self.edge_memory_bytes
        if budget is not None and not (isinstance(budget, int) and budget > 0):
            raise ConfigError(f"edge memory budget {budget!r} must be a positive byte count")
        limit = self.max_latency_s
        if limit is not None and not (_is_number(limit) and math.isfinite(limit) and limit > 0):
            raise ConfigError(f"max_latency_s={limit!r} must be seconds > 0")
        if not 0 < self.latency_quantile <= 1:
            raise ConfigError(f"latency_quantile={self.latency_quantile!r} must be in (0, 1]")
        drop = self.max_accuracy_drop
        if drop is not None and not (_is_number(drop) and math.isfinite(drop) and drop >= 0):
            raise ConfigError(f"max accuracy drop {drop!r} must be a number >= 0")


@dataclass(frozen=True)
class Ranked:
    """One feasible cut with its objective value and latency over the link."""

    cost: CutCost
    score: float
    latency: LatencyStats
    #: Seconds at the constraints' latency quantile.
    latency_at_quantile_s: float


def objective_values(
    costs: Sequence[CutCost],
    objective: str,
    expected_s: F64,
    energy: EnergyModel = EnergyModel(),
    pricing: CloudPricing = CloudPricing(),
) -> F64:
    """The objective per cut (lower is better); ``expected_s`` from :func:`latency_table`."""
    if objective == "latency":
        return expected_s
    if objective == "edge-energy":
        up = np.array([c.up_bytes for c in costs], dtype=np.float64)
        down = np.array([c.down_bytes for c in costs], dtype=np.float64)
        compute = np.array([c.edge_s + c.encode_s for c in costs])
        network_s = expected_s - np.array([c.fixed_s for c in costs])  # upload + rtt + download
        radio = (
            energy.alpha_up_w_per_mbps * up * 8 / 1e6
            + energy.alpha_down_w_per_mbps * down * 8 / 1e6
            + energy.beta_w * np.maximum(network_s, 0.0)
        )
        out: F64 = energy.edge_w * compute + radio
        return out
    if objective == "cloud-cost":
        per_s = pricing.usd_per_hour / 3600.0
        cloud: F64 = per_s * np.array([c.cloud_s_per_sample + c.decode_s for c in costs])
        return cloud
    raise ConfigError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")


def rank(
    costs: Sequence[CutCost],
    link: Link,
    objective: str = "latency",
    constraints: Constraints = Constraints(),
    *,
    energy: EnergyModel = EnergyModel(),
    pricing: CloudPricing = CloudPricing(),
) -> list[Ranked]:
    """The feasible cuts, best first; :class:`CutError` if none is feasible."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    if not costs:
        raise CutError("no candidate cuts to choose from")
    table = latency_table(costs, link, constraints.latency_quantile)
    keep = _feasible_mask(costs, table[:, 3], constraints)
    scores = objective_values(costs, objective, table[:, 0], energy, pricing)
    order = sorted(
        (int(i) for i in np.flatnonzero(keep)), key=lambda i: (scores[i], table[i, 0], i)
    )
    return [
        Ranked(
            costs[i],
            float(scores[i]),
            LatencyStats(float(table[i, 0]), float(table[i, 1]), float(table[i, 2])),
            float(table[i, 3]),
        )
        for i in order
    ]


def choose(
    costs: Sequence[CutCost],
    link: Link,
    objective: str = "latency",
    constraints: Constraints = Constraints(),
    *,
    energy: EnergyModel = EnergyModel(),
    pricing: CloudPricing = CloudPricing(),
) -> CutCost:
    """The best feasible cut under ``objective``; :class:`CutError` if none is feasible."""
    return rank(costs, link, objective, constraints, energy=energy, pricing=pricing)[0].cost


def _feasible_mask(costs: Sequence[CutCost], latency_q: F64, c: Constraints) -> npt.NDArray[Any]:
    n = len(costs)
    checks: list[tuple[str, npt.NDArray[Any]]] = []
    if c.edge_memory_bytes is not None:
        mem = np.array([x.edge_memory_bytes for x in costs])
        best = int(mem.min())
        checks.append(
            (
                f"the edge memory budget of {c.edge_memory_bytes} bytes (the smallest edge "
                f"footprint is {best} bytes, cut {costs[int(mem.argmin())].cut_id})",
                mem <= c.edge_memory_bytes,
            )
        )
    if c.max_accuracy_drop is not None:
        drops = [x.accuracy_drop for x in costs]
        ok = np.array([d is not None and d <= c.max_accuracy_drop for d in drops])
        known = [d for d in drops if d is not None]
        detail = (
            f"the smallest measured drop is {min(known):g}"
            if known
            else "no cut has a measured accuracy drop"
        )
        checks.append((f"the maximum accuracy drop of {c.max_accuracy_drop:g} ({detail})", ok))
    if c.max_latency_s is not None:
        best_i = int(latency_q.argmin())
        checks.append(
            (
                f"the maximum latency of {c.max_latency_s * 1e3:.4g} ms at p"
                f"{c.latency_quantile * 100:g} (the fastest cut, {costs[best_i].cut_id}, "
                f"takes {latency_q[best_i] * 1e3:.4g} ms)",
                latency_q <= c.max_latency_s,
            )
        )
    keep = np.ones(n, dtype=bool)
    for _, ok in checks:
        keep &= ok
    if keep.any():
        return keep
    alone = [what for what, ok in checks if not ok.any()]
    if alone:
        raise CutError(f"no cut satisfies {alone[0]}; relax that constraint")
    names = " and ".join(what.split(" (")[0] for what, _ in checks)
    raise CutError(f"no cut satisfies {names} together; relax one of them")


# -- K cuts for run-time switching ------------------------------------------------


def best_across_links(
    costs: Sequence[CutCost],
    rates_bps: Sequence[float],
    rtt_s: float,
    k: int,
    downlink_bps: float | None = None,
) -> list[CutCost]:
    """The ``k`` cuts that are best across the uplink range ``[min(rates), max(rates)]``.

    At a fixed uplink rate ``r`` a cut's latency is a line in ``x = 1/r``:
    ``fixed + rtt + down*8/downlink + x * 8 * up`` (edge-only cuts: ``fixed``; with
    ``downlink_bps=None`` the downlink runs at ``r`` too). The cuts optimal
    somewhere on the range are the lower envelope of these lines, found exactly
    (not on a grid). If there are more than ``k``, the set is reduced to the ``k``
    that minimise the worst-case *relative* regret over the range, ``max_x
    min_S(L)/min_all(L) - 1`` (exact: the maximum of a ratio of piecewise-linear
    functions lies at a breakpoint of either envelope). With ``k >= 2`` the
    optimum at the slowest and at the fastest rate are always kept. Subsets are
    searched exhaustively up to :data:`MAX_SUBSETS`, greedily beyond; ties go to
    the lower mean regret, then to envelope order. The result is ordered from the
    cut best at the slowest rate to the one best at the fastest, and is the same
    for the same input.
    """
    if not costs:
        raise CutError("no candidate cuts to choose from")
    if not (isinstance(k, int) and k >= 1):
        raise ConfigError(f"--candidates {k!r} must be an integer >= 1")
    rates = np.asarray(rates_bps, dtype=np.float64)
    if rates.size == 0 or not np.isfinite(rates).all() or (rates <= 0).any():
        raise ConfigError("rates_bps must be one or more rates > 0 bits/s")
    if not (math.isfinite(rtt_s) and rtt_s >= 0):
        raise ConfigError(f"rtt_s={rtt_s!r} must be seconds >= 0")
    if downlink_bps is not None and not (math.isfinite(downlink_bps) and downlink_bps > 0):
        raise ConfigError(f"downlink_bps={downlink_bps!r} must be a rate > 0")
    a, b = _lines(costs, rtt_s, downlink_bps)
    x_lo, x_hi = 1.0 / float(rates.max()), 1.0 / float(rates.min())
    env, breaks = _envelope(a, b, np.arange(len(costs)), x_lo, x_hi)
    env = env[::-1]  # slowest link (largest x) first
    if k >= len(env):
        return [costs[i] for i in env]
    points = np.unique(np.concatenate([[x_lo, x_hi], breaks, np.geomspace(x_lo, x_hi, 64)]))
    ea, eb = a[env], b[env]  # on the range, the envelope's lines give every optimum
    best = (ea[:, None] + eb[:, None] * points[None, :]).min(axis=0)

    def score(subset: Sequence[int]) -> tuple[float, float]:
        idx = np.asarray(subset)
        _, sub_breaks = _envelope(a, b, idx, x_lo, x_hi)
        xs = np.unique(np.concatenate([points, sub_breaks]))
        opt = (ea[:, None] + eb[:, None] * xs[None, :]).min(axis=0)
        got = (a[idx, None] + b[idx, None] * xs[None, :]).min(axis=0)
        ratio = got / np.maximum(opt, 1e-300)
        on_grid = (a[idx, None] + b[idx, None] * points[None, :]).min(axis=0) / np.maximum(
            best, 1e-300
        )
        return float(ratio.max() - 1.0), float(on_grid.mean() - 1.0)

    positions = list(range(len(env)))
    if k == 1:
        pick = min(positions, key=lambda p: (*score([env[p]]), p))
        return [costs[env[pick]]]
    ends = [0, len(env) - 1]
    middle = positions[1:-1]
    need = k - 2
    chosen: list[int]
    if math.comb(len(middle), need) <= MAX_SUBSETS:
        chosen = list(
            min(
                itertools.combinations(middle, need),
                key=lambda sub: (*score([env[p] for p in (*ends, *sub)]), sub),
            )
        )
    else:
        chosen = []
        for _ in range(need):
            rest = [p for p in middle if p not in chosen]
            nxt = min(
                rest,
                key=lambda p: (*score([env[q] for q in (*ends, *chosen, p)]), p),
            )
            chosen.append(nxt)
    return [costs[env[p]] for p in sorted([*ends, *chosen])]


def _lines(costs: Sequence[CutCost], rtt_s: float, downlink_bps: float | None) -> tuple[F64, F64]:
    """Latency = a + b * x with x = 1/uplink (s/bit)."""
    up = np.array([c.up_bytes for c in costs], dtype=np.float64) * 8
    down = np.array([c.down_bytes for c in costs], dtype=np.float64) * 8
    fixed = np.array([c.fixed_s for c in costs], dtype=np.float64)
    used = (up > 0) | (down > 0)
    if downlink_bps is None:
        a = fixed + np.where(used, rtt_s, 0.0)
        b = up + down
    else:
        a = fixed + np.where(used, rtt_s + down / downlink_bps, 0.0)
        b = up
    return a, b


def _envelope(
    a: F64, b: F64, idx: npt.NDArray[Any], x_lo: float, x_hi: float
) -> tuple[list[int], F64]:
    """Lower envelope of lines ``a[i] + b[i] x`` for ``i`` in ``idx`` over
    ``[x_lo, x_hi]``: the lines in order of increasing x, and the breakpoints."""
    idx = np.asarray(idx)
    aa, bb = a[idx], b[idx]
    # optimum at x_lo; ties: the flatter line (it stays optimal longer), then input order
    vals = aa + bb * x_lo
    tol = 1e-12 * max(1.0, float(np.abs(vals).max()))
    cand = np.flatnonzero(vals <= vals.min() + tol)
    cur = int(cand[np.lexsort((cand, bb[cand]))[0]])
    order, breaks = [int(idx[cur])], []
    x = x_lo
    while True:
        flatter = np.flatnonzero(bb < bb[cur])
        if flatter.size == 0:
            break
        cross = (aa[flatter] - aa[cur]) / (bb[cur] - bb[flatter])
        ahead = cross > x + 1e-12 * max(1.0, abs(x))
        if not ahead.any():
            break
        flatter, cross = flatter[ahead], cross[ahead]
        first = cross.min()
        if first >= x_hi:
            break
        tied = flatter[cross <= first + 1e-12 * max(1.0, abs(first))]
        cur = int(tied[np.lexsort((tied, bb[tied]))[0]])
        x = float(first)
        order.append(int(idx[cur]))
        breaks.append(x)
    return order, np.asarray(breaks, dtype=np.float64)
