"""Export a torch module to ONNX with a free batch dimension, quietly.

Used by the demo and the model zoo. torch is imported here, at the point of use.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def export_onnx(
    net: Any,
    example: tuple[Any, ...],
    path: Path,
    input_names: Sequence[str],
    output_names: Sequence[str],
    max_batch: int = 1024,
    dynamic: Sequence[Mapping[int, Any]] | None = None,
) -> Path:
    """Export ``net`` (eval mode) with dimension 0 of every input as ``batch``.

    ``dynamic``, one mapping per input (axis -> ``torch.export.Dim``), replaces
    that default when more dimensions are free (a sequence length, H and W).
    The dynamo exporter prints progress to stdout and logs torchvision notices;
    both are silenced so that commands built on this keep their output clean.
    """
    import torch

    if dynamic is None:
        batch = torch.export.Dim("batch", min=1, max=max_batch)
        dynamic = [{0: batch} for _ in input_names]
    path.parent.mkdir(parents=True, exist_ok=True)
    logging.getLogger("torch").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
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
