"""Noise-aware cloud segments: fine-tune what comes after the privacy noise.

``partition --split auto --epsilon E --clip C --adapt-cloud`` keeps the
mechanism of ``shared/privacy.py`` exactly as it is (the edge clips each
sample's cut activation to L2 norm C and adds Gaussian noise of std z·2C, then
the wire codec quantizes it) and trains the parts around it so that the model's
answer survives the noise:

- the **cloud segment**, which only ever sees released (noised) data, so
  changing it is post-processing and leaves the (ε, δ) guarantee unchanged;
- with ``--bottleneck K``, the **linear encoder** on the edge (the PCA
  projection, now learned) that maps the cut tensor to the K coordinates that
  get clipped and noised. It is a deterministic function of the request's own
  input, applied before the clip, so the guarantee holds for it as for any edge
  segment; the sensitivity stays 2C because the clip comes after it.

Training is knowledge distillation from the fp32 model on the calibration
inputs (its soft outputs are the targets; no labels). Each step draws the noise
with :func:`shared.privacy.clip_and_noise`, the function the edge agent runs,
and rounds the result with the package's own quantizer
(:func:`shared.quant.quantize` / ``dequantize`` with the cut's recorded
parameters); gradients pass the clip as torch's and the noise and rounding
straight through. The wire codec is planned on noised activations (its range
must hold the noise, not only the signal), and the last quarter of the budget
trains with the final codec. The graph is run in torch by
:mod:`partitioner.onnx_torch` and the trained weights are written back into
the same ONNX graphs, which ONNX Runtime then checks against torch. The
adaptation is kept only when the measured utility on held-out samples (top-1
agreement with the fp32 model, mean of three noise draws, through the real
ONNX segments and codec) is not below the un-adapted one; the cut's manifest
entry records it under ``quality.adaptation``.

torch is imported inside the functions; CUDA is used when torch sees a GPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from splitinfer.partitioner.dp import PCA_SUFFIX, noise_batch, soften_bottleneck
from splitinfer.partitioner.onnx_torch import graph_module, segment_module
from splitinfer.partitioner.wirecodec import WirePlan, plan_wire
from splitinfer.shared.codecs import QuantParams, dequantize, quantize
from splitinfer.shared.errors import ConfigError, ModelError
from splitinfer.shared.manifest import PrivacySpec
from splitinfer.shared.ortsession import open_session
from splitinfer.shared.privacy import clip_and_noise

Feed = dict[str, np.ndarray]
Progress = Callable[[str], None]

#: Default ``--adapt-time`` (seconds): the digits case (six shortlisted cuts) stays under a minute.
DEFAULT_SECONDS = 30.0
#: Noise draws behind each utility figure.
DRAWS = 3
#: Fraction of each training budget spent with the final (noise-calibrated) codec.
FINAL_PHASE = 0.25
#: Where a learned encoder's codes start: this many times C, so the clip is active.
INIT_NORM = 2.0


@dataclass(frozen=True)
class AdaptOptions:
    """``--adapt-cloud`` and ``--adapt-time``: how the noise-aware fine-tune runs."""

    #: Wall-clock budget of the whole adaptation (all cuts), in seconds.
    seconds: float = DEFAULT_SECONDS
    #: torch device; None: "cuda" when torch sees a GPU, else "cpu".
    device: str | None = None
    seed: int = 0
    batch_size: int = 128
    lr: float = 3e-3
    #: Distillation temperature of the soft targets.
    temperature: float = 1.0
    #: Stop earlier than the budget after this many passes over the samples.
    max_epochs: int = 3000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ConfigError(f"--adapt-time {self.seconds:g}s: must be more than 0s")
        if self.batch_size < 1 or self.max_epochs < 1:
            raise ConfigError("adaptation batch size and epochs must be at least 1")
        if not (self.lr > 0 and self.temperature > 0):
            raise ConfigError("adaptation learning rate and temperature must be > 0")


@dataclass
class Adapted:
    """One cut after the fine-tune: segments, wire plan and the manifest record."""

    edge: onnx.ModelProto
    cloud: onnx.ModelProto
    #: None when the adaptation did not help: the cut keeps its segments and codec.
    wire: WirePlan | None
    record: dict[str, Any]

    @property
    def utility(self) -> float:
        return float(self.record["utility_after" if self.record["adapted"] else "utility_before"])


def torch_device(requested: str | None) -> str:
    import torch

    if requested is not None:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_model(
    model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], extra: Sequence[str] = ()
) -> Feed:

    probe = model
    if extra:
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        have = {o.name for o in probe.graph.output}
        for name in extra:
            if name not in have:
                probe.graph.output.append(
                    helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
                )
    sess = open_session(probe)
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name: feeds[i.name] for i in sess.get_inputs()}
    return dict(zip(names, sess.run(names, wanted), strict=True))


def _agreement(reference: np.ndarray, got: np.ndarray) -> float:
    return float(np.mean(reference.argmax(axis=1) == got.argmax(axis=1)))


def _round(arrays: Mapping[str, np.ndarray], quant: Mapping[str, QuantParams]) -> Feed:
    """What the cloud decodes: the package's int8 quantizer, both ways."""
    return {
        k: dequantize(quantize(a, quant[k]), quant[k]) if k in quant else a
        for k, a in arrays.items()
    }


