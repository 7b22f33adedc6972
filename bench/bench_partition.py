"""Speed and memory of ``partition`` on the real-scale zoo, against ONNX Runtime; and cut
enumeration on the largest small-zoo model and two 500-node synthetic graphs.

    python bench/bench_partition.py [--quick] [--models a,b] [--repeats 5] [--json out.json] [-q]

**Budgets** (issue 15), each run of ``partition`` in a fresh child process (wall
time from spawn to exit, peak RSS from ``os.wait4``), each against the same
model loaded into an ONNX Runtime session and run once, also in a fresh child
(the ratio line: how many such loads the partition costs):

- ``--split auto`` (defaults: measured per-node times, INT8 edge, synthetic
  calibration) on the 22M-parameter sentence encoder (``minilm``) at 128
  tokens: <= 20 s and <= 1.5 GB peak RSS;
- ``--split auto`` on ResNet-50 at 224x224: <= 30 s and <= 2 GB;
- ``--list-cuts`` on every real-scale zoo model: <= 5 s.

One PASS/FAIL line per budget. ``--quick`` checks ``--list-cuts`` on a few
models only and takes one synthetic repeat. Progress goes to stderr (``-q``
silences it).

**Synthetic** columns (median of the repeats): ``list-cuts`` is the whole CLI
path in-process (load, optimize, ONNX Runtime analysis, enumeration, JSON);
``space`` builds a ``CutSpace`` (units, order, FLOPs) on an analysed graph;
``ideals`` enumerates the cuts; ``plans`` enumerates and plans them (fresh
space, nothing cached); ``split`` is ``partition --split <middle cut> -o DIR``;
``ort`` is ONNX Runtime session creation of the same model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from splitinfer.models.zoo import REAL, SMALL, export
from splitinfer.partitioner.cli import main as partition
from splitinfer.partitioner.cuts import CutSpace
from splitinfer.partitioner.pipeline import Prepared, prepare
from splitinfer.shared.ortsession import open_session

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from graphs import chain, f32, make  # noqa: E402

N_NODES = 500
LIMIT_S = 1.0
GB = 10**9
#: (model, wall seconds, peak RSS bytes) of the --split auto budgets
AUTO_BUDGETS = (("minilm", 20.0, 1.5 * GB), ("resnet50", 30.0, 2.0 * GB))
LIST_CUTS_S = 5.0
QUICK_MODELS = ("minilm", "resnet50", "mobilenetv3", "unet")

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
    """The small zoo (``models/zoo.py``), exported quietly."""
    import torch  # noqa: F401  (configures torch logging before we quieten it)

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    paths: dict[str, Path] = {}
    for name, model in SMALL.items():
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
    ort_s = median_time(lambda: open_session(path, log_severity=2), repeats)
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


@dataclass
class Budget:
    what: str
    model: str
    unit: str  # "s" or "GB"
    measured: float
    limit: float
    baseline: float  # the ONNX Runtime load-and-run figure, same unit
    note: str = ""
    #: where the run's time went (:meth:`Child.phases`), printed under a failed budget
    phases: str = ""

    @property
    def ok(self) -> bool:
        return self.measured <= self.limit

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pass": self.ok}


@dataclass
class Child:
    wall_s: float
    peak_rss: int  # bytes
    rc: int
    stderr: str
    #: (seconds since the spawn, line) of each line it wrote on stderr
    lines: list[tuple[float, str]] = field(default_factory=list)

    def phases(self, prefix: str = "partition: ") -> str:
        """Where its wall time went, from the times of its progress lines: each
        phase lasts from its line to the next (start-up: until the first line)."""
        marks = [(t, ln.removeprefix(prefix)) for t, ln in self.lines if ln.startswith(prefix)]
        if not marks:
            return ""
        spent: dict[str, float] = {"start-up": marks[0][0]}
        ends = [t for t, _ in marks[1:]] + [self.wall_s]
        for (t, what), end in zip(marks, ends, strict=True):
            # "building cut 2/6: c0 ..." and "measuring the codec on 19/192 ..." add up
            label = what.split(" (")[0].split(":")[0]
            label = re.sub(r"\s+/\S*|\s*\d+/\d+.*", "", label)[:40]  # no paths, no counts
            spent[label] = spent.get(label, 0.0) + end - t
        return ", ".join(f"{k} {v:.2f}" for k, v in spent.items()) + " (s)"


def run_child(argv: list[str], work: Path) -> Child:
    """Run ``argv`` in a fresh process: its wall time, its own peak RSS (``wait4``) and
    the time of each line it writes on stderr."""
    out = work / "child.out"
    lines: list[tuple[float, str]] = []
    with out.open("wb") as o:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=o, stderr=subprocess.PIPE, text=True, errors="replace")

        def read() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.append((time.perf_counter() - t0, line.rstrip("\n")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        reader.join(10)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4
    text = "\n".join(line for _, line in lines)
    return Child(wall, int(usage.ru_maxrss) * 1024, proc.returncode, text, lines)


EXPORT_CHILD = """
import sys
from pathlib import Path
from splitinfer.models.zoo import REAL, export
export(REAL[sys.argv[1]], Path(sys.argv[2]))
"""

ORT_CHILD = """
import sys, numpy as np
from splitinfer.shared.ortsession import open_session
feeds = dict(np.load(sys.argv[2]))
sess = open_session(sys.argv[1], log_severity=2)
sess.run(None, feeds)
"""


def ort_baseline(path: Path, name: str, work: Path) -> Child:
    """ONNX Runtime creating a session of the model and running it once, in a fresh child."""
    feeds = work / f"{name}-feeds.npz"
    np.savez(feeds, **REAL[name].sample(1))
    child = run_child([sys.executable, "-c", ORT_CHILD, str(path), str(feeds)], work)
    if child.rc != 0:
        raise RuntimeError(f"ONNX Runtime failed on {name}: {child.stderr.strip()[-500:]}")
    return child


def partition_child(argv: list[str], work: Path) -> Child:
    cmd = [sys.executable, "-m", "splitinfer.partitioner.cli", *argv]
    return run_child(cmd, work)


def real_scale(
    names: list[str], auto: bool, work: Path, say: Callable[[str], None]
) -> list[Budget]:
    """Export the models, then time every budgeted ``partition`` run and its baseline."""
    wanted = list(dict.fromkeys([*names, *([m for m, _, _ in AUTO_BUDGETS] if auto else [])]))
    paths: dict[str, Path] = {}
    for name in wanted:
        t0 = time.perf_counter()
        paths[name] = work / "real" / name / f"{name}.onnx"
        # in a child: torch stays out of this process, whose size a forked child
        # inherits (and ru_maxrss would count) until it execs
        c = run_child([sys.executable, "-c", EXPORT_CHILD, name, str(paths[name])], work)
        if c.rc != 0:
            raise RuntimeError(f"exporting {name} failed: {c.stderr.strip()[-500:]}")
        say(f"exported {name} in {time.perf_counter() - t0:.1f} s")
    os.sync()  # the exported weights' write-back must not land in the timed runs
    base = {}
    for name in wanted:
        base[name] = ort_baseline(paths[name], name, work)
        say(f"{name}: ONNX Runtime session + one run {base[name].wall_s:.2f} s")
    budgets: list[Budget] = []
    for name in names:
        say(f"{name}: partition --list-cuts")
        shape = REAL[name].input_shape_args(1)
        c = partition_child([str(paths[name]), "--list-cuts", *shape], work)
        note = "" if c.rc == 0 else f"exit {c.rc}: {_last_line(c.stderr)}"
        wall = c.wall_s if c.rc == 0 else float("inf")
        budgets.append(
            Budget("--list-cuts", name, "s", wall, LIST_CUTS_S, base[name].wall_s, note, c.phases())
        )
    if auto:
        for name, limit_s, limit_rss in AUTO_BUDGETS:
            say(f"{name}: partition --split auto (this takes a while)")
            shape = REAL[name].input_shape_args(1)
            pkg = work / f"pkg-{name}"
            c = partition_child([str(paths[name]), "--split", "auto", "-o", str(pkg), *shape], work)
            note = "" if c.rc == 0 else f"exit {c.rc}: {_last_line(c.stderr)}"
            wall = c.wall_s if c.rc == 0 else float("inf")
            b = base[name]
            budgets.append(
                Budget("--split auto", name, "s", wall, limit_s, b.wall_s, note, c.phases())
            )
            rss = c.peak_rss / GB
            budgets.append(
                Budget("  peak RSS", name, "GB", rss, limit_rss / GB, b.peak_rss / GB, note)
            )
    return budgets


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no message"


def budget_table(budgets: list[Budget]) -> str:
    lines = [
        "",
        "budgets (issue 15): each partition run in a fresh process; baseline = a fresh "
        "process creating an ONNX Runtime session of the same model and running it once",
        f"{'budget':<14}{'model':<17}{'measured':>10}{'limit':>9}{'ORT':>9}{'ratio':>9}  verdict",
    ]
    for b in budgets:
        ratio = b.measured / b.baseline if b.baseline > 0 else float("inf")
        lines.append(
            f"{b.what:<14}{b.model:<17}{b.measured:>8.2f} {b.unit:<1}{b.limit:>7.1f} {b.unit:<1}"
            f"{b.baseline:>7.2f} {b.unit:<1}{ratio:>8.1f}x  {'PASS' if b.ok else 'FAIL'}"
            + (f"  ({b.note})" if b.note else "")
        )
    shown = [b for b in budgets if b.phases and (not b.ok or b.what == "--split auto")]
    if shown:
        lines.append("where the time went (from its progress lines): --split auto, failed budgets")
        lines += [f"  {b.what.strip()} {b.model}: {b.phases}" for b in shown]
    return "\n".join(lines)


def synthetic(args: argparse.Namespace, work: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """Enumeration and planning on the largest small-zoo model and two 500-node graphs."""
    rows: list[Row] = []
    zoo_dir = work / "zoo"
    zoo_dir.mkdir()
    t0 = time.perf_counter()
    zoo = {name: (path, prepare(path)) for name, path in export_zoo(zoo_dir).items()}
    say(f"exported and prepared the small zoo in {time.perf_counter() - t0:.1f} s")
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
        say(f"benchmarking {label} ...")
        rows.append(bench(label, path, prepared, args.repeats, work))
    head = f"{'model':<16}{'nodes':>6}{'units':>6}{'cuts':>6}"
    cols = ("list_cuts_s", "space_s", "ideals_s", "plans_s", "split_s", "ort_session_s")
    names = ("list-cuts", "space", "ideals", "plans", "split", "ort")
    print(f"\nsynthetic graphs, median of {args.repeats} runs, seconds")
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
    print(
        f"\n{'PASS' if ok else 'FAIL'}: space + enumeration + planning of the {N_NODES}-node "
        f"graphs {worst:.3f} s (limit {LIMIT_S:.1f} s)"
    )
    return {"pass": ok, "worst_s": worst, "limit_s": LIMIT_S, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="timed runs per synthetic figure")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"one synthetic repeat; --list-cuts budget on {', '.join(QUICK_MODELS)} only",
    )
    p.add_argument("--models", help="comma-separated real-zoo models for the --list-cuts budget")
    p.add_argument("--no-synthetic", action="store_true", help="only the real-scale budgets")
    p.add_argument("--no-auto", action="store_true", help="skip the two --split auto budgets")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the figures as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 1

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"bench_partition: {msg}", file=sys.stderr, flush=True)

    names = list(REAL) if not args.models else args.models.split(",")
    if args.quick and not args.models:
        names = list(QUICK_MODELS)
    unknown = [n for n in names if n not in REAL]
    if unknown:
        print(f"bench_partition: error: unknown model(s) {unknown}; known: {list(REAL)}",
              file=sys.stderr)  # fmt: skip
        return 2
    t_start = time.perf_counter()
    doc: dict[str, Any] = {"repeats": args.repeats, "quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="bench-partition-") as tmp:
        work = Path(tmp)
        # the real-scale budgets first: the synthetic part imports torch into this process
        budgets = real_scale(names, not args.no_auto, work, say)
        if not args.no_synthetic:
            doc["synthetic"] = synthetic(args, work, say)
    print(budget_table(budgets))
    doc["budgets"] = [b.to_dict() for b in budgets]
    ok = all(b.ok for b in budgets) and doc.get("synthetic", {}).get("pass", True)
    total = time.perf_counter() - t_start
    print(f"total {total:.1f} s")
    doc["total_s"] = total
    doc["pass"] = ok
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
