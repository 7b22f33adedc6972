"""Choosing how a cut's tensors travel, at partition time, from real activations.

For each candidate cut the partitioner runs the edge segment on calibration
samples and hands the cut activations here:

1. per-channel int8 parameters are calibrated on them (they go in the
   manifest, so the edge does not recompute them per request);
2. the int8 + zstd payloads of held-out samples are measured with and without a
   zstd dictionary trained on the calibration payloads; the dictionary is kept
   only when it makes the payloads at least 10% smaller (it pays off on small
   activations, where a zstd frame alone has little history to learn from);
3. when a ``score`` function is given (the cloud segment's top-1 agreement on
   the dequantized activations vs the fp32 ones), int8 must keep at least
   ``min_agreement``; otherwise the cut falls back to fp16.

Tensors that are not floats (ids, masks) always travel raw.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from splitinfer.shared.codecs import (
    FLOAT_DTYPES,
    Fp16Codec,
    Int8ZstdCodec,
    QuantParams,
    calibrate_params,
    dequantize,
    quantize,
)
from splitinfer.shared.manifest import CodecSpec, QuantSpec
from splitinfer.shared.package import quant_spec

#: A dictionary must shrink held-out payloads by this fraction to be kept.
DICT_GAIN = 0.10
DICT_SIZE = 16 * 1024
DEFAULT_LEVEL = 1  # as small as level 3 on activations here, about twice as fast

Acts = Mapping[str, np.ndarray]  # tensor name -> [n, ...] activations of n samples
Score = Callable[[Acts], float]  # agreement of the cloud's answer with these activations


@dataclass(frozen=True)
class WirePlan:
    """What the partitioner records for one cut."""

    codec: CodecSpec
    quant: dict[str, QuantSpec]
    dictionary: bytes | None
    ratio: float  # fp32 bytes / wire bytes per sample, measured on held-out samples
    wire_bytes: float  # mean payload bytes per sample
    agreement: float | None  # score of the int8 round trip, when a score was given

    def summary(self) -> dict[str, float | str | None]:
        return {
            "codec": self.codec.name,
            "dictionary": self.codec.dictionary,
            "ratio": round(self.ratio, 3),
            "wire_bytes": round(self.wire_bytes, 1),
            "agreement": self.agreement,
        }


#: Above this many channels one scale serves the whole tensor: per-channel
#: parameters travel in every frame's header, which is bounded (64 KiB).
MAX_CHANNELS = 512


def _axis(array: np.ndarray) -> int | None:
    """The channel axis: C of NCHW, the features of [batch, features] and of
    [batch, sequence, hidden] (never a sequence axis, whose length varies)."""
    axis = 2 if array.ndim == 3 else 1 if array.ndim >= 2 else None
    if axis is None or not 1 < array.shape[axis] <= MAX_CHANNELS:
        return None
    return axis


def calibrate(acts: Acts) -> dict[str, QuantParams]:
    """Per-channel (axis 1) int8 parameters of every float tensor."""
    return {
        name: calibrate_params(a, axis=_axis(a))
        for name, a in acts.items()
        if str(a.dtype) in FLOAT_DTYPES
    }


def plan_wire(
    acts: Acts,
    *,
    dictionary_file: str,
    level: int = DEFAULT_LEVEL,
    score: Score | None = None,
    min_agreement: float = 0.99,
    train_dictionary: bool = True,
) -> WirePlan:
    """Measure and choose the codec of one cut from its calibration activations."""
    import zstandard

    floats = {k: v for k, v in acts.items() if str(v.dtype) in FLOAT_DTYPES}
    n = min((a.shape[0] for a in acts.values()), default=0)
    raw_bytes = sum(a[:1].nbytes for a in acts.values())
    if not floats or n == 0:
        return WirePlan(CodecSpec("raw"), {}, None, 1.0, float(raw_bytes), None)
    params = calibrate(floats)
    agreement = None
    if score is not None:
        rounded = {
            **acts,
            **{k: dequantize(quantize(a, params[k]), params[k]) for k, a in floats.items()},
        }
        agreement = float(score(rounded))
        if agreement < min_agreement:
            half = sum(len(Fp16Codec().encode(a)) for a in floats.values()) / n
            other = sum(a[:1].nbytes for k, a in acts.items() if k not in floats)
            wire = half + other
            return WirePlan(CodecSpec("fp16"), {}, None, raw_bytes / wire, wire, agreement)
    split = max(1, n // 2) if n >= 8 else n
    plain = Int8ZstdCodec(level)
    held = range(split, n) if split < n else range(n)
    plain_bytes = sum(
        len(plain.encode(a[i : i + 1], params[k])) for k, a in floats.items() for i in held
    )
    dictionary: bytes | None = None
    best = plain_bytes
    if train_dictionary and n >= 8:
        samples: list[bytes | bytearray | memoryview] = [
            b for k, a in floats.items() for b in _raw_int8(a[:split], params[k])
        ]
        # zstd's guidance: a dictionary about a tenth of the data it learns from
        size = int(np.clip(sum(map(len, samples)) // 10, 256, DICT_SIZE))
        try:
            trained = zstandard.train_dictionary(size, samples, level=level).as_bytes()
        except zstandard.ZstdError:
            trained = None  # too few or too uniform samples to learn from
        if trained:
            with_dict = Int8ZstdCodec(level, trained)
            dict_bytes = sum(
                len(with_dict.encode(a[i : i + 1], params[k]))
                for k, a in floats.items()
                for i in held
            )
            if dict_bytes <= (1 - DICT_GAIN) * plain_bytes:
                dictionary, best = trained, dict_bytes
    other = sum(a[:1].nbytes for k, a in acts.items() if k not in floats)
    wire = best / len(held) + other
    return WirePlan(
        CodecSpec("int8+zstd", level, dictionary_file if dictionary else None),
        {k: quant_spec(p) for k, p in params.items()},
        dictionary,
        raw_bytes / wire,
        wire,
        agreement,
    )


def _raw_int8(a: np.ndarray, p: QuantParams) -> list[bytes]:
    return [quantize(a[i : i + 1], p).tobytes() for i in range(a.shape[0])]


def stack(samples: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per-sample outputs (batch 1 each) stacked into [n, ...] per tensor."""
    if not samples:
        return {}
    return {k: np.concatenate([s[k] for s in samples]) for k in samples[0]}