def _params(wire: WirePlan) -> dict[str, QuantParams]:
    return {
        k: QuantParams(scale=q.scale, zero_point=q.zero_point, axis=q.axis or 0)
        for k, q in wire.quant.items()
    }


def measure(
    edge: onnx.ModelProto,
    cloud: onnx.ModelProto,
    crossing: Sequence[str],
    quant: Mapping[str, QuantParams],
    spec: PrivacySpec,
    feeds: Feed,
    reference: np.ndarray,
    out_name: str,
    seed: int,
    draws: int = DRAWS,
) -> float:
    """Top-1 agreement with ``reference`` through the real segments: edge, clip and
    noise, the cut's quantizer, cloud; mean of ``draws`` noise draws."""
    acts = run_model(edge, feeds)
    rng = np.random.default_rng(seed)
    scores = []
    for _ in range(draws):
        noised = noise_batch([acts[t] for t in crossing], spec, rng)
        moved = _round(dict(zip(crossing, noised, strict=True)), quant)
        scores.append(_agreement(reference, run_model(cloud, moved)[out_name]))
    return float(np.mean(scores))


class _Student:
    """Encoder tails (learned bottlenecks) and the cloud segment as torch modules."""

    def __init__(
        self, edge: onnx.ModelProto, cloud: onnx.ModelProto, crossing: Sequence[str], out_name: str
    ):
        self.crossing = list(crossing)
        self.out = [o.name for o in cloud.graph.output].index(out_name)
        self.tails: dict[str, Any] = {}
        self.sources: list[str] = []
        g = edge.graph
        for c in self.crossing:
            nodes = [n for n in g.node if n.name.startswith(c + "__")]
            if c.endswith(PCA_SUFFIX) and nodes:
                src = c[: -len(PCA_SUFFIX)]
                self.tails[c] = graph_module(nodes, list(g.initializer), [src], [c], "encoder")
                self.sources.append(src)
            else:
                self.sources.append(c)
        self.cloud = segment_module(cloud, "the cloud segment")

    def modules(self) -> list[Any]:
        return [*self.tails.values(), self.cloud]

    def to(self, device: str) -> None:
        for m in self.modules():
            m.to(device)

    def codes(self, src: Sequence[Any]) -> list[Any]:
        return [
            self.tails[c](s)[0] if c in self.tails else s
            for c, s in zip(self.crossing, src, strict=True)
        ]

    def write_back(
        self, edge: onnx.ModelProto, cloud: onnx.ModelProto
    ) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        for tail in self.tails.values():
            edge = tail.write_back(edge)
        return edge, self.cloud.write_back(cloud)


