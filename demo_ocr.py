"""The default ``splitinfer-demo`` job: ddddocr's trained captcha recogniser.

The model ships inside the ``ddddocr`` wheel (``splitinfer[demo]``); see
:mod:`splitinfer.models.ocr` for the graph edits and the inputs. Every edge
agent emulates a Raspberry Pi 5 (``--emulate-device raspberry-pi-5``,
the slowest built-in edge profile) and the partitioner plans for that profile.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from splitinfer.demo import Job, Strategy

MODEL_NAME = "ocr"
DEVICE = "raspberry-pi-5"
CALIBRATION = 32
TEST_SEED = 1
CALIBRATION_SEED = 0


def build_ocr(
    out: Path, trace: Path, epsilon: float, samples: int, with_private: bool = True
) -> tuple[list[Strategy], Job]:
    from splitinfer.demo import Job, Strategy, _partition, _say, _step, split_candidate
    from splitinfer.models import ocr
    from splitinfer.shared.ortsession import open_session

    t0 = time.perf_counter()
    _step("exporting ddddocr's captcha recogniser with an argmax head")
    model = ocr.export_ocr(out / "ocr.onnx")
    _step(f"drawing {CALIBRATION} + {samples} captchas")
    x_cal, _ = ocr.make_captchas(CALIBRATION, CALIBRATION_SEED)
    x_test, texts = ocr.make_captchas(samples, TEST_SEED)
    _step("checking the exported model against the source on 8 captchas")
    ocr.verify_export(model, x_test[:8])
    calib = out / "calibration"
    calib.mkdir(exist_ok=True)
    np.save(calib / "captchas.npy", x_cal)
    chars = ocr.charset()
    src = open_session(model)
    _step(f"the fp32 model's answers to {samples} captchas")
    fp32 = [ocr.decode(src.run(None, {ocr.INPUT_NAME: x_test[i : i + 1]})[0], chars)
            for i in range(len(x_test))]  # fmt: skip
    _say(
        f"exported {ocr.source_model()} with an argmax head (checked against the source), "
        f"drew {CALIBRATION} + {samples} captchas in {time.perf_counter() - t0:.1f} s -> {model}"
    )
    base = [str(model), "--calibration", str(calib)]
    # png: lossless on these 256-level inputs. (--input-codec auto would accept jpeg: the
    # partitioner's agreement metric reads this int64 output as if it were logits.)
    plan = [*base, "--input-codec", "png", "--trace", str(trace), "--rtt", "40ms",
            "--edge-profile", DEVICE]  # fmt: skip
    pk = out / "packages"
    t0 = time.perf_counter()
    _partition([*plan, "--split", "auto", "--candidates", "3", "-o", str(pk / "auto"),
                "--report", str(out / "cuts.png")])  # fmt: skip
    _partition([*base, "--input-codec", "png", "--split", "none", "-o", str(pk / "cloud-only")])
    _partition([*base, "--split", "all", "--precision", "int8", "-o", str(pk / "edge")])
    if with_private:
        _partition([*plan, "--split", "auto", "--candidates", "3", "-o", str(pk / "private"),
                    "--epsilon", str(epsilon), "--clip", "1"])  # fmt: skip
    _say(f"partitioned {3 + with_private} ways in {time.perf_counter() - t0:.1f} s")
    repo = out / "repository" / MODEL_NAME
    for version, name in (("1", "auto"), ("2", "cloud-only"), ("3", "private")):
        if (pk / name).is_dir():
            shutil.copytree(pk / name, repo / version)
    split = split_candidate(pk / "auto")
    strategies = [
        Strategy("auto (its choice)", pk / "auto", "1", "INT8 edge, run-time candidates"),
        Strategy(f"split at {split}", pk / "auto", "1", "run-time candidate, pinned",
                 force_cut=split),
        Strategy("cloud-only", pk / "cloud-only", "2", "input as PNG (lossless)"),
        Strategy("edge-only", pk / "edge", None, "INT8, no network"),
    ]  # fmt: skip
    if with_private:
        private = split_candidate(pk / "private")
        strategies.append(
            Strategy(f"split at {private}, DP", pk / "private", "3",
                     f"eps={epsilon:g} per request, clip 1, not adapted", force_cut=private)
        )  # fmt: skip

    def decode(result: Any) -> str:
        return ocr.decode(result[ocr.OUTPUT_NAME], chars)

    job = Job(
        name=MODEL_NAME,
        what="captchas",
        x=x_test,
        truth=texts,
        fp32=fp32,
        decode=decode,
        score=ocr.char_accuracy,
        metric="char acc",
        emulate=DEVICE,
        auto_package=pk / "auto",
    )
    return strategies, job
