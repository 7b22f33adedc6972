"""The demo's real model: ddddocr's trained captcha recogniser, on rendered captchas.

The weights ship inside the ``ddddocr`` wheel on PyPI (MIT licence): its
``common.onnx`` (54 MB, fp32, the recogniser ``ddddocr.DdddOcr(beta=True)``
loads) is a convolutional network with SiLU activations (21 convolutions), an
LSTM and a per-column classifier over 8210 characters (``CHARSET_BETA`` in the
wheel's ``charsets.py``), decoded CTC-style. (The default ``common_old.onnx`` is
dynamically quantized with ONNX Runtime contrib ops, which the partitioner
refuses.) Only the two data files are read,
found through the installed package's location; ddddocr's Python API (and its
OpenCV import) is never used.

:func:`export_ocr` writes the model the demo partitions, two documented edits of
the source graph, checked against it on real images by :func:`verify_export`:

* the input ``input1`` is pinned to ``1x1x64xWIDTH`` (a 160x60 captcha resized
  to height 64, as ddddocr does), so every cut has a static size;
* the batch dimension is freed (the source pins it to 1; the graph itself
  takes any batch), so the partitioner can calibrate and the cloud batch;
* an ``ArgMax`` over the class axis and a ``Transpose`` to batch-first are
  appended: the output ``chars`` is the ``int64`` class index per column,
  ``(batch, columns)``;
* the graph is converted from opset 12 to 13 (``onnx.version_converter``),
  where ``DequantizeLinear`` has the ``axis`` a per-channel INT8 edge needs. The source's output is
  ``(columns, 1, 8210)`` float32 (its declared shape ``[1, seqlen]`` is wrong;
  the edit declares the real one): 720 KB a request down the link, where the
  indices are 180 bytes. The argmax is exactly what ddddocr computes next.

Inputs are captchas drawn by the ``captcha`` package (BSD), the widely used
generator of distorted, noisy text images, from random 4-character strings: the
ground truth is known, and the metric is character accuracy (one minus the
edit distance over the length) and exact match. The noise matters: clean
rendered text compresses to a few hundred bytes and would make sending the
input the best plan on any link (see docs/demo.md).
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from splitinfer.shared.errors import ConfigError

SOURCE_FILE = "common.onnx"
CHARSET_FILE = "charsets.py"
INPUT_NAME = "input1"
OUTPUT_NAME = "chars"
HEIGHT = 64
#: Captcha size the generator draws; resized to HEIGHT it is WIDTH columns wide.
CAPTCHA_SIZE = (160, 60)
WIDTH = CAPTCHA_SIZE[0] * HEIGHT // CAPTCHA_SIZE[1]
#: Characters of the generated strings: lower case and digits without the look-alikes.
ALPHABET = "abcdefhkmnprstuvwxyz2345678"
TEXT_LENGTH = 4
#: The source is opset 12; per-channel INT8 (DequantizeLinear's axis) needs 13.
OPSET = 13

Float32 = npt.NDArray[np.float32]


def package_dir() -> Path:
    """The installed ``ddddocr`` package's folder (not imported); a ConfigError if absent."""
    spec = importlib.util.find_spec("ddddocr")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        if (Path(loc) / SOURCE_FILE).is_file():
            return Path(loc)
    raise ConfigError(
        "the demo's OCR model ships in the ddddocr wheel: pip install 'splitinfer[demo]' "
        "(or run the digits demo: splitinfer-demo --quick)"
    )


def source_model() -> Path:
    return package_dir() / SOURCE_FILE