def _release(
    codes: Sequence[Any], spec: PrivacySpec, quant: Mapping[str, QuantParams], names: Sequence[str],
    rng: np.random.Generator,
) -> list[Any]:  # fmt: skip
    """The mechanism on a batch of codes, its values exactly the edge's, with gradients.

    The values come from :func:`clip_and_noise` (the edge's function) and the
    package's quantizer; the gradient is that of the clip (a rescale), passed
    straight through the noise and the rounding.
    """
    import torch

    batch = codes[0].shape[0]
    flat = torch.cat([c.reshape(batch, -1) for c in codes], dim=1)
    released = clip_and_noise(flat.detach().cpu().numpy(), spec.clip, spec.noise_multiplier, rng)
    norms = flat.norm(dim=1, keepdim=True).clamp_min(1e-30)
    clipped = flat * torch.clamp(spec.clip / norms, max=1.0)
    out, start = [], 0
    for name, c in zip(names, codes, strict=True):
        size = int(np.prod(c.shape[1:], dtype=np.int64))
        part = released[:, start : start + size].reshape(c.shape)
        if name in quant:
            part = dequantize(quantize(part, quant[name]), quant[name])
        value = torch.from_numpy(np.ascontiguousarray(part)).to(flat.device)
        grad = clipped[:, start : start + size].reshape(c.shape)
        out.append(grad + (value - grad).detach())
        start += size
    return out


def _train(
    student: _Student,
    sources: list[np.ndarray],
    targets: np.ndarray,
    spec: PrivacySpec,
    quant: Mapping[str, QuantParams],
    opts: AdaptOptions,
    seconds: float,
    device: str,
    rng: np.random.Generator,
    progress: Progress,
    what: str,
    lr_scale: float = 1.0,
) -> tuple[int, float]:
    """Distil for ``seconds`` (cosine learning rate over the budget); (steps, last loss)."""
    import torch

    params = [p for m in student.modules() for p in m.parameters()]
    optim = torch.optim.Adam(params, lr=opts.lr * lr_scale)
    src = [torch.from_numpy(np.ascontiguousarray(s, np.float32)).to(device) for s in sources]
    soft = torch.softmax(torch.from_numpy(targets.astype(np.float32)) / opts.temperature, dim=1)
    soft = soft.to(device)
    n = targets.shape[0]
    steps_per_epoch = max(1, math.ceil(n / opts.batch_size))
    total = opts.max_epochs * steps_per_epoch
    t0 = time.perf_counter()
    shown = t0
    steps, loss_avg = 0, float("nan")
    while steps < total:
        done = max((time.perf_counter() - t0) / seconds, steps / total)
        if done >= 1.0:
            break
        for group in optim.param_groups:
            group["lr"] = opts.lr * lr_scale * 0.5 * (1.0 + math.cos(math.pi * done))
        idx = rng.permutation(n)[: opts.batch_size]
        pick = torch.from_numpy(idx).to(device)
        codes = student.codes([s[pick] for s in src])
        moved = _release(codes, spec, quant, student.crossing, rng)
        logits = student.cloud(*moved)[student.out] / opts.temperature
        loss = -(soft[pick] * torch.log_softmax(logits, dim=1)).sum(dim=1).mean()
        optim.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optim.step()
        steps += 1
        value = float(loss.detach())
        loss_avg = value if steps == 1 else 0.98 * loss_avg + 0.02 * value
        now = time.perf_counter()
        if now - shown >= 2.0:
            shown = now
            progress(
                f"adapting cut {what}: {now - t0:.0f}/{seconds:.0f} s, step {steps}, "
                f"distillation loss {loss_avg:.3f}"
            )
    return steps, loss_avg


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(axis=1, keepdims=True))
    out: np.ndarray = z / z.sum(axis=1, keepdims=True)
    return out


