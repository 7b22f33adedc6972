"""The model zoo: torch networks exported to ONNX, for the tests and the benchmarks.

Two tiers, one registry each:

- ``SMALL`` (:mod:`models.zoo_small`): tiny networks, one per graph shape the
  partitioner must cut correctly (chain, residual, squeeze-excite, Inception
  block, transformer with a mask, two inputs and two outputs). Exported in
  seconds; most tests use them.
- ``REAL`` (:mod:`models.zoo_vision`, :mod:`models.zoo_text`): the networks
  people actually split, at their real size with random weights: ResNet-50,
  MobileNetV3-Large, EfficientNet-B0, a YOLO-style detector with a PAN neck, a
  depth-5 U-Net, an Inception-style net, a BERT-base encoder and a 22M-parameter
  sentence encoder.

Each entry says its inputs (per-sample shapes, where a string names a free
dimension), its outputs, the default size of every free dimension and which
ones the ONNX export leaves free (the batch always is). :func:`export` writes
the model with those dimensions dynamic, through
:func:`splitinfer.partitioner.torch_export.export_onnx`. torch is imported only
inside the builders and :func:`export`, so importing this module needs no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class InputSpec:
    """One model input: per-sample shape (``int`` or the name of a free dim) and values."""

    shape: tuple[int | str, ...]
    dtype: str = "float32"
    #: ``float`` (standard normal), ``ids`` (integers in [0, high)) or ``mask``
    #: (ones, the second half of every sequence padded with zeros).
    kind: str = "float"
    high: int = 50


@dataclass(frozen=True)
class ZooModel:
    name: str
    build: Callable[[], Any]
    inputs: Mapping[str, InputSpec]
    outputs: tuple[str, ...]
    #: Default size of every named dimension of ``inputs`` (e.g. ``seq``, ``height``).
    dims: Mapping[str, int] = field(default_factory=dict)
    #: The named dimensions the export leaves free, with the multiple each must be
    #: (a U-Net at depth 5 needs H and W divisible by 16).
    free: Mapping[str, int] = field(default_factory=dict)
    #: Two values of each free dimension the tests compose at.
    test_dims: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    about: str = ""

    def shapes(self, batch: int, **dims: int) -> dict[str, tuple[int, ...]]:
        """Full input shapes at ``batch`` and the given (else default) dimension sizes."""
        size = {**self.dims, **dims}
        unknown = set(dims) - set(self.dims)
        if unknown:
            raise ValueError(f"{self.name}: no dimension(s) {sorted(unknown)}")
        return {
            n: (batch, *(size[d] if isinstance(d, str) else d for d in s.shape))
            for n, s in self.inputs.items()
        }

    def input_shape_args(self, batch: int = 1, **dims: int) -> list[str]:
        """``--input-shape NAME=DxD...`` arguments of ``partition`` for these sizes."""
        out: list[str] = []
        for name, shape in self.shapes(batch, **dims).items():
            out += ["--input-shape", f"{name}=" + "x".join(str(d) for d in shape)]
        return out

    def sample(self, batch: int, seed: int = 0, **dims: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        feeds: dict[str, np.ndarray] = {}
        for name, shape in self.shapes(batch, **dims).items():
            spec = self.inputs[name]
            if spec.kind == "mask":
                m = np.ones(shape, dtype=spec.dtype)
                m[:, shape[1] // 2 :] = 0
                feeds[name] = m
            elif spec.kind == "ids":
                feeds[name] = rng.integers(0, spec.high, size=shape).astype(spec.dtype)
            else:
                feeds[name] = rng.standard_normal(shape).astype(spec.dtype)
        return feeds

    def n_params(self) -> int:
        return sum(p.numel() for p in self.build().parameters())


def _dynamic(model: ZooModel) -> list[dict[int, Any]]:
    """``torch.export`` dims per input: the batch, then the free named dimensions."""
    import torch

    dims: dict[str, Any] = {}
    for name, multiple in model.free.items():
        top = 4096 // multiple
        base = torch.export.Dim(f"{name}_{multiple}" if multiple > 1 else name, min=1, max=top)
        dims[name] = base * multiple if multiple > 1 else base
    out: list[dict[int, Any]] = []
    for spec in model.inputs.values():
        axes: dict[int, Any] = {0: torch.export.Dim("batch", min=1, max=1024)}
        for axis, d in enumerate(spec.shape, start=1):
            if isinstance(d, str) and d in dims:
                axes[axis] = dims[d]
        out.append(axes)
    return out


def export(model: ZooModel, path: Path, seed: int = 0) -> Path:
    """Export ``model`` (random weights from ``seed``, eval mode) to ``path``.

    BatchNorm gets non-trivial running statistics so that folding it is really
    tested. The example input is batch 2 at the default dimension sizes.
    """
    import torch

    from splitinfer.partitioner.torch_export import export_onnx

    torch.manual_seed(seed)
    net = model.build()
    net.eval()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                assert m.running_mean is not None
                assert m.running_var is not None
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    example = tuple(torch.from_numpy(v) for v in model.sample(2).values())
    return export_onnx(
        net, example, path, list(model.inputs), list(model.outputs), dynamic=_dynamic(model)
    )


def reference(model_path: Path, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Outputs of the unmodified model under ONNX Runtime."""
    from splitinfer.shared.ortsession import open_session

    sess = open_session(model_path)
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name: feeds[i.name] for i in sess.get_inputs()}
    return dict(zip(names, sess.run(names, wanted), strict=True))


