"""The small zoo's networks: one tiny torch model per graph shape the partitioner must cut.

A plain chain, residual blocks, depthwise + squeeze-excite + hard-swish, a
multi-branch Inception block, a transformer encoder with an attention-mask
input (fixed length 16), and a model with two inputs and two outputs. The
registry entries are in :mod:`models.zoo`.
"""

from __future__ import annotations

from typing import Any


def _torch() -> Any:  # heavy import at the point of use
    import torch

    return torch


def chain() -> Any:
    nn: Any = _torch().nn
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def resnet() -> Any:
    torch = _torch()
    nn: Any = torch.nn

    class Block(nn.Module):  # type: ignore[misc]
        def __init__(self, c_in: int, c_out: int, stride: int) -> None:
            super().__init__()
            self.c1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(c_out)
            self.c2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(c_out)
            self.down = None
            if stride != 1 or c_in != c_out:
                self.down = nn.Sequential(
                    nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
                )

        def forward(self, x: Any) -> Any:
            y = torch.relu(self.b1(self.c1(x)))
            y = self.b2(self.c2(y))
            skip = x if self.down is None else self.down(x)
            return torch.relu(y + skip)

    class Net(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.BatchNorm2d(16), nn.ReLU())
            self.blocks = nn.Sequential(Block(16, 16, 1), Block(16, 32, 2), Block(32, 32, 1))
            self.head = nn.Linear(32, 10)

        def forward(self, x: Any) -> Any:
            y = self.blocks(self.stem(x))
            return self.head(y.mean(dim=(2, 3)))

    return Net()


def mobilenet() -> Any:
    torch = _torch()
    nn: Any = torch.nn

    class SE(nn.Module):  # type: ignore[misc]
        def __init__(self, c: int) -> None:
            super().__init__()
            self.f1 = nn.Conv2d(c, c // 4, 1)
            self.f2 = nn.Conv2d(c // 4, c, 1)

        def forward(self, x: Any) -> Any:
            s = x.mean(dim=(2, 3), keepdim=True)
            s = nn.functional.hardsigmoid(self.f2(torch.relu(self.f1(s))))
            return x * s

    class InvertedResidual(nn.Module):  # type: ignore[misc]
        def __init__(self, c: int, expand: int) -> None:
            super().__init__()
            h = c * expand
            self.body = nn.Sequential(
                nn.Conv2d(c, h, 1, bias=False),
                nn.BatchNorm2d(h),
                nn.Hardswish(),
                nn.Conv2d(h, h, 3, 1, 1, groups=h, bias=False),
                nn.BatchNorm2d(h),
                nn.Hardswish(),
                SE(h),
                nn.Conv2d(h, c, 1, bias=False),
                nn.BatchNorm2d(c),
            )

        def forward(self, x: Any) -> Any:
            return x + self.body(x)

    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1),
        nn.BatchNorm2d(16),
        nn.Hardswish(),
        InvertedResidual(16, 4),
        InvertedResidual(16, 3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def inception() -> Any:
    torch = _torch()
    nn: Any = torch.nn

    class Inception(nn.Module):  # type: ignore[misc]
        def __init__(self, c: int) -> None:
            super().__init__()
            self.b1 = nn.Conv2d(c, 8, 1)
            self.b2 = nn.Sequential(nn.Conv2d(c, 8, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
            self.b3 = nn.Sequential(nn.Conv2d(c, 4, 1), nn.ReLU(), nn.Conv2d(4, 8, 5, padding=2))
            self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(c, 8, 1))

        def forward(self, x: Any) -> Any:
            return torch.relu(torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1))

    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        Inception(16),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def transformer() -> Any:
    torch = _torch()
    nn: Any = torch.nn

    class Attention(nn.Module):  # type: ignore[misc]
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.h = heads
            self.qkv = nn.Linear(d, 3 * d)
            self.out = nn.Linear(d, d)

        def forward(self, x: Any, bias: Any) -> Any:
            b, s, d = x.shape
            q, k, v = self.qkv(x).split(d, dim=-1)
            q = q.reshape(b, s, self.h, d // self.h).transpose(1, 2)
            k = k.reshape(b, s, self.h, d // self.h).transpose(1, 2)
            v = v.reshape(b, s, self.h, d // self.h).transpose(1, 2)
            att = (q @ k.transpose(-1, -2)) / (d // self.h) ** 0.5 + bias
            y = att.softmax(-1) @ v
            return self.out(y.transpose(1, 2).reshape(b, s, d))

    class Layer(nn.Module):  # type: ignore[misc]
        def __init__(self, d: int) -> None:
            super().__init__()
            self.att = Attention(d, 4)
            self.n1 = nn.LayerNorm(d)
            self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            self.n2 = nn.LayerNorm(d)

        def forward(self, x: Any, bias: Any) -> Any:
            x = self.n1(x + self.att(x, bias))
            return self.n2(x + self.ff(x))

    class Encoder(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(64, 32)
            self.pos = nn.Parameter(torch.randn(1, 16, 32) * 0.02)
            self.layers = nn.ModuleList([Layer(32), Layer(32)])
            self.head = nn.Linear(32, 5)

        def forward(self, ids: Any, mask: Any) -> Any:
            x = self.emb(ids) + self.pos
            bias = (1.0 - mask[:, None, None, :].to(x.dtype)) * -1e4
            for layer in self.layers:
                x = layer(x, bias)
            pooled = (x * mask[:, :, None]).sum(1) / mask.sum(1, keepdim=True)
            return self.head(pooled)

    return Encoder()


def two_io() -> Any:
    torch = _torch()
    nn: Any = torch.nn

    class TwoIO(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.img = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
            self.vec = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
            self.cls = nn.Linear(16, 4)
            self.reg = nn.Linear(8, 2)

        def forward(self, image: Any, features: Any) -> Any:
            a = self.img(image).flatten(1)
            b = self.vec(features)
            return self.cls(torch.cat([a, b], 1)), self.reg(a * b)

    return TwoIO()
