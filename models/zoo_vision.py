"""Vision networks at their real size, written in torch (random weights).

ResNet-50, MobileNetV3-Large, EfficientNet-B0, an Inception-style net
(GoogLeNet's nine modules), a YOLO-style detector (CSP backbone, SPPF, PAN
neck, three heads) and a depth-5 U-Net. They follow the published layer tables;
torchvision is not used (it does not import beside this torch build). The
registry entries are in :mod:`models.zoo`; torch is imported when a builder runs.
"""

from __future__ import annotations

from typing import Any


def _nn() -> Any:
    import torch

    return torch.nn


def _cbr(c_in: int, c_out: int, k: int = 3, s: int = 1, act: str = "relu", groups: int = 1) -> Any:
    """Conv (no bias) + BatchNorm + activation; ``act`` '' for none."""
    nn: Any = _nn()
    acts = {"relu": nn.ReLU, "hswish": nn.Hardswish, "silu": nn.SiLU}
    layers = [
        nn.Conv2d(c_in, c_out, k, s, k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(c_out),
    ]
    if act:
        layers.append(acts[act]())
    return nn.Sequential(*layers)


def resnet50(classes: int = 1000) -> Any:
    nn: Any = _nn()

    class Bottleneck(nn.Module):  # type: ignore[misc]
        def __init__(self, c_in: int, width: int, stride: int) -> None:
            super().__init__()
            c_out = width * 4
            self.body = nn.Sequential(
                _cbr(c_in, width, 1),
                _cbr(width, width, 3, stride),
                _cbr(width, c_out, 1, act=""),
            )
            self.down = None
            if stride != 1 or c_in != c_out:
                self.down = _cbr(c_in, c_out, 1, stride, act="")
            self.relu = nn.ReLU()

        def forward(self, x: Any) -> Any:
            skip = x if self.down is None else self.down(x)
            return self.relu(self.body(x) + skip)

    layers: list[Any] = [_cbr(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1)]
    c = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(c, width, stride if i == 0 else 1))
            c = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes)]
    return nn.Sequential(*layers)


