"""The README's and docs' shell commands, followed literally, work.

Every command of a ``sh``/``bash``/``shell`` block (each non-comment line) and of a
``console`` block or a bare block (each ``$ `` line) in README.md and docs/*.md is
extracted, its continuation lines (``\\``) joined, and split at ``&&``, ``;``, ``|``
and ``&`` into simple commands. Each one is **parsed**:

* one of splitinfer's programs (``partition``, ``cloud-service``, ``edge-agent``,
  ``netsim``, ``splitinfer-demo``, ``splitinfer-triton``): every flag it names
  (``--flag``, ``-o``; placeholders such as ``[--json]`` too) appears in that
  program's (or sub-command's) own ``--help``;
* ``python -c CODE``: CODE compiles; ``python SCRIPT``: the script is in the
  repository and defines every flag given;
* ``make TARGET``: the Makefile has the target;
* ``serve run MODULE:ATTR key=value ...`` (Ray Serve): the module is in the
  package and defines ATTR, every key is a ``ScaleConfig`` field or a
  cloud-service option, and the line says how devices authenticate
  (``credentials=`` or ``no_auth=true``: the service refuses to start otherwise);
* anything else must be a program on :data:`EXTERNAL` (so a new one is a decision).

The cheap ones are also **run** as written, in a scratch copy of the repository's
``sim/scenarios`` and ``sim/traces`` (:data:`CHEAP`, an explicit allowlist keyed by
the file and the exact command): they must exit as the docs say and, where the docs
show the output's first line, print it. An allowlisted command that is no longer in
its file fails the test, so the list cannot rot into testing nothing.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"sh", "bash", "shell"}
PROMPT_LANGS = {"console", ""}
OPERATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<", "2>", "2>&1"}

#: splitinfer's programs: module of their ``main(argv)``, and sub-commands with a help of
#: their own
OURS: dict[str, tuple[str, tuple[str, ...]]] = {
    "partition": ("splitinfer.partitioner.cli", ()),
    "cloud-service": ("splitinfer.cloud.cli", ()),
    "edge-agent": ("splitinfer.edge.cli", ("profile",)),
    "netsim": ("splitinfer.sim.cli", ("link", "run", "compare", "fleet")),
    "splitinfer-demo": ("splitinfer.demo", ()),
    "splitinfer-triton": ("splitinfer.cloud.triton", ()),
}
#: programs that are not ours and are only checked to be named here
EXTERNAL = frozenset(
    {"mkdir", "cp", "mv", "rm", "cat", "curl", "openssl", "pip", "kill", "ls", "sleep"}
)
#: shell keywords and builtins a block may use around our commands
SHELL = frozenset(
    {".", "source", "cd", "export", "for", "until", "while", "do", "done", "if", "then", "fi"}
)


@dataclass
class Command:
    file: Path
    line: int
    text: str
    #: the lines a console block shows after the command (its output)
    output: list[str] = field(default_factory=list)

    def where(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}: {self.text}"


def commands(path: Path) -> list[Command]:
    """The shell commands of ``path``'s fenced blocks (see the module docstring)."""
    found: list[Command] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i + 1
        end = start
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        body = lines[start:end]
        if lang in SHELL_LANGS or (lang in PROMPT_LANGS and any(b.startswith("$ ") for b in body)):
            found += _block(path, start, body, prompt=lang not in SHELL_LANGS)
        i = end + 1
    return found


def _block(path: Path, first: int, body: list[str], prompt: bool) -> list[Command]:
    out: list[Command] = []
    j = 0
    while j < len(body):
        raw = body[j]
        is_cmd = raw.startswith("$ ") if prompt else bool(raw.strip()) and not raw.startswith("#")
        if not is_cmd:
            if prompt and out:
                out[-1].output.append(raw)
            j += 1
            continue
        text, line = (raw[2:] if prompt else raw), first + j + 1
        while text.rstrip().endswith("\\") and j + 1 < len(body):
            j += 1
            text = text.rstrip()[:-1] + " " + body[j].strip()
        out.append(Command(path, line, text.strip()))
        j += 1
    return out