def _init_encoders(
    student: _Student, sources: list[np.ndarray], teacher: np.ndarray, clip: float
) -> None:
    """Start each learned encoder from the fp32 model's answer, not from PCA.

    The projection starts as the least-squares prediction of the teacher's
    outputs from the cut tensor (its bias as their mean), so that the soft code
    (:func:`dp.soften_bottleneck`) starts as the teacher's probabilities minus
    1/K: a confident answer is a vertex of the regular simplex. A plain linear
    code (K other than the number of classes) keeps its PCA start. The codes are
    scaled to ``INIT_NORM`` x C so the clip is active from the first step, and
    the decoder starts as the least-squares inverse of the code.
    """
    import torch

    for c, src in zip(student.crossing, sources, strict=True):
        tail = student.tails.get(c)
        if tail is None:
            continue
        enc = {n[len(c) + 2 :]: i for n, i in tail.index.items()}
        dec = {n[len(c) + 2 :]: i for n, i in student.cloud.index.items() if n.startswith(c)}
        if {"wt", "mean"} - enc.keys() or {"w", "mean"} - dec.keys():
            continue
        x = src.reshape(src.shape[0], -1).astype(np.float64)
        mean = x.mean(axis=0)
        xc = x - mean
        w = tail.params[enc["wt"]].detach().numpy().astype(np.float64)
        soft = {"bias", "center", "scale"} <= enc.keys()
        if soft:
            ridge = 1e-3 * float((xc**2).sum()) / max(1, xc.shape[0])
            w = np.linalg.solve(xc.T @ xc + ridge * np.eye(xc.shape[1]), xc.T @ teacher)
            bias = teacher.mean(axis=0)
            k = w.shape[1]
            code = (_softmax(xc @ w + bias) - 1.0 / k) * INIT_NORM * clip / math.sqrt((k - 1) / k)
            scale = INIT_NORM * clip / math.sqrt((k - 1) / k)
        else:
            code = xc @ w
            median = float(np.median(np.linalg.norm(code, axis=1)))
            if not median > 0:
                continue
            w = w * INIT_NORM * clip / median
            code = xc @ w
        back = np.linalg.lstsq(code, xc, rcond=None)[0]

        def put(module: Any, i: int, value: np.ndarray) -> None:
            module.params[i].copy_(torch.from_numpy(np.asarray(value, np.float32)))

        with torch.no_grad():
            put(tail, enc["wt"], w)
            put(tail, enc["mean"], mean)
            if soft:
                put(tail, enc["bias"], bias)
                put(tail, enc["center"], np.full(w.shape[1], 1.0 / w.shape[1]))
                put(tail, enc["scale"], np.array([scale]))
            put(student.cloud, dec["w"], back)
            put(student.cloud, dec["mean"], mean)


