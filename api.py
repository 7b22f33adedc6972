"""The Python API: :func:`partition`, :func:`list_cuts` and :func:`load_package`.

Each is the ``partition`` command's own code path, called from Python. The keyword
arguments become the command's flags and are parsed and checked by its request
(:class:`~splitinfer.partitioner.request.PartitionRequest`), so a bad value raises
the :class:`~splitinfer.shared.errors.SplitInferError` whose message the command
prints after ``partition: error:``; then :func:`splitinfer.partitioner.cli.run`
does what the command does, and the answer comes back typed instead of printed.

Nothing is printed: progress goes to ``progress`` (or to stderr, as the command
writes it, with ``quiet=False``). Warnings (calibrating on synthetic data without
``calibration``) go to stderr as the command's do. The partitioner (ONNX, ONNX
Runtime) is imported on the first call, not with this module.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitinfer.shared.manifest import Cut, Manifest, resolve_file

if TYPE_CHECKING:
    from splitinfer.partitioner.cli import Listing, Written
    from splitinfer.partitioner.request import PartitionRequest

__all__ = [
    "CutListing",
    "Package",
    "PartitionResult",
    "list_cuts",
    "load_package",
    "partition",
]

PathLike = str | os.PathLike[str]
#: Input shapes for the analysis: ``{"x": (1, 3, 224, 224)}`` or ``["x=1x3x224x224"]``.
InputShapes = Mapping[str, Sequence[int]] | Sequence[str]
Progress = Callable[[str], None]


@dataclass(frozen=True)
class PartitionResult:
    """What :func:`partition` wrote: the chosen cut, its costs and the package.

    ``table`` is the cost model's rows, one dict per cut it priced (``cut``, ``kind``,
    ``edge_ms``, ``transfer_ms``, ``cloud_ms``, ``total_ms``, ``p95_ms``, ``up_bytes``,
    ``chosen``, ...; ``pandas.DataFrame(result.table)`` reads it); empty for a fixed
    cut, which nothing priced. ``candidates`` are the cut ids in the package, the
    chosen one first. ``predicted_ms`` is the chosen cut's predicted mean end-to-end
    latency (its ``total_ms``; None for a fixed cut). ``search`` says how ``--split
    auto`` found its candidates (every cut, or the min-cuts); empty for a fixed cut.
    ``summary`` is what the ``partition`` command prints.
    """

    cut: str
    kind: str
    table: list[dict[str, Any]]
    candidates: tuple[str, ...]
    package: Path
    manifest: Manifest
    predicted_ms: float | None
    search: str
    summary: str


@dataclass(frozen=True)
class CutListing:
    """What :func:`list_cuts` found, as ``partition --list-cuts`` shows it.

    ``cuts`` holds one dict per listed cut (``id``, ``kind``, ``tensors``,
    ``bytes_per_sample``, ``edge_flops``, ``cloud_flops``, ``edge_nodes``,
    ``cloud_nodes``, and ``why`` when not every cut is listed). ``count`` is how many
    valid cuts the model has (a lower bound when not ``exact``); past ``max_cuts``
    only the cuts worth a look are listed and ``note`` says which. ``document`` is the
    ``--list-cuts --json`` object, ``text`` the table the command prints.
    """

    model: str
    cuts: list[dict[str, Any]]
    count: int
    exact: bool
    note: str | None
    nonstandard_ops: tuple[str, ...]
    document: dict[str, Any]
    text: str

    @property
    def ids(self) -> tuple[str, ...]:
        """The listed cut ids, in table order."""
        return tuple(str(row["id"]) for row in self.cuts)


@dataclass(frozen=True)
class Package:
    """A split package on disk: its manifest and the paths of its segments.

    ``cut`` is the default cut's id (the one the partitioner chose) and ``edge`` /
    ``cloud`` its segments (None where that side runs nothing: ``cloud`` of an
    all-edge cut, ``edge`` of an all-cloud one); ``cuts`` are every cut id in the
    package, the default first. :meth:`segments` gives any cut's pair.
    """

    path: Path
    manifest: Manifest
    cut: str
    edge: Path | None
    cloud: Path | None
    cuts: tuple[str, ...]

    def segments(self, cut_id: str | None = None) -> tuple[Path | None, Path | None]:
        """(edge, cloud) segment paths of ``cut_id`` (default: the default cut)."""
        from splitinfer.shared.errors import PackageError

        cut = self.manifest.cut if cut_id is None else self.manifest.find_cut(cut_id)
        if cut is None:
            raise PackageError(f"{self.path}: no cut {cut_id!r}; the package holds {self.cuts}")
        return _segment_paths(self.path, cut)


def partition(
    model: PathLike,
    *,
    split: str = "auto",
    out: PathLike,
    input_shape: InputShapes | None = None,
    uplink: str = "5mbit",
    downlink: str = "20mbit",
    rtt: str = "50ms",
    trace: PathLike | None = None,
    edge_profile: PathLike | None = None,
    cloud_profile: PathLike | None = None,
    objective: str = "latency",
    precision: str | None = None,
    calibration: PathLike | None = None,
    calibration_method: str = "minmax",
    preprocess: str | None = None,
    candidates: int = 1,
    edge_memory: str | None = None,
    max_latency: str | None = None,
    epsilon: float | None = None,
    delta: float | None = None,
    clip: float | None = None,
    edge_fallback: bool = False,
    input_codec: str | None = None,
    max_cuts: int | None = None,
    report: PathLike | None = None,
    quiet: bool = True,
    progress: Progress | None = None,
) -> PartitionResult:
    """Optimize ``model``, cut it and write the split package ``out``: ``partition
    MODEL --split SPLIT -o OUT`` from Python.

    ``split`` is ``"auto"`` (the cost model picks the cut for the network ``uplink``
    / ``downlink`` / ``rtt`` or ``trace`` and the devices ``edge_profile`` /
    ``cloud_profile``: a built-in name such as ``"raspberry-pi-5"`` and ``"l4"``, a
    measured profile file, or None to measure on this machine), a cut id from
    :func:`list_cuts` (``"c3"``), ``"none"`` (all cloud), ``"all"`` (all edge) or
    comma-separated tensor names. Every other keyword is the command's flag of the
    same name (``partition --help``), with its default and its rules: a bad value or
    combination raises :class:`~splitinfer.shared.errors.ConfigError` with the
    command's message; an unreadable model, an unknown cut or an unwritable ``out``
    raise the other :class:`~splitinfer.shared.errors.SplitInferError` children.
    ``progress`` hears every step (default: nothing, or stderr with ``quiet=False``).
    """
    flags: dict[str, object] = {
        "split": split,
        "output": out,
        "input_shape": _input_shapes(input_shape),
        "uplink": uplink,
        "downlink": downlink,
        "rtt": rtt,
        "trace": trace,
        "edge_profile": edge_profile,
        "cloud_profile": cloud_profile,
        "objective": objective,
        "precision": precision,
        "calibration": calibration,
        "calibration_method": calibration_method,
        "preprocess": preprocess,
        "candidates": candidates,
        "edge_memory": edge_memory,
        "max_latency": max_latency,
        "epsilon": epsilon,
        "delta": delta,
        "clip": clip,
        "edge_fallback": edge_fallback,
        "input_codec": input_codec,
        "max_cuts": max_cuts,
        "report": report,
        "quiet": quiet,
    }
    from splitinfer.partitioner.cli import Written

    written = _run(model, flags, quiet, progress)
    assert isinstance(written, Written)
    return _result(written)


def list_cuts(
    model: PathLike,
    *,
    input_shape: InputShapes | None = None,
    max_cuts: int | None = None,
    edge_profile: PathLike | None = None,
    cloud_profile: PathLike | None = None,
    quiet: bool = True,
    progress: Progress | None = None,
) -> CutListing:
    """Every valid cut of ``model`` (``partition MODEL --list-cuts``); past ``max_cuts``
    the cuts worth a look, the latency min-cuts priced with ``edge_profile`` /
    ``cloud_profile`` (default ``raspberry-pi-5`` and ``l4``)."""
    flags: dict[str, object] = {
        "list_cuts": True,
        "input_shape": _input_shapes(input_shape),
        "max_cuts": max_cuts,
        "edge_profile": edge_profile,
        "cloud_profile": cloud_profile,
        "quiet": quiet,
    }
    from splitinfer.partitioner.cli import Listing

    listing = _run(model, flags, quiet, progress)
    assert isinstance(listing, Listing)
    doc = listing.document()
    return CutListing(
        model=str(doc["model"]),
        cuts=list(doc["cuts"]),
        count=listing.count,
        exact=listing.exact,
        note=listing.note,
        nonstandard_ops=tuple(listing.prepared.nonstandard_ops),
        document=doc,
        text=listing.text(),
    )


def load_package(path: PathLike, *, verify: bool = True) -> Package:
    """The split package at ``path``, as the daemons open it: the manifest read and,
    with ``verify``, every file it names checked (present, sha256); a
    :class:`~splitinfer.shared.errors.PackageError` names what is wrong."""
    from splitinfer.shared.package import open_package

    opened = open_package(Path(path).resolve(), verify=verify)
    manifest = opened.manifest
    edge, cloud = _segment_paths(opened.path, manifest.cut)
    return Package(
        path=opened.path,
        manifest=manifest,
        cut=manifest.default_cut,
        edge=edge,
        cloud=cloud,
        cuts=(manifest.default_cut, *(c for c in manifest.cut_ids if c != manifest.default_cut)),
    )


# -- the command's path -------------------------------------------------------------------


def _request(model: PathLike, flags: Mapping[str, object]) -> PartitionRequest:
    """The command's request for ``model`` and ``flags`` (request field -> value; None,
    or the field's default, leaves a flag out), built by the command's own parser from
    the argv it stands for, so that every check and message is the command's."""
    from splitinfer.partitioner.request import PartitionRequest
    from splitinfer.shared.options import options

    known = {o.name: o for o in options(PartitionRequest) if not o.spec.positional}
    argv: list[str] = []
    for name, value in flags.items():
        opt = known[name]  # a KeyError here is a bug of this module
        if value is None or value == opt.default:
            continue
        assert opt.flag is not None
        if opt.base is bool and isinstance(value, bool):
            argv.append(opt.flag)  # True: the flag (every bool of the command defaults off)
            continue
        values = value if opt.spec.repeat and isinstance(value, tuple) else (value,)
        # --flag=VALUE: a value that starts with '-' stays a value
        argv += [f"{opt.flag}={os.fspath(v) if isinstance(v, os.PathLike) else v}" for v in values]
    return PartitionRequest.from_argv([*argv, "--", os.fspath(model)])


