"""Where cached experts live and run: numpy in memory here, torch on CUDA on a GPU.

:func:`select_device` picks one. The CUDA path copies each expert from the
memory-mapped shard through pinned host memory to the GPU on a side stream;
it is real code, but this project's CI has no GPU, so only the numpy path is
tested (see docs/moe.md).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from splitinfer.cloud.moe.executor import expert_forward
from splitinfer.shared.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


class Device(Protocol):
    name: str

    def upload(self, host: Mapping[str, np.ndarray]) -> Any: ...

    def expert_forward(self, x: np.ndarray, weights: Any, kind: str) -> np.ndarray: ...


class NumpyDevice:
    """The bounded "device" of a CPU-only machine: plain numpy arrays in memory.

    The buffers of evicted experts are reused by the next page-in of the same shapes
    (:meth:`recycle`): copying into memory already touched is 1.5-3x faster here than
    into a fresh allocation, which takes a page fault per 4 KiB. At most ``spare``
    evicted experts wait for reuse, the only memory held beyond the cache's budget.
    """

    name = "cpu"

    def __init__(self, spare: int = 2) -> None:
        self.spare = spare
        self._lock = threading.Lock()  # page-ins also run on the prefetch worker
        self._free: dict[tuple[tuple[str, tuple[int, ...]], ...], list[dict[str, np.ndarray]]] = {}

    @staticmethod
    def _shape_key(arrays: Mapping[str, Any]) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return tuple((k, tuple(v.shape)) for k, v in sorted(arrays.items()))

    def upload(self, host: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            free = self._free.get(self._shape_key(host))
            reused = free.pop() if free else None
        if reused is None:
            return {k: np.array(v, dtype=np.float32, copy=True) for k, v in host.items()}
        for k, v in host.items():
            np.copyto(reused[k], v, casting="same_kind")
        return reused

    def recycle(self, weights: Any) -> None:
        """``weights`` of an evicted expert, no longer used by anyone: reuse its memory."""
        if not isinstance(weights, dict) or self.spare <= 0:
            return
        with self._lock:
            free = self._free.setdefault(self._shape_key(weights), [])
            if len(free) < self.spare:
                free.append(weights)

    def expert_forward(self, x: np.ndarray, weights: Any, kind: str) -> np.ndarray:
        return expert_forward(x, weights, kind)


class TorchCudaDevice:  # pragma: no cover - needs a CUDA GPU
    """Experts as CUDA tensors; host copies staged through pinned memory."""

    name = "cuda"

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.stream: Any = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def upload(self, host: Mapping[str, np.ndarray]) -> dict[str, Any]:
        torch = self.torch
        out = {}
        with torch.cuda.stream(self.stream):
            for k, v in host.items():
                pinned = torch.from_numpy(np.ascontiguousarray(v)).pin_memory()
                out[k] = pinned.to("cuda", non_blocking=True)
        self.stream.synchronize()
        return out

    def expert_forward(self, x: np.ndarray, weights: Any, kind: str) -> np.ndarray:
        torch = self.torch
        xt = torch.from_numpy(np.ascontiguousarray(x)).to("cuda")
        h = xt @ weights["w1"].T
        h = torch.nn.functional.silu(h) * (xt @ weights["w3"].T) if kind == "swiglu" else h.relu()
        out: np.ndarray = (h @ weights["w2"].T).cpu().numpy()
        return out


def select_device(kind: str = "auto") -> Device:
    """``cpu``, ``cuda`` (refused without a GPU), or ``auto`` (cuda when torch sees one)."""
    if kind not in DEVICES:
        raise ConfigError(f"expert device {kind!r} is not one of {DEVICES}")
    if kind == "cpu":
        return NumpyDevice()
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except ImportError:
        has_cuda = False
    if has_cuda:
        return TorchCudaDevice()  # pragma: no cover - needs a CUDA GPU
    if kind == "cuda":
        raise ConfigError("expert device 'cuda' asked for, but torch sees no CUDA GPU; use cpu")
    return NumpyDevice()
