"""The partition pipeline: load, optimize, analyse, enumerate, write a package."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from splitinfer import __version__
from splitinfer.partitioner.analysis import GraphAnalysis, analyse
from splitinfer.partitioner.batch import BatchAxis, forget_declared_shapes, free_batch
from splitinfer.partitioner.cuts import DEFAULT_MAX_CUTS, CutPlan, CutSpace
from splitinfer.partitioner.loader import LoadedModel, dims_of, load_model, sha256_file
from splitinfer.partitioner.passes import (
    DEFAULT_PIPELINE,
    PassReport,
    nonstandard_ops,
    optimize,
)
from splitinfer.partitioner.segments import cloud_model, edge_model
from splitinfer.partitioner.verify import candidates_for, verify
from splitinfer.shared.errors import PackageError
from splitinfer.shared.manifest import (
    MANIFEST_NAME,
    CodecSpec,
    Cut,
    Manifest,
    PrivacySpec,
    QuantSpec,
    Segment,
    TensorSpec,
    is_package,
    resolve_file,
)
from splitinfer.shared.preprocess import PreprocessSpec

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass
class Prepared:
    source: LoadedModel
    optimized: onnx.ModelProto
    passes: list[PassReport]
    analysis: GraphAnalysis
    space: CutSpace
    #: Ops outside the default ONNX domain that the source model already holds
    #: (``domain::op_type``, sorted): they pass through untouched, and a segment that
    #: holds one needs ONNX Runtime (TensorRT has no kernel for them).
    nonstandard_ops: tuple[str, ...] = ()
    #: The batch axis: declared free, freed from a declared 1, or fixed (see :mod:`.batch`).
    batch: BatchAxis = field(default_factory=lambda: BatchAxis("symbolic"))

    @property
    def nodes_before(self) -> int:
        return len(self.source.model.graph.node)

    @property
    def nodes_after(self) -> int:
        return len(self.optimized.graph.node)


def prepare(
    model_path: Path,
    input_shapes: dict[str, list[int]] | None = None,
    *,
    passes: tuple[str, ...] = DEFAULT_PIPELINE,
    max_cuts: int = DEFAULT_MAX_CUTS,
    progress: Progress = _quiet,
) -> Prepared:
    progress(f"loading {model_path}")
    source = load_model(model_path)
    forget_declared_shapes(source.model)
    batch = free_batch(source.model, input_shapes or {})
    if batch.note is not None:
        progress(f"note: {batch.note}")
    progress(f"optimizing ({', '.join(passes) or 'no passes'})")
    optimized, reports = optimize(source.model, passes)
    progress("analysing shapes with ONNX Runtime")
    analysis = analyse(optimized, input_shapes or {})
    for fd in analysis.free_dims:
        if fd.alt is None:
            progress(
                f"note: the model runs at no second size of {fd.symbol} (analysed at "
                f"{fd.size}); the segments are fixed to that size"
            )
    space = CutSpace(analysis, max_cuts=max_cuts)
    ops = nonstandard_ops(optimized)  # the source's: a pass that adds one is refused
    return Prepared(source, optimized, reports, analysis, space, nonstandard_ops=ops, batch=batch)


def synthetic_shapes(analysis: GraphAnalysis) -> dict[str, tuple[int, ...]]:
    """Each input's shape for one synthetic sample: batch 1 in front of a batched input's
    analysis shape; an input that is not batched (an RNN state ``[2, 1, 128]`` fixed
    whole) at its own shape."""
    out: dict[str, tuple[int, ...]] = {}
    for name, per_sample in analysis.sample_input_shapes.items():
        info = analysis.tensors[name]
        out[name] = (1, *per_sample) if info.batched else tuple(info.sample_shape)
    return out


def tensor_spec(analysis: GraphAnalysis, name: str) -> TensorSpec:
    """The manifest spec of a tensor as the analysis runs showed it.

    The batch and the free input dimensions keep their symbols; a size that varies
    with no input dimension gets a symbol of its own (``NAME_dimK``), fixed sizes
    stay numbers. Never the shape the source model declares.
    """
    info = analysis.tensors[name]
    dims = info.symbolic
    if dims is None:
        lead = (analysis.batch_symbol or "batch",) if info.batched else ()
        dims = [*lead, *info.sample_shape]
    return TensorSpec(
        name, info.dtype, tuple(f"{name}_dim{k}" if d is None else d for k, d in enumerate(dims))
    )


def io_spec(vi: onnx.ValueInfoProto) -> TensorSpec:
    """The manifest spec of a graph input or output."""
    elem = vi.type.tensor_type.elem_type
    dtype = str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem)))
    dims = tuple(d if d is not None else "?" for d in dims_of(vi))
    return TensorSpec(vi.name, dtype, dims)


@dataclass
class CutArtifacts:
    """One cut as it goes into a package: the plan, its two segments and extras.

    ``edge``/``cloud`` default to the fp32 segments of the plan; the auto
    split replaces ``edge`` with its INT8 version and fills the rest.
    """

    plan: CutPlan
    edge: onnx.ModelProto | None = None
    cloud: onnx.ModelProto | None = None
    edge_precision: str = "fp32"
    cloud_precision: str = "fp32"
    codec: CodecSpec = field(default_factory=CodecSpec)
    quant: dict[str, QuantSpec] = field(default_factory=dict)
    predicted: dict[str, Any] = field(default_factory=dict)
    quality: dict[str, Any] = field(default_factory=dict)
    #: The crossing tensors when a segment rewrite changed them (e.g. a bottleneck).
    tensors: tuple[TensorSpec, ...] | None = None
    #: Extra files of this cut (package-relative name -> bytes), e.g. its zstd dictionary.
    files: dict[str, bytes] = field(default_factory=dict)


def artifacts_for(prepared: Prepared, plan: CutPlan) -> CutArtifacts:
    """The fp32 segments of a plan; a cut with no work on a side has no segment there."""
    a = prepared.analysis
    return CutArtifacts(
        plan=plan,
        edge=None if plan.kind == "none" else edge_model(a, plan),
        cloud=None if plan.kind == "all" else cloud_model(a, plan),
    )


@dataclass
class PackageExtras:
    """Package-wide parts beside the cuts."""

    fallback: onnx.ModelProto | None = None
    fallback_precision: str = "fp32"
    privacy: PrivacySpec | None = None
    planning: dict[str, Any] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)  # extra files, e.g. a zstd dictionary
    #: Declared picture-to-input preprocessing by input name (``--preprocess``).
    preprocessing: dict[str, PreprocessSpec] = field(default_factory=dict)


def _segment(path: Path, root: Path, precision: str) -> Segment:
    model = onnx.load(str(path), load_external_data=False)
    return Segment(
        file=path.relative_to(root).as_posix(),
        sha256=sha256_file(path),
        inputs=tuple(vi.name for vi in model.graph.input),
        outputs=tuple(vi.name for vi in model.graph.output),
        nodes=len(model.graph.node),
        precision=precision,
        nonstandard_ops=nonstandard_ops(model),
    )


def _cut_entry(prepared: Prepared, art: CutArtifacts, root: Path, folder: Path) -> Cut:
    a = prepared.analysis
    plan = art.plan
    segs: dict[str, Segment | None] = {"edge": None, "cloud": None}
    for role, model, precision in (
        ("edge", art.edge, art.edge_precision),
        ("cloud", art.cloud, art.cloud_precision),
    ):
        if model is None:
            continue
        onnx.checker.check_model(model)
        path = folder / f"{role}.onnx"
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(path))
        segs[role] = _segment(path, root, precision)
    tensors = art.tensors or tuple(tensor_spec(a, n) for n in plan.crossing)
    return Cut(
        id=plan.id,
        kind=plan.kind,
        tensors=tensors,
        rematerialized=plan.remat,
        bytes_per_sample=plan.bytes_per_sample,
        edge_flops=plan.edge_flops,
        cloud_flops=plan.cloud_flops,
        edge=segs["edge"],
        cloud=segs["cloud"],
        codec=art.codec,
        quant=dict(art.quant),
        predicted=dict(art.predicted),
        quality=dict(art.quality),
        sample_shapes={
            t.name: tuple(a.tensors[t.name].sample_shape) for t in tensors if t.name in a.tensors
        },
    )


def build_manifest(
    prepared: Prepared,
    cuts: list[Cut],
    default_cut: str,
    fallback: Segment | None,
    extras: PackageExtras,
) -> Manifest:
    a = prepared.analysis
    inputs = {vi.name: vi for vi in a.model.graph.input}
    opset = next((o.version for o in a.model.opset_import if o.domain in {"", "ai.onnx"}), 0)
    return Manifest(
        model_name=prepared.source.path.stem,
        source_sha256=prepared.source.sha256,
        opset=int(opset),
        batch_dim=a.batch_symbol,
        inputs=tuple(io_spec(inputs[n]) for n in a.inputs),
        outputs=tuple(tensor_spec(a, n) for n in a.outputs),
        default_cut=default_cut,
        cuts=tuple(cuts),
        fallback=fallback,
        privacy=extras.privacy,
        planning=dict(extras.planning),
        analysis_shapes=dict(a.sample_input_shapes),
        optimization={
            "passes": [r.name for r in prepared.passes],
            "nodes_before": prepared.nodes_before,
            "nodes_after": prepared.nodes_after,
            # declared free, freed from a declared 1, or fixed (served one request per run)
            "batch": prepared.batch.to_json(),
        },
        preprocessing=dict(extras.preprocessing),
        tool_version=__version__,
    )


def write_package(
    prepared: Prepared,
    cuts: CutPlan | Sequence[CutPlan | CutArtifacts],
    out_dir: Path,
    *,
    extras: PackageExtras | None = None,
    progress: Progress = _quiet,
    check: bool = True,
) -> Manifest:
    """Write the segments of every cut and ``manifest.json`` into ``out_dir``.

    The first cut is the default: its segments are ``edge.onnx`` and
    ``cloud.onnx`` at the top; other candidates go to ``candidates/<id>/``.
    Everything is written to a temporary folder beside ``out_dir`` and renamed
    into place, so a failure leaves no half-written package. An existing
    ``out_dir`` is replaced only if it is empty or a split package. Before the
    rename every cut is run against the source model (:mod:`.verify`, skipped
    with ``check=False``); a cut that answers differently stops the package.
    """
    extras = extras or PackageExtras()
    items = [cuts] if isinstance(cuts, CutPlan) else list(cuts)
    if not items:
        raise PackageError("a package needs at least one cut")
    arts = [artifacts_for(prepared, c) if isinstance(c, CutPlan) else c for c in items]
    out_dir = out_dir.resolve()
    if out_dir.exists():
        if not out_dir.is_dir():
            raise PackageError(f"{out_dir}: exists and is not a folder")
        if any(out_dir.iterdir()) and not is_package(out_dir):
            raise PackageError(
                f"{out_dir}: exists and is not a split package; refusing to overwrite it"
            )
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    except OSError as exc:
        raise PackageError(f"{out_dir}: cannot write there ({exc.strerror or exc})") from None
    try:
        entries = []
        for i, art in enumerate(arts):
            progress(f"extracting segments for cut {art.plan.id}")
            folder = tmp if i == 0 else tmp / "candidates" / art.plan.id
            entries.append(_cut_entry(prepared, art, tmp, folder))
        fallback = None
        if extras.fallback is not None:
            onnx.checker.check_model(extras.fallback)
            onnx.save(extras.fallback, str(tmp / "full.onnx"))
            fallback = _segment(tmp / "full.onnx", tmp, extras.fallback_precision)
        extra_files = dict(extras.files)
        for art in arts:
            extra_files.update(art.files)
        for name, data in extra_files.items():
            path = resolve_file(tmp, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        if check:
            verify_arts(prepared, arts, progress)
        manifest = build_manifest(prepared, entries, arts[0].plan.id, fallback, extras)
        (tmp / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"wrote {out_dir}")
    return manifest


def verify_arts(
    prepared: Prepared, arts: Sequence[CutArtifacts], progress: Progress = _quiet
) -> None:
    """Run every cut against the source model; a PackageError names the first that differs."""
    cands = []
    for art in arts:
        exact = art.tensors is None and art.edge_precision == art.cloud_precision == "fp32"
        cands.extend(candidates_for(prepared.analysis, art.plan, art.edge, art.cloud, exact))
    source = prepared.source
    verify(
        source.model,
        prepared.analysis,
        cands,
        progress,
        source_path=str(source.path),
        per_sample=prepared.batch.mode == "freed",
    )


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)


def stderr_progress(message: str) -> None:
    print(f"partition: {message}", file=sys.stderr, flush=True)
