"""A package proves itself before it is written: every cut against the source model.

``partition`` runs the source model (as loaded, before any pass) and the
segments of every packaged cut, edge then cloud joined by tensor name, on the
same sample inputs: at batch 1 and 3 at the analysis shapes, and at batch 2 at
the second size analysis found for each free dimension (a sequence length, an
image's H or W). A cut whose outputs differ from the source's in name, shape or
dtype, or, for fp32 segments, in value beyond ``1e-5 * max(1, |ref|)``, stops
the package with a :class:`PackageError` naming the cut, the output and the
inputs. Segments that are not fp32 (an INT8 edge, a PCA bottleneck) are checked
for shape and dtype, and their cut's fp32 reference segments for value.

A size the source model itself cannot run at is skipped: the source defines
what a package must do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from splitinfer.partitioner.analysis import GraphAnalysis
from splitinfer.partitioner.cuts import CutPlan
from splitinfer.partitioner.loader import dims_of, graph_inputs
from splitinfer.partitioner.segments import cloud_model, edge_model
from splitinfer.shared.errors import PackageError
from splitinfer.shared.ortsession import open_session

Array = np.ndarray[Any, Any]
Feeds = dict[str, Array]

#: The float tolerance of an fp32 cut: |got - ref| <= RTOL * max(1, |ref|), elementwise.
RTOL = 1e-5


@dataclass(frozen=True)
class Candidate:
    """One cut as packaged: its plan, segments, and whether they are fp32 as planned."""

    plan: CutPlan
    edge: onnx.ModelProto | None
    cloud: onnx.ModelProto | None
    exact: bool  # fp32 segments of the plan: compare values too
    what: str = "packaged segments"


def sample_feeds(source: onnx.ModelProto, analysis: GraphAnalysis) -> list[tuple[str, Feeds]]:
    """Sample inputs, labelled: two batch sizes, and a second size of each free dimension."""
    inputs = graph_inputs(source)
    base = analysis.sample_input_shapes
    batched = analysis.batch_symbol is not None
    sizes: list[tuple[int | None, dict[str, list[int]]]] = []
    for b in (1, 3) if batched else (None,):
        sizes.append((b, base))
    for fd in analysis.free_dims:
        if fd.alt is None:
            continue
        shapes = {k: list(v) for k, v in base.items()}
        for name, axis in fd.axes:
            shapes[name][axis - 1] = fd.alt
        sizes.append((2 if batched else None, shapes))
    out: list[tuple[str, Feeds]] = []
    for i, (batch, shapes) in enumerate(sizes):
        rng = np.random.default_rng(i)
        feeds: Feeds = {}
        for vi in inputs:
            dims = dims_of(vi)
            shape: list[int] = []
            if dims:
                lead = dims[0] if isinstance(dims[0], int) else batch or 1
                shape = [lead, *shapes.get(vi.name, [])]
            feeds[vi.name] = _random(vi, shape, rng)
        label = ", ".join(f"{k}={'x'.join(map(str, v.shape)) or '()'}" for k, v in feeds.items())
        out.append((label, feeds))
    return out


def _random(vi: onnx.ValueInfoProto, shape: list[int], rng: np.random.Generator) -> Array:
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    # token ids, masks, indices: 0 and 1 are valid for all; no all-zero row
    values = rng.integers(0, 2, shape).astype(dtype)
    if values.ndim >= 2:
        values[:, 0] = 1
    return values


def _session(model: onnx.ModelProto | str) -> Any:
    # a few runs each: no arena, give the memory back
    return open_session(model, log_severity=4, arena=False)


def _run(sess: Any, feeds: Feeds) -> Feeds:
    import onnxruntime as ort

    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name: feeds[i.name] for i in sess.get_inputs()}
    opts = ort.RunOptions()
    opts.log_severity_level = 4
    return dict(zip(names, sess.run(names, wanted, opts), strict=True))


def _run_per_sample(sess: Any, feeds: Feeds, analysis: GraphAnalysis) -> Feeds:
    """``feeds`` one sample at a time, the answers joined along each output's batch axis."""
    batched = [n for n in feeds if analysis.tensors[n].batched]
    rows = len(feeds[batched[0]]) if batched else 1
    parts = [
        _run(sess, {**feeds, **{n: feeds[n][i : i + 1] for n in batched}}) for i in range(rows)
    ]
    out: Feeds = {}
    for name in parts[0]:
        dims = analysis.tensors[name].symbolic or []
        axis = dims.index(analysis.batch_symbol) if analysis.batch_symbol in dims else 0
        out[name] = np.concatenate([p[name] for p in parts], axis=axis)
    return out


