"""The corpus of real models (``tests/corpus/models.toml``) through ``partition``, by hand:
one table row per model.

    python bench/corpus_table.py [--models a,b] [--no-fixed] [--json out.json] [--work DIR]

Per model, each ``partition`` a fresh child process (one OpenMP thread): ``--list-cuts
--json``, one fixed interior cut halfway down by depth (``--split CUT --precision
fp32``), and ``--split auto`` on built-in profiles (``raspberry-pi-5`` edge,
``x86-server`` cloud; INT8 edge, synthetic calibration, two run-time candidates, as
``tests/test_corpus.py`` runs it). Columns: nodes of the source
graph, valid cuts (listed or counted), the fixed cut and auto's choice (or the first
error line, with ``[known N]`` where ``models.toml`` expects it), seconds of list-cuts
+ fixed + auto, and for a refused model its reason. A command that prints a Python
traceback is marked ``TRACEBACK``. The wheels come from the corpus cache
(``$SPLITINFER_CORPUS_CACHE``, default ``~/.cache/splitinfer/corpus``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import corpus  # noqa: E402
from corpus import (  # noqa: E402
    AUTO_SPLIT,
    CorpusModel,
    Ran,
    cut_rows,
    fetch,
    middle,
    partition,
    valid_cuts,
)

CHOSE = re.compile(r"^chose (\S+) \((\w+)\)", re.MULTILINE)


@dataclass
class Row:
    model: str
    package: str
    nodes: int
    cuts: str
    fixed: str
    auto: str
    seconds: float
    refused: str
    tracebacks: int


def _outcome(model: CorpusModel, check: str, ran: Ran, ok: str) -> str:
    """``ok`` when it worked; else, for a failure ``models.toml`` expects, its category;
    else the first error line."""
    if ran.rc == 0 and "Traceback" not in ran.text:
        return ok
    if check == "auto" and model.auto_refused is not None:
        said = ran.text.strip().splitlines()
        if ran.rc == 2 and said[-1:] == [f"partition: error: {model.auto_refused}"]:
            return "refused by design (an input not batched on axis 0: a recurrent state)"
    known = model.known.get(check)
    if known is not None and known.match in ran.text:
        return f"fails, known ({known.category})"
    said = re.sub(r"^partition: (internal )?error: ", "", ran.error)
    return f"FAILS: {said[:140]}"


def survey(model: CorpusModel, work: Path, fixed: bool) -> Row:
    path = fetch(model)
    nodes = len(onnx.load(str(path), load_external_data=False).graph.node)
    runs: list[Ran] = []
    listed = partition(path, "--list-cuts", "--json", *model.shape_args)
    runs.append(listed)
    if model.refused is not None:
        said = listed.text.strip().splitlines()
        ok = listed.rc == 2 and said[-1:] == [f"partition: error: {model.refused}"]
        why = model.refused if ok else f"NOT AS EXPECTED: {listed.error}"
        tracebacks = int("Traceback" in listed.text)
        return Row(model.name, model.package, nodes, "-", "-", "-", listed.seconds, why, tracebacks)
    cuts, fixed_out, auto_out = _outcome(model, "list_cuts", listed, ""), "-", "-"
    rows = []
    if listed.rc == 0:
        rows = cut_rows(listed.out)
        cuts = f"{valid_cuts(listed.out):,}"
    if fixed and rows and (cut := middle(rows)) is not None:
        out = work / f"fixed-{cut}"
        ran = partition(path, "--split", cut, "--precision", "fp32", "-o", out, *model.shape_args)
        runs.append(ran)
        fixed_out = _outcome(model, "fixed", ran, f"{cut} ok")
    if listed.rc == 0:
        ran = partition(path, *AUTO_SPLIT, "-o", work / "auto", *model.shape_args)
        runs.append(ran)
        chose = CHOSE.search(ran.out)
        auto_out = _outcome(model, "auto", ran, f"{chose[1]} ({chose[2]})" if chose else "ok")
    seconds = sum(r.seconds for r in runs)
    tracebacks = sum("Traceback" in r.text for r in runs)
    return Row(model.name, model.package, nodes, cuts, fixed_out, auto_out, seconds, "", tracebacks)


def table(rows: list[Row]) -> str:
    out = [
        "| model | package | nodes | cuts | fixed interior cut | `--split auto` | s | refused |",
        "| --- | --- | ---: | ---: | --- | --- | ---: | --- |",
    ]
    for r in rows:
        tb = " TRACEBACK" if r.tracebacks else ""
        cells = [r.model, r.package, str(r.nodes), r.cuts, r.fixed, r.auto + tb]
        cells += [f"{r.seconds:.1f}", r.refused or "-"]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", help="comma-separated names (default: all)")
    p.add_argument("--no-fixed", action="store_true", help="skip the fixed interior cut")
    p.add_argument("--json", type=Path, help="also write the rows as JSON")
    p.add_argument("--work", type=Path, help="keep the packages here (default: a temp dir)")
    args = p.parse_args(argv)
    models = corpus.load()
    if args.models:
        wanted = args.models.split(",")
        unknown = set(wanted) - {m.name for m in models}
        if unknown:
            p.error(f"unknown models {sorted(unknown)}")
        models = [m for m in models if m.name in wanted]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in models:
            work = (args.work or Path(tmp)) / m.name
            rows.append(survey(m, work, fixed=not args.no_fixed))
            r = rows[-1]
            print(f"{r.model}: {r.cuts} cuts, fixed {r.fixed}, auto {r.auto}, "
                  f"{r.seconds:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
