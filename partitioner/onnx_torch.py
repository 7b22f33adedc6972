"""Run a small ONNX graph as a trainable torch module, and write the weights back.

:mod:`partitioner.adapt` fine-tunes cloud segments (and a linear encoder on the
edge) and needs them in torch. The ONNX-to-torch converter one would reach for,
onnx2torch, imports torchvision at import time, and the only torchvision wheels
for a CPU-only torch are CUDA-linked ones that do not load against it (pip even
swaps the CPU torch for a CUDA build to satisfy it). The graphs adapted here are
the cloud segments of convolutional and dense classifiers, so this module
interprets exactly the ops those hold, node by node in graph order, and refuses
any other op with a one-line error.

The module keeps the ONNX graph as it is: every float initializer becomes a
``torch.nn.Parameter``, the rest (shapes, integer constants) plain tensors, and
:meth:`GraphModule.write_back` puts the trained values into a copy of the
original model, so names, opset, batch dimension and node order of the segment
never change. The caller checks the result with ONNX Runtime.

torch is imported inside the functions; the op table is built on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from splitinfer.shared.errors import ConfigError

Op = Callable[[list[Any], dict[str, Any]], Any]

#: The ONNX ops this interpreter runs (see :func:`_ops`).
SUPPORTED = (
    "Add", "AveragePool", "BatchNormalization", "Concat", "Constant", "Conv", "Div",
    "Flatten", "Gemm", "GlobalAveragePool", "Identity", "MatMul", "MaxPool", "Mul",
    "Relu", "Reshape", "Sigmoid", "Softmax", "Sub", "Tanh", "Transpose",
)  # fmt: skip


def unsupported(nodes: Iterable[onnx.NodeProto]) -> list[str]:
    """The op types among ``nodes`` this module cannot run (sorted, unique)."""
    return sorted({n.op_type for n in nodes if n.op_type not in SUPPORTED or n.domain})


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _pads(attrs: Mapping[str, Any], dims: int) -> tuple[list[int], list[int]]:
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise ConfigError("ONNX auto_pad is not supported by the adaptation; export with pads")
    pads = list(attrs.get("pads", [0] * (2 * dims)))
    return pads[:dims], pads[dims:]


def _conv(x: list[Any], a: dict[str, Any]) -> Any:
    import torch.nn.functional as F

    w = x[1]
    dims = w.dim() - 2
    begin, end = _pads(a, dims)
    inp = x[0]
    if begin != end:
        flat = [p for b, e in zip(reversed(begin), reversed(end), strict=True) for p in (b, e)]
        inp, begin = F.pad(inp, flat), [0] * dims
    conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    return conv(
        inp,
        w,
        x[2] if len(x) > 2 else None,
        stride=list(a.get("strides", [1] * dims)),
        padding=begin,
        dilation=list(a.get("dilations", [1] * dims)),
        groups=int(a.get("group", 1)),
    )


def _pool(kind: str) -> Op:
    def run(x: list[Any], a: dict[str, Any]) -> Any:
        import torch.nn.functional as F

        kernel = list(a["kernel_shape"])
        dims = len(kernel)
        begin, end = _pads(a, dims)
        if begin != end:
            raise ConfigError(f"{kind} with asymmetric pads is not supported by the adaptation")
        strides = list(a.get("strides", [1] * dims))
        ceil = bool(a.get("ceil_mode", 0))
        if kind == "MaxPool":
            mp: Any = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[dims - 1]
            dil = list(a.get("dilations", [1] * dims))
            return mp(x[0], kernel, strides, begin, dil, ceil_mode=ceil)
        ap: Any = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[dims - 1]
        include = bool(a.get("count_include_pad", 0))
        return ap(x[0], kernel, strides, begin, ceil_mode=ceil, count_include_pad=include)

    return run


def _reshape(x: list[Any], a: dict[str, Any]) -> Any:
    shape = [int(v) for v in x[1].tolist()]
    if not a.get("allowzero", 0):
        shape = [x[0].shape[i] if v == 0 else v for i, v in enumerate(shape)]
    return x[0].reshape(shape)


def _gemm(x: list[Any], a: dict[str, Any]) -> Any:
    left = x[0].transpose(0, 1) if a.get("transA", 0) else x[0]
    right = x[1].transpose(0, 1) if a.get("transB", 0) else x[1]
    out = float(a.get("alpha", 1.0)) * (left @ right)
    if len(x) > 2 and x[2] is not None:
        out = out + float(a.get("beta", 1.0)) * x[2]
    return out


def _batchnorm(x: list[Any], a: dict[str, Any]) -> Any:
    view = [1, -1] + [1] * (x[0].dim() - 2)
    scale, bias, mean, var = (t.reshape(view) for t in x[1:5])
    eps = float(a.get("epsilon", 1e-5))
    return (x[0] - mean) / (var + eps).sqrt() * scale + bias


def _ops() -> dict[str, Op]:
    import torch

    return {
        "Add": lambda x, a: x[0] + x[1],
        "Sub": lambda x, a: x[0] - x[1],
        "Mul": lambda x, a: x[0] * x[1],
        "Div": lambda x, a: x[0] / x[1],
        "MatMul": lambda x, a: x[0] @ x[1],
        "Relu": lambda x, a: torch.relu(x[0]),
        "Sigmoid": lambda x, a: torch.sigmoid(x[0]),
        "Tanh": lambda x, a: torch.tanh(x[0]),
        "Identity": lambda x, a: x[0],
        "Softmax": lambda x, a: torch.softmax(x[0], dim=int(a.get("axis", -1))),
        "Flatten": lambda x, a: x[0].reshape(
            int(np.prod(x[0].shape[: int(a.get("axis", 1))], dtype=np.int64)), -1
        ),
        "Concat": lambda x, a: torch.cat(x, dim=int(a["axis"])),
        "Transpose": lambda x, a: x[0].permute(
            *(a["perm"] if "perm" in a else range(x[0].dim() - 1, -1, -1))
        ),
        "GlobalAveragePool": lambda x, a: x[0].mean(dim=tuple(range(2, x[0].dim())), keepdim=True),
        "Constant": lambda x, a: torch.from_numpy(numpy_helper.to_array(a["value"]).copy()),
        "Conv": _conv,
        "MaxPool": _pool("MaxPool"),
        "AveragePool": _pool("AveragePool"),
        "Reshape": _reshape,
        "Gemm": _gemm,
        "BatchNormalization": _batchnorm,
    }


def graph_module(
    nodes: Sequence[onnx.NodeProto],
    initializers: Sequence[onnx.TensorProto],
    inputs: Sequence[str],
    outputs: Sequence[str],
    what: str,
) -> Any:
    """A :class:`GraphModule` over ``nodes`` (in graph order) with these weights."""
    bad = unsupported(nodes)
    if bad:
        raise ConfigError(
            f"{what} uses ONNX op(s) {', '.join(bad)} that the adaptation cannot train "
            f"(it runs {', '.join(SUPPORTED)}); leave --adapt-cloud off for this model"
        )
    import torch

    class GraphModule(torch.nn.Module):
        """The graph as torch ops; float initializers are its parameters."""

        def __init__(self) -> None:
            super().__init__()
            self.params = torch.nn.ParameterList()
            self.index: dict[str, int] = {}
            self.fixed: dict[str, Any] = {}
            used = {i for n in nodes for i in n.input}
            for init in initializers:
                if init.name not in used:
                    continue
                value = numpy_helper.to_array(init).copy()
                if value.dtype.kind == "f":
                    self.index[init.name] = len(self.params)
                    self.params.append(
                        torch.nn.Parameter(torch.from_numpy(value.astype(np.float32)))
                    )
                else:
                    self.fixed[init.name] = torch.from_numpy(value)
            self.table = _ops()

        def forward(self, *feeds: Any) -> list[Any]:
            env: dict[str, Any] = dict(zip(inputs, feeds, strict=True))
            for name, i in self.index.items():
                env[name] = self.params[i]
            for name, t in self.fixed.items():
                env[name] = t.to(feeds[0].device) if t.dtype.is_floating_point else t
            for node in nodes:
                args = [env[i] if i else None for i in node.input]
                value = self.table[node.op_type](args, _attrs(node))
                if node.op_type == "Constant" and value.dtype.is_floating_point:
                    value = value.to(feeds[0].device)
                env[node.output[0]] = value
            return [env[o] for o in outputs]

        def write_back(self, model: onnx.ModelProto) -> onnx.ModelProto:
            """A copy of ``model`` whose initializers hold this module's weights."""
            out = onnx.ModelProto()
            out.CopyFrom(model)
            for init in out.graph.initializer:
                if init.name in self.index:
                    value = self.params[self.index[init.name]].detach().cpu().numpy()
                    init.CopyFrom(numpy_helper.from_array(value.astype(np.float32), init.name))
            return out

    return GraphModule()


def segment_module(model: onnx.ModelProto, what: str) -> Any:
    """The whole segment ``model`` (its inputs to its outputs) as a module."""
    g = model.graph
    feeds = [i.name for i in g.input if i.name not in {t.name for t in g.initializer}]
    return graph_module(list(g.node), list(g.initializer), feeds, [o.name for o in g.output], what)