def _small() -> dict[str, ZooModel]:
    from splitinfer.models import zoo_small as z

    img = {"x": InputSpec((3, 16, 16))}
    text = {"ids": InputSpec((16,), "int64", "ids"), "mask": InputSpec((16,), "int64", "mask")}
    two = {"image": InputSpec((3, 8, 8)), "features": InputSpec((6,))}
    models = [
        ZooModel("chain", z.chain, img, ("logits",)),
        ZooModel("resnet", z.resnet, img, ("logits",)),
        ZooModel("mobilenet", z.mobilenet, img, ("logits",)),
        ZooModel("inception", z.inception, {"x": InputSpec((3, 12, 12))}, ("logits",)),
        ZooModel("transformer", z.transformer, text, ("logits",)),
        ZooModel("two_io", z.two_io, two, ("cls", "reg")),
    ]
    return {m.name: m for m in models}


def _real() -> dict[str, ZooModel]:
    from splitinfer.models import zoo_text as t
    from splitinfer.models import zoo_vision as v

    img = {"x": InputSpec((3, "height", "width"))}
    at224 = {"height": 224, "width": 224}
    text = {
        "input_ids": InputSpec(("seq",), "int64", "ids", high=t.VOCAB),
        "attention_mask": InputSpec(("seq",), "int64", "mask"),
    }
    models = [
        ZooModel("resnet50", v.resnet50, img, ("logits",), at224, about="ResNet-50, 224x224"),
        ZooModel(
            "mobilenetv3", v.mobilenet_v3_large, img, ("logits",), at224,
            about="MobileNetV3-Large, 224x224",
        ),
        ZooModel(
            "efficientnet_b0", v.efficientnet_b0, img, ("logits",), at224,
            about="EfficientNet-B0 (squeeze-excite), 224x224",
        ),
        ZooModel(
            "inception_net", v.inception_net, img, ("logits",), at224,
            about="GoogLeNet-style, nine four-branch modules, 224x224",
        ),
        ZooModel(
            "yolo_pan", v.yolo_pan, img, ("p3", "p4", "p5"), {"height": 256, "width": 256},
            free={"height": 32, "width": 32}, test_dims={"height": (256, 192), "width": (256, 320)},
            about="YOLO-style detector, PAN neck, three heads, free H and W (multiples of 32)",
        ),
        ZooModel(
            "unet", v.unet, img, ("mask",), {"height": 128, "width": 128},
            free={"height": 16, "width": 16}, test_dims={"height": (128, 96), "width": (128, 160)},
            about="U-Net of depth 5 (base 64), free H and W (multiples of 16)",
        ),
        ZooModel(
            "minilm", t.sentence_encoder, text, ("sentence_embedding",), {"seq": 128},
            free={"seq": 1}, test_dims={"seq": (128, 9)},
            about="6 x 384 sentence encoder (~22M parameters), free batch and sequence",
        ),
        ZooModel(
            "bert_base", t.bert_base, text, ("last_hidden_state", "pooled"), {"seq": 128},
            free={"seq": 1}, test_dims={"seq": (128, 9)},
            about="BERT-base encoder (12 x 768, 12 heads, ffn 3072), free batch and sequence",
        ),
    ]  # fmt: skip
    return {m.name: m for m in models}


#: The tiny zoo most tests use (exported in seconds).
SMALL: dict[str, ZooModel] = _small()
#: The real-scale zoo (tests marked slow, the partition benchmark).
REAL: dict[str, ZooModel] = _real()
#: Every zoo model by name.
ZOO: dict[str, ZooModel] = {**SMALL, **REAL}
