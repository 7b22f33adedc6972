"""Bytes per request and encode/decode time of the input codecs a cloud-only client uses.

    python bench/bench_input_codecs.py [--quick] [--json out.json]

Two inputs, one request = one sample (batch 1), as the edge sends them:

* ``digits``: sklearn's 8x8 digits scaled to k/16 (float32 [1, 1, 8, 8]), 64 samples;
* ``natural``: a synthetic 224x224 RGB picture, smooth gradients and blobs plus mild
  noise (float32 [1, 3, 224, 224] in [0, 1]), 8 different pictures.

Codecs: ``raw`` (float32, the baseline), ``int8+zstd`` (per-channel int8 calibrated on
the samples, zstd level 1, no dictionary), ``png`` and ``jpeg:90`` (the per-tensor
affine to pixels from ``calibrate_image``). Columns: mean bytes per request, the
ratio raw bytes / codec bytes, median encode and decode milliseconds (one thread,
in-process), and the largest and mean absolute error in units of the pixel step.

Targets (PASS/FAIL): PNG is lossless on the digits (grid values); on the natural
picture PNG is at least 2x smaller than raw and JPEG q=90 at least 4x smaller than
int8+zstd, with a mean error of at most 3 pixel levels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.shared.codecs import (
    Codec,
    Int8ZstdCodec,
    JpegCodec,
    PngCodec,
    QuantParams,
    RawCodec,
    calibrate_image,
    calibrate_params,
)

LIMIT = 1 << 28


def digits(n: int) -> np.ndarray:
    from sklearn.datasets import load_digits

    return (load_digits().images[:n, None] / 16).astype(np.float32)


def natural(n: int, size: int = 224, seed: int = 0) -> np.ndarray:
    """Smooth colour gradients, a few soft blobs and mild sensor noise, in [0, 1]."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    out = np.empty((n, 3, size, size), np.float32)
    for i in range(n):
        for c in range(3):
            a, b = rng.uniform(-1, 1, 2)
            img = 0.5 + 0.25 * (a * xx + b * yy)
            for _ in range(4):
                cy, cx, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.3)
                img += rng.uniform(-0.3, 0.3) * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / r**2)
            img += rng.normal(0, 0.01, img.shape)
            out[i, c] = np.clip(img, 0, 1)
    return out


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(
    name: str, codec: Codec, x: np.ndarray, params: QuantParams | None, step: float, repeats: int
) -> dict[str, Any]:
    sizes, enc, dec, worst, mean = [], [], [], 0.0, []
    for i in range(x.shape[0]):
        sample = x[i : i + 1]
        data = codec.encode(sample, params)
        sizes.append(len(data))
        enc.append(_median_ms(lambda s=sample: codec.encode(s, params), repeats))
        dec.append(
            _median_ms(
                lambda d=data, s=sample: codec.decode(d, "float32", s.shape, params, LIMIT),
                repeats,
            )
        )
        y = codec.decode(data, "float32", sample.shape, params, LIMIT)
        err = np.abs(y.astype(np.float64) - sample) / step
        worst = max(worst, float(err.max()))
        mean.append(float(err.mean()))
    return {
        "codec": name,
        "bytes": float(np.mean(sizes)),
        "encode_ms": statistics.median(enc),
        "decode_ms": statistics.median(dec),
        "max_err_levels": worst,
        "mean_err_levels": float(np.mean(mean)),
    }


def run(x: np.ndarray, repeats: int) -> list[dict[str, Any]]:
    image = calibrate_image(x)
    int8 = calibrate_params(x, axis=1 if x.shape[1] > 1 else None)
    step = image.scale[0]
    rows = [
        measure("raw", RawCodec(), x, None, step, repeats),
        measure("int8+zstd", Int8ZstdCodec(1), x, int8, step, repeats),
        measure("png", PngCodec(), x, image, step, repeats),
        measure("jpeg:90", JpegCodec(90), x, image, step, repeats),
    ]
    for r in rows:
        r["ratio"] = rows[0]["bytes"] / r["bytes"]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and repeats")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    inputs = {
        "digits": digits(16 if args.quick else 64),
        "natural": natural(2 if args.quick else 8),
    }
    results: dict[str, list[dict[str, Any]]] = {}
    for label, x in inputs.items():
        rows = run(x, repeats)
        results[label] = rows
        print(f"{label}: float32 {list(x.shape[1:])}, {x.shape[0]} requests of one sample")
        print(
            f"  {'codec':<10} {'bytes/req':>10} {'vs raw':>7} {'enc ms':>8} {'dec ms':>8} "
            f"{'max err':>8} {'mean err':>9}  (errors in pixel steps)"
        )
        for r in rows:
            print(
                f"  {r['codec']:<10} {r['bytes']:>10,.1f} {r['ratio']:>6.1f}x "
                f"{r['encode_ms']:>8.3f} {r['decode_ms']:>8.3f} {r['max_err_levels']:>8.2f} "
                f"{r['mean_err_levels']:>9.3f}"
            )
    d = {r["codec"]: r for r in results["digits"]}
    nat = {r["codec"]: r for r in results["natural"]}
    checks = [
        ("png lossless on digits (max error 0)", d["png"]["max_err_levels"] == 0.0),
        ("png >= 2x smaller than raw on natural", nat["png"]["ratio"] >= 2.0),
        (
            "jpeg:90 >= 4x smaller than int8+zstd on natural",
            nat["int8+zstd"]["bytes"] / nat["jpeg:90"]["bytes"] >= 4.0,
        ),
        ("jpeg:90 mean error <= 3 levels on natural", nat["jpeg:90"]["mean_err_levels"] <= 3),
    ]
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {text}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "quick": args.quick}, indent=2))
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
