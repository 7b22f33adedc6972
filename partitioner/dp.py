"""Differential privacy at partition time: the mechanism's parameters, the
utility it leaves at each cut, and a training-free linear bottleneck.

The mechanism itself (clip to L2 norm C, Gaussian noise of std z·2C) lives in
``shared/privacy.py``; the edge runs it. Here the partitioner

- turns ``--epsilon/--delta/--clip`` into a :class:`PrivacySpec` (z from
  opacus's PRV accountant for one release),
- measures, on calibration samples, how much of the model's answer survives the
  noise at a given cut (:func:`utility`), so the auto choice can respect
  ``--max-accuracy-drop``,
- fits a PCA bottleneck on a cut's activations (:func:`fit_bottleneck`) and
  bakes it into the two segments (:func:`apply_bottleneck`): the edge projects
  to k dimensions before the noise, the cloud maps back. The noise then spreads
  over k coordinates instead of the tensor's full width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from splitinfer.shared.errors import ConfigError, CutError
from splitinfer.shared.manifest import PrivacySpec, TensorSpec
from splitinfer.shared.privacy import clip_and_noise, noise_multiplier_for

Feeds = Mapping[str, np.ndarray]
Runner = Callable[[Feeds], dict[str, np.ndarray]]

#: Suffix of the projected tensor that crosses the cut when a bottleneck is on.
PCA_SUFFIX = "__pca"


def privacy_spec(epsilon: float, delta: float, clip: float, accountant: str = "prv") -> PrivacySpec:
    """Validate the user's (epsilon, delta, C) and compute the noise multiplier."""
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise ConfigError(f"--epsilon {epsilon!r}: must be a finite number > 0")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ConfigError(f"--delta {delta!r}: must be in (0, 1), e.g. 1e-5")
    if not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip > 0):
        raise ConfigError(f"--clip {clip!r}: must be a finite number > 0 (an L2 norm bound)")
    if accountant not in {"prv", "rdp"}:
        raise ConfigError(f"accountant {accountant!r}: use 'prv' or 'rdp'")
    z = noise_multiplier_for(float(epsilon), float(delta), accountant)  # type: ignore[arg-type]
    return PrivacySpec(float(epsilon), float(delta), float(clip), z, accountant)


def check_private_cut(tensors: Sequence[TensorSpec]) -> None:
    """Only float tensors can be noised; a cut that ships ids or masks leaks them."""
    bad = [t.name for t in tensors if not t.dtype.startswith("float")]
    if bad:
        raise CutError(
            f"cut ships non-float tensor(s) {', '.join(bad)} that noise cannot protect; "
            "pick a cut after the layers that consume them"
        )


def noise_batch(
    arrays: Sequence[np.ndarray], spec: PrivacySpec, rng: np.random.Generator
) -> list[np.ndarray]:
    """Clip and noise one batch of cut tensors as one vector per sample.

    Several tensors crossing a cut are one release: they are flattened and
    concatenated per sample, clipped to ``spec.clip`` together and noised.
    """
    if not arrays:
        return []
    batch = arrays[0].shape[0]
    flat = np.concatenate([a.reshape(batch, -1).astype(np.float32) for a in arrays], axis=1)
    noised = clip_and_noise(flat, spec.clip, spec.noise_multiplier, rng)
    out, start = [], 0
    for a in arrays:
        size = int(np.prod(a.shape[1:], dtype=np.int64))
        out.append(noised[:, start : start + size].reshape(a.shape))
        start += size
    return out


def utility(
    edge: Runner,
    cloud: Runner,
    samples: Sequence[Feeds],
    crossing: Sequence[str],
    spec: PrivacySpec | None,
    reference: Sequence[np.ndarray],
    rng: np.random.Generator,
    labels: Sequence[int] | None = None,
) -> float:
    """Top-1 accuracy of the split model under the mechanism.

    ``reference`` holds the fp32 model's first output per sample. Against
    ``labels`` when given (real accuracy), else against the reference's top-1
    (agreement: the accuracy a user loses, without needing labels).
    """
    hits = 0
    for i, feeds in enumerate(samples):
        acts = edge(feeds)
        moved = [acts[n] for n in crossing]
        if spec is not None:
            moved = noise_batch(moved, spec, rng)
        out = cloud(dict(zip(crossing, moved, strict=True)))
        got = int(np.argmax(next(iter(out.values())).reshape(-1)))
        want = labels[i] if labels is not None else int(np.argmax(reference[i].reshape(-1)))
        hits += int(got == want)
    return hits / max(1, len(samples))


@dataclass(frozen=True)
class Bottleneck:
    """A PCA projection of one cut tensor: ``y = (x - mean) @ components.T``."""

    tensor: str
    sample_shape: tuple[int, ...]
    mean: np.ndarray  # [d]
    components: np.ndarray  # [k, d], orthonormal rows
    explained: float  # fraction of the calibration variance kept

    @property
    def dims(self) -> int:
        return int(self.components.shape[0])

    @property
    def projected(self) -> str:
        return self.tensor + PCA_SUFFIX


