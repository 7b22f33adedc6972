"""``partition``: list the cuts of an ONNX model or write a split package.

    partition MODEL.onnx --list-cuts [--json]
    partition MODEL.onnx --split CUT -o DIR
    partition MODEL.onnx --split auto -o DIR [--edge-profile P] [--uplink 5mbit] ...

CUT is an id from the table (``c3``), ``none`` (all cloud), ``all`` (all edge),
comma-separated tensor names, or ``auto``: the cost model picks it (see
``partitioner/auto.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitinfer import __version__
from splitinfer.partitioner.cuts import DEFAULT_MAX_CUTS, CutPlan
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
from splitinfer.shared.cli import ArgumentParser, run_cli
from splitinfer.shared.costs import OBJECTIVES, Constraints
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.links import Link, parse_duration, parse_rate
from splitinfer.shared.manifest import PRECISIONS

if TYPE_CHECKING:
    from splitinfer.partitioner.auto import AutoOptions
    from splitinfer.partitioner.wirecodec import InputCodec
    from splitinfer.shared.preprocess import PreprocessSpec

#: Rooflines the --list-cuts min-cuts are priced with unless --edge/--cloud-profile say.
LIST_EDGE_PROFILE = "raspberry-pi-5"
LIST_CLOUD_PROFILE = "l4"
_SIZE = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20}
_SIZE["gib"] = 2**30


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="partition",
        description="Optimize an ONNX model and cut it into an edge and a cloud segment.",
    )
    p.add_argument("model", type=Path, help="the ONNX model (.onnx)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--list-cuts",
        action="store_true",
        help="print every valid cut (past --max-cuts: how many there are, and the ones "
        "worth a look)",
    )
    mode.add_argument(
        "--split",
        metavar="CUT",
        help="cut id from --list-cuts, 'none' (all cloud), 'all' (all edge) or tensor names",
    )
    p.add_argument("-o", "--output", type=Path, help="output folder of the split package")
    p.add_argument("--json", action="store_true", help="with --list-cuts: print JSON")
    p.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="NAME=DxDx...",
        help="fix an input's free dimensions for analysis (repeatable); the leading "
        "dimension is the batch, which stays free in the written segments",
    )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="edge segment precision (default: int8 with --split auto, else fp32); "
        "int8 is QDQ ONNX that ONNX Runtime runs and TensorRT builds its engine from",
    )
    auto = p.add_argument_group("--split auto: the cost model and its inputs")
    auto.add_argument(
        "--edge-profile",
        metavar="NAME|FILE",
        help="built-in device profile "
        "or a measured profile JSON (default: measure on this machine)",
    )
    auto.add_argument("--cloud-profile", metavar="NAME|FILE", help="likewise for the cloud")
    auto.add_argument("--uplink", default="5mbit", help="uplink rate (default 5mbit)")
    auto.add_argument("--downlink", default="20mbit", help="downlink rate (default 20mbit)")
    auto.add_argument("--rtt", default="50ms", help="round-trip time (default 50ms)")
    auto.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help="Mahimahi uplink trace: plan on its capacity distribution",
    )
    auto.add_argument("--objective", choices=OBJECTIVES, default="latency")
    auto.add_argument("--edge-memory", metavar="SIZE", help="edge memory budget, e.g. 512MB")
    auto.add_argument("--max-latency", metavar="DURATION", help="p95 latency bound, e.g. 80ms")
    auto.add_argument(
        "--max-accuracy-drop",
        type=float,
        metavar="FRACTION",
        help="largest top-1 drop vs the fp32 model (e.g. 0.01), privacy included",
    )
    auto.add_argument(
        "--calibration",
        type=Path,
        metavar="DIR",
        help="folder of .npy/.npz samples, or of pictures (.png, .jpg, ...) read with "
        "--preprocess (default: synthetic data, with a warning)",
    )
    auto.add_argument(
        "--calibration-method", choices=("minmax", "entropy", "percentile"), default="minmax"
    )
    auto.add_argument(
        "--min-agreement",
        type=float,
        metavar="FRACTION",
        help="fail unless the chosen cut keeps this agreement with fp32",
    )
    auto.add_argument(
        "--candidates",
        type=int,
        default=1,
        metavar="K",
        help="also package the cuts best across link speeds, K in all",
    )
    auto.add_argument("--epsilon", type=float, help="per-request DP epsilon of the cut tensors")
    auto.add_argument("--delta", type=float, default=1e-5, help="DP delta (default 1e-5)")
    auto.add_argument("--clip", type=float, help="L2 clip norm C of each sample's activation")
    auto.add_argument(
        "--bottleneck",
        type=int,
        metavar="K",
        help="with --epsilon: PCA-project single-tensor cuts to K dims first",
    )
    auto.add_argument(
        "--adapt-cloud",
        action="store_true",
        help="with --epsilon: fine-tune the cloud segment (and the --bottleneck encoder) for "
        "the noise, by distillation from the fp32 model on the calibration samples",
    )
    auto.add_argument(
        "--adapt-seconds",
        type=float,
        metavar="S",
        help="time budget of --adapt-cloud in seconds (default 30)",
    )
    auto.add_argument(
        "--edge-fallback",
        action="store_true",
        help="also package the whole model for the edge to run when no cloud answers",
    )
    auto.add_argument(
        "--report", type=Path, metavar="PNG", help="draw the per-cut edge/transfer/cloud bar chart"
    )
    p.add_argument(
        "--preprocess",
        metavar="KEY=VALUE,...|FILE.json",
        help="how a picture becomes the image input, recorded in the manifest for calibration "
        "images and the edge agent's image bodies: mode=L|RGB, size=HxW, scale=1/255, "
        "layout=NCHW|NHWC, mean=M[,M,M], std=S[,S,S], resize=bilinear|nearest|bicubic|..., "
        "input=NAME (needed only with several inputs); "
        "e.g. 'mode=L,size=8x8,scale=1/16'. FILE.json: the same keys as a JSON object",
    )
    p.add_argument(
        "--input-codec",
        metavar="auto|raw|png|jpeg[:QUALITY]",
        help="how the cloud-only cut's inputs travel, as a client uploads them: auto "
        "(measure int8+zstd, png and jpeg on the calibration samples, keep the smallest "
        "that holds the agreement), raw, png (lossless on 256-level inputs) or jpeg "
        "(lossy, QUALITY 1-100, default 90); png and jpeg need image inputs [N, C, H, W] "
        "with C 1 or 3, or [N, H, W]. With --split none or auto (default there: auto; "
        "--split none without it: int8+zstd with per-request parameters)",
    )
    p.add_argument(
        "--max-cuts",
        type=int,
        default=DEFAULT_MAX_CUTS,
        help=f"list every cut, and let --split auto weigh every cut, up to this many "
        f"(default {DEFAULT_MAX_CUTS}); past it --list-cuts shows the cuts worth a look "
        "and --split auto chooses by minimum cut",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--version", action="version", version=f"splitinfer {__version__}")
    return p


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


def _list_cuts(args: argparse.Namespace, prepared: Prepared, progress: Progress) -> int:
    """Every cut when there are at most --max-cuts; else the ones a person would consider."""
    progress("enumerating cuts")
    space = prepared.space
    plans = space.exhaustive()
    if plans is not None:
        if args.json:
            print(json.dumps(cut_rows(prepared, plans), indent=2))
        else:
            print(format_table(prepared, plans))
        return 0
    from splitinfer.partitioner.costmodel import DEFAULT_CODEC_RATIO
    from splitinfer.partitioner.cutsearch import list_candidates

    progress(f"more than {space.max_cuts} cuts (--max-cuts): counting them, then min-cuts")
    count, exact = space.count()
    edge = args.edge_profile or LIST_EDGE_PROFILE
    cloud = args.cloud_profile or LIST_CLOUD_PROFILE
    plans, why, found = list_candidates(space, edge, cloud, DEFAULT_CODEC_RATIO)
    total = f"{count:,}" if exact else f"at least {count:,}"
    how = "counted, not listed" if exact else "a lower bound, too many to count"
    note = (
        f"{total} cuts in all ({how}: the down-sets of the unit order in which no tensor "
        "that cannot cross would cross; a rare one may still fail to plan), more than "
        f"--max-cuts {space.max_cuts}; showing {len(plans)}: all cloud, all edge, the "
        f"single-tensor cuts, the latency min-cuts at {found.points} uplink rates "
        f"(rooflines of {edge} and {cloud}, float tensors / {DEFAULT_CODEC_RATIO:g} on the "
        "wire) and the fewest-bytes cut per depth band"
    )
    if args.json:
        out = {"valid_cuts": count, "exact": exact, "max_cuts": space.max_cuts, "note": note,
               "cuts": cut_rows(prepared, plans, why)}  # fmt: skip
        print(json.dumps(out, indent=2))
    else:
        print(format_table(prepared, plans, why=why, total=f"{total} ({how})"))
        print(note)
    return 0


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_cuts < 1:
        raise ConfigError("--max-cuts must be at least 1")
    if args.split is not None and args.output is None:
        raise ConfigError("--split needs -o/--output DIR")
    if args.list_cuts and args.output is not None:
        raise ConfigError("-o/--output goes with --split, not --list-cuts")
    if args.list_cuts and (args.precision is not None or args.edge_fallback):
        raise ConfigError("--precision and --edge-fallback go with --split, not --list-cuts")
    if args.list_cuts and args.input_codec is not None:
        raise ConfigError("--input-codec goes with --split none or --split auto")
    if args.list_cuts and args.preprocess is not None:
        raise ConfigError("--preprocess goes with --split, not --list-cuts")
    progress = (lambda _m: None) if args.quiet else stderr_progress
    shapes = parse_input_shapes(args.input_shape)
    prepared = prepare(args.model, shapes, max_cuts=args.max_cuts, progress=progress)
    if args.list_cuts:
        return _list_cuts(args, prepared, progress)
    args.preprocessing = _preprocessing(args.preprocess, prepared)
    input_codec = _input_codec(args, prepared)
    if args.split == "auto":
        return _auto(args, prepared, progress)
    _refuse_auto_only(args)
    plan = prepared.space.find(args.split)
    art = artifacts_for(prepared, plan)
    if input_codec is not None:
        if plan.kind != "none":
            raise ConfigError(
                f"--input-codec applies to the cloud-only cut; cut {plan.id} is {plan.kind!r}: "
                "use it with --split none or --split auto"
            )
        _plan_inputs(args, prepared, art, input_codec)
    precision = args.precision or "fp32"
    if precision != "fp32" and art.edge is not None:
        from splitinfer.partitioner.auto import AutoOptions
        from splitinfer.partitioner.automeasure import convert

        opts = AutoOptions(link=Link.fixed(1e6, 1e6), precision=precision)
        samples = _calibration(args, prepared)
        art.edge = convert(art.edge, opts, samples)
        art.edge_precision = precision
    extras = PackageExtras(
        fallback=prepared.optimized if args.edge_fallback else None,
        preprocessing=args.preprocessing,
    )
    manifest = write_package(prepared, [art], args.output, extras=extras, progress=progress)
    cut = manifest.cut
    sides = ", ".join(
        f"{seg.file} {seg.nodes} nodes" for seg in (cut.edge, cut.cloud) if seg is not None
    )
    print(
        f"cut {plan.id} ({plan.kind}): {len(plan.crossing)} tensor(s), "
        f"{plan.bytes_per_sample:,} bytes/sample; edge {plan.edge_flops / 1e6:.2f} MFLOPs, "
        f"cloud {plan.cloud_flops / 1e6:.2f} MFLOPs -> {args.output} "
        f"({sides})"
    )
    return 0


def _input_codec(args: argparse.Namespace, prepared: Prepared) -> InputCodec | None:
    """``--input-codec`` parsed, and refused early on a model whose inputs are not images."""
    from splitinfer.partitioner.pipeline import tensor_spec
    from splitinfer.partitioner.wirecodec import InputCodec, check_image_inputs

    if args.input_codec is None:
        return None
    choice = InputCodec.parse(args.input_codec)
    none = prepared.space.find("none")
    check_image_inputs(choice, [tensor_spec(prepared.analysis, t) for t in none.crossing])
    return choice


def _plan_inputs(
    args: argparse.Namespace, prepared: Prepared, art: CutArtifacts, choice: InputCodec
) -> None:
    """The cloud-only cut's codec from the calibration samples, scored by the whole model."""
    import numpy as np

    from splitinfer.partitioner.auto import _agree
    from splitinfer.partitioner.automeasure import run as _run
    from splitinfer.partitioner.wirecodec import plan_wire

    assert art.cloud is not None
    cloud = art.cloud
    samples = _calibration(args, prepared)
    feeds = {k: np.concatenate([s[k] for s in samples]) for k in samples[0]}
    out_name = prepared.analysis.outputs[0]
    ref = _run(cloud, feeds, optimize=True)[out_name]
    metric = "top1" if ref.ndim == 2 and ref.shape[1] > 1 else "cosine"

    def score(rounded: Mapping[str, Any]) -> float:
        return _agree(metric, ref, _run(cloud, {**feeds, **rounded}, optimize=True)[out_name])

    name = f"codec/{art.plan.id}.zdict"
    acts = {t: feeds[t] for t in art.plan.crossing}
    wire = plan_wire(acts, dictionary_file=name, score=score, input_codec=choice)
    art.codec, art.quant = wire.codec, wire.quant
    if wire.dictionary is not None:
        art.files[name] = wire.dictionary
    art.quality["wire"] = wire.summary()