def verify(
    source: onnx.ModelProto,
    analysis: GraphAnalysis,
    candidates: Sequence[Candidate],
    progress: Callable[[str], None] = lambda _: None,
    source_path: str | None = None,
    per_sample: bool = False,
) -> int:
    """Check every candidate against ``source`` (read from ``source_path`` when given,
    which keeps external weights mapped, not copied); returns the compositions run.

    ``per_sample``: the source file declares batch 1 and the partitioner freed it
    (:mod:`.batch`); a batch the file cannot run at is checked against the source's
    answers to each sample at batch 1, joined along each output's batch axis."""
    samples = sample_feeds(source, analysis)
    src = _session(source_path or source)
    refs: list[tuple[str, Feeds, Feeds]] = []
    for label, feeds in samples:
        try:
            refs.append((label, feeds, _run(src, feeds)))
        except Exception:  # ORT's own exception types: the source cannot run there
            if not per_sample:
                continue
            try:
                refs.append((label, feeds, _run_per_sample(src, feeds, analysis)))
            except Exception:
                continue
    del src
    runs = 0
    edge = cloud = None
    for cand in candidates:
        edge = cloud = None  # one cut's sessions at a time
        progress(
            f"verifying cut {cand.plan.id} ({cand.what}) against the source model "
            f"at {len(refs)} input sizes"
        )
        edge = None if cand.edge is None else _session(cand.edge)
        cloud = None if cand.cloud is None else _session(cand.cloud)
        for label, feeds, want in refs:
            try:
                mid = feeds if edge is None else {**feeds, **_run(edge, feeds)}
                got = mid if cloud is None else _run(cloud, mid)
            except Exception as exc:  # ORT's own exception types
                text = str(exc).strip().splitlines()
                raise PackageError(
                    f"cut {cand.plan.id} fails where the source model runs ({label}): "
                    f"{text[0] if text else type(exc).__name__}"
                ) from exc
            _compare(cand, label, {k: got[k] for k in want if k in got}, want)
            runs += 1
    return runs


def _compare(cand: Candidate, label: str, got: Feeds, want: Feeds) -> None:
    cut = cand.plan.id
    for name, ref in want.items():
        if name not in got:
            raise PackageError(f"cut {cut}: output {name!r} is missing ({label})")
        out = np.asarray(got[name])
        if out.shape != ref.shape:
            raise PackageError(
                f"cut {cut}: output {name!r} has shape {out.shape} where the source model "
                f"returns {ref.shape} ({label})"
            )
        if out.dtype != ref.dtype:
            raise PackageError(
                f"cut {cut}: output {name!r} is {out.dtype} where the source model returns "
                f"{ref.dtype} ({label})"
            )
        if not cand.exact:
            continue
        if out.dtype.kind != "f":
            if not np.array_equal(out, ref):
                raise PackageError(
                    f"cut {cut}: output {name!r} differs from the source model's ({label})"
                )
            continue
        ref64 = ref.astype(np.float64)
        err = np.abs(out.astype(np.float64) - ref64)
        same_nan = np.isnan(out) & np.isnan(ref)
        excess = np.where(same_nan, 0.0, err - RTOL * np.maximum(1.0, np.abs(ref64)))
        worst = float(np.nanmax(np.where(np.isnan(excess), np.inf, excess))) if excess.size else 0
        if worst > 0:
            raise PackageError(
                f"cut {cut}: output {name!r} differs from the source model's by up to "
                f"{float(np.nanmax(np.where(same_nan, 0, err))):.3g} "
                f"(tolerance {RTOL:g} x max(1, |ref|)) ({label})"
            )


def candidates_for(
    analysis: GraphAnalysis,
    plan: CutPlan,
    edge: onnx.ModelProto | None,
    cloud: onnx.ModelProto | None,
    exact: bool,
) -> list[Candidate]:
    """The packaged segments of a cut; when they are not its fp32 segments, those too."""
    out = [Candidate(plan, edge, cloud, exact)]
    if not exact:
        ref_edge = None if plan.kind == "none" else edge_model(analysis, plan)
        ref_cloud = None if plan.kind == "all" else cloud_model(analysis, plan)
        out.append(Candidate(plan, ref_edge, ref_cloud, True, "fp32 reference segments"))
    return out