def fit_bottleneck(tensor: str, activations: np.ndarray, k: int) -> Bottleneck:
    """Fit a k-dimensional PCA on calibration activations ``[n, ...]``."""
    if activations.ndim < 2 or activations.shape[0] < 2:
        raise ConfigError(f"bottleneck on {tensor!r}: need at least 2 calibration samples")
    n = activations.shape[0]
    x = activations.reshape(n, -1).astype(np.float64)
    d = x.shape[1]
    if not 1 <= k <= min(n, d):
        raise ConfigError(
            f"--bottleneck {k}: must be between 1 and min(samples, width) = {min(n, d)} "
            f"for {tensor!r}"
        )
    mean = x.mean(axis=0)
    _, s, vt = np.linalg.svd(x - mean, full_matrices=False)
    energy = float((s**2).sum())
    explained = float((s[:k] ** 2).sum() / energy) if energy > 0 else 1.0
    return Bottleneck(
        tensor,
        tuple(int(v) for v in activations.shape[1:]),
        mean.astype(np.float32),
        vt[:k].astype(np.float32),
        explained,
    )


def apply_bottleneck(
    edge: onnx.ModelProto, cloud: onnx.ModelProto, bn: Bottleneck
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """Bake the projection into the segments: the edge gives ``<tensor>__pca``
    ``[batch, k]`` in place of ``<tensor>``, the cloud takes it and maps back."""
    edge, cloud = _copy(edge), _copy(cloud)
    t, p = bn.tensor, bn.projected
    names = [o.name for o in edge.graph.output]
    if t not in names or t not in [i.name for i in cloud.graph.input]:
        raise CutError(f"bottleneck: {t!r} is not a tensor crossing this cut")
    batch = _batch_dim(next(o for o in edge.graph.output if o.name == t))
    g = edge.graph
    g.initializer.extend(
        [
            numpy_helper.from_array(bn.mean, f"{p}__mean"),
            numpy_helper.from_array(np.ascontiguousarray(bn.components.T), f"{p}__wt"),
        ]
    )
    g.node.extend(
        [
            helper.make_node("Flatten", [t], [f"{p}__flat"], axis=1, name=f"{p}__flatten"),
            helper.make_node("Sub", [f"{p}__flat", f"{p}__mean"], [f"{p}__c"], name=f"{p}__sub"),
            helper.make_node("MatMul", [f"{p}__c", f"{p}__wt"], [p], name=f"{p}__project"),
        ]
    )
    out = _vi(p, [batch, bn.dims])
    i = names.index(t)
    g.output.remove(g.output[i])
    g.output.insert(i, out)

    c = cloud.graph
    j = [x.name for x in c.input].index(t)
    c.input.remove(c.input[j])
    c.input.insert(j, _vi(p, [batch, bn.dims]))
    shape = np.array([-1, *bn.sample_shape], dtype=np.int64)
    c.initializer.extend(
        [
            numpy_helper.from_array(bn.components, f"{p}__w"),
            numpy_helper.from_array(bn.mean, f"{p}__mean"),
            numpy_helper.from_array(shape, f"{p}__shape"),
        ]
    )
    restore = [
        helper.make_node("MatMul", [p, f"{p}__w"], [f"{p}__r"], name=f"{p}__restore"),
        helper.make_node("Add", [f"{p}__r", f"{p}__mean"], [f"{p}__rm"], name=f"{p}__add"),
        helper.make_node("Reshape", [f"{p}__rm", f"{p}__shape"], [t], name=f"{p}__reshape"),
    ]
    nodes = list(c.node)
    del c.node[:]
    c.node.extend(restore + nodes)
    onnx.checker.check_model(edge)
    onnx.checker.check_model(cloud)
    return edge, cloud


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _batch_dim(vi: onnx.ValueInfoProto) -> int | str:
    dims = vi.type.tensor_type.shape.dim
    if dims and dims[0].dim_param:
        return str(dims[0].dim_param)
    if dims and dims[0].dim_value:
        return int(dims[0].dim_value)
    return "batch"


def _vi(name: str, shape: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)


def soften_bottleneck(edge: onnx.ModelProto, projected: str) -> onnx.ModelProto:
    """Turn the edge's PCA projection ``projected`` into a learnable soft code.

    After the projection ``z`` (``[batch, k]``) come ``softmax(z + bias)``, minus
    ``center``, times ``scale``: a confident input then lands on one vertex of a
    regular simplex, the code that tolerates the most noise at a given clip
    (``partitioner.adapt`` trains all of it). The tensor that crosses the cut
    keeps its name and shape, so the cloud segment is unchanged. Initial values:
    bias 0, center 1/k, scale 1.
    """
    edge = _copy(edge)
    g = edge.graph
    node = next((n for n in g.node if n.output and n.output[0] == projected), None)
    if node is None:
        raise CutError(f"soft code: the edge segment does not compute {projected!r}")
    k = next(_dims(o)[1] for o in g.output if o.name == projected)
    p = projected
    node.output[0] = f"{p}__z"
    g.initializer.extend(
        [
            numpy_helper.from_array(np.zeros(k, np.float32), f"{p}__bias"),
            numpy_helper.from_array(np.full(k, 1.0 / k, np.float32), f"{p}__center"),
            numpy_helper.from_array(np.ones(1, np.float32), f"{p}__scale"),
        ]
    )
    g.node.extend(
        [
            helper.make_node("Add", [f"{p}__z", f"{p}__bias"], [f"{p}__a"], name=f"{p}__addbias"),
            helper.make_node("Softmax", [f"{p}__a"], [f"{p}__s"], axis=1, name=f"{p}__softmax"),
            helper.make_node("Sub", [f"{p}__s", f"{p}__center"], [f"{p}__sc"], name=f"{p}__ctr"),
            helper.make_node("Mul", [f"{p}__sc", f"{p}__scale"], [p], name=f"{p}__scale"),
        ]
    )
    onnx.checker.check_model(edge)
    return edge


def _dims(vi: onnx.ValueInfoProto) -> list[int]:
    return [int(d.dim_value) for d in vi.type.tensor_type.shape.dim]
