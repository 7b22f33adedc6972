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

from splitinfer.shared.errors import ModelError


def run(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="splitinfer-ort-") as tmp:
        src = Path(tmp) / "in.onnx"
        dst = Path(tmp) / "out.onnx"
        onnx.save(model, str(src))
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.optimized_model_filepath = str(dst)
        opts.log_severity_level = 3
        try:
            ort.InferenceSession(str(src), opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises its own exception types for any load failure
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelError(f"ONNX Runtime cannot load the model: {first}") from exc
        out = onnx.load(str(dst))
    # ORT does not carry model-level metadata through; keep the source's.
    del out.metadata_props[:]
    out.metadata_props.extend(model.metadata_props)
    out.producer_name = model.producer_name
    out.producer_version = model.producer_version
    return out
