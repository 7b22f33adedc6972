"""ONNX Runtime's offline basic-level graph optimization.

Basic level holds only provider-independent, semantics-preserving rewrites
(constant folding, redundant node elimination such as Identity and Dropout,
Conv+BatchNorm/Add/Mul folding), so the saved graph stays standard ONNX and
portable; extended and higher levels insert contrib ops and are not used.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from splitinfer.shared.ortsession import open_session


def run(model: onnx.ModelProto) -> onnx.ModelProto:

    with tempfile.TemporaryDirectory(prefix="splitinfer-ort-") as tmp:
        src = Path(tmp) / "in.onnx"
        dst = Path(tmp) / "out.onnx"
        onnx.save(model, str(src))
        open_session(src, optimize="basic", optimized_path=dst, name="the model")
        out = onnx.load(str(dst))
    # ORT does not carry model-level metadata through; keep the source's.
    del out.metadata_props[:]
    out.metadata_props.extend(model.metadata_props)
    out.producer_name = model.producer_name
    out.producer_version = model.producer_version
    return out
