"""The ``splitinfer-demo --quick`` job: the digits classifier, trained on the spot.

It trains on scikit-learn's bundled digits (seconds), and its private run fine-tunes
the cloud segment and a learned 10-dimensional code for the noise (``--adapt-cloud``).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np

from splitinfer.demo import Job, Strategy, _partition, _say, _step, split_candidate

#: --adapt-time of the private run (seconds): the fine-tune that keeps its answers usable.
ADAPT_SECONDS = 20


def build_digits(
    out: Path, trace: Path, epsilon: float, with_private: bool = True
) -> tuple[list[Strategy], Job]:
    from splitinfer.models.digits import export_digits, load_digits_split, train_digits_cnn

    t0 = time.perf_counter()
    _step("training the digits CNN")
    x_train, _, x_test, y_test = load_digits_split(0)
    net = train_digits_cnn(seed=0)
    model = export_digits(out / "digits.onnx", seed=0, net=net)
    calib = out / "calibration"
    calib.mkdir(exist_ok=True)
    np.save(calib / "train.npy", x_train[:256])
    _say(f"trained and exported the digits CNN in {time.perf_counter() - t0:.1f} s -> {model}")
    link = ["--trace", str(trace)]
    common = [str(model), "--calibration", str(calib), *link, "--rtt", "40ms"]
    pk = out / "packages"
    t0 = time.perf_counter()
    _partition([*common, "--split", "auto", "--candidates", "3", "-o", str(pk / "auto"),
                "--report", str(out / "cuts.png")])  # fmt: skip
    _partition([str(model), "--split", "none", "-o", str(pk / "cloud-only")])
    _partition([*common[:3], "--split", "all", "--precision", "int8", "-o", str(pk / "edge")])
    clip = _median_norm(out, pk)
    if with_private:
        _partition(
            [*common, "--split", "auto", "-o", str(pk / "private"), "--epsilon", str(epsilon),
             "--clip", f"{clip:.3g}", "--bottleneck", "10", "--adapt-cloud",
             "--adapt-time", f"{ADAPT_SECONDS}s", "--candidates", "3"]
        )  # fmt: skip
    _say(f"partitioned {3 + with_private} ways in {time.perf_counter() - t0:.1f} s")
    _step("the fp32 model's answers")
    repo = out / "repository" / "digits"
    for version, name in (("1", "auto"), ("2", "cloud-only"), ("3", "private")):
        if (pk / name).is_dir():
            shutil.copytree(pk / name, repo / version)
    split = split_candidate(pk / "auto")
    strategies = [
        Strategy("auto (its choice)", pk / "auto", "1", "INT8 edge"),
        Strategy(
            f"split at {split}", pk / "auto", "1", "run-time candidate, pinned", force_cut=split
        ),
        Strategy("cloud-only", pk / "cloud-only", "2", "raw input, int8+zstd"),
        Strategy("edge-only", pk / "edge", None, "INT8, no network"),
    ]
    if with_private:
        private = split_candidate(pk / "private")
        strategies.append(
            Strategy(
                f"split at {private}, DP",
                pk / "private",
                "3",
                f"eps={epsilon:g} per request, adapted code-10, clip {clip:.3g}",
                force_cut=private,
            )
        )
    job = Job(
        name="digits",
        what="digits",
        x=x_test,
        truth=[int(v) for v in y_test],
        fp32=[int(v) for v in _fp32(model, x_test)],
        decode=lambda result: int(result["logits"].argmax()),
        score=lambda pred, truth: float(
            np.mean([p == t for p, t in zip(pred, truth, strict=True)])
        ),
        metric="accuracy",
        emulate=None,
        auto_package=pk / "auto",
    )
    return strategies, job


def _median_norm(out: Path, packages: Path) -> float:
    """A clip norm for the private run: the median L2 norm of the auto cut's activations."""
    import onnxruntime as ort

    from splitinfer.shared.manifest import load_manifest

    m = load_manifest(packages / "auto")
    cut = next((c for c in m.cuts if c.kind == "split" and c.edge is not None), None)
    if cut is None or cut.edge is None:
        return 10.0
    x = np.load(out / "calibration" / "train.npy")
    sess = ort.InferenceSession(str(packages / "auto" / cut.edge.file))
    acts = sess.run(None, {"x": x})
    flat = np.concatenate([a.reshape(len(x), -1) for a in acts], axis=1)
    return float(np.median(np.linalg.norm(flat, axis=1)))


def _fp32(model: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    preds: np.ndarray = sess.run(None, {"x": x})[0].argmax(axis=1)
    return preds
