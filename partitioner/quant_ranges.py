"""Activation ranges for INT8: ONNX Runtime's calibrators with the settings we need.

:func:`calibrate` runs MinMax, Entropy or Percentile calibration and saves the
ranges as ONNX Runtime's calibration cache; :func:`entropy_threshold` is the
Entropy calibrator's KL-divergence search, vectorized. :class:`ModelRanges` holds
the ranges of a whole model, calibrated once, for every segment cut from it.
``onnxruntime.quantization`` is imported at the point of use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import onnx

if TYPE_CHECKING:
    from splitinfer.partitioner.quant_config import QuantConfig

__all__ = [
    "ENTROPY_BINS",
    "ENTROPY_QUANTIZED_BINS",
    "PERCENTILE",
    "ModelRanges",
    "calibrate",
    "entropy_threshold",
    "tensor_types",
]

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
    """Activation ranges for ``config.method``, saved as ORT's calibration cache."""
    method, data = calibrate_data(model_path, feeds, config, tmp)
    return method, save_cache(data, tmp)


def save_cache(data: Any, tmp: Path) -> Path:
    """``data`` (a TensorsData) as ORT's calibration cache file in ``tmp``."""
    from onnxruntime.quantization import save_tensors_data

    cache = tmp / "calibration.json"
    save_tensors_data(data, cache)
    return cache


def calibrate_data(
    model_path: Path, feeds: list[Feed], config: QuantConfig, tmp: Path
) -> tuple[Any, Any]:
    """``(method, TensorsData)``: the activation ranges for ``config.method``.

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
    data = calibrator.compute_data()
    del calibrator
    return method, data


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


@dataclass(frozen=True)
class ModelRanges:
    """Activation ranges of every float tensor of one model, calibrated once.

    ``--split auto`` builds an INT8 edge segment per shortlisted cut; each is a
    sub-graph of the same model fed the same calibration samples from the same
    inputs, so its tensors take the values they take in the whole model and
    ONNX Runtime's calibrator (which reduces each tensor on its own) finds the
    same ranges. Calibrating the whole model once and handing each segment its
    subset (:meth:`subset`) replaces a calibration run per cut.
    ``value_info`` is the shape inference of the pre-processed whole model,
    which a segment inherits instead of running the pre-processing again.
    Made by :func:`splitinfer.partitioner.quantize.model_ranges`.
    """

    activations: str
    method: str
    calibration_method: Any
    data: Any  # onnxruntime.quantization.calibrate.TensorsData
    types: Mapping[str, int]  # element type of every typed tensor of the whole model
    value_info: Mapping[str, onnx.ValueInfoProto]
    samples: int
    #: Each weight quantized once for every segment (:func:`.quant_memo.weights_once`).
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def fits(self, config: QuantConfig, samples: int) -> bool:
        """True if these ranges are what ``config`` would calibrate on ``samples`` samples."""
        return (
            config.activations == self.activations
            and config.method == self.method
            and samples == self.samples
        )

    def subset(self, model: onnx.ModelProto) -> Any | None:
        """The ranges of ``model``'s float tensors, or None if one is not known here
        (a tensor the whole model does not have): then the segment calibrates itself."""
        from onnxruntime.quantization.calibrate import TensorsData

        inits = {t.name for t in model.graph.initializer}
        names = {vi.name for vi in model.graph.input} - inits
        for node in model.graph.node:
            names.update(n for n in (*node.input, *node.output) if n and n not in inits)
        picked = {}
        for name in names:
            elem = self.types.get(name)
            if elem is None:
                return None
            if elem in FLOAT_TYPES:
                if name not in self.data:
                    return None
                picked[name] = self.data[name]
        return TensorsData(self.calibration_method, picked)


#: The element types ONNX Runtime's calibrators calibrate (float32 and float16).
FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16})


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor ``model`` declares a type for."""
    out: dict[str, int] = {}
    for vi in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        if vi.type.HasField("tensor_type"):
            out[vi.name] = vi.type.tensor_type.elem_type
    for t in model.graph.initializer:
        out[t.name] = t.data_type
    return out