def _divisible(v: float, d: int = 8) -> int:
    n = max(d, int(v + d / 2) // d * d)
    return n + d if n < 0.9 * v else n


def _se(c: int, squeeze: int, gate: str) -> Any:
    nn: Any = _nn()

    class SqueezeExcite(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.f1 = nn.Conv2d(c, squeeze, 1)
            self.f2 = nn.Conv2d(squeeze, c, 1)
            self.act = nn.SiLU() if gate == "sigmoid" else nn.ReLU()
            self.gate = nn.Sigmoid() if gate == "sigmoid" else nn.Hardsigmoid()

        def forward(self, x: Any) -> Any:
            s = x.mean(dim=(2, 3), keepdim=True)
            return x * self.gate(self.f2(self.act(self.f1(s))))

    return SqueezeExcite()


def _mbconv(c_in: int, exp: int, c_out: int, k: int, s: int, se: int, act: str, gate: str) -> Any:
    """Inverted residual: expand 1x1, depthwise kxk, squeeze-excite, project 1x1."""
    nn: Any = _nn()

    class MBConv(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            layers: list[Any] = []
            if exp != c_in:
                layers.append(_cbr(c_in, exp, 1, act=act))
            layers.append(_cbr(exp, exp, k, s, act=act, groups=exp))
            if se:
                layers.append(_se(exp, se, gate))
            layers.append(_cbr(exp, c_out, 1, act=""))
            self.body = nn.Sequential(*layers)
            self.residual = s == 1 and c_in == c_out

        def forward(self, x: Any) -> Any:
            y = self.body(x)
            return x + y if self.residual else y

    return MBConv()


#: MobileNetV3-Large (Howard et al. 2019, table 1): kernel, expansion, out, SE, act, stride.
_MNV3_LARGE = (
    (3, 16, 16, False, "relu", 1),
    (3, 64, 24, False, "relu", 2),
    (3, 72, 24, False, "relu", 1),
    (5, 72, 40, True, "relu", 2),
    (5, 120, 40, True, "relu", 1),
    (5, 120, 40, True, "relu", 1),
    (3, 240, 80, False, "hswish", 2),
    (3, 200, 80, False, "hswish", 1),
    (3, 184, 80, False, "hswish", 1),
    (3, 184, 80, False, "hswish", 1),
    (3, 480, 112, True, "hswish", 1),
    (3, 672, 112, True, "hswish", 1),
    (5, 672, 160, True, "hswish", 2),
    (5, 960, 160, True, "hswish", 1),
    (5, 960, 160, True, "hswish", 1),
)


def mobilenet_v3_large(classes: int = 1000) -> Any:
    nn: Any = _nn()
    layers: list[Any] = [_cbr(3, 16, 3, 2, act="hswish")]
    c = 16
    for k, exp, out, se, act, s in _MNV3_LARGE:
        layers.append(_mbconv(c, exp, out, k, s, _divisible(exp / 4) if se else 0, act, "hard"))
        c = out
    layers += [
        _cbr(c, 960, 1, act="hswish"),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(960, 1280),
        nn.Hardswish(),
        nn.Dropout(0.2),
        nn.Linear(1280, classes),
    ]
    return nn.Sequential(*layers)


#: EfficientNet-B0 (Tan & Le 2019, table 1): expansion, kernel, stride, out, repeats.
_EFFNET_B0 = (
    (1, 3, 1, 16, 1),
    (6, 3, 2, 24, 2),
    (6, 5, 2, 40, 2),
    (6, 3, 2, 80, 3),
    (6, 5, 1, 112, 3),
    (6, 5, 2, 192, 4),
    (6, 3, 1, 320, 1),
)


def efficientnet_b0(classes: int = 1000) -> Any:
    nn: Any = _nn()
    layers: list[Any] = [_cbr(3, 32, 3, 2, act="silu")]
    c = 32
    for e, k, s, out, n in _EFFNET_B0:
        for i in range(n):
            se = max(1, c // 4)
            layers.append(_mbconv(c, c * e, out, k, s if i == 0 else 1, se, "silu", "sigmoid"))
            c = out
    layers += [
        _cbr(c, 1280, 1, act="silu"),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(1280, classes),
    ]
    return nn.Sequential(*layers)


#: GoogLeNet's inception modules: 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj.
_INCEPTION = {
    "3a": (64, 96, 128, 16, 32, 32),
    "3b": (128, 128, 192, 32, 96, 64),
    "4a": (192, 96, 208, 16, 48, 64),
    "4b": (160, 112, 224, 24, 64, 64),
    "4c": (128, 128, 256, 24, 64, 64),
    "4d": (112, 144, 288, 32, 64, 64),
    "4e": (256, 160, 320, 32, 128, 128),
    "5a": (256, 160, 320, 32, 128, 128),
    "5b": (384, 192, 384, 48, 128, 128),
}


def inception_net(classes: int = 1000) -> Any:
    """GoogLeNet-style: stem, nine four-branch modules with max-pools between, head."""
    import torch

    nn: Any = torch.nn

    class Module(nn.Module):  # type: ignore[misc]
        def __init__(self, c_in: int, cfg: tuple[int, ...]) -> None:
            super().__init__()
            b1, r3, b3, r5, b5, pp = cfg
            self.b1 = _cbr(c_in, b1, 1)
            self.b2 = nn.Sequential(_cbr(c_in, r3, 1), _cbr(r3, b3, 3))
            self.b3 = nn.Sequential(_cbr(c_in, r5, 1), _cbr(r5, b5, 3), _cbr(b5, b5, 3))
            self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), _cbr(c_in, pp, 1))
            self.out = b1 + b3 + b5 + pp

        def forward(self, x: Any) -> Any:
            return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)

    layers: list[Any] = [
        _cbr(3, 64, 7, 2),
        nn.MaxPool2d(3, 2, 1),
        _cbr(64, 64, 1),
        _cbr(64, 192, 3),
        nn.MaxPool2d(3, 2, 1),
    ]
    c = 192
    for name, cfg in _INCEPTION.items():
        if name in ("4a", "5a"):
            layers.append(nn.MaxPool2d(3, 2, 1))
        m = Module(c, cfg)
        layers.append(m)
        c = m.out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(c, classes)]
    return nn.Sequential(*layers)


