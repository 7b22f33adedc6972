"""The MoE split package's own parts, which the partitioner writes and the cloud reads.

An MoE package's cloud segment is a program (``moe.json``, format
:data:`PROGRAM_FORMAT`): dense ONNX steps and MoE layers, each layer a step
``{"domain": MOE_DOMAIN, "op": MOE_OP, "spec": MoESpec.to_dict(), ...}`` whose
router and experts sit in one safetensors shard per layer: ``router``
[experts, d] and, per expert ``j``, ``e{j}.w1``, ``e{j}.w2`` (and ``e{j}.w3``
for SwiGLU) in torch Linear layout, the spec as JSON metadata ``moe_spec``.
``partitioner/moe_export.py`` writes them, ``cloud/moe/`` reads them; see docs/moe.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.shared.errors import ConfigError, PackageError

PROGRAM_FORMAT = "splitinfer.moe-program"
MOE_DOMAIN, MOE_OP = "splitinfer.moe", "MoE"
ROUTINGS = ("switch", "mixtral")


@dataclass(frozen=True)
class MoESpec:
    """One MoE layer: sizes, routing and capacity (see the module docstring)."""

    d_model: int
    hidden: int
    n_experts: int
    top_k: int
    routing: str
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ConfigError(f"moe routing {self.routing!r} is not one of {ROUTINGS}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"moe top_k {self.top_k} must be in 1..{self.n_experts}")
        if self.routing == "switch" and self.top_k != 1:
            raise ConfigError(f"switch routing is top-1, got top_k {self.top_k}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"moe capacity_factor {self.capacity_factor} must be positive")

    @property
    def expert_kind(self) -> str:
        """``relu`` (w2 relu(w1 x)) for switch, ``swiglu`` (w2 (silu(w1 x) * w3 x)) else."""
        return "relu" if self.routing == "switch" else "swiglu"

    @property
    def expert_tensors(self) -> tuple[str, ...]:
        return ("w1", "w2", "w3") if self.expert_kind == "swiglu" else ("w1", "w2")

    def capacity(self, tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> MoESpec:
        if not isinstance(data, dict):
            raise PackageError(f"{where}: expected an object with the MoE layer's sizes")
        try:
            return cls(**data)
        except TypeError as e:
            raise PackageError(f"{where}: {e}") from None
        except ConfigError as e:
            raise PackageError(f"{where}: {e}") from None


def write_layer_shard(
    path: Path, router: np.ndarray, experts: Sequence[Mapping[str, np.ndarray]], spec: str
) -> Path:
    """Write one layer's router and experts as a safetensors file (``spec``: JSON metadata)."""
    from safetensors.numpy import save_file

    tensors = {"router": np.ascontiguousarray(router, dtype=np.float32)}
    for j, w in enumerate(experts):
        for name, arr in w.items():
            tensors[f"e{j}.{name}"] = np.ascontiguousarray(arr, dtype=np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"moe_spec": spec})
    return path