@contextmanager
def _torch_threads(device: str) -> Iterator[None]:
    """One torch thread on the CPU while adapting: a small net, more threads only add contention."""
    import torch

    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def adapt_cut(
    edge: onnx.ModelProto,
    cloud: onnx.ModelProto,
    crossing: Sequence[str],
    spec: PrivacySpec,
    quant: Mapping[str, QuantParams],
    calib: Feed,
    teacher: np.ndarray,
    held: Feed,
    reference: np.ndarray,
    out_name: str,
    opts: AdaptOptions,
    seconds: float,
    progress: Progress,
    what: str,
    dictionary_file: str,
    bottleneck: int | None = None,
    fresh: bool = True,
) -> Adapted:
    """Fine-tune one cut's cloud segment (and learned encoder) for ``seconds``.

    ``calib``/``held`` are model inputs; ``teacher``/``reference`` the fp32
    model's ``out_name`` on them. ``quant`` is the cut's current wire quantizer.
    Returns the segments to package (the originals when adapting did not help).
    ``fresh``: the segments were not adapted before (a PCA bottleneck whose K is
    the number of classes becomes the soft simplex code, encoders are
    initialised); otherwise training continues from them.
    """
    import torch

    device = torch_device(opts.device)
    with _torch_threads(device):
        torch.manual_seed(opts.seed)
        rng = np.random.default_rng(opts.seed)
        before = measure(edge, cloud, crossing, quant, spec, held, reference, out_name, opts.seed)
        start = edge
        classes = teacher.shape[1] if teacher.ndim == 2 else 0
        soft = False
        for c in crossing:
            width = _width(edge, c)
            if fresh and c.endswith(PCA_SUFFIX) and classes > 1 and width == classes:
                start, soft = soften_bottleneck(start, c), True
        student = _Student(start, cloud, crossing, out_name)
        soft = soft or any(n.name.endswith("__softmax") for n in start.graph.node)
        calib_src = run_model(start, calib, student.sources)
        sources = [calib_src[s] for s in student.sources]
        if fresh:
            _init_encoders(student, sources, teacher, spec.clip)
        student.to(device)

        def noised_codes(n_rng: np.random.Generator) -> Feed:
            with torch.no_grad():
                src = [
                    torch.from_numpy(np.ascontiguousarray(s, np.float32)).to(device)
                    for s in sources
                ]
                codes = [c.cpu().numpy() for c in student.codes(src)]
            return dict(zip(crossing, noise_batch(codes, spec, n_rng), strict=True))

        def cloud_out(moved: Mapping[str, np.ndarray]) -> np.ndarray:
            with torch.no_grad():
                feeds = [
                    torch.from_numpy(np.ascontiguousarray(moved[c])).to(device) for c in crossing
                ]
                result: np.ndarray = student.cloud(*feeds)[student.out].cpu().numpy()
            return result

        t0 = time.perf_counter()
        first = _params(plan_wire(noised_codes(rng), dictionary_file=dictionary_file))
        steps, _ = _train(
            student, sources, teacher, spec, first, opts, seconds * (1 - FINAL_PHASE), device, rng,
            progress, what,
        )  # fmt: skip
        codes = noised_codes(rng)
        reference_out = cloud_out(codes)
        wire = plan_wire(
            codes,
            dictionary_file=dictionary_file,
            score=lambda rounded: _agreement(reference_out, cloud_out(rounded)),
        )
        final = _params(wire)
        left = max(0.0, seconds - (time.perf_counter() - t0))
        more, loss = _train(
            student, sources, teacher, spec, final, opts, max(left, 1e-3), device, rng, progress,
            what, lr_scale=0.3,
        )  # fmt: skip
        elapsed = time.perf_counter() - t0
        student.to("cpu")
        new_edge, new_cloud = student.write_back(start, cloud)
        _check_export(student, new_cloud, codes, crossing, what)
        after = measure(
            new_edge, new_cloud, crossing, final, spec, held, reference, out_name, opts.seed
        )
        kept = after >= before
        progress(
            f"adapted cut {what}: held-out agreement under noise {before:.3f} -> {after:.3f} "
            f"({steps + more} steps, {elapsed:.1f} s on {device})"
            + ("" if kept else "; kept the un-adapted segments")
        )
        record = {
            "adapted": kept,
            "method": "distillation from the fp32 model on noised activations",
            "segments": ["edge encoder", "cloud"] if student.tails else ["cloud"],
            "epsilon": spec.epsilon,
            "delta": spec.delta,
            "clip": spec.clip,
            "noise_multiplier": spec.noise_multiplier,
            "bottleneck": bottleneck if student.tails else None,
            "encoder": (
                ("learned soft simplex code" if soft else "learned linear")
                if student.tails
                else None
            ),
            "samples": int(teacher.shape[0]),
            "held_out_samples": int(reference.shape[0]),
            "noise_draws": DRAWS,
            "metric": "top1 agreement with the fp32 model under the mechanism",
            "utility_before": before,
            "utility_after": after,
            "steps": steps + more,
            "seconds": round(elapsed, 2),
            "device": device,
            "final_loss": loss,
        }
        if not kept:
            return Adapted(edge, cloud, None, record)
        return Adapted(new_edge, new_cloud, wire, record)


def _width(model: onnx.ModelProto, name: str) -> int | None:
    vi = next((o for o in model.graph.output if o.name == name), None)
    dims = [] if vi is None else vi.type.tensor_type.shape.dim
    return int(dims[1].dim_value) if len(dims) == 2 and dims[1].dim_value else None


def _check_export(
    student: _Student, cloud: onnx.ModelProto, codes: Feed, crossing: Sequence[str], what: str
) -> None:
    """The written-back ONNX cloud segment computes what the trained torch one does."""
    import torch

    sample = {c: codes[c][:64] for c in crossing}
    got = run_model(cloud, sample)[cloud.graph.output[student.out].name]
    with torch.no_grad():
        want = student.cloud(*[torch.from_numpy(sample[c]) for c in crossing])[student.out].numpy()
    tol = 1e-3 * (1.0 + float(np.abs(want).max()))
    if got.shape != want.shape or float(np.abs(got - want).max()) > tol:
        raise ModelError(
            f"cut {what}: the adapted cloud segment disagrees with its torch twin under "
            f"ONNX Runtime (max difference {float(np.abs(got - want).max()):.3g}); not packaged"
        )
