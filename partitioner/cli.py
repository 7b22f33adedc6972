"""``partition``: list the cuts of an ONNX model or write a split package.

    partition MODEL.onnx --list-cuts [--json]
    partition MODEL.onnx --split CUT -o DIR
    partition MODEL.onnx --split auto -o DIR [--edge-profile P] [--uplink 5mbit] ...

CUT is an id from the table (``c3``), ``none`` (all cloud), ``all`` (all edge),
comma-separated tensor names, or ``auto``: the cost model picks it (see
``partitioner/auto.py``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitinfer.partitioner.cuts import CutPlan
from splitinfer.partitioner.loader import parse_input_shapes
from splitinfer.partitioner.pipeline import (
    CutArtifacts,
    PackageExtras,
    Prepared,
    Progress,
    artifacts_for,
    io_spec,
    prepare,
    stderr_progress,
    write_package,
)
from splitinfer.partitioner.request import PartitionRequest, build_parser
from splitinfer.shared.cli import run_cli
from splitinfer.shared.costs import Constraints
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.links import Link, parse_duration, parse_rate

if TYPE_CHECKING:
    from splitinfer.partitioner.auto import AutoOptions, AutoResult
    from splitinfer.partitioner.wirecodec import InputCodec
    from splitinfer.shared.manifest import Manifest
    from splitinfer.shared.preprocess import PreprocessSpec

__all__ = [
    "LIST_CUTS_SCHEMA",
    "Listing",
    "Written",
    "build_parser",
    "cut_rows",
    "format_costs",
    "format_table",
    "list_cuts_document",
    "main",
    "run",
]

#: Version of the ``--list-cuts --json`` object; bumped when a field changes meaning.
LIST_CUTS_FORMAT = 1
#: Its JSON Schema (draft 2020-12).
LIST_CUTS_SCHEMA = Path(__file__).with_name("list_cuts.schema.json")
#: Rooflines the --list-cuts min-cuts are priced with unless --edge/--cloud-profile say.
LIST_EDGE_PROFILE = "raspberry-pi-5"
LIST_CLOUD_PROFILE = "l4"


def cut_rows(
    prepared: Prepared,
    plans: Sequence[CutPlan] | None = None,
    why: Mapping[str, str] | None = None,
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for plan in prepared.space.plans() if plans is None else plans:
        row: dict[str, object] = {
            "id": plan.id,
            "kind": plan.kind,
            "tensors": list(plan.crossing),
            "bytes_per_sample": plan.bytes_per_sample,
            "edge_flops": plan.edge_flops,
            "cloud_flops": plan.cloud_flops,
            "edge_nodes": len(plan.edge_nodes),
            "cloud_nodes": len(plan.cloud_nodes),
        }
        if why is not None:
            row["why"] = why.get(plan.id, "")
        rows.append(row)
    return rows


def format_table(
    prepared: Prepared,
    plans: list[CutPlan],
    mark: str | None = None,
    *,
    why: Mapping[str, str] | None = None,
    total: str | None = None,
) -> str:
    width = min(max([6, *(len(p.id) for p in plans)]), 16)  # longer ids push the row
    lines = [
        f"model: {prepared.source.path.name}  nodes: {prepared.nodes_before} -> "
        f"{prepared.nodes_after} after optimization ("
        + ", ".join(f"{r.name}: {r.nodes_before}->{r.nodes_after}" for r in prepared.passes)
        + f")  units: {len(prepared.space.units)}  valid cuts: {total or len(plans)}",
        f"{'':2}{'cut':>{width}} {'bytes/sample':>13} {'edge MFLOPs':>12} {'cloud MFLOPs':>13}  "
        + ("tensors" if why is None else "tensors  [why listed]"),
    ]
    for plan in plans:
        names = ", ".join(plan.crossing)
        if len(names) > 60:
            names = names[:57] + "..."
        flag = "*" if plan.id == mark else ""
        reason = f"  [{why.get(plan.id, '')}]" if why is not None else ""
        lines.append(
            f"{flag:2}{plan.id:>{width}} {plan.bytes_per_sample:>13,} "
            f"{plan.edge_flops / 1e6:>12.2f} {plan.cloud_flops / 1e6:>13.2f}  {names}{reason}"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Listing:
    """What ``--list-cuts`` found: the CLI prints it, :func:`splitinfer.list_cuts` returns it."""

    prepared: Prepared
    plans: list[CutPlan]
    #: Past ``--max-cuts``: why each listed cut is worth a look (None: every cut is listed).
    why: Mapping[str, str] | None
    #: How many valid cuts there are (a lower bound when not ``exact``).
    count: int
    exact: bool
    #: The line under the table past ``--max-cuts`` (None: every cut is listed).
    note: str | None
    #: The table's "valid cuts:" text past ``--max-cuts``.
    total: str | None

    def document(self) -> dict[str, Any]:
        """The ``--list-cuts --json`` object."""
        return list_cuts_document(
            self.prepared, self.plans, self.why, count=self.count, exact=self.exact, note=self.note
        )

    def text(self) -> str:
        """The ``--list-cuts`` table and the notes under it."""
        lines = [format_table(self.prepared, self.plans, why=self.why, total=self.total)]
        if self.note is not None:
            lines.append(self.note)
        if self.prepared.nonstandard_ops:
            lines.append(nonstandard_note(self.prepared.nonstandard_ops))
        return "\n".join(lines)


@dataclass(frozen=True)
class Written:
    """A package ``--split`` wrote: what the CLI prints and :func:`splitinfer.partition`
    returns. ``auto`` is the cost model's answer with ``--split auto`` (None for a fixed cut)."""

    output: Path
    manifest: Manifest
    summary: str
    auto: AutoResult | None = None


