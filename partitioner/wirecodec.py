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
   ``min_agreement``; otherwise the cut falls back to fp16;
4. with a score, the quantization step is then made coarser, as long as the
   agreement stays within ``max_step_loss`` of the full int8 step's and above
   ``min_agreement``: 7, 6, 5 and 4 effective bits (the scale times
   127 / (2^(b-1) - 1), the values still travel as int8). Fewer levels compress
   better and faster under zstd; the codec's error bound (half a step) holds
   with the recorded scale. Without a score the full int8 step is kept. At 4
   bits the values also travel packed two to a byte (``int4+zstd``) when that
   is smaller on the held-out samples, which it is on every activation here.

Tensors that are not floats (ids, masks) always travel raw.

The inputs of the cloud-only cut are what a real client uploads: when they are
image-shaped (``[N, C, H, W]`` with C 1 or 3, or ``[N, H, W]``; float or uint8),
``plan_wire(input_codec=InputCodec())`` also measures PNG (and JPEG, when a score can
check its loss) with a per-tensor affine to pixels calibrated on the samples
(:func:`splitinfer.shared.codecs.calibrate_image`), and keeps the smallest codec
on held-out samples among those that keep ``min_agreement``. ``partition
--input-codec`` forces one (:meth:`InputCodec.parse`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from splitinfer.shared import images
from splitinfer.shared.codecs import (
    FLOAT_DTYPES,
    IMAGE_DTYPES,
    JPEG_QUALITY,
    Fp16Codec,
    Int4ZstdCodec,
    Int8ZstdCodec,
    JpegCodec,
    PngCodec,
    QuantParams,
    calibrate_image,
    calibrate_params,
    dequantize,
    quantize,
)
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.manifest import CodecSpec, QuantSpec, TensorSpec
from splitinfer.shared.package import quant_spec

#: A dictionary must shrink held-out payloads by this fraction to be kept.
DICT_GAIN = 0.10
DICT_SIZE = 16 * 1024
DEFAULT_LEVEL = 1  # as small as level 3 on activations here, about twice as fast

Acts = Mapping[str, np.ndarray]  # tensor name -> [n, ...] activations of n samples
Score = Callable[[Acts], float]  # agreement of the cloud's answer with these activations

INPUT_CODECS = ("auto", "raw", "png", "jpeg")
#: JPEG qualities ``--input-codec auto`` measures, when a score can check them.
AUTO_JPEG_QUALITIES = (90, 75)
#: Effective bits the step search tries, finest first (8 = the calibrated step).
STEP_BITS = (7, 6, 5, 4)
#: Agreement a coarser step may lose against the full int8 step (half a point).
MAX_STEP_LOSS = 0.005
#: uint8 pictures are the pixels: the identity affine (x = u), recorded so that
#: frames refer to the manifest instead of carrying per-batch parameters.
IDENTITY = QuantSpec((1.0,), (-128,), None)


@dataclass(frozen=True)
class InputCodec:
    """How the inputs of the cloud-only cut travel (``partition --input-codec``).

    ``auto`` measures the usual codecs and, for image-shaped inputs, PNG and JPEG,
    and keeps the smallest that holds the agreement; the others force one codec.
    ``quality`` is the JPEG quality (1-100) of a forced ``jpeg``.
    """

    name: str = "auto"
    quality: int = JPEG_QUALITY

    def __post_init__(self) -> None:
        if self.name not in INPUT_CODECS:
            raise ConfigError(f"--input-codec {self.name!r}: use auto, raw, png or jpeg[:QUALITY]")
        q = self.quality
        if not isinstance(q, int) or isinstance(q, bool) or not 1 <= q <= 100:
            raise ConfigError(f"--input-codec jpeg:{q!r}: QUALITY must be an integer in 1..100")

    @classmethod
    def parse(cls, text: str) -> InputCodec:
        """``auto``, ``raw``, ``png``, ``jpeg`` or ``jpeg:QUALITY``."""
        name, sep, quality = text.strip().lower().partition(":")
        if not sep:
            return cls(name)
        if name != "jpeg" or not quality.strip().isdigit():
            raise ConfigError(
                f"--input-codec {text!r}: only jpeg takes a quality, as jpeg:QUALITY (1-100)"
            )
        return cls(name, int(quality))

    def spec(self) -> CodecSpec:
        """The manifest's codec entry of a forced codec."""
        if self.name == "jpeg":
            return CodecSpec("jpeg", quality=self.quality)
        return CodecSpec(self.name)


def check_image_inputs(choice: InputCodec, tensors: Sequence[TensorSpec]) -> None:
    """Raise :class:`ConfigError` if ``choice`` forces an image codec on inputs that are
    not images (every float or uint8 input must be one, and there must be one)."""
    if choice.name not in ("png", "jpeg"):
        return
    carried = [t for t in tensors if t.dtype in IMAGE_DTYPES]
    for t in carried:
        if images.layout(t.shape) is None:
            raise ConfigError(
                f"--input-codec {choice.name}: input {t.name!r} has {images.describe(t.shape)}; "
                "use --input-codec raw or auto"
            )
    if not carried:
        names = ", ".join(f"{t.name} ({t.dtype})" for t in tensors) or "none"
        raise ConfigError(
            f"--input-codec {choice.name}: no float or uint8 input to carry as an image "
            f"(inputs: {names}); use --input-codec raw or auto"
        )


@dataclass(frozen=True)
class WirePlan:
    """What the partitioner records for one cut."""

    codec: CodecSpec
    quant: dict[str, QuantSpec]
    dictionary: bytes | None
    ratio: float  # fp32 bytes / wire bytes per sample, measured on held-out samples
    wire_bytes: float  # mean payload bytes per sample
    agreement: float | None  # score of the int8 round trip, when a score was given
    #: Every codec measured for the choice (codec, wire bytes, agreement), image inputs only.
    tried: tuple[dict[str, Any], ...] = ()
    #: Effective bits of the int8 step (8: as calibrated; fewer: a coarser step, see 4.).
    bits: int = 8

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "codec": self.codec.name,
            "dictionary": self.codec.dictionary,
            "ratio": round(self.ratio, 3),
            "wire_bytes": round(self.wire_bytes, 1),
            "agreement": self.agreement,
        }
        if self.codec.quality is not None:
            out["quality"] = self.codec.quality
        if self.codec.name in ("int8", "int8+zstd", "int4+zstd"):
            out["bits"] = self.bits
        if self.tried:
            out["tried"] = list(self.tried)
        return out

    def row(self) -> dict[str, Any]:
        """This plan as one entry of another plan's ``tried``."""
        name = self.codec.name + (f":{self.codec.quality}" if self.codec.quality else "")
        return {"codec": name, "wire_bytes": round(self.wire_bytes, 1), "agreement": self.agreement}


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
    input_codec: InputCodec | None = None,
) -> WirePlan:
    """Measure and choose the codec of one cut from its calibration activations.

    ``input_codec`` is given for the cloud-only cut (its tensors are the model
    inputs): see :class:`InputCodec`.
    """
    if input_codec is not None and input_codec.name != "auto":
        return _forced(acts, input_codec, score)
    plan = _plan_activations(acts, dictionary_file, level, score, min_agreement, train_dictionary)
    if input_codec is None or not _all_images(acts):
        return plan
    qualities = AUTO_JPEG_QUALITIES if score is not None else ()
    candidates = [plan, _image_plan(acts, PngCodec(), score)]
    candidates += [_image_plan(acts, JpegCodec(q), score) for q in qualities]
    kept = [c for c in candidates[1:] if c.agreement is None or c.agreement >= min_agreement]
    best = min([plan, *kept], key=lambda c: c.wire_bytes)
    return replace(best, tried=tuple(c.row() for c in candidates))


