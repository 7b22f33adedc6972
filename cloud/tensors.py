"""Batch assembly: peek at a frame's ids, pad variable lengths to buckets, stack, split.

Variable-length bucketing, kept simple: a cut qualifies when one of its
tensors has a symbolic non-batch dimension (a sequence length) *and* the cut
carries a mask over that dimension (a tensor whose name contains ``mask``).
Then every cut tensor with that symbol is zero-padded along it to the next
power of two, the mask included (so padded positions are masked out), and
outputs that carry the symbol are cut back to each request's own length.
Without a mask, or for other symbolic dimensions, requests batch only with
requests of equal shape (the shape is part of the queue key).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from splitinfer.shared.manifest import Cut, TensorSpec

Array = npt.NDArray[Any]
Arrays = dict[str, Array]


@dataclass(frozen=True)
class PadPlan:
    """How one cut's variable-length tensors are padded to buckets."""

    symbol: str
    axes: Mapping[str, int]  # cut tensor -> axis of the symbol
    output_axes: Mapping[str, int]  # output -> axis to cut back

    def length(self, arrays: Mapping[str, Array]) -> int:
        name, axis = next(iter(self.axes.items()))
        return int(arrays[name].shape[axis])

    def pad(self, arrays: Mapping[str, Array], target: int) -> Arrays:
        out = dict(arrays)
        for name, axis in self.axes.items():
            a = arrays[name]
            extra = target - a.shape[axis]
            if extra > 0:
                widths = [(0, 0)] * a.ndim
                widths[axis] = (0, extra)
                out[name] = np.pad(a, widths)
        return out

    def unpad(self, outputs: Mapping[str, Array], length: int) -> Arrays:
        out = dict(outputs)
        for name, axis in self.output_axes.items():
            index = [slice(None)] * out[name].ndim
            index[axis] = slice(0, length)
            out[name] = out[name][tuple(index)]
        return out


def bucket(length: int) -> int:
    """The padded length: the next power of two."""
    return 1 << max(0, length - 1).bit_length()


def pad_plan(cut: Cut, outputs: Sequence[TensorSpec], batch_dim: str | None) -> PadPlan | None:
    """The padding of ``cut`` if it has a variable-length dimension and a mask over it."""
    for spec in cut.tensors:
        for dim in spec.shape[1:]:
            if not isinstance(dim, str) or dim in (batch_dim, "?"):
                continue
            masks = [t for t in cut.tensors if "mask" in t.name.lower() and dim in t.shape[1:]]
            if not masks:
                continue
            axes = {t.name: t.shape.index(dim, 1) for t in cut.tensors if dim in t.shape[1:]}
            outs = {o.name: o.shape.index(dim, 1) for o in outputs if dim in o.shape[1:]}
            return PadPlan(dim, axes, outs)
    return None


def batchable(cut: Cut, outputs: Sequence[TensorSpec], batch_dim: str | None) -> bool:
    """True if every cut tensor leads with the batch dimension and every output holds it
    at exactly one axis (the first, or another: a ``(T, N, C)`` RNN or CTC head)."""
    if batch_dim is None:
        return False
    if not all(t.shape[:1] == (batch_dim,) for t in cut.tensors):
        return False
    return all(o.shape.count(batch_dim) == 1 for o in outputs)


def output_axes(outputs: Sequence[TensorSpec], batch_dim: str | None) -> dict[str, int]:
    """The batch axis of each output that holds the batch dimension (0 for most)."""
    if batch_dim is None:
        return {}
    return {o.name: o.shape.index(batch_dim) for o in outputs if batch_dim in o.shape}


def sample_shape(arrays: Mapping[str, Array], names: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    return tuple([arrays[n].shape[1:] for n in names])  # a shape is a tuple already


def stack(parts: Sequence[Mapping[str, Array]], names: Sequence[str]) -> Arrays:
    """One feed per name: the parts concatenated along the batch axis (no copy for one)."""
    if len(parts) == 1:
        return {n: parts[0][n] for n in names}
    return {n: np.concatenate([p[n] for p in parts], axis=0) for n in names}


def split(
    outputs: Mapping[str, Array], rows: Sequence[int], axes: Mapping[str, int] | None = None
) -> list[Arrays]:
    """Each caller's share of a batch's outputs, as views along each output's batch axis
    (``axes``, default 0)."""
    if len(rows) == 1:
        return [dict(outputs)]
    axes = axes or {}
    shares: list[Arrays] = [{} for _ in rows]
    for name, value in outputs.items():
        axis = axes.get(name, 0)
        start = 0
        for share, n in zip(shares, rows, strict=True):
            index = [slice(None)] * value.ndim
            index[axis] = slice(start, start + n)
            share[name] = value[tuple(index)]
            start += n
    return shares
