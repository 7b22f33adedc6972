"""OnnxSlim: dead nodes, common subexpressions, standard-op pattern fusions."""

from __future__ import annotations

import logging

import onnx

from splitinfer.shared.errors import ModelError


def run(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxslim

    logging.getLogger("onnxslim").setLevel(logging.ERROR)
    try:
        out = onnxslim.slim(model)
    except Exception as exc:  # onnxslim raises bare Exceptions from its graph code
        raise ModelError(f"onnxslim failed on the model: {exc}") from exc
    if not isinstance(out, onnx.ModelProto):
        raise ModelError("onnxslim returned no model")
    return out