def _warn(message: str) -> None:
    print(f"partition: warning: {message}", file=sys.stderr, flush=True)


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]i?[bB]|[bB])?\s*", text)
    if not m:
        raise ConfigError(f"--edge-memory {text!r}: use a byte count like 512MB, 2GiB or 800000")
    return int(float(m.group(1)) * _SIZE[(m.group(2) or "").lower()])


def _refuse_auto_only(args: argparse.Namespace) -> None:
    only = (
        "edge_profile",
        "cloud_profile",
        "trace",
        "edge_memory",
        "max_latency",
        "report",
        "max_accuracy_drop",
        "min_agreement",
        "epsilon",
        "clip",
        "bottleneck",
        "adapt_seconds",
    )
    given = [f"--{n.replace('_', '-')}" for n in only if getattr(args, n) is not None]
    if args.candidates != 1:
        given.append("--candidates")
    if args.adapt_cloud:
        given.append("--adapt-cloud")
    if given:
        raise ConfigError(f"{', '.join(given)} go(es) with --split auto")


def _calibration(args: argparse.Namespace, prepared: Prepared) -> list[dict[str, Any]]:
    from splitinfer.partitioner.calibration import load_calibration, synthetic_calibration

    a = prepared.analysis
    inputs = [io_spec(vi) for vi in a.model.graph.input if vi.name in a.inputs]
    if args.calibration is not None:
        return load_calibration(
            args.calibration, inputs, a.batch_symbol, preprocessing=args.preprocessing
        )
    _warn("no --calibration folder: calibrating on SYNTHETIC random inputs")
    shapes = {k: (1, *v) for k, v in a.sample_input_shapes.items()}
    return synthetic_calibration(inputs, 64, 0, shapes)


