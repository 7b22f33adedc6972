"""fp32 vs int8 agreement of an edge segment, measured on held-out samples.

The metric follows the segment's first output: top-1 for classifiers
(``[batch, classes]``), cosine for other float tensors (embeddings, cut
feature maps), max absolute error otherwise. When the int8 model falls short,
:func:`worst_layers` names the intermediate tensors where the error grows,
by comparing same-named tensors of both models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from splitinfer.partitioner.batch import RowSession
from splitinfer.shared.errors import ConfigError, ModelError
from splitinfer.shared.ortsession import open_session

Array = npt.NDArray[Any]
Feed = dict[str, Array]

METRICS = ("top1", "cosine", "max_abs")
KERNELS = ("int8", "reference")
#: How many hold-out samples the per-layer comparison of :func:`agreement` runs.
LAYER_SAMPLES = 32
WORST_LAYERS = 5


@dataclass(frozen=True)
class Agreement:
    """How closely the int8 model follows the fp32 one on held-out samples.

    ``metric``: ``top1`` (fraction of rows with the same argmax), ``cosine``
    (mean per-row cosine similarity) or ``max_abs`` (largest absolute
    difference; lower is better). ``worst_layers``: intermediate tensors with
    the largest relative L2 error ``|int8 - fp32| / |fp32|``, worst first.
    """

    metric: str
    value: float
    samples: int
    worst_layers: tuple[tuple[str, float], ...] = ()

    @property
    def higher_is_better(self) -> bool:
        return self.metric != "max_abs"

    def to_dict(self) -> dict[str, Any]:
        """The manifest's record of the measurement."""
        return {
            "metric": self.metric,
            "value": self.value,
            "samples": self.samples,
            "worst_layers": [[name, err] for name, err in self.worst_layers],
        }


def _session(model: onnx.ModelProto, optimize: bool) -> Any:
    return RowSession(open_session(model, optimize="all" if optimize else "none"))


def _run_all(model: onnx.ModelProto, samples: Sequence[Feed], optimize: bool) -> list[list[Array]]:
    sess = _session(model, optimize)
    wanted = [i.name for i in sess.get_inputs()]
    return [sess.run(None, {n: feed[n] for n in wanted}) for feed in samples]


def pick_metric(output: Array) -> str:
    """``top1`` for ``[batch, classes>1]`` floats, ``cosine`` for other float rank >= 2,
    else ``max_abs``."""
    if output.dtype.kind != "f":
        return "max_abs"
    if output.ndim == 2 and output.shape[1] > 1:
        return "top1"
    if output.ndim >= 2:
        return "cosine"
    return "max_abs"


def output_metric(reference: Array) -> str:
    """The metric whole-model outputs are compared with when cuts and wire codecs are
    ranked: ``exact`` for integer or boolean outputs (class ids, decoded tokens: a
    near miss is a wrong answer), ``top1`` for float ``[batch, classes>1]``, else
    ``cosine``."""
    if reference.dtype.kind in "iub":
        return "exact"
    return "top1" if reference.ndim == 2 and reference.shape[1] > 1 else "cosine"


def output_agreement(metric: str, reference: Array, got: Array) -> float:
    """The score ``partition`` ranks cuts and wire codecs by (see :func:`output_metric`):
    the share of samples whose output is identical (``exact``), top-1 agreement of
    ``got`` with ``reference``, or their mean per-sample cosine similarity (a sample
    whose norms multiply to 0 counts as agreeing)."""
    if metric == "exact":
        rows = reference.shape[0] if reference.ndim else 1
        same = reference.reshape(rows, -1) == got.reshape(rows, -1)
        return float(np.mean(same.all(axis=1)))
    if metric == "top1":
        return float(np.mean(reference.argmax(axis=1) == got.argmax(axis=1)))
    r = reference.reshape(reference.shape[0], -1).astype(np.float64)
    g = got.reshape(got.shape[0], -1).astype(np.float64)
    den = np.linalg.norm(r, axis=1) * np.linalg.norm(g, axis=1)
    cos = np.where(den > 0, (r * g).sum(axis=1) / np.maximum(den, 1e-300), 1.0)
    return float(np.mean(cos))


