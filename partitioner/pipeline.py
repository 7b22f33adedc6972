"""The partition pipeline: load, optimize, analyse, enumerate, write a package."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from splitinfer import __version__
from splitinfer.partitioner.analysis import GraphAnalysis, analyse
from splitinfer.partitioner.cuts import DEFAULT_MAX_CUTS, CutPlan, CutSpace
from splitinfer.partitioner.loader import LoadedModel, dims_of, load_model, sha256_file
from splitinfer.partitioner.passes import DEFAULT_PIPELINE, PassReport, optimize
from splitinfer.partitioner.segments import cloud_model, edge_model
from splitinfer.shared.errors import PackageError
from splitinfer.shared.manifest import MANIFEST_NAME, Cut, Manifest, Segment, TensorSpec, is_package

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
    progress(f"optimizing ({', '.join(passes) or 'no passes'})")
    optimized, reports = optimize(source.model, passes)
    progress("analysing shapes with ONNX Runtime")
    analysis = analyse(optimized, input_shapes or {})
    space = CutSpace(analysis, max_cuts=max_cuts)
    return Prepared(source, optimized, reports, analysis, space)


def _spec(analysis: GraphAnalysis, name: str) -> TensorSpec:
    info = analysis.tensors[name]
    if info.batched:
        sym = info.symbolic
        tail: list[int | str] = list(info.sample_shape)
        if sym is not None and len(sym) == len(tail) + 1:
            tail = [d if d is not None else "?" for d in sym[1:]]
        return TensorSpec(name, info.dtype, (analysis.batch_symbol or "batch", *tail))
    return TensorSpec(name, info.dtype, tuple(info.sample_shape))


def _io_spec(vi: onnx.ValueInfoProto) -> TensorSpec:
    elem = vi.type.tensor_type.elem_type
    dtype = str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem)))
    dims = tuple(d if d is not None else "?" for d in dims_of(vi))
    return TensorSpec(vi.name, dtype, dims)


def build_manifest(
    prepared: Prepared, plan: CutPlan, precision: str, files: dict[str, tuple[str, Path]]
) -> Manifest:
    a = prepared.analysis
    inputs = {vi.name: vi for vi in a.model.graph.input}
    outputs = {vi.name: vi for vi in a.model.graph.output}
    segments = {}
    for role, (fname, path) in files.items():
        model = onnx.load(str(path), load_external_data=False)
        segments[role] = Segment(
            file=fname,
            sha256=sha256_file(path),
            inputs=tuple(vi.name for vi in model.graph.input),
            outputs=tuple(vi.name for vi in model.graph.output),
            nodes=len(model.graph.node),
        )
    opset = next((o.version for o in a.model.opset_import if o.domain in {"", "ai.onnx"}), 0)
    return Manifest(
        model_name=prepared.source.path.stem,
        source_sha256=prepared.source.sha256,
        opset=int(opset),
        batch_dim=a.batch_symbol,
        precision={"edge": precision, "cloud": precision},
        inputs=tuple(_io_spec(inputs[n]) for n in a.inputs),
        outputs=tuple(_io_spec(outputs[n]) for n in a.outputs),
        cut=Cut(
            id=plan.id,
            kind=plan.kind,
            tensors=tuple(_spec(a, n) for n in plan.crossing),
            rematerialized=plan.remat,
            bytes_per_sample=plan.bytes_per_sample,
            edge_flops=plan.edge_flops,
            cloud_flops=plan.cloud_flops,
        ),
        segments=segments,
        analysis_shapes=dict(a.sample_input_shapes),
        optimization={
            "passes": [r.name for r in prepared.passes],
            "nodes_before": prepared.nodes_before,
            "nodes_after": prepared.nodes_after,
        },
        tool_version=__version__,
    )


def write_package(
    prepared: Prepared,
    plan: CutPlan,
    out_dir: Path,
    *,
    precision: str = "fp32",
    progress: Progress = _quiet,
) -> Manifest:
    """Write ``edge.onnx``, ``cloud.onnx`` and ``manifest.json`` into ``out_dir``.

    Everything is written to a temporary folder beside ``out_dir`` and renamed
    into place, so a failure leaves no half-written package. An existing
    ``out_dir`` is replaced only if it is empty or a split package.
    """
    out_dir = out_dir.resolve()
    if out_dir.exists():
        if not out_dir.is_dir():
            raise PackageError(f"{out_dir}: exists and is not a folder")
        if any(out_dir.iterdir()) and not is_package(out_dir):
            raise PackageError(
                f"{out_dir}: exists and is not a split package; refusing to overwrite it"
            )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        progress(f"extracting segments for cut {plan.id}")
        files = {}
        for role, model in (
            ("edge", edge_model(prepared.analysis, plan)),
            ("cloud", cloud_model(prepared.analysis, plan)),
        ):
            onnx.checker.check_model(model)
            path = tmp / f"{role}.onnx"
            onnx.save(model, str(path))
            files[role] = (path.name, path)
        manifest = build_manifest(prepared, plan, precision, files)
        (tmp / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"wrote {out_dir}")
    return manifest


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