def charset() -> list[str]:
    """The recogniser's classes (index 0 is the CTC blank), from the wheel's charsets.py."""
    path = package_dir() / CHARSET_FILE
    spec = importlib.util.spec_from_file_location("_ddddocr_charsets", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: cannot be read as Python")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    chars: list[str] = list(module.CHARSET_BETA)
    return chars


def export_ocr(out: Path, width: int = WIDTH) -> Path:
    """Write the demo model (pinned input width, argmax head) to ``out``; return it."""
    import onnx
    from onnx import TensorProto, helper, version_converter

    model = onnx.load(str(source_model()))
    graph = model.graph
    if len(graph.input) != 1 or len(graph.output) != 1:
        raise ConfigError(f"{source_model()}: expected one input and one output")
    dims = graph.input[0].type.tensor_type.shape.dim
    dims[0].Clear()
    dims[0].dim_param = "batch"
    dims[3].Clear()
    dims[3].dim_value = width
    source_out = graph.output[0].name
    columns = _columns(width)
    del graph.output[:]
    graph.value_info.append(
        helper.make_tensor_value_info(source_out, TensorProto.FLOAT, [columns, "batch", None])
    )
    graph.node.extend(
        [
            helper.make_node("ArgMax", [source_out], ["argmax_cols"], name="argmax_head",
                             axis=2, keepdims=0),
            helper.make_node("Transpose", ["argmax_cols"], [OUTPUT_NAME], name="batch_first",
                             perm=[1, 0]),
        ]
    )  # fmt: skip
    graph.output.append(
        helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.INT64, ["batch", columns])
    )
    model = version_converter.convert_version(model, OPSET)
    onnx.checker.check_model(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out))
    return out


def _columns(width: int) -> int:
    """Output columns of the recogniser at an input width, measured by one run of the source."""
    from splitinfer.shared.ortsession import open_session

    sess = open_session(source_model())
    x = np.zeros((1, 1, HEIGHT, width), np.float32)
    return int(sess.run(None, {INPUT_NAME: x})[0].shape[0])


def verify_export(model: Path, x: Float32) -> None:
    """The exported model's answer equals the source's argmax on every image of ``x``."""
    from splitinfer.shared.ortsession import open_session

    src = open_session(source_model())
    ours = open_session(model)
    for i in range(len(x)):
        want = src.run(None, {INPUT_NAME: x[i : i + 1]})[0].argmax(axis=2).T
        got = ours.run(None, {INPUT_NAME: x[i : i + 1]})[0]
        if not np.array_equal(want, got):
            raise ConfigError(f"{model}: the argmax head disagrees with {source_model()}")


class _SeededSecrets:
    """The three ``secrets`` functions ``captcha.image`` draws from, off a seeded generator."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def randbelow(self, n: int) -> int:
        return self._rng.randrange(n)

    def randbits(self, k: int) -> int:
        return self._rng.getrandbits(k)

    def choice(self, seq: Sequence[Any]) -> Any:
        return self._rng.choice(seq)


def make_captchas(n: int, seed: int) -> tuple[Float32, list[str]]:
    """``n`` captchas of random strings: float32 ``[n, 1, 64, WIDTH]`` in 0..1 and the texts.

    The same ``seed`` draws the same images: ``captcha.image`` takes its noise from
    the ``secrets`` module, which it is handed a seeded stand-in for while drawing.
    """
    from captcha import image as captcha_image
    from PIL import Image

    rng = random.Random(seed)
    gen = captcha_image.ImageCaptcha(width=CAPTCHA_SIZE[0], height=CAPTCHA_SIZE[1])
    texts = ["".join(rng.choice(ALPHABET) for _ in range(TEXT_LENGTH)) for _ in range(n)]
    x = np.empty((n, 1, HEIGHT, WIDTH), np.float32)
    namespace = vars(captcha_image)  # the module's globals, where its functions look up
    real = namespace["secrets"]
    namespace["secrets"] = _SeededSecrets(rng)
    try:
        for i, text in enumerate(texts):
            img = gen.generate_image(text).resize((WIDTH, HEIGHT), Image.Resampling.LANCZOS)
            x[i, 0] = np.asarray(img.convert("L"), np.float32) / 255.0
    finally:
        namespace["secrets"] = real
    return x, texts


def decode(indices: Any, chars: Sequence[str]) -> str:
    """CTC greedy decoding of per-column class indices: merge repeats, drop blanks (0)."""
    out: list[str] = []
    prev = -1
    for k in np.asarray(indices).reshape(-1).tolist():
        if k not in (prev, 0) and 0 <= k < len(chars):
            out.append(chars[k])
        prev = k
    return "".join(out).lower()


def edit_distance(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def char_accuracy(pred: Sequence[str], truth: Sequence[str]) -> float:
    """Mean over samples of 1 - edit distance / length of the truth (floored at 0)."""
    scores = [max(0.0, 1 - edit_distance(p, t) / len(t)) for p, t in zip(pred, truth, strict=True)]
    return float(np.mean(scores)) if scores else 0.0
