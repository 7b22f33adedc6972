"""TensorRT on a real GPU: the INT8 edge segments and fp16 cloud segments of the zoo.

    python bench/gpu_check.py [--models chain,resnet] [--runs 50] [--batch 8]
                              [--budget 420] [--json out.json]

Needs a CUDA GPU, ONNX Runtime with its TensorRT provider and the ``tensorrt``
Python package; it installs nothing. On a CUDA 12 machine:

    pip install onnxruntime-gpu tensorrt-cu12

(ONNX Runtime's TensorRT provider loads ``libnvinfer.so.10``; the script imports
``tensorrt`` first, which loads the wheel's copy; if ONNX Runtime still cannot
find it, add the wheel's ``tensorrt_libs`` folder to ``LD_LIBRARY_PATH``.)
Without a GPU, or without those packages, it says what is missing and exits 0.

For each model of the test zoo (tests/zoo.py): the partitioner's passes, a cut
inside the graph, the edge segment quantized with the ``tensorrt`` recipe and
checked against TensorRT's rules (partitioner/trt_rules.py), TensorRT's own ONNX
parser on that segment, then four TensorRT engines built through ONNX Runtime's
TensorRT provider with no fallback (edge/runtime.py ``open_segment(strict=True)``,
the edge agent's own code path): the edge segment at INT8 (its Q/DQ: explicit
quantization; fp16 allowed elsewhere), at FP16 and at FP32 from the fp32
segment, and the cloud segment at FP16. Each engine's outputs are compared with
ONNX Runtime on the CPU running the fp32 segment on the same batch (max error
relative to the largest reference value, and cosine), and timed: median of
``--runs`` runs after a warm-up. One table on stdout; progress on stderr.
Engines are built into a temporary folder and thrown away. Models left when
``--budget`` seconds have passed are skipped and named (the whole run is meant
to fit in 8 minutes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from splitinfer.shared.errors import ConfigError, SplitInferError
from splitinfer.shared.ortsession import open_session

TESTS = Path(__file__).resolve().parent.parent / "tests"
PIP_LINE = "pip install onnxruntime-gpu tensorrt-cu12"
DEFAULT_BUDGET_S = 420.0
Feed = dict[str, np.ndarray]


@dataclass(frozen=True)
class Row:
    """One engine: what was built, whether TensorRT took it, how fast and how close."""

    model: str
    segment: str  # "edge" | "cloud"
    precision: str  # "int8" | "fp16" | "fp32"
    built: bool
    build_s: float | None = None
    median_ms: float | None = None
    speedup: float | None = None  # edge fp32 engine ms / this engine ms
    max_rel_err: float | None = None
    cosine: float | None = None
    note: str = ""


def _progress(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


def missing_pieces(providers: Sequence[str], gpu_name: str, has_tensorrt: bool) -> list[str]:
    """What this machine lacks for the check, in words; [] when it can run. Pure."""
    missing = []
    if not gpu_name:
        missing.append("no CUDA GPU (nvidia-smi found none)")
    if "TensorrtExecutionProvider" not in providers:
        missing.append(
            "onnxruntime has no TensorrtExecutionProvider "
            f"(it has {', '.join(providers) or 'no providers'})"
        )
    if not has_tensorrt:
        missing.append("the tensorrt Python package is not installed")
    return missing


def no_gpu_message(missing: Sequence[str]) -> str:
    return (
        "gpu_check: not run: " + "; ".join(missing) + ". Nothing was built or timed. "
        f"On a machine with a CUDA 12 GPU: {PIP_LINE}, then python bench/gpu_check.py"
    )


def select_models(spec: str | None, available: Sequence[str]) -> list[str]:
    """The models named by ``--models`` (comma-separated, in that order), or all of them."""
    if not spec:
        return list(available)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in available]
    if unknown or not names:
        raise ConfigError(
            f"unknown model {unknown[0] if unknown else spec!r}; the zoo has {', '.join(available)}"
        )
    return list(dict.fromkeys(names))


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: Sequence[Row], skipped: Sequence[str] = ()) -> str:
    """The one table: a row per engine, failures with their reason underneath."""
    head = ("model", "segment", "precision", "built", "build s", "ms", "x fp32", "max err", "cos")
    body = [
        (
            r.model,
            r.segment,
            r.precision,
            "yes" if r.built else "NO",
            _fmt(r.build_s, ".1f"),
            _fmt(r.median_ms, ".3f"),
            _fmt(r.speedup, ".2f"),
            _fmt(r.max_rel_err, ".1e"),
            _fmt(r.cosine, ".5f"),
        )
        for r in rows
    ]
    widths = [
        max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    notes = [f"  {r.model} {r.segment} {r.precision}: {r.note}" for r in rows if r.note]
    if notes:
        lines += ["", "notes:", *notes]
    if skipped:
        lines += ["", f"skipped (time budget spent): {', '.join(skipped)}"]
    return "\n".join(lines)


def compare(want: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray]) -> tuple[float, float]:
    """Worst max |got - want| / max(1, max |want|) and worst cosine over the outputs."""
    err, cos = 0.0, 1.0
    for name, ref in want.items():
        a = np.asarray(ref, np.float64).ravel()
        b = np.asarray(got[name], np.float64).ravel()
        err = max(err, float(np.abs(a - b).max() / max(1.0, float(np.abs(a).max()))))
        norm = float(np.linalg.norm(a) * np.linalg.norm(b))
        cos = min(cos, float(a @ b / norm) if norm else 1.0)
    return err, cos


def time_runs(run: Callable[[], object], runs: int) -> float:
    """Median milliseconds of ``runs`` calls after three warm-up calls."""
    for _ in range(3):
        run()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return 1000.0 * statistics.median(times)


def _segment(path: Path, precision: str) -> Any:
    from splitinfer.partitioner.loader import sha256_file
    from splitinfer.shared.manifest import Segment

    model = onnx.load(str(path))
    return Segment(
        file=path.name,
        sha256=sha256_file(path),
        inputs=tuple(vi.name for vi in model.graph.input),
        outputs=tuple(vi.name for vi in model.graph.output),
        nodes=len(model.graph.node),
        precision=precision,
    )


def _cpu(path: Path, feeds: Feed) -> dict[str, np.ndarray]:

    sess = open_session(path, log_severity=2)
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name: feeds[i.name] for i in sess.get_inputs()}
    return dict(zip(names, sess.run(names, wanted), strict=True))


def check_model(name: str, folder: Path, runs: int, batch: int) -> list[Row]:
    """Build and time the four engines of one zoo model; a failure becomes a row, not an exit."""
    from zoo import ZOO, export

    from splitinfer.edge.config import RuntimeConfig
    from splitinfer.edge.runtime import (
        available_providers,
        detect_device,
        open_segment,
        tensorrt_parse_errors,
    )
    from splitinfer.partitioner.pipeline import artifacts_for, prepare
    from splitinfer.partitioner.quantize import config_for, quantize_model
    from splitinfer.partitioner.trt_rules import check_tensorrt_qdq

    zoo = ZOO[name]
    source = export(zoo, folder / f"{name}.onnx")
    prepared = prepare(source)
    splits = [p for p in prepared.space.plans() if p.kind == "split"]
    plan = splits[len(splits) // 2] if splits else prepared.space.plans()[-1]
    art = artifacts_for(prepared, plan)
    assert art.edge is not None
    calib = [zoo.sample(1, seed=s) for s in range(16)]
    int8 = quantize_model(art.edge, calib, config_for("tensorrt"))  # refuses a rule breach
    paths = {"fp32": folder / f"{name}.edge.onnx", "int8": folder / f"{name}.edge.int8.onnx"}
    onnx.save(art.edge, str(paths["fp32"]))
    onnx.save(int8, str(paths["int8"]))
    feeds = zoo.sample(batch, seed=99)
    edge_ref = _cpu(paths["fp32"], feeds)
    engines: list[tuple[str, str, Path, str, RuntimeConfig]] = [
        (
            "edge",
            "int8",
            paths["int8"],
            "int8",
            RuntimeConfig(providers=("tensorrt",), trt_fp16=True, trt_int8=True),
        ),
        (
            "edge",
            "fp16",
            paths["fp32"],
            "fp32",
            RuntimeConfig(providers=("tensorrt",), trt_fp16=True, trt_int8=False),
        ),
        (
            "edge",
            "fp32",
            paths["fp32"],
            "fp32",
            RuntimeConfig(providers=("tensorrt",), trt_fp16=False, trt_int8=False),
        ),
    ]
    cloud_feeds: Feed = {}
    cloud_ref: dict[str, np.ndarray] = {}
    if art.cloud is not None:
        paths["cloud"] = folder / f"{name}.cloud.onnx"
        onnx.save(art.cloud, str(paths["cloud"]))
        cloud_feeds = {**feeds, **edge_ref}
        cloud_ref = _cpu(paths["cloud"], cloud_feeds)
        engines.append(
            (
                "cloud",
                "fp16",
                paths["cloud"],
                "fp32",
                RuntimeConfig(providers=("tensorrt",), trt_fp16=True, trt_int8=False),
            )
        )
    parse = tensorrt_parse_errors(paths["int8"])
    rules = check_tensorrt_qdq(int8)
    device, providers = detect_device(), available_providers()
    rows: list[Row] = []
    for segment, precision, path, seg_precision, config in engines:
        _progress(f"{name}: {segment} {precision} engine (cut {plan.id})")
        ref, inputs = (edge_ref, feeds) if segment == "edge" else (cloud_ref, cloud_feeds)
        note = ""
        if segment == "edge" and precision == "int8" and (parse or rules):
            note = "; ".join([*(f"parser: {e}" for e in parse[:2]), *rules[:2]])
        try:
            t0 = time.perf_counter()
            runner = open_segment(
                path,
                _segment(path, seg_precision),
                config,
                device,
                providers,
                cache_root=folder / "trt-cache",
                strict=True,
            )
            got = runner.run(inputs)  # the first run finishes the engine build
            build_s = time.perf_counter() - t0
        except SplitInferError as exc:
            rows.append(
                Row(
                    name,
                    segment,
                    precision,
                    False,
                    note=(note + "; " if note else "") + str(exc)[:300],
                )
            )
            continue
        err, cos = compare(ref, got)
        ms = time_runs(lambda r=runner, f=inputs: r.run(f), runs)
        rows.append(Row(name, segment, precision, True, build_s, ms, None, err, cos, note))
    base = next(
        (r.median_ms for r in rows if r.segment == "edge" and r.precision == "fp32" and r.built),
        None,
    )
    return [
        Row(**{**asdict(r), "speedup": base / r.median_ms})
        if base and r.median_ms and r.segment == "edge"
        else r
        for r in rows
    ]


def main(
    argv: Sequence[str] | None = None,
    probe: Callable[[], list[str]] | None = None,
) -> int:
    """Run the check; ``probe`` (tests) says what is missing instead of asking the machine."""
    sys.path.insert(0, str(TESTS))
    from zoo import ZOO

    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", help=f"comma-separated, from: {', '.join(ZOO)} (default all)")
    p.add_argument("--runs", type=int, default=50, help="timed runs per engine (default 50)")
    p.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds (default 420)")
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    try:
        models = select_models(args.models, list(ZOO))
        if args.runs < 1 or args.batch < 1 or args.budget <= 0:
            raise ConfigError("--runs, --batch and --budget must be positive")
    except ConfigError as exc:
        print(f"gpu_check: error: {exc}", file=sys.stderr)
        return 2
    missing = (probe or _probe)()
    if missing:
        print(no_gpu_message(missing))
        return 0
    import tensorrt

    _progress(f"TensorRT {tensorrt.__version__}; {len(models)} models, batch {args.batch}")
    started = time.perf_counter()
    rows: list[Row] = []
    skipped: list[str] = []
    with tempfile.TemporaryDirectory(prefix="splitinfer-gpu-check-") as tmp:
        for name in models:
            if time.perf_counter() - started > args.budget:
                skipped.append(name)
                continue
            folder = Path(tmp) / name
            folder.mkdir()
            try:
                rows += check_model(name, folder, args.runs, args.batch)
            except SplitInferError as exc:
                rows.append(Row(name, "edge", "int8", False, note=str(exc)[:300]))
    print(format_table(rows, skipped))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 0


def _probe() -> list[str]:
    from splitinfer.edge.runtime import available_providers, detect_device

    try:
        providers = available_providers()
    except Exception as exc:  # a broken onnxruntime-gpu install raises on import
        return [f"onnxruntime does not load: {exc}"]
    has_trt = importlib.util.find_spec("tensorrt") is not None
    gpu = detect_device(want_gpu=True).gpu_name
    return missing_pieces(providers, gpu, has_trt)


if __name__ == "__main__":
    sys.exit(main())
