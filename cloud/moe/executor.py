"""The MoE layer in numpy: routing, dispatch by expert, combine.

:func:`route` turns router logits into top-k choices and gates, exactly as
``models/moe.py`` does in torch (ties go to the lowest expert index: a stable
sort of the negated logits). :func:`group_by_expert` gathers the tokens of the
whole batch per expert, so that :class:`MoEExecutor` runs each needed expert
once per layer per batch on all its tokens and scatters the gated result back.
Experts no token chose are never asked for, so never paged in.

:func:`moe_reference` is the dense loop beside it: every expert on every token,
combined through the gate matrix. Tests hold the two together and against the
torch model.

Capacity (``capacity_factor``): an expert takes at most
``ceil(capacity_factor * tokens * k / experts)`` assignments per batch; first
choices in token order first, then second choices. An assignment over capacity
is dropped (its gate counts as zero, the others are not renormalised): a token
that lost every choice gets zero from the layer and passes through on the
residual, as in Switch. Capacity is per executed batch, so with dynamic
batching a request's result can depend on the requests batched with it; leave
it off (``None``, the default) where that matters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from splitinfer.shared.errors import ConfigError
from splitinfer.shared.moe import MoESpec

Weights = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class Routing:
    """Top-k choices of every token: expert ids, gates and kept (within capacity)."""

    experts: np.ndarray  # [tokens, k] int64
    gates: np.ndarray  # [tokens, k] float32
    kept: np.ndarray  # [tokens, k] bool


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    out: np.ndarray = e / e.sum(axis=-1, keepdims=True)
    return out


def top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest logits per row, ties to the lowest index."""
    return np.argsort(-logits, axis=-1, kind="stable")[:, :k]


def route(x: np.ndarray, router: np.ndarray, spec: MoESpec) -> Routing:
    """Route tokens ``x`` [N, d] with router weights [experts, d]."""
    logits = x @ router.T
    idx = top_k(logits, spec.top_k)
    if spec.routing == "switch":
        gates = np.take_along_axis(_softmax(logits), idx, axis=1)
    else:
        gates = _softmax(np.take_along_axis(logits, idx, axis=1))
    kept = np.ones(idx.shape, dtype=bool)
    cap = spec.capacity(x.shape[0])
    if cap is not None:
        # Priority: rank 0 of every token in token order, then rank 1, ...
        flat = idx.T.reshape(-1)
        onehot = np.zeros((flat.size, spec.n_experts), dtype=np.int64)
        onehot[np.arange(flat.size), flat] = 1
        position = np.cumsum(onehot, axis=0)[np.arange(flat.size), flat]  # 1-based
        kept = (position <= cap).reshape(idx.T.shape).T
    return Routing(experts=idx.astype(np.int64), gates=gates.astype(np.float32), kept=kept)


def group_by_expert(routing: Routing) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Expert id -> (token indices, gates) of its kept assignments, by ascending expert."""
    tok, slot = np.nonzero(routing.kept)
    experts = routing.experts[tok, slot]
    order = np.argsort(experts, kind="stable")
    tok, slot, experts = tok[order], slot[order], experts[order]
    bounds = np.flatnonzero(np.diff(experts)) + 1
    groups: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for t, s in zip(np.split(tok, bounds), np.split(slot, bounds), strict=True):
        if t.size:
            groups[int(routing.experts[t[0], s[0]])] = (t, routing.gates[t, s])
    return groups


def _silu(z: np.ndarray) -> np.ndarray:
    out: np.ndarray = z / (1.0 + np.exp(-z))
    return out


def expert_forward(x: np.ndarray, w: Weights, kind: str) -> np.ndarray:
    """One expert on tokens x [n, d]; weights in torch Linear layout ([out, in])."""
    if kind == "swiglu":
        out: np.ndarray = (_silu(x @ w["w1"].T) * (x @ w["w3"].T)) @ w["w2"].T
    else:
        out = np.maximum(x @ w["w1"].T, 0.0) @ w["w2"].T
    return out


def moe_reference(
    u: np.ndarray, router: np.ndarray, experts: Sequence[Weights], spec: MoESpec
) -> np.ndarray:
    """The dense loop: every expert on every token, combined by the gate matrix."""
    x = u.reshape(-1, spec.d_model)
    r = route(x, router, spec)
    combine = np.zeros((x.shape[0], spec.n_experts), dtype=np.float32)
    for t in range(x.shape[0]):
        for j in range(spec.top_k):
            if r.kept[t, j]:
                combine[t, r.experts[t, j]] += r.gates[t, j]
    out = np.zeros_like(x)
    for e in range(spec.n_experts):
        out += combine[:, e : e + 1] * expert_forward(x, experts[e], spec.expert_kind)
    return out.reshape(u.shape)


class ExpertSource(Protocol):
    """Where the executor gets expert weights from (the cache, or plain memory)."""

    def waves(self, layer: int, experts: Sequence[int]) -> list[list[int]]: ...

    def acquire(self, layer: int, experts: Sequence[int]) -> dict[int, Any]: ...

    def release(self, layer: int, experts: Sequence[int]) -> None: ...

    def prefetch(
        self, layer: int, experts: Sequence[int], protect: Sequence[tuple[int, int]]
    ) -> None: ...

    def expert_forward(self, x: np.ndarray, weights: Any, kind: str) -> np.ndarray: ...

    def observe(self, layer: int, tokens: int, experts: int) -> None: ...


@dataclass(frozen=True)
class MoELayerParams:
    spec: MoESpec
    router: np.ndarray  # [experts, d], always resident (small)


class MoEExecutor:
    """Runs MoE layers with tokens grouped by expert; experts from an :class:`ExpertSource`.

    ``prefetch``: before running layer i, route the same hidden state with
    layer i+1's router and ask the source to prefetch the experts it picks
    (the source overlaps that with this layer's compute).
    """

    def __init__(
        self,
        layers: Sequence[MoELayerParams],
        source: ExpertSource,
        *,
        prefetch: bool = True,
        next_layer: Callable[[int], int | None] | None = None,
    ) -> None:
        self.layers = list(layers)
        self.source = source
        self.prefetch = prefetch
        self._next = next_layer or (lambda i: i + 1 if i + 1 < len(self.layers) else None)

    def forward(self, layer: int, u: np.ndarray) -> np.ndarray:
        params = self.layers[layer]
        spec = params.spec
        if u.shape[-1] != spec.d_model:
            raise ConfigError(
                f"moe layer {layer}: input's last dimension {u.shape[-1]} is not d_model "
                f"{spec.d_model}"
            )
        x = np.ascontiguousarray(u, dtype=np.float32).reshape(-1, spec.d_model)
        groups = group_by_expert(route(x, params.router, spec))
        needed = sorted(groups)
        self.source.observe(layer, x.shape[0], len(needed))
        nxt = self._next(layer) if self.prefetch else None
        if nxt is not None:
            nparams = self.layers[nxt]
            predicted = np.unique(top_k(x @ nparams.router.T, nparams.spec.top_k))
            self.source.prefetch(
                nxt, [int(e) for e in predicted], protect=[(layer, e) for e in needed]
            )
        out = np.zeros_like(x)
        for wave in self.source.waves(layer, needed):
            weights = self.source.acquire(layer, wave)
            try:
                for e in wave:
                    tokens, gates = groups[e]
                    y = self.source.expert_forward(x[tokens], weights[e], spec.expert_kind)
                    out[tokens] += gates[:, None] * y
            finally:
                self.source.release(layer, wave)
        return out.reshape(u.shape)