def _preprocessing(text: str | None, prepared: Prepared) -> dict[str, PreprocessSpec]:
    """``--preprocess``, checked against the model's inputs (empty when not given)."""
    from splitinfer.shared.preprocess import parse_option

    if text is None:
        return {}
    a = prepared.analysis
    return parse_option(text, [io_spec(vi) for vi in a.model.graph.input if vi.name in a.inputs])


def _options(args: argparse.Namespace) -> AutoOptions:
    from splitinfer.partitioner.auto import AutoOptions
    from splitinfer.partitioner.dp import privacy_spec
    from splitinfer.partitioner.wirecodec import InputCodec

    if args.trace is not None:
        link = Link.from_trace(
            args.trace, rtt_s=parse_duration(args.rtt), downlink_bps=parse_rate(args.downlink)
        )
    else:
        link = Link.fixed(args.uplink, args.downlink, args.rtt)
    privacy = None
    if args.epsilon is not None or args.clip is not None:
        if args.epsilon is None or args.clip is None:
            raise ConfigError("privacy needs both --epsilon and --clip (and optionally --delta)")
        privacy = privacy_spec(args.epsilon, args.delta, args.clip)
    adapt = _adapt_options(args)
    constraints = Constraints(
        edge_memory_bytes=_size(args.edge_memory) if args.edge_memory else None,
        max_latency_s=parse_duration(args.max_latency) if args.max_latency else None,
        max_accuracy_drop=args.max_accuracy_drop,
    )
    return AutoOptions(
        link=link,
        edge_profile=args.edge_profile,
        cloud_profile=args.cloud_profile,
        objective=args.objective,
        constraints=constraints,
        precision=args.precision or "int8",
        calibration=args.calibration,
        calibration_method=args.calibration_method,
        min_agreement=args.min_agreement,
        candidates=args.candidates,
        privacy=privacy,
        bottleneck=args.bottleneck,
        adapt=adapt,
        input_codec=InputCodec.parse(args.input_codec or "auto"),
        preprocessing=args.preprocessing,
    )