def _list_cuts(req: PartitionRequest, prepared: Prepared, progress: Progress) -> Listing:
    """Every cut when there are at most --max-cuts; else the ones a person would consider."""
    progress("enumerating cuts")
    space = prepared.space
    plans = space.exhaustive()
    why: Mapping[str, str] | None = None
    note: str | None = None
    if plans is not None:
        count, exact, total = len(plans), True, None
    else:
        from splitinfer.partitioner.costmodel import DEFAULT_CODEC_RATIO
        from splitinfer.partitioner.cutsearch import list_candidates

        progress(f"more than {space.max_cuts} cuts (--max-cuts): counting them, then min-cuts")
        count, exact = space.count()
        edge = req.edge_profile or LIST_EDGE_PROFILE
        cloud = req.cloud_profile or LIST_CLOUD_PROFILE
        plans, why, found = list_candidates(space, edge, cloud, DEFAULT_CODEC_RATIO)
        shown = f"{count:,}" if exact else f"at least {count:,}"
        how = "counted, not listed" if exact else "a lower bound, too many to count"
        total = f"{shown} ({how})"
        note = (
            f"{shown} cuts in all ({how}: the down-sets of the unit order in which no tensor "
            "that cannot cross would cross; a rare one may still fail to plan), more than "
            f"--max-cuts {space.max_cuts}; showing {len(plans)}: all cloud, all edge, the "
            f"single-tensor cuts, the latency min-cuts at {found.points} uplink rates "
            f"(rooflines of {edge} and {cloud}, float tensors / {DEFAULT_CODEC_RATIO:g} on the "
            "wire) and the fewest-bytes cut per depth band"
        )
    return Listing(prepared, plans, why, count, exact, note, total)


def nonstandard_note(ops: Sequence[str]) -> str:
    """The one line ``--list-cuts`` prints when the source holds non-standard ops."""
    return (
        f"note: the source holds non-standard ops {', '.join(ops)}: a segment holding them "
        "runs on ONNX Runtime, not TensorRT"
    )


def list_cuts_document(
    prepared: Prepared,
    plans: Sequence[CutPlan],
    why: Mapping[str, str] | None,
    *,
    count: int,
    exact: bool,
    note: str | None,
) -> dict[str, Any]:
    """``--list-cuts --json``: one object, whether every cut is listed or not.

    Its JSON Schema is ``list_cuts.schema.json`` beside this module (:data:`LIST_CUTS_SCHEMA`).
    """
    return {
        "format": LIST_CUTS_FORMAT,
        "model": prepared.source.path.name,
        "valid_cuts": count,
        "exact": exact,
        "max_cuts": prepared.space.max_cuts,
        "listed": len(plans),
        "note": note,
        "optimization": {
            "nodes_before": prepared.nodes_before,
            "nodes_after": prepared.nodes_after,
            "units": len(prepared.space.units),
            "passes": [
                {"name": r.name, "nodes_before": r.nodes_before, "nodes_after": r.nodes_after}
                for r in prepared.passes
            ],
        },
        "nonstandard_ops": list(prepared.nonstandard_ops),
        "cuts": cut_rows(prepared, plans, why),
    }


