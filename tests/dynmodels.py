"""Models whose free dimensions go beyond the batch, exported as users export them.

* a BERT-like encoder (token + learned position embeddings, attention mask,
  post-norm layers) with dynamic batch and sequence axes;
* a conv + LSTM text recognizer with dynamic width whose output is
  sequence-first ``(T, N, classes)``, the batch not leading;
* a fully convolutional net (stride-2 down, upsample, skip) with dynamic H, W;
* an ``onnx.helper`` model whose declared output shape is wrong.

torch is imported at the point of use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _export(net: Any, example: tuple[Any, ...], path: Path, names: list[str], dyn: Any) -> Path:
    """``net`` in eval mode through the one torch->ONNX helper, output ``out``, the free
    dimensions ``dyn`` (one axis -> Dim mapping per input)."""
    from splitinfer.partitioner.torch_export import export_onnx

    net.eval()
    return export_onnx(net, example, path, names, ["out"], dynamic=dyn)


def encoder(
    path: Path,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    ffn: int = 128,
    vocab: int = 100,
    max_len: int = 128,
    seed: int = 0,
) -> Path:
    """A BERT-like encoder ``(ids, mask) -> (N, S, hidden)`` with free N and S."""
    import torch

    nn = torch.nn
    torch.manual_seed(seed)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.proj = nn.Linear(hidden, hidden)
            self.n1 = nn.LayerNorm(hidden)
            self.ff = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
            self.n2 = nn.LayerNorm(hidden)

        def forward(self, x: Any, bias: Any) -> Any:
            b, s, d = x.shape
            q, k, v = self.qkv(x).split(d, dim=-1)
            q = q.reshape(b, s, heads, d // heads).transpose(1, 2)
            k = k.reshape(b, s, heads, d // heads).transpose(1, 2)
            v = v.reshape(b, s, heads, d // heads).transpose(1, 2)
            att = (q @ k.transpose(-1, -2)) / (d // heads) ** 0.5 + bias
            y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
            x = self.n1(x + self.proj(y))
            return self.n2(x + self.ff(x))

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, hidden)
            self.pos = nn.Embedding(max_len, hidden)
            self.layers = nn.ModuleList([Layer() for _ in range(layers)])

        def forward(self, ids: Any, mask: Any) -> Any:
            s = ids.shape[1]
            x = self.tok(ids) + self.pos(torch.arange(s, device=ids.device))[None]
            bias = (1.0 - mask[:, None, None, :].to(x.dtype)) * -1e4
            for layer in self.layers:
                x = layer(x, bias)
            return x

    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=2, max=max_len)
    ids = torch.randint(0, vocab, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    dyn = ({0: batch, 1: seq}, {0: batch, 1: seq})
    return _export(Encoder(), (ids, mask), path, ["ids", "mask"], dyn)


def encoder_feeds(batch: int, seq: int, vocab: int = 100, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[:, max(1, seq - seq // 3) :] = 0
    return {"ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64), "mask": mask}


def recognizer(path: Path, classes: int = 37, seed: int = 0) -> Path:
    """Conv + BiLSTM over the width: ``(N, 1, 32, W) -> (W/4, N, classes)``, seq-first."""
    import torch

    nn = torch.nn
    torch.manual_seed(seed)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Sequential(
                nn.Conv2d(1, 8, 3, 1, 1),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(8, 16, 3, 1, 1),
                nn.ReLU(),
                nn.MaxPool2d(2),
            )
            self.rnn = nn.LSTM(16 * 8, 24, bidirectional=True)
            self.fc = nn.Linear(48, classes)

        def forward(self, x: Any) -> Any:
            f = self.conv(x)  # N, 16, 8, W/4
            n, c, h, w = f.shape
            seq = f.permute(3, 0, 1, 2).reshape(w, n, c * h)  # T, N, C
            y, _ = self.rnn(seq)
            return self.fc(y)  # T, N, classes

    width = torch.export.Dim("w4", min=2, max=128)
    x = torch.randn(1, 1, 32, 64)
    dyn = ({3: 4 * width},)
    return _export(Net(), (x,), path, ["image"], dyn)


def fully_conv(path: Path, seed: int = 0) -> Path:
    """Conv, stride-2 conv, upsample back, concat the skip: any even H and W."""
    import torch

    nn = torch.nn
    torch.manual_seed(seed)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.ReLU())
            self.down = nn.Sequential(nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU())
            self.up = nn.ConvTranspose2d(16, 8, 2, 2)
            self.head = nn.Conv2d(16, 4, 1)

        def forward(self, x: Any) -> Any:
            a = self.a(x)
            u = self.up(self.down(a))
            return self.head(torch.cat([a, u], 1))

    batch = torch.export.Dim("batch", min=1, max=64)
    h2 = torch.export.Dim("h2", min=2, max=256)
    w2 = torch.export.Dim("w2", min=2, max=256)
    x = torch.randn(2, 3, 16, 24)
    dyn = ({0: batch, 2: 2 * h2, 3: 2 * w2},)
    return _export(Net(), (x,), path, ["x"], dyn)


def wrong_declared_output() -> onnx.ModelProto:
    """``x (N, 4, W) -> y`` of real shape ``(W, N, 8)``; the graph declares ``y`` as ``[1, 'len']``.

    The body is MatMul, Transpose to seq-first, Relu, and a Reshape of an
    intermediate through shape arithmetic, so cuts land in batched and
    non-batched regions alike.
    """
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "w")
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),  # N, W, 4
        helper.make_node("MatMul", ["xt", "w"], ["h"]),  # N, W, 8
        helper.make_node("Sigmoid", ["h"], ["hs"]),
        helper.make_node("Shape", ["hs"], ["shp"]),
        helper.make_node("Reshape", ["hs", "shp"], ["hr"]),
        helper.make_node("Transpose", ["hr"], ["t"], perm=[1, 0, 2]),  # W, N, 8
        helper.make_node("Relu", ["t"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "wrong",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "len"])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model