def _adapt_options(args: argparse.Namespace) -> Any:
    """``--adapt-cloud`` / ``--adapt-seconds`` as ``AdaptOptions`` (None when off)."""
    if args.adapt_seconds is not None and not args.adapt_cloud:
        raise ConfigError("--adapt-seconds goes with --adapt-cloud")
    if not args.adapt_cloud:
        return None
    if args.epsilon is None:
        raise ConfigError("--adapt-cloud goes with --epsilon (it trains for the privacy noise)")
    from splitinfer.partitioner.adapt import DEFAULT_SECONDS, AdaptOptions

    seconds = DEFAULT_SECONDS if args.adapt_seconds is None else args.adapt_seconds
    return AdaptOptions(seconds=seconds)


def _auto(args: argparse.Namespace, prepared: Prepared, progress: Progress) -> int:
    from splitinfer.partitioner.auto import auto_split

    opts = _options(args)
    result = auto_split(prepared, opts, progress, _warn)
    extras = result.extras
    if args.edge_fallback:
        extras.fallback = prepared.optimized
    manifest = write_package(
        prepared, result.artifacts, args.output, extras=extras, progress=progress
    )
    print(format_costs(result.table, limit=12))
    print(f"cut search: {result.search}")
    c = result.chosen
    others = [x.plan.id for x in result.artifacts[1:]]
    print(
        f"chose {c.cut_id} ({c.kind}) for {opts.link.describe()} by {opts.objective}: "
        f"edge {c.edge_s * 1e3:.2f} ms, {c.up_bytes:,} B up, cloud {c.cloud_s * 1e3:.2f} ms"
        + (f"; run-time candidates {', '.join(others)}" if others else "")
        + f" -> {args.output} ({len(manifest.cuts)} cut(s))"
    )
    if args.report is not None:
        from splitinfer.partitioner.report import draw_report

        draw_report(
            result.table,
            c.cut_id,
            args.report,
            f"{prepared.source.path.name} at {opts.link.describe()}",
        )
        print(f"report: {args.report}")
    return 0


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