def _score(metric: str, ref: Array, got: Array) -> tuple[float, int]:
    if metric == "max_abs":
        diff = np.abs(ref.astype(np.float64) - got.astype(np.float64))
        return (float(diff.max()) if diff.size else 0.0), int(ref.shape[0]) if ref.ndim else 1
    if ref.ndim < 2:
        raise ConfigError(f"metric {metric} needs an output of rank >= 2, got shape {ref.shape}")
    rows = ref.shape[0]
    a = ref.reshape(rows, -1).astype(np.float64)
    b = got.reshape(rows, -1).astype(np.float64)
    if metric == "top1":
        return float(np.mean(a.argmax(1) == b.argmax(1))), rows
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    dot = np.sum(a * b, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where((na == 0) & (nb == 0), 1.0, dot / (na * nb))
    return float(np.mean(np.nan_to_num(cos, nan=0.0))), rows


def agreement(
    fp32: onnx.ModelProto,
    int8: onnx.ModelProto,
    samples: Sequence[Feed],
    metric: str = "auto",
    kernels: str = "int8",
) -> Agreement:
    """Compare the first output of ``fp32`` and ``int8`` over ``samples`` (held-out feeds).

    ``metric="auto"`` picks :func:`pick_metric` of the fp32 output. ``kernels``:
    ``int8`` runs the int8 model as ONNX Runtime CPU deploys it (all graph
    optimizations, so QDQ groups become integer kernels of this CPU);
    ``reference`` runs it unoptimized, i.e. float math on dequantized values,
    the exact-accumulation result a TensorRT engine approximates. The per-layer
    ranking always uses the reference path on at most ``LAYER_SAMPLES`` samples.
    """
    if metric != "auto" and metric not in METRICS:
        raise ConfigError(f"agreement metric {metric!r} is not one of auto, {', '.join(METRICS)}")
    if kernels not in KERNELS:
        raise ConfigError(f"kernels {kernels!r} is not one of {', '.join(KERNELS)}")
    if not samples:
        raise ConfigError("no hold-out samples to measure int8 agreement on")
    ref_runs = _run_all(fp32, samples, optimize=True)
    got_runs = _run_all(int8, samples, optimize=kernels == "int8")
    ref = np.concatenate([np.atleast_1d(r[0]) for r in ref_runs], axis=0)
    got = np.concatenate([np.atleast_1d(r[0]) for r in got_runs], axis=0)
    if ref.shape != got.shape:
        raise ModelError(f"int8 output shape {got.shape} differs from fp32 {ref.shape}")
    chosen = pick_metric(ref) if metric == "auto" else metric
    value, count = _score(chosen, ref, got)
    worst = worst_layers(fp32, int8, samples[:LAYER_SAMPLES])
    return Agreement(chosen, value, count, worst)


def _float_tensors(model: onnx.ModelProto) -> dict[str, int]:
    """Node outputs with a float element type (from shape inference), name → elem type."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types: dict[str, int] = {}
    for vi in (*inferred.graph.value_info, *inferred.graph.output):
        elem = vi.type.tensor_type.elem_type
        if elem in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE):
            types[vi.name] = elem
    produced = {o for n in model.graph.node for o in n.output}
    return {k: v for k, v in types.items() if k in produced}


def _dequantized_view(model: onnx.ModelProto) -> dict[str, str]:
    """For each tensor fed to a QuantizeLinear → DequantizeLinear pair, the DQ output.

    That is the value downstream consumers of the int8 model really see (for
    u8s8 it includes the ReLU the quantizer folded into the zero point).
    """
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    view: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear":
            continue
        dq = [c for c in consumers.get(node.output[0], []) if c.op_type == "DequantizeLinear"]
        if dq:
            view[node.input[0]] = dq[0].output[0]
    return view


def _expose(model: onnx.ModelProto, names: dict[str, int]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    present = {o.name for o in out.graph.output}
    for name, elem in names.items():
        if name not in present:
            out.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
    return out


def worst_layers(
    fp32: onnx.ModelProto, int8: onnx.ModelProto, samples: Sequence[Feed], top: int = WORST_LAYERS
) -> tuple[tuple[str, float], ...]:
    """The ``top`` intermediate tensors (by fp32 name) with the largest relative L2 error.

    Tensors are matched by name; in the int8 model a tensor that is quantized is
    read after its QuantizeLinear → DequantizeLinear pair. Both models run
    unoptimized so that every tensor exists as named.
    """
    if not samples:
        return ()
    ref_types = _float_tensors(fp32)
    int8_types = _float_tensors(int8)
    view = _dequantized_view(int8)
    pairs = {
        name: view.get(name, name)
        for name in ref_types
        if name in int8_types and view.get(name, name) in int8_types
    }
    if not pairs:
        return ()
    ref_model = _expose(fp32, {n: ref_types[n] for n in pairs})
    got_model = _expose(int8, {v: int8_types[v] for v in pairs.values()})
    ref_sess, got_sess = _session(ref_model, False), _session(got_model, False)
    ref_names, got_names = list(pairs), [pairs[n] for n in pairs]
    num = dict.fromkeys(pairs, 0.0)
    den = dict.fromkeys(pairs, 0.0)
    in_names = [i.name for i in ref_sess.get_inputs()]
    for feed in samples:
        ref_vals = ref_sess.run(ref_names, {n: feed[n] for n in in_names})
        got_vals = got_sess.run(got_names, {n: feed[n] for n in in_names})
        for name, a, b in zip(ref_names, ref_vals, got_vals, strict=True):
            if a.shape != b.shape:
                continue
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            num[name] += float(np.sum((a64 - b64) ** 2))
            den[name] += float(np.sum(a64**2))
    errors = [(name, float(np.sqrt(num[name]) / max(np.sqrt(den[name]), 1e-12))) for name in pairs]
    errors.sort(key=lambda item: item[1], reverse=True)
    return tuple((name, round(err, 6)) for name, err in errors[:top])


def check_agreement(a: Agreement, minimum: float) -> None:
    """Raise :class:`ModelError` when ``a`` misses ``minimum``.

    For ``top1`` and ``cosine`` the value must be at least ``minimum``; for
    ``max_abs`` (lower is better) ``minimum`` is the largest error allowed.
    """
    ok = a.value >= minimum if a.higher_is_better else a.value <= minimum
    if ok:
        return
    relation = "<" if a.higher_is_better else ">"
    bound = "minimum" if a.higher_is_better else "maximum"
    layers = ", ".join(f"{name} ({err:.3g})" for name, err in a.worst_layers) or "none found"
    raise ModelError(
        f"int8 edge segment agreement too low: {a.metric} = {a.value:.4g} {relation} "
        f"{bound} {minimum:g} on {a.samples} held-out samples; worst layers by relative "
        f"error: {layers}; calibrate with more representative samples (--calibration), "
        "try another calibration method, or use --precision fp16"
    )
