"""``partition``: list the cuts of an ONNX model or write a split package.

    partition MODEL.onnx --list-cuts [--json]
    partition MODEL.onnx --split CUT -o DIR

CUT is an id from the table (``c3``), ``none`` (all cloud), ``all`` (all edge)
or comma-separated tensor names.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from splitinfer import __version__
from splitinfer.partitioner.cuts import DEFAULT_MAX_CUTS, CutPlan
from splitinfer.partitioner.loader import parse_input_shapes
from splitinfer.partitioner.pipeline import Prepared, prepare, stderr_progress, write_package
from splitinfer.shared.cli import run_cli
from splitinfer.shared.errors import ConfigError

PRECISIONS = ("fp32",)  # int8 and fp16 edge segments arrive with --split auto


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="partition",
        description="Optimize an ONNX model and cut it into an edge and a cloud segment.",
    )
    p.add_argument("model", type=Path, help="the ONNX model (.onnx)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--list-cuts", action="store_true", help="print every valid cut")
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
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="segment precision")
    p.add_argument(
        "--max-cuts",
        type=int,
        default=DEFAULT_MAX_CUTS,
        help=f"stop with an error past this many valid cuts (default {DEFAULT_MAX_CUTS})",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--version", action="version", version=f"splitinfer {__version__}")
    return p


def cut_rows(prepared: Prepared) -> list[dict[str, object]]:
    return [
        {
            "id": plan.id,
            "kind": plan.kind,
            "tensors": list(plan.crossing),
            "bytes_per_sample": plan.bytes_per_sample,
            "edge_flops": plan.edge_flops,
            "cloud_flops": plan.cloud_flops,
            "edge_nodes": len(plan.edge_nodes),
            "cloud_nodes": len(plan.cloud_nodes),
        }
        for plan in prepared.space.plans()
    ]


def format_table(prepared: Prepared, plans: list[CutPlan], mark: str | None = None) -> str:
    lines = [
        f"model: {prepared.source.path.name}  nodes: {prepared.nodes_before} -> "
        f"{prepared.nodes_after} after optimization ("
        + ", ".join(f"{r.name}: {r.nodes_before}->{r.nodes_after}" for r in prepared.passes)
        + f")  units: {len(prepared.space.units)}  valid cuts: {len(plans)}",
        f"{'':2}{'cut':>6} {'bytes/sample':>13} {'edge MFLOPs':>12} {'cloud MFLOPs':>13}  tensors",
    ]
    for plan in plans:
        names = ", ".join(plan.crossing)
        if len(names) > 60:
            names = names[:57] + "..."
        flag = "*" if plan.id == mark else ""
        lines.append(
            f"{flag:2}{plan.id:>6} {plan.bytes_per_sample:>13,} {plan.edge_flops / 1e6:>12.2f} "
            f"{plan.cloud_flops / 1e6:>13.2f}  {names}"
        )
    return "\n".join(lines)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_cuts < 1:
        raise ConfigError("--max-cuts must be at least 1")
    if args.split is not None and args.output is None:
        raise ConfigError("--split needs -o/--output DIR")
    if args.list_cuts and args.output is not None:
        raise ConfigError("-o/--output goes with --split, not --list-cuts")
    progress = (lambda _m: None) if args.quiet else stderr_progress
    shapes = parse_input_shapes(args.input_shape)
    prepared = prepare(args.model, shapes, max_cuts=args.max_cuts, progress=progress)
    if args.list_cuts:
        progress("enumerating cuts")
        if args.json:
            print(json.dumps(cut_rows(prepared), indent=2))
        else:
            print(format_table(prepared, prepared.space.plans()))
        return 0
    plan = prepared.space.find(args.split)
    manifest = write_package(prepared, plan, args.output, progress=progress)
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


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("partition", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