def _plan_activations(
    acts: Acts,
    dictionary_file: str,
    level: int,
    score: Score | None,
    min_agreement: float,
    train_dictionary: bool,
    max_step_loss: float = MAX_STEP_LOSS,
) -> WirePlan:
    import zstandard

    floats = {k: v for k, v in acts.items() if str(v.dtype) in FLOAT_DTYPES}
    n = min((a.shape[0] for a in acts.values()), default=0)
    raw_bytes = sum(a[:1].nbytes for a in acts.values())
    if not floats or n == 0:
        return WirePlan(CodecSpec("raw"), {}, None, 1.0, float(raw_bytes), None)
    params = calibrate(floats)
    agreement = None
    bits = 8
    if score is not None:

        def agreement_of(p: dict[str, QuantParams]) -> float:
            rounded = {k: dequantize(quantize(a, p[k]), p[k]) for k, a in floats.items()}
            return float(score({**acts, **rounded}))

        agreement = agreement_of(params)
        if agreement < min_agreement:
            half = sum(len(Fp16Codec().encode(a)) for a in floats.values()) / n
            other = sum(a[:1].nbytes for k, a in acts.items() if k not in floats)
            wire = half + other
            return WirePlan(CodecSpec("fp16"), {}, None, raw_bytes / wire, wire, agreement)
        floor = max(min_agreement, agreement - max_step_loss)
        calibrated = params
        for b in STEP_BITS:
            coarser = {k: coarsen(p, b) for k, p in calibrated.items()}
            got = agreement_of(coarser)
            if got < floor:
                break
            params, agreement, bits = coarser, got, b
    split = max(1, n // 2) if n >= 8 else n
    held = range(split, n) if split < n else range(n)

    def held_bytes(codec: Int8ZstdCodec) -> int:
        return sum(
            len(codec.encode(a[i : i + 1], params[k])) for k, a in floats.items() for i in held
        )

    # at 4 effective bits the values also fit two to a byte (int4+zstd): keep the smaller
    kinds: list[type[Int8ZstdCodec]] = [Int8ZstdCodec] + ([Int4ZstdCodec] if bits <= 4 else [])
    measured = [(held_bytes(kind(level)), kind) for kind in kinds]
    plain_bytes, kind = min(measured, key=lambda m: m[0])
    plain = kind(level)
    dictionary: bytes | None = None
    best = plain_bytes
    if train_dictionary and n >= 8:
        samples: list[bytes | bytearray | memoryview] = [
            plain._payload(quantize(a[i : i + 1], params[k]))
            for k, a in floats.items()
            for i in range(split)
        ]
        # zstd's guidance: a dictionary about a tenth of the data it learns from
        size = int(np.clip(sum(map(len, samples)) // 10, 256, DICT_SIZE))
        try:
            trained = zstandard.train_dictionary(size, samples, level=level).as_bytes()
        except zstandard.ZstdError:
            trained = None  # too few or too uniform samples to learn from
        if trained:
            with_dict = kind(level, trained)
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
        CodecSpec(plain.name, level, dictionary_file if dictionary else None),
        {k: quant_spec(p) for k, p in params.items()},
        dictionary,
        raw_bytes / wire,
        wire,
        agreement,
        bits=bits,
    )


def coarsen(params: QuantParams, bits: int) -> QuantParams:
    """``params`` with the step of ``bits`` effective bits over the same range."""
    factor = 127 / (2 ** (bits - 1) - 1)
    return QuantParams(tuple(s * factor for s in params.scale), params.zero_point, params.axis)


def _all_images(acts: Acts) -> bool:
    carried = [a for a in acts.values() if str(a.dtype) in IMAGE_DTYPES]
    return bool(carried) and all(images.layout(a.shape) is not None for a in carried)


def _forced(acts: Acts, choice: InputCodec, score: Score | None) -> WirePlan:
    if choice.name == "raw":
        n = sum(a[:1].nbytes for a in acts.values())
        return WirePlan(CodecSpec("raw"), {}, None, 1.0, float(n), None)
    specs = [TensorSpec(k, str(a.dtype), a.shape) for k, a in acts.items()]
    check_image_inputs(choice, specs)
    codec = PngCodec() if choice.name == "png" else JpegCodec(choice.quality)
    return _image_plan(acts, codec, score)


def _image_plan(acts: Acts, codec: PngCodec | JpegCodec, score: Score | None) -> WirePlan:
    """An image codec's plan: per-tensor affine to pixels, bytes on held-out samples."""
    carried = {k: a for k, a in acts.items() if str(a.dtype) in IMAGE_DTYPES}
    params = {k: calibrate_image(a) for k, a in carried.items() if str(a.dtype) != "uint8"}
    n = min(a.shape[0] for a in acts.values())
    split = max(1, n // 2) if n >= 8 else n
    held = range(split, n) if split < n else range(n)
    sent = sum(
        len(codec.encode(a[i : i + 1], params.get(k))) for k, a in carried.items() for i in held
    )
    other = sum(a[:1].nbytes for k, a in acts.items() if k not in carried)
    wire = sent / len(held) + other
    agreement = None
    if score is not None:
        rounded = dict(acts)
        for k, a in carried.items():
            p = params.get(k)
            data = codec.encode(a, p)
            rounded[k] = codec.decode(data, str(a.dtype), a.shape, p, max(len(data), a.nbytes))
        agreement = float(score(rounded))
    spec = CodecSpec("jpeg", quality=codec.quality) if isinstance(codec, JpegCodec) else None
    quant = {k: quant_spec(params[k]) if k in params else IDENTITY for k in carried}
    raw_bytes = sum(a[:1].nbytes for a in acts.values())
    return WirePlan(spec or CodecSpec("png"), quant, None, raw_bytes / wire, wire, agreement)


def stack(samples: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per-sample outputs (batch 1 each) stacked into [n, ...] per tensor."""
    if not samples:
        return {}
    return {k: np.concatenate([s[k] for s in samples]) for k in samples[0]}
