"""Export a torch module to ONNX with a free batch dimension, quietly: the one
torch -> ONNX export helper (the model zoo, the demo, the MoE package exporter,
the tests' models and the benchmarks all export through it).

torch is imported here, at the point of use.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: the opset of the TorchScript exporter (the dynamo exporter picks its own)
TORCHSCRIPT_OPSET = 17


def export_onnx(
    net: Any,
    example: tuple[Any, ...],
    path: Path,
    input_names: Sequence[str],
    output_names: Sequence[str],
    max_batch: int = 1024,
    dynamic: Sequence[Mapping[int, Any]] | None = None,
    *,
    dynamo: bool = True,
) -> Path:
    """Export ``net`` (eval mode) with dimension 0 of every input as ``batch``.

    ``dynamic``, one mapping per input (axis -> ``torch.export.Dim``), replaces
    that default when more dimensions are free (a sequence length, H and W).
    ``dynamo=False`` uses the TorchScript exporter instead (opset
    :data:`TORCHSCRIPT_OPSET`, dimension 0 of every input and output free as
    ``batch``): about 20x faster on small modules, for those it can trace.
    The exporters print progress to stdout and log torchvision notices; both
    are silenced so that commands built on this keep their output clean.
    """
    import torch

    if not dynamo and dynamic is not None:
        raise ValueError("dynamic shapes need the dynamo exporter (dynamo=True)")
    path.parent.mkdir(parents=True, exist_ok=True)
    logging.getLogger("torch").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if not dynamo:
            torch.onnx.export(
                net,
                example,
                str(path),
                input_names=list(input_names),
                output_names=list(output_names),
                dynamic_axes={n: {0: "batch"} for n in (*input_names, *output_names)},
                opset_version=TORCHSCRIPT_OPSET,
                dynamo=False,
            )
            return path
        if dynamic is None:
            batch = torch.export.Dim("batch", min=1, max=max_batch)
            dynamic = [{0: batch} for _ in input_names]
        torch.onnx.export(
            net,
            example,
            str(path),
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_shapes=tuple(dict(d) for d in dynamic),
            dynamo=True,
            verbose=False,
        )
    return path
