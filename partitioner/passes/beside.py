"""Large initializers kept in a file beside the graph while the passes run.

ONNX Runtime's pass writes the optimized weights to a file; reading them into
the graph (a copy), then out of it again for onnxslim (a copy and a hash) and
back in (a copy) costs more than a second on BERT-base. Instead they stay in
the file as external-data references until :func:`splitinfer.partitioner.passes.optimize`
reads them once, after the last pass. A pass that handles references reads a
tensor's bytes through :class:`BesideData` (a read-only memory map, no copy).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx.external_data_helper import load_external_data_for_model

#: Initializers at least this big (bytes of data) are written beside the graph.
BESIDE_BYTES = 1 << 16


def is_beside(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL


def tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor ``graph`` holds: its initializers, node attributes' tensors, and
    those of its subgraphs (If branches, Loop and Scan bodies), which ONNX Runtime's
    writer also puts beside the graph."""
    yield from graph.initializer
    yield from node_tensors(graph)


def node_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """The tensors of ``graph``'s nodes' attributes and of their subgraphs, all of them."""
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sub in _subgraphs(attr):
                yield from tensors(sub)


def graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph in it, at any depth."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for sub in _subgraphs(attr):
                yield from graphs(sub)


def _subgraphs(attr: onnx.AttributeProto) -> list[onnx.GraphProto]:
    return [*([attr.g] if attr.HasField("g") else ()), *attr.graphs]


def any_beside(model: onnx.ModelProto) -> bool:
    return any(is_beside(t) for t in tensors(model.graph))


def read_beside(model: onnx.ModelProto, beside: Path) -> None:
    """Put the data of every external-data tensor (relative to ``beside``), subgraphs'
    included, into ``model``, in place."""
    if any_beside(model):
        load_external_data_for_model(model, str(beside))  # walks the subgraphs too
        for t in tensors(model.graph):  # as if never external (DEFAULT left unset)
            if t.HasField("data_location") and t.data_location == onnx.TensorProto.DEFAULT:
                t.ClearField("data_location")


class BesideData:
    """The bytes of external-data initializers whose files are in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._maps: dict[str, np.memmap] = {}

    def bytes_of(self, t: onnx.TensorProto) -> memoryview:
        """The tensor's data: a read-only view of the file (no copy)."""
        info = {e.key: e.value for e in t.external_data}
        location = info["location"]
        if Path(location).is_absolute() or ".." in Path(location).parts:
            raise ValueError(f"external data {location!r} is outside {self.folder}")
        whole = self._maps.get(location)
        if whole is None:
            whole = np.memmap(self.folder / location, dtype=np.uint8, mode="r")
            self._maps[location] = whole
        offset = int(info.get("offset", "0"))
        length = int(info["length"]) if "length" in info else whole.size - offset
        if offset < 0 or length < 0 or offset + length > whole.size:
            raise ValueError(f"external data of {t.name!r} runs past the end of {location!r}")
        return whole[offset : offset + length].data
