"""The best cut as a minimum s-t cut of the unit order (DADS, INFOCOM 2019).

Pure logic over a small interface, :class:`CutProblem`: units ``0..n-1`` with
their dependencies, the cost of running each unit on the edge or in the cloud,
and the tensors between units with the cost of sending each one. A cut is an
edge set ``S`` (a bitmask) that is a down-set of the order; its cost
(:func:`cost_of`) is::

    sum(edge_cost[u] for u in S) + sum(cloud_cost[u] for u not in S)
      + sum(t.cost for t in tensors if t.producer is on the edge and a consumer is not)

where a model input (producer :data:`INPUT`) is on the edge and a model output
(consumer :data:`OUTPUT`) is read in the cloud. A tensor with ``cost = inf``
may not cross.

:func:`solve` finds the cheapest cut with one max-flow (networkx), on the
graph of Hu et al., "Dynamic Adaptive DNN Surgery for Inference Acceleration
on the Edge" (INFOCOM 2019): the source side is the edge. A unit pays its
cloud cost on an edge from the source and its edge cost on an edge to the sink
(only the difference is needed: the smaller of the two is paid either way). A
tensor read by several units is paid once through an auxiliary node: producer
-> aux at the tensor's cost, aux -> each consumer at infinity. An infinite
edge from each unit back to every unit it depends on keeps the source side a
down-set: nothing on the edge reads from the cloud.

:func:`count_downsets` counts the cuts of an order without listing them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from splitinfer.shared.errors import ConfigError

#: Producer of a model input: the edge holds the inputs.
INPUT = -1
#: Consumer standing for the model's outputs: the cloud returns them.
OUTPUT = -1
#: Integer capacity resolution: the finite costs are scaled to sum to about this.
_RESOLUTION = 2**48


@dataclass(frozen=True)
class Tensor:
    """One value between units, paid once when it crosses from edge to cloud."""

    producer: int  # a unit, or INPUT
    consumers: tuple[int, ...]  # units, and OUTPUT for a model output
    cost: float  # math.inf: it may not cross


@dataclass(frozen=True)
class CutProblem:
    """Units, their order, and what each placement costs (any unit, >= 0)."""

    preds: tuple[tuple[int, ...], ...]
    edge_cost: tuple[float, ...]
    cloud_cost: tuple[float, ...]
    tensors: tuple[Tensor, ...] = ()
    #: Units that must run on the edge / in the cloud (bitmasks).
    forced_edge: int = 0
    forced_cloud: int = 0
    #: Per unit: the units it depends on, through ``preds`` or read tensors.
    deps: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.preds)
        if len(self.edge_cost) != n or len(self.cloud_cost) != n:
            raise ConfigError(f"cut problem: {n} units but {len(self.edge_cost)} edge and "
                              f"{len(self.cloud_cost)} cloud costs")  # fmt: skip
        for name, costs in (("edge", self.edge_cost), ("cloud", self.cloud_cost)):
            for u, c in enumerate(costs):
                if not (math.isfinite(c) and c >= 0):
                    raise ConfigError(f"cut problem: {name} cost of unit {u} is {c!r}")
        deps = [0] * n
        for v, ps in enumerate(self.preds):
            for p in ps:
                _check_unit(p, n, "dependency")
                deps[v] |= 1 << p
        for t in self.tensors:
            if t.producer != INPUT:
                _check_unit(t.producer, n, "tensor producer")
            if not (t.cost >= 0):  # rejects NaN too
                raise ConfigError(f"cut problem: tensor cost {t.cost!r} must be >= 0")
            for c in t.consumers:
                if c == OUTPUT:
                    continue
                _check_unit(c, n, "tensor consumer")
                if t.producer not in (INPUT, c):
                    deps[c] |= 1 << t.producer
        object.__setattr__(self, "deps", tuple(deps))

    @property
    def size(self) -> int:
        return len(self.preds)


def _check_unit(u: int, n: int, what: str) -> None:
    if not (isinstance(u, int) and 0 <= u < n):
        raise ConfigError(f"cut problem: {what} {u!r} is not a unit (0..{n - 1})")


def is_downset(problem: CutProblem, mask: int) -> bool:
    return all(not (mask >> v & 1) or problem.deps[v] & ~mask == 0 for v in range(problem.size))


def cost_of(problem: CutProblem, mask: int) -> float:
    """The cost of edge set ``mask``; ``inf`` if it is not a valid cut of ``problem``."""
    if not is_downset(problem, mask):
        return math.inf
    if mask & problem.forced_cloud or problem.forced_edge & ~mask:
        return math.inf
    total = 0.0
    for u in range(problem.size):
        total += problem.edge_cost[u] if mask >> u & 1 else problem.cloud_cost[u]
    for t in problem.tensors:
        if t.producer != INPUT and not mask >> t.producer & 1:
            continue
        if any(c == OUTPUT or not mask >> c & 1 for c in t.consumers if c != t.producer):
            total += t.cost
    return total


def solve(problem: CutProblem) -> int | None:
    """The edge set of a cheapest cut (the smallest one among ties); None if every cut
    sends a tensor that may not cross or breaks a forced placement."""
    import networkx as nx
    from networkx.algorithms.flow import boykov_kolmogorov

    scale = _scale(problem)
    g = nx.DiGraph()
    g.add_nodes_from(range(problem.size))
    g.add_nodes_from(("s", "t"))

    def add(u: object, v: object, cap: int | None) -> None:
        """Add capacity ``cap`` (None: infinite) to edge u -> v."""
        if g.has_edge(u, v):
            data = g.edges[u, v]
            if "capacity" not in data:
                return
            if cap is None:
                del data["capacity"]
            else:
                data["capacity"] += cap
        elif cap is None:
            g.add_edge(u, v)
        elif cap > 0:
            g.add_edge(u, v, capacity=cap)

    if problem.forced_edge & problem.forced_cloud:
        return None
    for u in range(problem.size):
        diff = scale(problem.cloud_cost[u]) - scale(problem.edge_cost[u])
        if problem.forced_edge >> u & 1:
            add("s", u, None)
        elif problem.forced_cloud >> u & 1:
            add(u, "t", None)
        elif diff > 0:
            add("s", u, diff)  # paid when u runs in the cloud
        elif diff < 0:
            add(u, "t", -diff)  # paid when u runs on the edge
        m = problem.deps[u]
        while m:
            low = m & -m
            add(u, low.bit_length() - 1, None)  # u on the edge needs what it reads there
            m ^= low
    for k, t in enumerate(problem.tensors):
        src: object = "s" if t.producer == INPUT else t.producer
        sinks = sorted({"t" if c == OUTPUT else c for c in t.consumers if c != t.producer}, key=str)
        if not sinks:
            continue
        cap = None if math.isinf(t.cost) else scale(t.cost)
        if cap is None or len(sinks) == 1:
            for c in sinks:
                add(src, c, cap)
        elif cap > 0:
            aux = ("x", k)
            add(src, aux, cap)
            for c in sinks:
                add(aux, c, None)
    try:
        _, (reach, _) = nx.minimum_cut(g, "s", "t", flow_func=boykov_kolmogorov)
    except nx.NetworkXUnbounded:
        return None
    mask = 0
    for node in reach:
        if isinstance(node, int):
            mask |= 1 << node
    return mask


def _scale(problem: CutProblem) -> Callable[[float], int]:
    """Costs -> integer capacities: exact when every cost is an integer, else scaled so
    the finite costs sum to about 2^48 (rounding moves a cut's cost by < 1e-13 relative)."""
    finite = [*problem.edge_cost, *problem.cloud_cost]
    finite += [t.cost for t in problem.tensors if math.isfinite(t.cost)]
    if all(float(c).is_integer() for c in finite):
        return int
    total = math.fsum(finite)
    return lambda c: round(c / total * _RESOLUTION)


# -- counting --------------------------------------------------------------------------


def count_downsets(preds: Sequence[int], budget: int = 2_000_000) -> int | None:
    """How many down-sets the order has (``preds[v]``: bitmask of what v depends on,
    acyclic), or None if counting would visit more than ``budget`` elements (each
    step visits the elements of the set it splits: about a second per 10^6 here).

    Recursive and memoised on the set left: a set that falls apart into
    unrelated parts counts as the product of the parts; otherwise, for a pivot
    ``x``, the down-sets without ``x`` are those of the set minus everything
    above ``x``, and those with ``x`` are those of the set minus everything
    below it. Pivots comparable to the most elements (a block boundary of a
    residual net, the fork and join of parallel branches) split the quickest:
    a chain of n units takes O(n) steps, a block of parallel chains a few per
    chain, so the 4^20 + 2 down-sets of 20 parallel chains of depth 3 between a
    fork and a join take under a hundred steps.
    """
    n = len(preds)
    below = closure(preds, down=True)
    above = closure(preds, down=False)
    adj = [0] * n  # neighbours in the order's Hasse-ish graph (direct relations)
    for v, m in enumerate(preds):
        adj[v] |= m
        x = m
        while x:
            low = x & -x
            adj[low.bit_length() - 1] |= 1 << v
            x ^= low
    memo: dict[int, int] = {0: 1}
    steps = [0]

    def parts(s: int) -> list[int]:
        out = []
        while s:
            seed = s & -s
            comp, frontier = seed, seed
            while frontier:
                low = frontier & -frontier
                frontier ^= low
                new = adj[low.bit_length() - 1] & s & ~comp
                comp |= new
                frontier |= new
            out.append(comp)
            s &= ~comp
        return out

    def count(s: int) -> int:
        if s in memo:
            return memo[s]
        steps[0] += s.bit_count()
        if steps[0] > budget:
            raise _OverBudget
        comps = parts(s)
        if len(comps) > 1:
            result = 1
            for c in comps:
                result *= count(c)
        else:
            size = s.bit_count()
            best, pivot, chain, m = -1, 0, True, s
            while m:
                low = m & -m
                m ^= low
                x = low.bit_length() - 1
                lo, hi = (below[x] & s).bit_count(), (above[x] & s).bit_count()
                chain = chain and lo + hi == size + 1
                score = (lo + hi) * (size + 2) + min(lo, hi)
                if score > best:
                    best, pivot = score, x
            # a chain (every element comparable to every other) has size + 1
            result = size + 1 if chain else count(s & ~above[pivot]) + count(s & ~below[pivot])
        memo[s] = result
        return result

    try:
        return count((1 << n) - 1)
    except _OverBudget:
        return None


class _OverBudget(Exception):
    pass


def closure(preds: Sequence[int], down: bool) -> list[int]:
    """Per element: itself and everything below it (``down``) or above it."""
    n = len(preds)
    order = topological(preds)
    out = [1 << v for v in range(n)]
    if down:
        for v in order:
            m = preds[v]
            while m:
                low = m & -m
                out[v] |= out[low.bit_length() - 1]
                m ^= low
    else:
        for v in reversed(order):
            m = preds[v]
            while m:
                low = m & -m
                out[low.bit_length() - 1] |= out[v]
                m ^= low
    return out


def topological(preds: Sequence[int]) -> list[int]:
    """Elements in an order where each comes after everything it depends on."""
    n = len(preds)
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for v, m in enumerate(preds):
        for p in bits(m):
            succ[p].append(v)
            indeg[v] += 1
    ready = [v for v in range(n) if indeg[v] == 0]
    ready.reverse()
    order: list[int] = []
    while ready:
        v = ready.pop()
        order.append(v)
        for w in reversed(succ[v]):
            indeg[w] -= 1
            if indeg[w] == 0:
                ready.append(w)
    if len(order) != n:
        raise ConfigError("cut problem: the dependencies have a cycle")
    return order


def bits(mask: int) -> Iterator[int]:
    """The indices of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