def _run(
    model: PathLike, flags: Mapping[str, object], quiet: bool, progress: Progress | None
) -> Listing | Written:
    from splitinfer.partitioner.cli import run
    from splitinfer.partitioner.pipeline import stderr_progress

    req = _request(model, flags)
    if progress is None:
        progress = _silent if quiet else stderr_progress
    return run(req, progress)


def _silent(_message: str) -> None:
    pass


def _result(written: Written) -> PartitionResult:
    manifest = written.manifest
    auto = written.auto
    table = [dict(row) for row in auto.table] if auto is not None else []
    chosen = next((row for row in table if row.get("chosen")), None)
    return PartitionResult(
        cut=manifest.default_cut,
        kind=manifest.cut.kind,
        table=table,
        candidates=(
            manifest.default_cut,
            *(c for c in manifest.cut_ids if c != manifest.default_cut),
        ),
        package=written.output.resolve(),
        manifest=manifest,
        predicted_ms=float(chosen["total_ms"]) if chosen is not None else None,
        search=auto.search if auto is not None else "",
        summary=written.summary,
    )


def _input_shapes(shapes: InputShapes | None) -> tuple[str, ...] | None:
    """``{"x": (1, 3, 8, 8)}`` or ``["x=1x3x8x8"]`` as the ``--input-shape`` values."""
    if shapes is None:
        return None
    if isinstance(shapes, str):
        return (shapes,)
    if isinstance(shapes, Mapping):
        return tuple(f"{k}={'x'.join(str(d) for d in dims)}" for k, dims in shapes.items())
    return tuple(shapes)


def _segment_paths(root: Path, cut: Cut) -> tuple[Path | None, Path | None]:
    edge = None if cut.edge is None else resolve_file(root, cut.edge.file)
    cloud = None if cut.cloud is None else resolve_file(root, cut.cloud.file)
    return edge, cloud
