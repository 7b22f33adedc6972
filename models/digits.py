"""A small CNN classifier for scikit-learn's bundled 8x8 digits set.

No download: ``sklearn.datasets.load_digits`` ships with scikit-learn. The net
trains in a few seconds on one CPU core with a fixed seed and reaches about
98% test accuracy. It is the project's demo model and the INT8 acceptance
model, so it has several layers and therefore interesting cuts:

    conv3x3(1→16)-relu-conv3x3(16→32)-relu-maxpool2-conv3x3(32→32)-relu
    -flatten-fc(512→64)-relu-fc(64→10)

torch and scikit-learn are imported inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

INPUT_NAME = "x"
OUTPUT_NAME = "logits"
#: Per-sample input shape (NCHW without N): one channel, 8x8 pixels.
SAMPLE_SHAPE = (1, 8, 8)
CLASSES = 10
TEST_FRACTION = 0.25
DEFAULT_EPOCHS = 15

Float32 = npt.NDArray[np.float32]
Int64 = npt.NDArray[np.int64]


def load_digits_split(seed: int = 0) -> tuple[Float32, Int64, Float32, Int64]:
    """``(x_train, y_train, x_test, y_test)``: float32 NCHW ``[n, 1, 8, 8]`` in 0..1, int64 labels.

    A stratified split (a quarter for test) fixed by ``seed``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (np.asarray(data.images, dtype=np.float32) / 16.0).reshape(-1, *SAMPLE_SHAPE)
    y = np.asarray(data.target, dtype=np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=TEST_FRACTION, random_state=seed, stratify=y
    )
    return (
        np.ascontiguousarray(x_train, dtype=np.float32),
        np.ascontiguousarray(y_train, dtype=np.int64),
        np.ascontiguousarray(x_test, dtype=np.float32),
        np.ascontiguousarray(y_test, dtype=np.int64),
    )


def build_digits_cnn() -> Any:
    """The untrained network (a ``torch.nn.Sequential``)."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, CLASSES),
    )


def train_digits_cnn(seed: int = 0, epochs: int = DEFAULT_EPOCHS, batch_size: int = 32) -> Any:
    """Train the CNN on the training split of :func:`load_digits_split` (``seed``); eval mode.

    Deterministic for a given seed and torch build: weights, shuffling and the
    split all derive from ``seed``. Training uses one torch thread (restored
    afterwards): on a small net extra threads only add contention.
    """
    import torch

    x_train, y_train, _, _ = load_digits_split(seed)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    net = build_digits_cnn()
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    loss_fn = torch.nn.CrossEntropyLoss()
    xs, ys = torch.from_numpy(x_train), torch.from_numpy(y_train)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net.train()
        for _ in range(epochs):
            order = torch.randperm(len(xs), generator=gen)
            for start in range(0, len(xs), batch_size):
                idx = order[start : start + batch_size]
                opt.zero_grad()
                loss = loss_fn(net(xs[idx]), ys[idx])
                loss.backward()
                opt.step()
            sched.step()
    finally:
        torch.set_num_threads(threads)
    net.eval()
    return net


def predict(net: Any, x: Float32) -> Int64:
    """Class predictions of a torch ``net`` on ``x`` (no gradient)."""
    import torch

    with torch.no_grad():
        logits = net(torch.from_numpy(x))
    return np.asarray(logits.argmax(dim=1).numpy(), dtype=np.int64)


def export_digits(
    path: Path, seed: int = 0, *, net: Any = None, epochs: int = DEFAULT_EPOCHS
) -> Path:
    """Write the trained classifier to ``path`` as ONNX: ``x [batch,1,8,8]`` to ``logits``.

    Trains with ``seed`` (and ``epochs``) unless an already trained ``net`` is given.
    """
    import torch

    from splitinfer.partitioner.torch_export import export_onnx

    if net is None:
        net = train_digits_cnn(seed, epochs=epochs)
    net.eval()
    example = (torch.zeros((2, *SAMPLE_SHAPE), dtype=torch.float32),)
    return export_onnx(net, example, Path(path), [INPUT_NAME], [OUTPUT_NAME])