def _main(argv: Sequence[str] | None) -> int:
    req = PartitionRequest.from_argv(argv)
    progress = (lambda _m: None) if req.quiet else stderr_progress
    done = run(req, progress)
    if isinstance(done, Written):
        print(done.summary)
    elif req.json:
        print(json.dumps(done.document(), indent=2))
    else:
        print(done.text())
    return 0


def run(req: PartitionRequest, progress: Progress) -> Listing | Written:
    """Do what a checked request asks, printing nothing (the CLI and the Python API both
    call it): the cuts with ``--list-cuts``, else the package written."""
    shapes = parse_input_shapes(list(req.input_shape))
    prepared = prepare(
        req.model, shapes, passes=req.passes, max_cuts=req.max_cuts, progress=progress
    )
    if req.list_cuts:
        return _list_cuts(req, prepared, progress)
    preprocessing = _preprocessing(req.preprocess, prepared)
    input_codec = _input_codec(req, prepared)  # refused early on inputs that are not images
    if req.auto:
        return _auto(req, prepared, preprocessing, progress)
    return _fixed(req, prepared, preprocessing, input_codec, progress)


def _fixed(
    req: PartitionRequest,
    prepared: Prepared,
    preprocessing: dict[str, PreprocessSpec],
    input_codec: InputCodec | None,
    progress: Progress,
) -> Written:
    """``--split CUT``: that cut, at ``--precision`` (int8 in ``--edge-profile``'s recipe)."""
    assert req.split is not None
    assert req.output is not None
    plan = prepared.space.find(req.split)
    art = artifacts_for(prepared, plan)
    if input_codec is not None:
        if plan.kind != "none":
            raise ConfigError(
                f"--input-codec applies to the cloud-only cut; cut {plan.id} is {plan.kind!r}: "
                "use it with --split none or --split auto"
            )
        _plan_inputs(req, prepared, preprocessing, art, input_codec)
    precision = req.edge_precision
    if precision != "fp32" and art.edge is not None:
        from splitinfer.partitioner.auto import AutoOptions
        from splitinfer.partitioner.automeasure import convert

        opts = AutoOptions(
            link=Link.fixed(1e6, 1e6),
            precision=precision,
            edge_profile=req.edge_profile,  # the INT8 recipe, as --split auto picks it
            calibration_method=req.calibration_method,
        )
        samples = _calibration(req, prepared, preprocessing)
        art.edge = convert(art.edge, opts, samples)
        art.edge_precision = precision
    extras = PackageExtras(
        fallback=prepared.optimized if req.edge_fallback else None,
        preprocessing=preprocessing,
    )
    manifest = write_package(prepared, [art], req.output, extras=extras, progress=progress)
    cut = manifest.cut
    sides = ", ".join(
        f"{seg.file} {seg.nodes} nodes" for seg in (cut.edge, cut.cloud) if seg is not None
    )
    summary = (
        f"cut {plan.id} ({plan.kind}): {len(plan.crossing)} tensor(s), "
        f"{plan.bytes_per_sample:,} bytes/sample; edge {plan.edge_flops / 1e6:.2f} MFLOPs, "
        f"cloud {plan.cloud_flops / 1e6:.2f} MFLOPs -> {req.output} "
        f"({sides})"
    )
    return Written(req.output, manifest, summary)


def _input_codec(req: PartitionRequest, prepared: Prepared) -> InputCodec | None:
    """``--input-codec`` parsed, and refused early on a model whose inputs are not images."""
    from splitinfer.partitioner.pipeline import tensor_spec
    from splitinfer.partitioner.wirecodec import InputCodec, check_image_inputs

    if req.input_codec is None:
        return None
    choice = InputCodec.parse(req.input_codec)
    none = prepared.space.find("none")
    check_image_inputs(choice, [tensor_spec(prepared.analysis, t) for t in none.crossing])
    return choice


