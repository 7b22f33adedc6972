"""Time ``partition --list-cuts`` and one split on the largest zoo model and on two
500-node synthetic graphs (a MatMul/Sigmoid chain and a stack of residual blocks).

    python bench/bench_partition.py [--repeats 5] [--json out.json]

Columns (median of the repeats): ``list-cuts`` is the whole CLI path in-process
(load, optimize, ONNX Runtime analysis, enumeration, JSON); ``space`` builds a
``CutSpace`` (units, order, FLOPs) on an analysed graph; ``ideals`` enumerates the
cuts; ``plans`` enumerates and plans them (fresh space, nothing cached); ``split``
is ``partition --split <middle cut> -o DIR``; ``ort`` is ONNX Runtime session
creation of the same model, the baseline for the ratio line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import onnx
import onnxruntime as ort
from onnx import helper

from splitinfer.partitioner.cli import main as partition
from splitinfer.partitioner.cuts import CutSpace
from splitinfer.partitioner.pipeline import Prepared, prepare

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from graphs import chain, f32, make  # noqa: E402

N_NODES = 500
LIMIT_S = 1.0

Row = dict[str, float | int | str]


def residual_stack(n: int, width: int = 4) -> onnx.ModelProto:
    """``n`` nodes of blocks x -> a=Sigmoid -> b=Tanh -> Add(b, a): a cut inside a block
    carries two tensors; a Sigmoid/Tanh tail tops the count up to exactly ``n``."""
    nodes: list[onnx.NodeProto] = []
    prev = "x"
    for i in range(n // 3):
        nodes.append(helper.make_node("Sigmoid", [prev], [f"a{i}"]))
        nodes.append(helper.make_node("Tanh", [f"a{i}"], [f"b{i}"]))
        nodes.append(helper.make_node("Add", [f"b{i}", f"a{i}"], [f"c{i}"]))
        prev = f"c{i}"
    for j in range(n % 3):
        nodes.append(helper.make_node(("Sigmoid", "Tanh")[j], [prev], [f"t{j}"]))
        prev = f"t{j}"
    nodes[-1].output[0] = "y"
    model: onnx.ModelProto = make(nodes, [f32("x", ["N", width])], [f32("y", ["N", width])])
    return model


def median_fresh(make: Callable[[], Callable[[], object]], repeats: int) -> float:
    """Median seconds of ``make()()``, timing only the call (``make`` is the setup)."""
    times = []
    for _ in range(repeats):
        fn = make()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    return median_fresh(lambda: fn, repeats)


def run_cli(argv: list[str]) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        rc = partition(argv)
    if rc != 0:
        raise RuntimeError(f"partition {' '.join(argv)} exited with {rc}")


def export_zoo(out: Path) -> dict[str, Path]:
    import torch  # noqa: F401  (configures torch logging before we quieten it)
    from zoo import ZOO, export

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    paths: dict[str, Path] = {}
    for name, model in ZOO.items():
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            paths[name] = export(model, out / f"{name}.onnx")
    return paths


def bench(label: str, path: Path, prepared: Prepared, repeats: int, work: Path) -> Row:
    analysis = prepared.analysis
    plans = prepared.space.plans()
    middle = plans[len(plans) // 2].id
    space_s = median_time(lambda: CutSpace(analysis), repeats)
    ideals_s = median_fresh(lambda: CutSpace(analysis).ideals, repeats)
    plans_s = median_fresh(lambda: CutSpace(analysis).plans, repeats)
    list_s = median_time(lambda: run_cli([str(path), "--list-cuts", "--json", "-q"]), repeats)
    pkg = work / f"pkg-{label}"
    split_s = median_time(
        lambda: run_cli([str(path), "--split", middle, "-o", str(pkg), "-q"]), repeats
    )
    providers = ["CPUExecutionProvider"]
    ort_s = median_time(lambda: ort.InferenceSession(str(path), providers=providers), repeats)
    return {
        "model": label,
        "nodes": prepared.nodes_after,
        "units": len(prepared.space.units),
        "cuts": len(plans),
        "split_cut": middle,
        "list_cuts_s": list_s,
        "space_s": space_s,
        "ideals_s": ideals_s,
        "plans_s": plans_s,
        "split_s": split_s,
        "ort_session_s": ort_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="timed runs per figure (median)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-partition-") as tmp:
        work = Path(tmp)
        zoo_dir = work / "zoo"
        zoo_dir.mkdir()
        t0 = time.perf_counter()
        zoo = {name: (path, prepare(path)) for name, path in export_zoo(zoo_dir).items()}
        print(f"exported and prepared the zoo in {time.perf_counter() - t0:.1f} s", flush=True)
        largest = max(zoo, key=lambda n: zoo[n][1].nodes_after)
        cases = [(f"zoo:{largest}", *zoo[largest])]
        for label, model in (
            (f"chain{N_NODES}", chain(N_NODES)),
            (f"residual{N_NODES}", residual_stack(N_NODES)),
        ):
            path = work / f"{label}.onnx"
            onnx.save(model, str(path))
            cases.append((label, path, prepare(path)))
        for label, path, prepared in cases:
            print(f"benchmarking {label} ...", flush=True)
            rows.append(bench(label, path, prepared, args.repeats, work))
    head = f"{'model':<16}{'nodes':>6}{'units':>6}{'cuts':>6}"
    cols = ("list_cuts_s", "space_s", "ideals_s", "plans_s", "split_s", "ort_session_s")
    names = ("list-cuts", "space", "ideals", "plans", "split", "ort")
    print(f"\nmedian of {args.repeats} runs, seconds")
    print(head + "".join(f"{n:>11}" for n in names))
    for r in rows:
        line = f"{r['model']:<16}{r['nodes']:>6}{r['units']:>6}{r['cuts']:>6}"
        print(line + "".join(f"{float(r[c]):>11.4f}" for c in cols))
    print("\nenumeration (ideals) / ONNX Runtime session creation of the same model:")
    for r in rows:
        ratio = float(r["ideals_s"]) / float(r["ort_session_s"])
        print(f"  {r['model']:<16}{ratio:8.3f}x")
    synth = [r for r in rows if not str(r["model"]).startswith("zoo:")]
    worst = max(float(r["space_s"]) + float(r["plans_s"]) for r in synth)
    ok = worst < LIMIT_S
    verdict = "PASS" if ok else "FAIL"
    print(
        f"\n{verdict}: space + enumeration + planning of the {N_NODES}-node graphs "
        f"{worst:.3f} s (limit {LIMIT_S:.1f} s)"
    )
    total = time.perf_counter() - t_start
    print(f"total {total:.1f} s")
    if args.json is not None:
        doc = {
            "repeats": args.repeats,
            "limit_s": LIMIT_S,
            "pass": ok,
            "worst_s": worst,
            "total_s": total,
            "rows": rows,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
