"""Expert shards on disk: safetensors files, memory-mapped, one file per MoE layer.

A layer's shard holds ``router`` [experts, d] and, per expert ``j``,
``e{j}.w1``, ``e{j}.w2`` (and ``e{j}.w3`` for SwiGLU) in torch Linear layout.
The files are written with the safetensors library
(:func:`splitinfer.shared.moe.write_layer_shard`); they are read here by
memory-mapping the file and viewing each tensor at its header offsets
(safetensors' documented layout: 8-byte little-endian header length, JSON
header, raw little-endian data), so reads from several threads need no
library handle and a read copies exactly one expert out of the page cache.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.shared.errors import PackageError

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "F64": np.float64}
MAX_HEADER = 100 * 1024 * 1024


class Shard:
    """One safetensors file, memory-mapped read-only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > MAX_HEADER:
                    raise PackageError(f"{path}: safetensors header of {length} bytes is too big")
                header = json.loads(f.read(length))
        except (OSError, struct.error, ValueError) as e:
            raise PackageError(f"{path}: not a readable safetensors file ({e})") from None
        self.metadata: dict[str, str] = header.pop("__metadata__", {}) or {}
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._base = 8 + length
        self.entries: dict[str, tuple[Any, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise PackageError(f"{path}: tensor {name} has dtype {info['dtype']}; use F32")
            start, end = info["data_offsets"]
            shape = tuple(info["shape"])
            if end - start != int(np.prod(shape)) * np.dtype(dtype).itemsize:
                raise PackageError(f"{path}: tensor {name}'s offsets do not match its shape")
            if self._base + end > self._map.size:
                raise PackageError(f"{path}: tensor {name} runs past the end of the file")
            self.entries[name] = (dtype, shape, start, end)

    def view(self, name: str) -> np.ndarray:
        """The tensor as a read-only view of the mapping (no copy)."""
        if name not in self.entries:
            raise PackageError(f"{self.path}: no tensor {name!r}")
        dtype, shape, start, end = self.entries[name]
        raw = self._map[self._base + start : self._base + end]
        out: np.ndarray = np.asarray(raw).view(dtype).reshape(shape)
        return out

    def nbytes(self, name: str) -> int:
        _, _, start, end = self.entries[name]
        return end - start


class ExpertStore:
    """The host side: every layer's shard mapped; routers read once and kept."""

    def __init__(self, shards: Mapping[int, Path], tensors: Mapping[int, Sequence[str]]) -> None:
        self.shards = {layer: Shard(p) for layer, p in shards.items()}
        self.tensors = {layer: tuple(t) for layer, t in tensors.items()}
        self.routers = {layer: np.array(s.view("router")) for layer, s in self.shards.items()}

    def n_experts(self, layer: int) -> int:
        return int(self.routers[layer].shape[0])

    def nbytes(self, layer: int, expert: int) -> int:
        shard = self.shards[layer]
        return sum(shard.nbytes(f"e{expert}.{t}") for t in self.tensors[layer])

    def read(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """Copy one expert out of the mapping (this is the page-in)."""
        shard = self.shards[layer]
        return {t: np.array(shard.view(f"e{expert}.{t}")) for t in self.tensors[layer]}

    def view(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """One expert as views of the mapping (the host source for a device copy)."""
        shard = self.shards[layer]
        return {t: shard.view(f"e{expert}.{t}") for t in self.tensors[layer]}