def _plan_inputs(
    req: PartitionRequest,
    prepared: Prepared,
    preprocessing: dict[str, PreprocessSpec],
    art: CutArtifacts,
    choice: InputCodec,
) -> None:
    """The cloud-only cut's codec from the calibration samples, scored by the whole model."""
    import numpy as np

    from splitinfer.partitioner.agreement import output_agreement, output_metric
    from splitinfer.partitioner.automeasure import run as _run
    from splitinfer.partitioner.wirecodec import plan_wire

    assert art.cloud is not None
    cloud = art.cloud
    samples = _calibration(req, prepared, preprocessing)
    feeds = {k: np.concatenate([s[k] for s in samples]) for k in samples[0]}
    out_name = prepared.analysis.outputs[0]
    ref = _run(cloud, feeds, optimize=True)[out_name]
    metric = output_metric(ref)

    def score(rounded: Mapping[str, Any]) -> float:
        got = _run(cloud, {**feeds, **rounded}, optimize=True)[out_name]
        return output_agreement(metric, ref, got)

    name = f"codec/{art.plan.id}.zdict"
    acts = {t: feeds[t] for t in art.plan.crossing}
    wire = plan_wire(acts, dictionary_file=name, score=score, input_codec=choice)
    art.codec, art.quant = wire.codec, wire.quant
    if wire.dictionary is not None:
        art.files[name] = wire.dictionary
    art.quality["wire"] = wire.summary()


def _warn(message: str) -> None:
    print(f"partition: warning: {message}", file=sys.stderr, flush=True)


def _calibration(
    req: PartitionRequest, prepared: Prepared, preprocessing: dict[str, PreprocessSpec]
) -> list[dict[str, Any]]:
    from splitinfer.partitioner.calibration import load_calibration, synthetic_calibration
    from splitinfer.partitioner.pipeline import synthetic_shapes

    a = prepared.analysis
    inputs = [io_spec(vi) for vi in a.model.graph.input if vi.name in a.inputs]
    if req.calibration is not None:
        return load_calibration(
            req.calibration, inputs, a.batch_symbol, preprocessing=preprocessing
        )
    _warn("no --calibration folder: calibrating on SYNTHETIC random inputs")
    shapes = synthetic_shapes(a)
    return synthetic_calibration(inputs, 64, 0, shapes)


def _preprocessing(text: str | None, prepared: Prepared) -> dict[str, PreprocessSpec]:
    """``--preprocess``, checked against the model's inputs (empty when not given)."""
    from splitinfer.shared.preprocess import parse_option

    if text is None:
        return {}
    a = prepared.analysis
    return parse_option(text, [io_spec(vi) for vi in a.model.graph.input if vi.name in a.inputs])


def _options(req: PartitionRequest, preprocessing: dict[str, PreprocessSpec]) -> AutoOptions:
    from splitinfer.partitioner.auto import AutoOptions
    from splitinfer.partitioner.dp import privacy_spec
    from splitinfer.partitioner.wirecodec import InputCodec

    if req.trace is not None:
        link = Link.from_trace(
            req.trace,
            rtt_s=parse_duration(req.rtt, "--rtt"),
            downlink_bps=parse_rate(req.downlink, "--downlink"),
        )
    else:
        link = Link.fixed(req.uplink, req.downlink, req.rtt)
    privacy = None
    if req.epsilon is not None and req.clip is not None:
        privacy = privacy_spec(req.epsilon, req.delta, req.clip)
    constraints = Constraints(
        edge_memory_bytes=req.edge_memory_bytes,
        max_latency_s=parse_duration(req.max_latency, "--max-latency") if req.max_latency else None,
        max_accuracy_drop=req.max_accuracy_drop,
    )
    return AutoOptions(
        link=link,
        edge_profile=req.edge_profile,
        cloud_profile=req.cloud_profile,
        objective=req.objective,
        constraints=constraints,
        precision=req.edge_precision,
        calibration=req.calibration,
        calibration_method=req.calibration_method,
        min_agreement=req.min_agreement,
        candidates=req.candidates,
        privacy=privacy,
        bottleneck=req.bottleneck,
        adapt=_adapt_options(req),
        input_codec=InputCodec.parse(req.input_codec or "auto"),
        preprocessing=preprocessing,
    )


