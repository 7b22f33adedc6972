"""ONNX Runtime's offline basic-level graph optimization.

Basic level holds only provider-independent, semantics-preserving rewrites
(constant folding, redundant node elimination such as Identity and Dropout,
Conv+BatchNorm/Add/Mul folding), so the saved graph stays standard ONNX and
portable; extended and higher levels insert contrib ops and are not used.

The weights go to ONNX Runtime beside the graph (a :class:`WeightShell`: the
model serialized without them, they replace the references before any
optimization runs): serializing a real-size model with its weights in it costs
seconds in Python. The result is written with its weights in it: ONNX Runtime's
external-initializer writer puts the nodes in another (valid) order, and the
order numbers the units and the cuts.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from splitinfer.partitioner.loader import WeightShell
from splitinfer.shared.ortsession import open_session


def run(model: onnx.ModelProto) -> onnx.ModelProto:
    shell = WeightShell(model)
    data = shell.model.SerializeToString()
    with tempfile.TemporaryDirectory(prefix="splitinfer-ort-") as tmp:
        dst = Path(tmp) / "out.onnx"
        opts = shell.options(
            optimize="basic",
            optimized_path=dst,
        )
        open_session(data, options=opts, name="the model")
        del data, opts, shell  # ONNX Runtime has copied the weights
        out = onnx.load(str(dst))
    # ORT does not carry model-level metadata through; keep the source's.
    del out.metadata_props[:]
    out.metadata_props.extend(model.metadata_props)
    out.producer_name = model.producer_name
    out.producer_version = model.producer_version
    return out
