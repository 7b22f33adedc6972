"""Small mixture-of-experts models in torch, and their dense reference forward.

Every model is an :class:`MoEStack`: a dense ``first`` stage, then for each MoE
layer the layer itself and a dense stage after it. The dense stages carry the
residual stream ``h``; the MoE layer reads the normalised stream ``u`` and
gives ``m``, which the next dense stage adds back (``h + m``)::

    first(x)          -> h0, u0
    moe_i(u_{i})      -> m_i
    mid_i(h_i, m_i)   -> h_{i+1}, u_{i+1}     (between MoE layers)
    last(h_n, m_n)    -> y

so the export (``partitioner/moe_export.py``) keeps every MoE layer out of ONNX by
cutting at these seams. :class:`MoELayer`'s ``forward`` is the dense in-memory
reference: routing with explicit tie-breaking (lowest expert index first),
capacity by a plain loop, then every expert run on every token and combined
through a gate matrix. torch is imported at the point of use.

Two routings:

- ``switch`` (Switch Transformer): softmax over all experts, top-1, the gate is
  the chosen expert's probability. Experts are ReLU MLPs.
- ``mixtral``: top-k of the logits, softmax over those k. Experts are SwiGLU
  (``w2(silu(w1 x) * w3 x)``).

Capacity (optional, ``capacity_factor``): each expert takes at most
``ceil(capacity_factor * tokens * k / experts)`` assignments per call; first
choices in token order come first, then second choices. An assignment over
capacity is dropped: its gate counts as zero (not renormalised), so a token
whose every choice overflowed gets ``m = 0`` and passes through on the
residual, as in Switch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ROUTINGS = ("switch", "mixtral")


@dataclass(frozen=True)
class MoEConfig:
    """Shape of one MoE layer."""

    d_model: int = 32
    hidden: int = 64
    n_experts: int = 8
    top_k: int = 1
    routing: str = "switch"
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        from splitinfer.shared.errors import ConfigError

        if self.routing not in ROUTINGS:
            raise ConfigError(f"routing {self.routing!r} is not one of {ROUTINGS}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"top_k {self.top_k} must be in 1..n_experts ({self.n_experts})")
        if self.routing == "switch" and self.top_k != 1:
            raise ConfigError(f"switch routing is top-1, got top_k {self.top_k}; use mixtral")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"capacity_factor {self.capacity_factor} must be positive or None")

    @property
    def expert_kind(self) -> str:
        return "relu" if self.routing == "switch" else "swiglu"


def capacity(cfg: MoEConfig, tokens: int) -> int | None:
    """Assignments one expert takes per call, or None without a capacity factor."""
    if cfg.capacity_factor is None:
        return None
    return max(1, math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.n_experts))


def _torch() -> Any:
    import torch

    return torch


def _build_classes() -> dict[str, Any]:
    torch = _torch()
    nn: Any = torch.nn
    functional = torch.nn.functional

    class Expert(nn.Module):  # type: ignore[misc]
        def __init__(self, cfg: MoEConfig) -> None:
            super().__init__()
            self.kind = cfg.expert_kind
            self.w1 = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
            self.w2 = nn.Linear(cfg.hidden, cfg.d_model, bias=False)
            if self.kind == "swiglu":
                self.w3 = nn.Linear(cfg.d_model, cfg.hidden, bias=False)

        def forward(self, x: Any) -> Any:
            if self.kind == "swiglu":
                return self.w2(functional.silu(self.w1(x)) * self.w3(x))
            return self.w2(torch.relu(self.w1(x)))

    class MoELayer(nn.Module):  # type: ignore[misc]
        def __init__(self, cfg: MoEConfig) -> None:
            super().__init__()
            self.cfg = cfg
            self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
            self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.n_experts))

        def gates(self, x: Any) -> Any:
            """The [tokens, experts] combine matrix, capacity applied."""
            cfg = self.cfg
            logits = self.router(x)
            order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
            idx = order[:, : cfg.top_k]
            if cfg.routing == "switch":
                gate = torch.softmax(logits, dim=-1).gather(1, idx)
            else:
                gate = torch.softmax(logits.gather(1, idx), dim=-1)
            cap = capacity(cfg, x.shape[0])
            combine = torch.zeros_like(logits)
            counts = [0] * cfg.n_experts
            for r in range(cfg.top_k):
                for t in range(x.shape[0]):
                    e = int(idx[t, r])
                    if cap is not None and counts[e] >= cap:
                        continue
                    counts[e] += 1
                    combine[t, e] = combine[t, e] + gate[t, r]
            return combine

        def forward(self, u: Any) -> Any:
            shape = u.shape
            x = u.reshape(-1, shape[-1])
            combine = self.gates(x)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                out = out + combine[:, e : e + 1] * expert(x)
            return out.reshape(shape)

    class Attention(nn.Module):  # type: ignore[misc]
        def __init__(self, d: int, heads: int = 2) -> None:
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(d, 3 * d)
            self.out = nn.Linear(d, d)

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).unbind(2)
            q, k, v = (z.transpose(1, 2) for z in (q, k, v))
            w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), dim=-1)
            return self.out((w @ v).transpose(1, 2).reshape(b, t, d))

    class TokenFirst(nn.Module):  # type: ignore[misc]
        """x [B, T, in] -> (h, u): projection, one attention block, norm."""

        def __init__(self, d_in: int, d: int) -> None:
            super().__init__()
            self.proj = nn.Linear(d_in, d)
            self.ln1 = nn.LayerNorm(d)
            self.attn = Attention(d)
            self.ln2 = nn.LayerNorm(d)

        def forward(self, x: Any) -> tuple[Any, Any]:
            h = self.proj(x)
            h = h + self.attn(self.ln1(h))
            return h, self.ln2(h)

    class Mid(nn.Module):  # type: ignore[misc]
        """(h, m) -> (h', u'): residual add, attention block, norm."""

        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = Attention(d)
            self.ln2 = nn.LayerNorm(d)

        def forward(self, h: Any, m: Any) -> tuple[Any, Any]:
            h = h + m
            h = h + self.attn(self.ln1(h))
            return h, self.ln2(h)

    class Last(nn.Module):  # type: ignore[misc]
        """(h, m) -> logits: residual add, norm, mean over tokens, linear head."""

        def __init__(self, d: int, classes: int) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, classes)

        def forward(self, h: Any, m: Any) -> Any:
            return self.head(self.ln(h + m).mean(dim=1))

    class PatchFirst(nn.Module):  # type: ignore[misc]
        """image [B, 3, 16, 16] -> (h, u): 4x4 patch conv to 16 tokens, norm."""

        def __init__(self, d: int) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, d, kernel_size=4, stride=4)
            self.ln = nn.LayerNorm(d)

        def forward(self, x: Any) -> tuple[Any, Any]:
            h = torch.relu(self.stem(x)).flatten(2).transpose(1, 2)
            return h, self.ln(h)

    class MoEStack(nn.Module):  # type: ignore[misc]
        def __init__(self, first: Any, moes: list[Any], mids: list[Any], last: Any) -> None:
            super().__init__()
            assert len(mids) == len(moes) - 1
            self.first = first
            self.moes = nn.ModuleList(moes)
            self.mids = nn.ModuleList(mids)
            self.last = last

        def forward(self, x: Any) -> Any:
            h, u = self.first(x)
            for i, moe in enumerate(self.moes):
                m = moe(u)
                if i < len(self.mids):
                    h, u = self.mids[i](h, m)
                else:
                    return self.last(h, m)
            raise AssertionError("an MoEStack has at least one MoE layer")

    return {
        "MoELayer": MoELayer,
        "TokenFirst": TokenFirst,
        "Mid": Mid,
        "Last": Last,
        "PatchFirst": PatchFirst,
        "MoEStack": MoEStack,
    }


# Per-sample input shape of each model kind, for tests, export and the bench.
TOKENS, D_IN, CLASSES = 8, 16, 10
INPUT_SHAPES = {"transformer": (TOKENS, D_IN), "vision": (3, 16, 16)}


def moe_transformer(
    layers: tuple[MoEConfig, ...] = (
        MoEConfig(top_k=1, routing="switch"),
        MoEConfig(top_k=2, routing="mixtral"),
    ),
    seed: int = 0,
) -> Any:
    """A small encoder: input [B, 8, 16] -> logits [B, 10], one MoE layer per config."""
    torch = _torch()
    c = _build_classes()
    d = layers[0].d_model
    torch.manual_seed(seed)
    first = c["TokenFirst"](D_IN, d)
    moes = [c["MoELayer"](cfg) for cfg in layers]
    mids = [c["Mid"](d) for _ in layers[1:]]
    return c["MoEStack"](first, moes, mids, c["Last"](d, CLASSES)).eval()


def moe_vision(cfg: MoEConfig | None = None, seed: int = 0) -> Any:
    """A patch model: image [B, 3, 16, 16] -> logits [B, 10] with one MoE block."""
    torch = _torch()
    c = _build_classes()
    cfg = cfg or MoEConfig(top_k=2, routing="mixtral")
    torch.manual_seed(seed)
    first = c["PatchFirst"](cfg.d_model)
    return c["MoEStack"](first, [c["MoELayer"](cfg)], [], c["Last"](cfg.d_model, CLASSES)).eval()


def moe_layer(cfg: MoEConfig, seed: int = 0) -> Any:
    """One MoE layer on its own (its ``forward`` is the dense reference)."""
    torch = _torch()
    torch.manual_seed(seed)
    return _build_classes()["MoELayer"](cfg).eval()


def reference(model: Any, x: Any) -> Any:
    """The dense in-memory torch forward, fp32, no grad, as numpy."""
    import numpy as np

    torch = _torch()
    with torch.no_grad():
        return model(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).numpy()