def _adapt_options(req: PartitionRequest) -> Any:
    """``--adapt-cloud`` / ``--adapt-time`` as ``AdaptOptions`` (None when off)."""
    if not req.adapt_cloud:
        return None
    from splitinfer.partitioner.adapt import DEFAULT_SECONDS, AdaptOptions

    seconds = DEFAULT_SECONDS if req.adapt_seconds is None else req.adapt_seconds
    return AdaptOptions(seconds=seconds)


def _check_stackable(prepared: Prepared) -> None:
    """``--split auto`` measures on samples stacked along the batch axis: refuse, in one
    line, a model with an input that is not batched along its first axis (an RNN state
    ``[2, 1, 128]`` beside a batched input); fixed cuts still partition it."""
    a = prepared.analysis
    ranked = [n for n in a.inputs if a.tensors[n].dims]

    def leads(name: str) -> bool:  # batched along axis 0 (at a fixed batch: its size)
        info = a.tensors[name]
        if a.batch_symbol is not None:
            return info.batched
        return info.dims[0][0] == prepared.batch.size or prepared.batch.size is None

    batched = [n for n in ranked if leads(n)]
    for name in ranked:
        info = a.tensors[name]
        if batched and not leads(name):
            shape = "x".join(map(str, info.sample_shape))
            raise ConfigError(
                f"--split auto: input {name!r} ({shape}) is not batched along its first axis "
                f"as {batched[0]!r} is (a recurrent state?): the cut choice measures stacked "
                "samples; partition it at a fixed cut (--split CUT, see --list-cuts)"
            )


def _auto(
    req: PartitionRequest,
    prepared: Prepared,
    preprocessing: dict[str, PreprocessSpec],
    progress: Progress,
) -> Written:
    from splitinfer.partitioner.auto import auto_split

    assert req.output is not None
    _check_stackable(prepared)
    opts = _options(req, preprocessing)
    result = auto_split(prepared, opts, progress, _warn)
    extras = result.extras
    if req.edge_fallback:
        extras.fallback = prepared.optimized
    manifest = write_package(
        prepared, result.artifacts, req.output, extras=extras, progress=progress
    )
    lines = [format_costs(result.table, limit=12), f"cut search: {result.search}"]
    c = result.chosen
    others = [x.plan.id for x in result.artifacts[1:]]
    lines.append(
        f"chose {c.cut_id} ({c.kind}) for {opts.link.describe()} by {opts.objective}: "
        f"edge {c.edge_s * 1e3:.2f} ms, {c.up_bytes:,} B up, cloud {c.cloud_s * 1e3:.2f} ms"
        + (f"; run-time candidates {', '.join(others)}" if others else "")
        + f" -> {req.output} ({len(manifest.cuts)} cut(s))"
    )
    if req.report is not None:
        from splitinfer.partitioner.report import draw_report

        draw_report(
            result.table,
            c.cut_id,
            req.report,
            f"{prepared.source.path.name} at {opts.link.describe()}",
        )
        lines.append(f"report: {req.report}")
    return Written(req.output, manifest, "\n".join(lines), result)


def format_costs(rows: list[dict[str, Any]], limit: int = 12) -> str:
    """The candidate table: predicted milliseconds per side, bytes up, chosen cut marked."""
    ordered = sorted(rows, key=lambda r: r["total_ms"])[:limit]
    lines = [
        f"{'':2}{'cut':>6} {'edge ms':>9} {'transfer ms':>12} {'cloud ms':>9} "
        f"{'total ms':>9} {'bytes up':>10}"
    ]
    for r in ordered:
        flag = "*" if r.get("chosen") else ""
        lines.append(
            f"{flag:2}{r['cut']:>6} {r['edge_ms']:>9.2f} {r['transfer_ms']:>12.2f} "
            f"{r['cloud_ms']:>9.2f} {r['total_ms']:>9.2f} {r['up_bytes']:>10,}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("partition", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
