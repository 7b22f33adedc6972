"""Run every benchmark and write the summary: docs/benchmarks.md and docs/benchmarks.json.

    python bench/run_all.py [--quick] [--only NAME,...] [--out docs]

Each benchmark is a script in this folder that prints its own figures and its
ratios against a baseline measured in the same run, with PASS/FAIL lines
against its target. This runner executes them one after another (never in
parallel: they time things), keeps their output, collects their verdict lines
and writes one page with the machine it ran on. A benchmark that crashes is
reported as such; the others still run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: name -> (script, arguments for a full run, arguments for --quick, what it measures)
BENCHES: dict[str, tuple[str, list[str], list[str], str]] = {
    "partition": ("bench_partition.py", [], ["--quick"],
                  "partition time and peak RSS on the real-scale zoo vs ONNX Runtime"),
    "codecs": ("bench_codecs.py", [], ["--repeats", "3"],
               "wire codecs on real cut activations: ratio, throughput, agreement"),
    "int8": ("bench_int8.py", [], ["--quick"], "INT8 QDQ edge segments vs fp32; digits agreement"),
    "costmodel": ("bench_costmodel.py", [], ["--quick"],
                  "predicted best cut vs the best measured end to end, per link"),
    "privacy": ("bench_privacy.py", ["--plot", "docs/privacy-curve.png"], ["--quick"],
                "digits accuracy vs epsilon at every cut, with and without the bottleneck"),
    "cloud": ("bench_cloud.py", [], ["--quick"],
              "cloud service throughput and latency vs a bare session and a peer server"),
    "frontend": ("bench_frontend.py", [], ["--rounds", "1", "--no-unet"],
                 "cloud front end CPU per request vs the baseline commit and LitServe; U-Net"),
    "edge": ("bench_edge.py", [], ["--quick"], "edge agent overhead per request"),
    "hostile": ("bench_hostile.py", [], ["--quick"],
                "both daemons under slow, idle and oversized clients: good answers, RSS, sockets"),
    "moe": ("bench_moe.py", [], ["--quick"],
            "MoE expert cache: throughput at cache budgets vs all-resident and naive paging"),
    "input_codecs": ("bench_input_codecs.py", [], ["--quick"],
                     "raw inputs as PNG/JPEG vs raw and int8+zstd: bytes, time, error"),
    "scaleout": ("bench_scaleout.py", [], ["--quick"],
                 "single-process cloud service vs two Ray Serve replicas (two CPUs bound it)"),
}  # fmt: skip

VERDICT = re.compile(r"\b(PASS|FAIL)\b")


def machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numpy
    import onnxruntime

    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "os": platform.platform(),
        "onnxruntime": onnxruntime.__version__,
        "numpy": numpy.__version__,
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def run(name: str, quick: bool) -> dict[str, object]:
    script, full, short, what = BENCHES[name]
    argv = [sys.executable, str(HERE / script), *(short if quick else full)]
    print(f"== {name}: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    took = time.perf_counter() - t0
    out = proc.stdout + (f"\n[stderr tail]\n{proc.stderr[-2000:]}" if proc.returncode else "")
    verdicts = [line.strip() for line in proc.stdout.splitlines() if VERDICT.search(line)]
    print(
        f"   exit {proc.returncode}, {took:.0f} s, {len(verdicts)} verdict line(s)", file=sys.stderr
    )
    return {
        "name": name,
        "what": what,
        "command": f"python bench/{script} {' '.join(short if quick else full)}".strip(),
        "exit": proc.returncode,
        "seconds": round(took, 1),
        "when": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "verdicts": verdicts,
        "output": out.strip(),
    }


def write(results: list[dict[str, object]], info: dict[str, str], quick: bool, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    (out / "benchmarks.json").write_text(
        json.dumps({"when": stamp, "quick": quick, "machine": info, "results": results}, indent=2)
        + "\n"
    )
    lines = [
        "# Benchmarks",
        "",
        f"Written by `python bench/run_all.py{' --quick' if quick else ''}` on {stamp} "
        "(a run with `--only` keeps the other benchmarks' earlier results: the `run` "
        "column says when each ran). "
        "Every figure below is printed by a script in `bench/` and compares against a "
        "baseline measured in the same run. This machine is shared and noisy: ratios "
        "are more trustworthy than absolute times.",
        "",
        "| machine | |",
        "| --- | --- |",
        *[f"| {k} | {v} |" for k, v in info.items()],
        "",
        "## Verdicts",
        "",
        "| benchmark | what | run | exit | seconds | PASS | FAIL |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        v = [str(x) for x in r["verdicts"]]  # type: ignore[attr-defined]
        passes = sum("PASS" in x for x in v)
        fails = sum("FAIL" in x for x in v)
        lines.append(
            f"| {r['name']} | {r['what']} | {r.get('when', '')} | {r['exit']} | {r['seconds']} "
            f"| {passes} | {fails} |"
        )
    for r in results:
        lines += [
            "",
            f"## {r['name']}",
            "",
            f"`{r['command']}`",
            "",
            "```text",
            str(r["output"]),
            "```",
        ]
    (out / "benchmarks.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="each benchmark's short run")
    p.add_argument(
        "--only",
        help=f"comma-separated subset of {','.join(BENCHES)}; the others' last results are kept",
    )
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="where the summary goes")
    args = p.parse_args(argv)
    names = list(BENCHES) if not args.only else args.only.split(",")
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"run_all: error: unknown benchmark(s) {unknown}; known: {list(BENCHES)}",
              file=sys.stderr)  # fmt: skip
        return 2
    info = machine()
    results = [run(n, args.quick) for n in names]
    if args.only:  # keep the other benchmarks' latest results
        old = args.out / "benchmarks.json"
        if old.is_file():
            earlier = json.loads(old.read_text())
            kept = [r for r in earlier["results"] if r["name"] not in names]
            for r in kept:  # results from before runs were dated ran with the whole page
                r.setdefault("when", earlier.get("when", ""))
            results = sorted(
                kept + results,
                key=lambda r: list(BENCHES).index(r["name"]) if r["name"] in BENCHES else 99,
            )
    write(results, info, args.quick, args.out)
    print(f"wrote {args.out / 'benchmarks.md'} and {args.out / 'benchmarks.json'}")
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