def yolo_pan(classes: int = 80, anchors: int = 3) -> Any:
    """A YOLOv5s-sized detector: CSP backbone, SPPF, PAN neck, heads at strides 8/16/32."""
    import torch

    nn: Any = torch.nn

    class Bottleneck(nn.Module):  # type: ignore[misc]
        def __init__(self, c: int, shortcut: bool) -> None:
            super().__init__()
            self.body = nn.Sequential(_cbr(c, c, 1, act="silu"), _cbr(c, c, 3, act="silu"))
            self.shortcut = shortcut

        def forward(self, x: Any) -> Any:
            return x + self.body(x) if self.shortcut else self.body(x)

    class C3(nn.Module):  # type: ignore[misc]
        def __init__(self, c_in: int, c_out: int, n: int, shortcut: bool = True) -> None:
            super().__init__()
            h = c_out // 2
            self.a = _cbr(c_in, h, 1, act="silu")
            self.b = _cbr(c_in, h, 1, act="silu")
            self.m = nn.Sequential(*(Bottleneck(h, shortcut) for _ in range(n)))
            self.out = _cbr(2 * h, c_out, 1, act="silu")

        def forward(self, x: Any) -> Any:
            return self.out(torch.cat([self.m(self.a(x)), self.b(x)], 1))

    class SPPF(nn.Module):  # type: ignore[misc]
        def __init__(self, c: int) -> None:
            super().__init__()
            self.a = _cbr(c, c // 2, 1, act="silu")
            self.pool = nn.MaxPool2d(5, 1, 2)
            self.out = _cbr(c * 2, c, 1, act="silu")

        def forward(self, x: Any) -> Any:
            x = self.a(x)
            y1 = self.pool(x)
            y2 = self.pool(y1)
            return self.out(torch.cat([x, y1, y2, self.pool(y2)], 1))

    class Detector(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            cbr = _cbr
            self.stem = nn.Sequential(cbr(3, 32, 3, 2, act="silu"), cbr(32, 64, 3, 2, act="silu"))
            self.s2 = nn.Sequential(C3(64, 64, 1), cbr(64, 128, 3, 2, act="silu"), C3(128, 128, 2))
            self.s3 = nn.Sequential(cbr(128, 256, 3, 2, act="silu"), C3(256, 256, 3))
            self.s4 = nn.Sequential(cbr(256, 512, 3, 2, act="silu"), C3(512, 512, 1), SPPF(512))
            self.lat4 = cbr(512, 256, 1, act="silu")
            self.td3 = C3(512, 256, 1, False)
            self.lat3 = cbr(256, 128, 1, act="silu")
            self.td2 = C3(256, 128, 1, False)  # P3 out, stride 8
            self.down2 = cbr(128, 128, 3, 2, act="silu")
            self.bu3 = C3(256, 256, 1, False)  # P4 out, stride 16
            self.down3 = cbr(256, 256, 3, 2, act="silu")
            self.bu4 = C3(512, 512, 1, False)  # P5 out, stride 32
            self.up = nn.Upsample(scale_factor=2.0, mode="nearest")
            no = anchors * (classes + 5)
            self.heads = nn.ModuleList(nn.Conv2d(c, no, 1) for c in (128, 256, 512))

        def forward(self, x: Any) -> Any:
            c2 = self.s2(self.stem(x))  # stride 8
            c3 = self.s3(c2)  # stride 16
            c4 = self.s4(c3)  # stride 32
            p4 = self.lat4(c4)
            t3 = self.td3(torch.cat([self.up(p4), c3], 1))
            p3 = self.lat3(t3)
            out8 = self.td2(torch.cat([self.up(p3), c2], 1))
            out16 = self.bu3(torch.cat([self.down2(out8), p3], 1))
            out32 = self.bu4(torch.cat([self.down3(out16), p4], 1))
            h8, h16, h32 = (h(o) for h, o in zip(self.heads, (out8, out16, out32), strict=True))
            return torch.sigmoid(h8), torch.sigmoid(h16), torch.sigmoid(h32)

    return Detector()


def unet(depth: int = 5, base: int = 64, classes: int = 2) -> Any:
    """Ronneberger et al.'s U-Net: ``depth`` levels (4 poolings at 5), padded 3x3 convs."""
    import torch

    nn: Any = torch.nn

    def double(c_in: int, c_out: int) -> Any:
        return nn.Sequential(_cbr(c_in, c_out, 3), _cbr(c_out, c_out, 3))

    class UNet(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            widths = [base * 2**i for i in range(depth)]
            self.down = nn.ModuleList()
            c = 3
            for w in widths:
                self.down.append(double(c, w))
                c = w
            self.pool = nn.MaxPool2d(2)
            self.ups = nn.ModuleList()
            self.dec = nn.ModuleList()
            for w in reversed(widths[:-1]):
                self.ups.append(nn.ConvTranspose2d(c, w, 2, 2))
                self.dec.append(double(2 * w, w))
                c = w
            self.head = nn.Conv2d(c, classes, 1)

        def forward(self, x: Any) -> Any:
            skips = []
            for i, block in enumerate(self.down):
                x = block(x if i == 0 else self.pool(x))
                skips.append(x)
            skips.pop()
            for up, dec in zip(self.ups, self.dec, strict=True):
                x = dec(torch.cat([up(x), skips.pop()], 1))
            return self.head(x)

    return UNet()
