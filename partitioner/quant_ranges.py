"""Activation ranges for INT8: ONNX Runtime's calibrators with the settings we need.

:func:`calibrate` runs MinMax, Entropy or Percentile calibration and saves the
ranges as ONNX Runtime's calibration cache; :func:`entropy_threshold` is the
Entropy calibrator's KL-divergence search, vectorized. ``onnxruntime.quantization``
is imported at the point of use.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from splitinfer.partitioner.quantize import QuantConfig

__all__ = ["ENTROPY_BINS", "ENTROPY_QUANTIZED_BINS", "PERCENTILE", "calibrate", "entropy_threshold"]

Array = npt.NDArray[Any]
Feed = dict[str, Array]

#: Histogram bins of the Entropy calibrator and the quantized bins its KL-divergence
#: search compares against (TensorRT's classic 2048 / 128): thresholds from 1/16 of
#: the largest |value| up to all of it are tried.
ENTROPY_BINS = 2048
ENTROPY_QUANTIZED_BINS = 128
#: Percentile the Percentile calibrator keeps: of |activation| for s8s8; for u8s8 each
#: tail loses half of the rest (0.0005%).
PERCENTILE = 99.999


def calibrate(
    model_path: Path, feeds: list[Feed], config: QuantConfig, tmp: Path
) -> tuple[Any, Path]:
    """Activation ranges for ``config.method``, saved as ORT's calibration cache.

    Calibration runs here rather than inside ``quantize_static`` because that
    function cannot pass histogram settings through: its Entropy calibrator
    keeps 128 bins for 128 quantized bins, which leaves a single candidate
    threshold (the min-max range), and its Percentile calibrator symmetrizes
    ranges, which wastes half the codes of unsigned activations. The ranges go
    to ``quantize_static`` through its calibration cache file.
    """
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        create_calibrator,
        save_tensors_data,
    )

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self._it = iter(feeds)

        def get_next(self) -> Feed | None:
            return next(self._it, None)

    symmetric = config.activations == "s8s8"
    method, options = {
        "minmax": (CalibrationMethod.MinMax, {"symmetric": symmetric}),
        "entropy": (
            CalibrationMethod.Entropy,
            {
                "symmetric": symmetric,
                "num_bins": ENTROPY_BINS,
                "num_quantized_bins": ENTROPY_QUANTIZED_BINS,
            },
        ),
        "percentile": (
            CalibrationMethod.Percentile,
            {"symmetric": symmetric, "num_bins": 2048, "percentile": PERCENTILE},
        ),
    }[config.method]
    calibrator = create_calibrator(
        model_path,
        augmented_model_path=str(tmp / "augmented.onnx"),
        calibrate_method=method,
        extra_options=options,
    )
    calibrator.collect_data(Reader())
    if config.method == "entropy":
        # same search, vectorized per candidate: ORT's loops over bins in Python
        # (about 1.5 s per tensor at 2048 bins, against 50 ms here)
        calibrator.collector.get_entropy_threshold = entropy_threshold
    cache = tmp / "calibration.json"
    save_tensors_data(calibrator.compute_data(), cache)
    return method, cache


def _smooth(p: Array, eps: float = 0.0001) -> Array | None:
    """ORT's ``smooth_distribution``: zeros become ``eps``, taken off the non-zeros (float32)."""
    zeros = p == 0
    n_zeros = int(np.count_nonzero(zeros))
    if n_zeros == p.size:
        return None
    eps1 = eps * float(n_zeros) / float(p.size - n_zeros)
    out = p.astype(np.float32)
    out += np.where(zeros, np.float32(eps), np.float32(-eps1)).astype(np.float32)
    return out


def _kl_smoothed(p: Array, q: Array) -> float:
    """KL(p || q) of the smoothed, normalized histograms, in float32 as ORT computes it."""
    ps, qs = _smooth(p), _smooth(q)
    if ps is None or qs is None:
        return float("inf")
    ps = ps / np.sum(ps)
    qs = qs / np.sum(qs)
    return float(np.sum(ps * np.log(ps / qs)))


def entropy_threshold(histogram: tuple[Any, ...], num_quantized_bins: int) -> tuple[Any, Any]:
    """The KL-divergence threshold of ONNX Runtime's Entropy calibrator, without its loops.

    ``histogram`` is ORT's ``(hist, edges, min, max, ...)`` over a range symmetric
    about zero. For each candidate half-width ``i`` (in bins) the reference ``p``
    is the central slice with the outliers folded into its end bins; ``q`` merges
    the slice into ``num_quantized_bins`` and spreads each back evenly (integer
    division, as ORT does). The ``(low, high)`` edges of the slice with the
    smallest KL(p || q) win, clipped to the observed min and max. The result is
    the same as ``HistogramCollector.get_entropy_threshold`` (tested).
    """
    hist = np.asarray(histogram[0])
    edges = np.asarray(histogram[1])
    num_bins = hist.size
    zero = num_bins // 2
    half = num_quantized_bins // 2
    cumsum = np.concatenate(([0], np.cumsum(hist)))
    best_div, best = np.inf, (edges[0], edges[-1])
    for i in range(half, zero + 1):
        start, end = zero - i, min(zero + i + 1, num_bins)
        sliced = hist[start:end]
        p = sliced.copy()
        p[0] += cumsum[start]
        p[-1] += cumsum[-1] - cumsum[end]
        merged = sliced.size // num_quantized_bins
        whole = num_quantized_bins * merged
        quantized = sliced[:whole].reshape(num_quantized_bins, merged).sum(axis=1)
        quantized[-1] += sliced[whole:].sum()
        nonzero = (p[:whole] != 0).reshape(num_quantized_bins, merged).sum(axis=1)
        spread = np.zeros(num_quantized_bins, dtype=np.int64)
        np.floor_divide(quantized, nonzero, out=spread, where=nonzero != 0)
        q = np.zeros(p.size, dtype=np.int64)
        q[:whole] = np.repeat(spread, merged)
        div = _kl_smoothed(p, q)
        if div < best_div:
            best_div, best = div, (edges[start], edges[end])
    low = max(best[0], histogram[2])
    high = min(best[1], histogram[3])
    dtype = edges.dtype
    return np.array(low, dtype=dtype), np.array(high, dtype=dtype)
