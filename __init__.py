"""splitinfer: run one neural network across an edge device and the cloud.

The Python API is the ``partition`` command's own code path, called from Python::

    import splitinfer

    result = splitinfer.partition("model.onnx", split="auto", uplink="5mbit", out="pkg")
    result.cut, result.table, result.candidates, result.package
    pkg = splitinfer.load_package("pkg")

- ``partition(model, *, split="auto", out, ...)`` -> ``PartitionResult``: optimize
  an ONNX model, choose the cut (or take the one given) and write the split package;
  the keywords are ``partition``'s flags.
- ``list_cuts(model, ...)`` -> ``CutListing``: every valid cut (``--list-cuts``).
- ``load_package(path)`` -> ``Package``: a split package's manifest and the paths of
  its segments, every file checked against its sha256.
- ``SplitInferError``: the root of every error bad input raises; its message is the
  one line the command prints.
- ``__version__``.

They live in :mod:`splitinfer.api` and load on first use: ``import splitinfer``
alone imports neither ONNX nor ONNX Runtime.

The rooms live in sub-packages: :mod:`splitinfer.shared` (formats both halves
agree on), :mod:`splitinfer.partitioner` (ONNX model -> split package),
:mod:`splitinfer.edge`, :mod:`splitinfer.cloud` and :mod:`splitinfer.sim`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from splitinfer.shared.errors import SplitInferError

__version__ = "0.1.0"

if TYPE_CHECKING:
    from splitinfer.api import (
        CutListing,
        Package,
        PartitionResult,
        list_cuts,
        load_package,
        partition,
    )

__all__ = [
    "CutListing",
    "Package",
    "PartitionResult",
    "SplitInferError",
    "__version__",
    "list_cuts",
    "load_package",
    "partition",
]

#: The names :mod:`splitinfer.api` defines, imported on first use (PEP 562).
_API = frozenset(
    {"CutListing", "Package", "PartitionResult", "list_cuts", "load_package", "partition"}
)


def __getattr__(name: str) -> Any:
    if name in _API:
        value = getattr(importlib.import_module("splitinfer.api"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
