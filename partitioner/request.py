"""What one ``partition`` run is asked to do: a frozen request built from argv.

Every flag of ``partition`` is an :func:`~splitinfer.shared.options.option` field
of :class:`PartitionRequest` (type, default, help, flag and, for the simple
ones, the bound); :func:`build_parser` generates the argparse parser from the
fields, and ``__post_init__`` holds every rule between flags (``--split`` needs
``-o``, the ``--split auto`` only flags, privacy needs ``--epsilon`` and
``--clip``, ...), so a request that exists is one ``partition`` can run.
:mod:`splitinfer.partitioner.cli` only builds it and dispatches.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from splitinfer import __version__
from splitinfer.partitioner.cuts import DEFAULT_MAX_CUTS
from splitinfer.partitioner.passes import DEFAULT_PIPELINE, PASSES
from splitinfer.shared.cli import ArgumentParser, add_debug_flag, add_version_flag, examples
from splitinfer.shared.costs import OBJECTIVES
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.links import parse_duration, parse_rate
from splitinfer.shared.manifest import PRECISIONS
from splitinfer.shared.options import add_flags, build, merge_flags, option
from splitinfer.shared.units import parse_size

AUTO = "--split auto: the cost model and its inputs"
#: the flags only the cost model reads, refused with a fixed ``--split CUT``
AUTO_ONLY = (
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
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
__all__ = ["PartitionRequest", "build_parser", "parse_size"]


def _flag(name: str) -> str:
    """The flag of field ``name`` (``adapt_seconds`` is ``--adapt-time``)."""
    from splitinfer.shared.options import options

    return next(o.flag for o in options(PartitionRequest) if o.name == name) or name


@dataclass(frozen=True)
class PartitionRequest:
    """One ``partition`` invocation, checked."""

    model: Path = option(help="the ONNX model (.onnx)", positional=True, metavar="model")
    list_cuts: bool = option(
        False,
        "print every valid cut (past --max-cuts: how many there are, and the ones worth a look)",
    )
    split: str | None = option(
        None,
        "cut id from --list-cuts, 'none' (all cloud), 'all' (all edge), tensor names, or "
        "'auto' (the cost model picks it)",
        metavar="CUT",
    )
    output: Path | None = option(
        None, "output folder of the split package", short="-o", metavar="OUTPUT"
    )
    json: bool = option(False, "with --list-cuts: print JSON")
    input_shape: tuple[str, ...] = option(
        (),
        "fix an input's free dimensions for analysis (repeatable); the leading dimension is "
        "the batch, which stays free in the written segments",
        repeat=True,
        metavar="NAME=DxDx...",
    )
    precision: str | None = option(
        None,
        "edge segment precision (default: int8 with --split auto, else fp32); int8 is QDQ "
        "ONNX that ONNX Runtime runs and TensorRT builds its engine from",
        choices=PRECISIONS,
    )
    edge_profile: str | None = option(
        None,
        "built-in device profile or a measured profile JSON (default: measure on this "
        "machine); with a fixed --split and --precision int8 it picks the INT8 recipe "
        "(TensorRT's for a TensorRT device, else the CPU one)",
        metavar="NAME|FILE",
        group=AUTO,
    )
    cloud_profile: str | None = option(
        None,
        "likewise for the cloud (default: measure on this machine)",
        metavar="NAME|FILE",
        group=AUTO,
    )
    uplink: str = option("5mbit", "uplink rate", metavar="RATE", group=AUTO)
    downlink: str = option("20mbit", "downlink rate", metavar="RATE", group=AUTO)
    rtt: str = option("50ms", "round-trip time", metavar="DURATION", group=AUTO)
    trace: Path | None = option(
        None,
        "Mahimahi uplink trace: plan on its capacity distribution",
        metavar="FILE",
        group=AUTO,
    )
    objective: str = option("latency", "what the cut minimizes", choices=OBJECTIVES, group=AUTO)
    edge_memory: str | None = option(
        None, "edge memory budget, e.g. 512MB", metavar="SIZE", group=AUTO
    )
    max_latency: str | None = option(
        None, "p95 latency bound, e.g. 80ms", metavar="DURATION", group=AUTO
    )
    max_accuracy_drop: float | None = option(
        None,
        "largest top-1 drop vs the fp32 model (e.g. 0.01), privacy included",
        metavar="FRACTION",
        group=AUTO,
    )
    calibration: Path | None = option(
        None,
        "folder of .npy/.npz samples, or of pictures (.png, .jpg, ...) read with "
        "--preprocess (default: synthetic data, with a warning)",
        metavar="DIR",
        group=AUTO,
    )
    calibration_method: str = option(
        "minmax", "int8 calibration", choices=CALIBRATION_METHODS, group=AUTO
    )
    min_agreement: float | None = option(
        None,
        "fail unless the chosen cut keeps this agreement with fp32",
        metavar="FRACTION",
        group=AUTO,
    )
    candidates: int = option(
        1,
        "also package the cuts best across link speeds, K in all",
        metavar="K",
        group=AUTO,
    )
    epsilon: float | None = option(
        None, "per-request DP epsilon of the cut tensors", metavar="EPSILON", group=AUTO
    )
    delta: float = option(1e-5, "DP delta", metavar="DELTA", group=AUTO)
    clip: float | None = option(
        None, "L2 clip norm C of each sample's activation", metavar="CLIP", group=AUTO
    )
    bottleneck: int | None = option(
        None,
        "with --epsilon: PCA-project single-tensor cuts to K dims first",
        metavar="K",
        group=AUTO,
    )
    adapt_cloud: bool = option(
        False,
        "with --epsilon: fine-tune the cloud segment (and the --bottleneck encoder) for the "
        "noise, by distillation from the fp32 model on the calibration samples",
        group=AUTO,
    )
    adapt_seconds: float | None = option(
        None, "time budget of --adapt-cloud (default: 30s)", group=AUTO, name="adapt_time"
    )
    edge_fallback: bool = option(
        False,
        "also package the whole model for the edge to run when no cloud answers",
        group=AUTO,
    )
    report: Path | None = option(
        None, "draw the per-cut edge/transfer/cloud bar chart", metavar="PNG", group=AUTO
    )
    preprocess: str | None = option(
        None,
        "how a picture becomes the image input, recorded in the manifest for calibration "
        "images and the edge agent's image bodies: mode=L|RGB, size=HxW, scale=1/255, "
        "layout=NCHW|NHWC, mean=M[,M,M], std=S[,S,S], resize=bilinear|nearest|bicubic|..., "
        "input=NAME (needed only with several inputs); e.g. 'mode=L,size=8x8,scale=1/16'. "
        "FILE.json: the same keys as a JSON object",
        metavar="KEY=VALUE,...|FILE.json",
    )
    input_codec: str | None = option(
        None,
        "how the cloud-only cut's inputs travel, as a client uploads them: auto (measure "
        "int8+zstd, png and jpeg on the calibration samples, keep the smallest that holds "
        "the agreement), raw, png (lossless on 256-level inputs) or jpeg (lossy, QUALITY "
        "1-100, default 90); png and jpeg need image inputs [N, C, H, W] with C 1 or 3, or "
        "[N, H, W]. With --split none or auto (default: auto there; --split none without "
        "it: int8+zstd with per-request parameters)",
        metavar="auto|raw|png|jpeg[:QUALITY]",
    )
    max_cuts: int = option(
        DEFAULT_MAX_CUTS,
        "list every cut, and let --split auto weigh every cut, up to this many; past it "
        "--list-cuts shows the cuts worth a look and --split auto chooses by minimum cut",
        metavar="MAX_CUTS",
    )
    skip_pass: tuple[str, ...] = option(
        (),
        "leave this optimization pass out (repeatable); the passes, in the order they run: "
        f"{', '.join(DEFAULT_PIPELINE)}",
        repeat=True,
        metavar="NAME",
    )
    no_optimize: bool = option(
        False, "run no optimization pass: partition the model as it is loaded"
    )
    quiet: bool = option(False, "no progress on stderr", short="-q")

    def __post_init__(self) -> None:
        if self.list_cuts == (self.split is not None):
            if self.list_cuts:
                raise ConfigError("--list-cuts and --split go one at a time: give one of them")
            raise ConfigError("one of the arguments --list-cuts --split is required")
        if self.max_cuts < 1:
            raise ConfigError("--max-cuts must be at least 1")
        unknown = [n for n in self.skip_pass if n not in PASSES]
        if unknown:
            raise ConfigError(
                f"--skip-pass {unknown[0]!r}: no such optimization pass; known: {', '.join(PASSES)}"
            )
        if self.no_optimize and self.skip_pass:
            raise ConfigError("--no-optimize already leaves every pass out; drop --skip-pass")
        if self.split is not None and self.output is None:
            raise ConfigError("--split needs -o/--output DIR")
        if self.list_cuts:
            self._check_list_cuts()
        elif self.auto:
            self._check_auto()
        else:
            self._check_fixed_cut()
        if self.edge_memory is not None:
            self.edge_memory_bytes  # noqa: B018 - parses it, a bad size is refused here
        # the link flags are read only by the cost model, but a bad one is refused
        # here, before the model loads, and named
        parse_rate(self.uplink, "--uplink")
        parse_rate(self.downlink, "--downlink")
        parse_duration(self.rtt, "--rtt")
        if self.max_latency is not None:
            parse_duration(self.max_latency, "--max-latency")

    def _check_list_cuts(self) -> None:
        if self.output is not None:
            raise ConfigError("-o/--output goes with --split, not --list-cuts")
        if self.precision is not None or self.edge_fallback:
            raise ConfigError("--precision and --edge-fallback go with --split, not --list-cuts")
        if self.input_codec is not None:
            raise ConfigError("--input-codec goes with --split none or --split auto")
        if self.preprocess is not None:
            raise ConfigError("--preprocess goes with --split, not --list-cuts")

    def _check_fixed_cut(self) -> None:
        given = [_flag(n) for n in AUTO_ONLY if getattr(self, n) is not None]
        if self.candidates != 1:
            given.append("--candidates")
        if self.adapt_cloud:
            given.append("--adapt-cloud")
        if given:
            raise ConfigError(f"{', '.join(given)} go(es) with --split auto")
        if self.edge_profile is not None and self.edge_precision != "int8":
            raise ConfigError(
                "--edge-profile with a fixed --split goes with --precision int8 (it picks the "
                "INT8 recipe); drop it, or give --precision int8"
            )

    def _check_auto(self) -> None:
        if (self.epsilon is None) != (self.clip is None):
            raise ConfigError("privacy needs both --epsilon and --clip (and optionally --delta)")
        if self.adapt_seconds is not None and not self.adapt_cloud:
            raise ConfigError("--adapt-time goes with --adapt-cloud")
        if self.adapt_cloud and self.epsilon is None:
            raise ConfigError("--adapt-cloud goes with --epsilon (it trains for the privacy noise)")

    @property
    def auto(self) -> bool:
        return self.split == "auto"

    @property
    def passes(self) -> tuple[str, ...]:
        """The optimization passes to run: the default pipeline less ``--skip-pass``,
        none with ``--no-optimize``."""
        if self.no_optimize:
            return ()
        return tuple(n for n in DEFAULT_PIPELINE if n not in self.skip_pass)

    @property
    def edge_precision(self) -> str:
        """``--precision``, else int8 for ``--split auto`` and fp32 for a fixed cut."""
        return self.precision or ("int8" if self.auto else "fp32")

    @property
    def edge_memory_bytes(self) -> int | None:
        if self.edge_memory is None:
            return None
        return parse_size(self.edge_memory, "--edge-memory")

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None) -> PartitionRequest:
        """Parse ``argv`` (flags only; ``partition`` reads no file) and check the result."""
        args = build_parser().parse_args(argv)
        return build(cls, merge_flags({}, args, cls), where=None)


def build_parser() -> argparse.ArgumentParser:
    """``partition``'s parser, generated from :class:`PartitionRequest`."""
    p = ArgumentParser(
        prog="partition",
        description="Optimize an ONNX model and cut it into an edge and a cloud segment.",
        epilog=examples(
            "partition model.onnx --list-cuts",
            "partition model.onnx --split c5 -o pkg --precision int8",
            "partition model.onnx --split auto -o pkg --uplink 5mbit --rtt 50ms "
            "--edge-profile raspberry-pi-5 --edge-memory 512MB",
            "partition model.onnx --split auto -o pkg --trace uplink.up --candidates 3",
        ),
    )
    add_flags(p, PartitionRequest, negatable=False)
    add_debug_flag(p)
    add_version_flag(p, __version__)
    return p