def simple_commands(text: str) -> list[list[str]]:
    """``text`` split into simple commands (argv lists), comments, operators and
    redirections removed, optional ``[...]`` placeholders unwrapped."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|<>")
    lex.whitespace_split = True
    lex.commenters = "#"
    parts: list[list[str]] = [[]]
    skip = False
    for token in lex:
        if token in OPERATORS:
            parts.append([])
        elif token in REDIRECTS or token.endswith(">"):
            skip = True
        elif skip:
            skip = False
        else:
            parts[-1].append(token.strip("[]"))
    return [p for p in parts if p]


def flags(argv: list[str]) -> list[str]:
    """The option names of ``argv`` (``--a=b`` -> ``--a``)."""
    return [t.split("=", 1)[0] for t in argv if re.match(r"^--?[A-Za-z]", t)]


_HELP: dict[tuple[str, ...], str] = {}


def help_text(program: str, sub: tuple[str, ...]) -> str:
    """``program [sub] --help``, run in process (this checkout's code)."""
    key = (program, *sub)
    if key not in _HELP:
        import importlib

        main = importlib.import_module(OURS[program][0]).main
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            main([*sub, "--help"])
        _HELP[key] = buf.getvalue()
    return _HELP[key]


def _has_flag(help_: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_) is not None


def check(argv: list[str]) -> list[str]:
    """What is wrong with one simple command (nothing: an empty list)."""
    program, args = argv[0], argv[1:]
    if program in OURS:
        subs = OURS[program][1]
        positional = [a for a in args if not a.startswith("-")]
        sub = (positional[0],) if positional and positional[0] in subs else ()
        text = help_text(program, sub)
        name = " ".join((program, *sub))
        return [f"{name} has no {f}" for f in flags(args) if not _has_flag(text, f)]
    if program in ("python", "python3"):
        return _check_python(args)
    if program == "make":
        makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
        targets = [a for a in args if "=" not in a and not a.startswith("-")]
        return [
            f"Makefile has no target {t}"
            for t in targets
            if not re.search(rf"^{t}:", makefile, re.M)
        ]
    if program == "serve":
        return _check_serve(args)
    if program not in EXTERNAL | SHELL:
        return [f"unknown program {program!r} (add it to EXTERNAL if it is not ours)"]
    return []


def _check_python(args: list[str]) -> list[str]:
    if args[:1] == ["-c"]:
        try:
            compile(args[1], "<doc>", "exec")
        except SyntaxError as exc:
            return [f"python -c does not compile: {exc}"]
        return []
    if args[:1] == ["-m"] and len(args) > 1:
        # python -m splitinfer.X: a module of the package, defining every flag given
        parts = args[1].split(".")
        script = ROOT.joinpath(*parts[1:]).with_suffix(".py")
        if parts[0] != "splitinfer" or not script.is_file():
            return [f"no module {args[1]} in the package"]
        source = script.read_text(encoding="utf-8")
        return [f"{args[1]} has no {f}" for f in flags(args[2:]) if f'"{f}"' not in source]
    script = ROOT / args[0]
    if not script.is_file():
        return [f"no script {args[0]}"]
    source = script.read_text(encoding="utf-8")
    return [f"{args[0]} has no {f}" for f in flags(args[1:]) if f'"{f}"' not in source]


def _check_serve(args: list[str]) -> list[str]:
    from dataclasses import fields

    from splitinfer.cloud.scale.config import ScaleConfig

    if args[:1] != ["run"] or len(args) < 2 or ":" not in args[1]:
        return ["expected serve run MODULE:ATTR key=value ..."]
    module, attr = args[1].split(":", 1)
    path = ROOT.joinpath(*module.split(".")[1:]).with_suffix(".py")
    problems = []
    if not path.is_file() or not re.search(rf"^def {attr}\(", path.read_text(), re.M):
        problems.append(f"{module} defines no {attr}")
    keys = [a.split("=", 1)[0] for a in args[2:]]
    scale = {f.name for f in fields(ScaleConfig)}
    service = help_text("cloud-service", ())
    for key in keys:
        top = key.split(".", 1)[0]
        if (
            key not in scale
            and "." not in key
            and not _has_flag(service, "--" + top.replace("_", "-"))
        ):
            problems.append(
                f"serve run: {key} is neither a ScaleConfig field nor a cloud-service option"
            )
    if "credentials" not in keys and "no_auth=true" not in args:
        problems.append(
            "serve run without credentials= or no_auth=true: the service refuses to start"
        )
    return problems


def all_commands() -> list[Command]:
    return [c for path in DOCS for c in commands(path)]


# -- parsed: every command ----------------------------------------------------------------


def test_the_extractor_finds_the_commands_it_should() -> None:
    found = {(c.file.name, c.text) for c in all_commands()}
    assert any(
        f == "README.md" and t.startswith("netsim run sim/scenarios/att-lte") for f, t in found
    )
    assert ("cloud-service.md", "cloud-service --repository models") in found
    # continuation lines are joined; output lines are the command's, not commands
    edge = [
        c
        for c in all_commands()
        if c.file.name == "edge-agent.md" and c.text.startswith("edge-agent --package")
    ]
    assert edge
    assert "--listen" in edge[0].text
    assert not any(c.text.startswith("cloud-service: error") for c in all_commands())
    assert simple_commands("mkdir -p a && cp -r b a/1 # x") == [
        ["mkdir", "-p", "a"],
        ["cp", "-r", "b", "a/1"],
    ]
    assert simple_commands("partition M.onnx --list-cuts [--json] > out.txt") == [
        ["partition", "M.onnx", "--list-cuts", "--json"]
    ]


def test_the_checks_catch_what_they_are_for() -> None:
    assert check(["netsim", "run", "s.toml", "--no-such-flag"]) == [
        "netsim run has no --no-such-flag"
    ]
    assert check(["make", "no-such-target"])
    assert check(["frobnicate"])
    assert check(["python", "-c", "import ("])
    no_auth = ["run", "splitinfer.cloud.scale.ray_serve:app_builder", "repository=repo"]
    assert any("credentials" in p for p in check(["serve", *no_auth]))
    assert check(["serve", *no_auth, "no_auth=true"]) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_names_programs_and_flags_that_exist(doc: Path) -> None:
    problems = [
        f"{c.where()}\n    {p}"
        for c in commands(doc)
        for argv in simple_commands(c.text)
        for p in check(argv)
    ]
    assert not problems, "\n".join(problems)


# -- run: the cheap ones --------------------------------------------------------------------


@dataclass(frozen=True)
class Cheap:
    """How an allowlisted command is run: its exit code, and a check of the scratch folder."""

    rc: int = 0
    after: Callable[[Path], None] | None = None
    #: a command that takes more than a few seconds here (marked slow, with why)
    slow: str = ""


def _scenarios_load(work: Path) -> None:
    from splitinfer.sim.scenario import load_scenario

    for toml in sorted((work / "sim" / "scenarios").glob("*.toml")):
        if toml.name.startswith("fleet"):  # netsim fleet's format: tests/test_fleet.py
            continue
        scenario = load_scenario(toml)  # the model the scenario names is there now
        assert scenario.model.is_file(), toml


def _is_npy(name: str) -> Callable[[Path], None]:
    def after(work: Path) -> None:
        import numpy as np

        assert np.load(work / name).shape == (2, 3, 16, 16)

    return after


EXPORT = "python -c \"from splitinfer.models.digits import export_digits; export_digits('{}')\""

#: (file, command) -> how it runs. Cheap: seconds, no daemon, nothing beyond loopback.
CHEAP: dict[tuple[str, str], Cheap] = {
    (
        "README.md",
        EXPORT.format("sim/scenarios/digits.onnx") + "  # the model the scenarios name",
    ): Cheap(after=_scenarios_load, slow="trains the digits CNN: 10-30 s on 2 shared cores"),
    ("cloud-service.md", "cloud-service --repository models"): Cheap(rc=2),
    ("cloud-service.md", "cloud-service --repository models --set batching.nope=1"): Cheap(rc=2),
    (
        "edge-agent.md",
        "python -c \"import numpy as np; np.save('x.npy', "
        "np.random.rand(2, 3, 16, 16).astype('float32'))\"",
    ): Cheap(after=_is_npy("x.npy")),
}


def _find(file: str, text: str) -> Command:
    for c in all_commands():
        if c.file.name == file and (
            c.text == text or c.text == text.split("  #", maxsplit=1)[0].strip()
        ):
            return c
    raise AssertionError(f"allowlisted command no longer in {file}: {text}")


def _run(argv: list[str], cwd: Path) -> tuple[int, str]:
    if argv[0] in OURS:  # in process, this checkout's code, as the console script would
        import importlib
        import os

        main = importlib.import_module(OURS[argv[0]][0]).main
        err, out = io.StringIO(), io.StringIO()
        old = Path.cwd()
        os.chdir(cwd)
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                try:
                    rc = main(argv[1:])
                except SystemExit as exc:
                    rc = exc.code if isinstance(exc.code, int) else 1
        finally:
            os.chdir(old)
        return rc, out.getvalue() + err.getvalue()
    exe = sys.executable if argv[0] in ("python", "python3") else shutil.which(argv[0])
    assert exe, argv[0]
    done = subprocess.run(
        [exe, *argv[1:]], check=False, cwd=cwd, capture_output=True, text=True, timeout=300
    )
    return done.returncode, done.stdout + done.stderr


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A scratch folder shaped like the repository root where commands write."""
    for sub in ("sim/scenarios", "sim/traces"):
        shutil.copytree(
            ROOT / sub, tmp_path / sub, ignore=shutil.ignore_patterns("*.onnx", "__pycache__")
        )
    (tmp_path / "models").mkdir()
    return tmp_path


@pytest.mark.integration  # runs programs (subprocesses)
@pytest.mark.parametrize(
    "key",
    [pytest.param(k, marks=[pytest.mark.slow] if v.slow else []) for k, v in CHEAP.items()],
    ids=lambda k: f"{k[0]}:{k[1][:40]}",
)
def test_the_cheap_commands_run_as_written(key: tuple[str, str], work: Path) -> None:
    command = _find(*key)
    spec = CHEAP[key]
    for argv in simple_commands(command.text):
        rc, printed = _run(argv, work)
        assert rc == spec.rc, f"{command.where()}\nexit {rc}:\n{printed}"
    shown = [line for line in command.output if line.strip()]
    if shown:  # the docs show the output's first line: it is what the command prints
        assert shown[0].strip() in printed, f"{command.where()}\ndocs: {shown[0]}\ngot:  {printed}"
    if spec.after is not None:
        spec.after(work)


@pytest.mark.integration
def test_the_bundled_scenarios_need_only_the_documented_export(work: Path) -> None:
    # without the README's export line the scenarios name a model that is not there
    from splitinfer.shared.errors import ConfigError
    from splitinfer.sim.scenario import load_scenario

    with pytest.raises(ConfigError, match=r"digits\.onnx"):
        load_scenario(work / "sim" / "scenarios" / "att-lte.toml")
    text = (ROOT / "sim" / "scenarios" / "att-lte.toml").read_text(encoding="utf-8")
    assert EXPORT.format("sim/scenarios/digits.onnx") in text
