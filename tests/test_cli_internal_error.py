"""No traceback from any command: a bug is one line and exit 70, its traceback only on
``--debug`` or ``SPLITINFER_DEBUG=1``; bad input is one line and exit 2."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import onnx
import pytest
from graphs import residual

from splitinfer.shared.cli import DEBUG_ENV, EXIT_INTERNAL, EXIT_USAGE, run_cli

pytestmark = pytest.mark.unit


class Tool(NamedTuple):
    prog: str
    module: str  # where main(argv) lives
    target: str  # "module:attribute" to make fail
    argv: tuple[str, ...]


TOOLS = [
    Tool("partition", "splitinfer.partitioner.cli", "splitinfer.partitioner.cli:prepare",
         ("m.onnx", "--list-cuts", "-q")),
    Tool("edge-agent", "splitinfer.edge.cli", "splitinfer.edge.cli:resolve",
         ("--cloud", "http://127.0.0.1:9",)),
    Tool("edge-agent", "splitinfer.edge.cli", "splitinfer.edge.profile:profile_package",
         ("profile", "--package", "pkg", "-o", "p.json")),
    Tool("cloud-service", "splitinfer.cloud.cli", "splitinfer.cloud.cli:config_from_args", ()),
    Tool("netsim", "splitinfer.sim.cli", "splitinfer.sim.cli:link_config",
         ("link", "--target", "127.0.0.1:9")),
    Tool("netsim", "splitinfer.sim.cli", "splitinfer.sim.scenario:load_scenario",
         ("run", "scenario.toml")),
    Tool("splitinfer-demo", "splitinfer.demo", "splitinfer.sim.traces:path", ("--quick",)),
    Tool("splitinfer-triton", "splitinfer.cloud.triton", "splitinfer.cloud.triton:open_package",
         ("pkg", "-o", "repo")),
]  # fmt: skip
IDS = [f"{t.prog}-{t.target.rpartition(':')[2]}" for t in TOOLS]


def boom(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("boom\n  on two lines")


def failing(tool: Tool, monkeypatch: pytest.MonkeyPatch) -> Callable[[Sequence[str]], int]:
    module, _, name = tool.target.partition(":")
    monkeypatch.setattr(importlib.import_module(module), name, boom)
    main: Callable[[Sequence[str]], int] = importlib.import_module(tool.module).main
    return main


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # the demo's --out and any stray file land here


@pytest.mark.parametrize("tool", TOOLS, ids=IDS)
def test_a_bug_is_one_line_and_exit_70(
    tool: Tool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert failing(tool, monkeypatch)(list(tool.argv)) == EXIT_INTERNAL == 70
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"{tool.prog}: internal error: RuntimeError: boom on two lines "
        "(run with --debug for the traceback)"
    ]
    assert "Traceback" not in out + err


@pytest.mark.parametrize("tool", TOOLS, ids=IDS)
@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_prints_the_traceback(
    tool: Tool, how: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = list(tool.argv)
    if how == "flag":
        argv.append("--debug")
    else:
        monkeypatch.setenv(DEBUG_ENV, "1")
    assert failing(tool, monkeypatch)(argv) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert "RuntimeError: boom" in err
    assert err.splitlines()[-1] == f"{tool.prog}: internal error: RuntimeError: boom on two lines"


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("splitinfer.sim.cli", ["--debug", "link", "--target", "127.0.0.1:9"]),
        ("splitinfer.edge.cli", ["--debug", "profile", "--package", "pkg", "-o", "p.json"]),
    ],
)
def test_debug_before_a_subcommand(
    module: str,
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(importlib.import_module("splitinfer.sim.cli"), "link_config", boom)
    monkeypatch.setattr(importlib.import_module("splitinfer.edge.profile"), "profile_package", boom)
    assert importlib.import_module(module).main(argv) == EXIT_INTERNAL
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["partition", "--help"],
        ["edge-agent", "--help"],
        ["edge-agent", "profile", "--help"],
        ["cloud-service", "--help"],
        ["netsim", "--help"],
        ["netsim", "link", "--help"],
        ["netsim", "run", "--help"],
        ["netsim", "compare", "--help"],
        ["splitinfer-demo", "--help"],
        ["splitinfer-triton", "--help"],
    ],
)
def test_every_help_shows_debug(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    module = {
        "partition": "splitinfer.partitioner.cli",
        "edge-agent": "splitinfer.edge.cli",
        "cloud-service": "splitinfer.cloud.cli",
        "netsim": "splitinfer.sim.cli",
        "splitinfer-demo": "splitinfer.demo",
        "splitinfer-triton": "splitinfer.cloud.triton",
    }[argv[0]]
    with pytest.raises(SystemExit) as info:
        importlib.import_module(module).main(argv[1:])
    assert info.value.code == 0
    assert "--debug" in capsys.readouterr().out


def test_run_cli_keeps_input_errors_at_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from splitinfer.shared.errors import ConfigError

    def body(_argv: Sequence[str] | None) -> int:
        raise ConfigError("bad\nflag")

    assert run_cli("tool", body, []) == EXIT_USAGE
    assert capsys.readouterr().err == "tool: error: bad flag\n"
    assert run_cli("tool", body, ["--", "--debug"]) == EXIT_USAGE  # after --: an operand
    assert capsys.readouterr().err == "tool: error: bad flag\n"


@pytest.mark.parametrize(
    ("module", "argv", "line"),
    [
        ("splitinfer.sim.cli", ["link", "--target", "127.0.0.1:9", "--delay=-5ms"],
         "netsim: error: --delay: must not be negative (got -5ms)"),
        ("splitinfer.sim.cli", ["link", "--target", "127.0.0.1:9", "--uplink=-5mbit"],
         "netsim: error: --uplink: rate must not be negative (got -5mbit)"),
        ("splitinfer.edge.cli", ["--cloud", "http://127.0.0.1:9", "--adapt-prior-rtt=-5ms"],
         "edge-agent: error: adapt.prior_rtt: must not be negative (got -5ms)"),
    ],
)  # fmt: skip
def test_negative_values_say_so(
    module: str, argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert importlib.import_module(module).main(argv) == EXIT_USAGE
    assert capsys.readouterr().err.splitlines() == [line]


# -- the installed entry point ---------------------------------------------------------


@pytest.mark.integration
def test_partition_bad_inputs_are_one_line_exit_2(tmp_path: Path) -> None:
    model = tmp_path / "res.onnx"
    onnx.save(residual(), str(model))
    text = tmp_path / "notes.onnx"
    text.write_text("not a model\n")
    exe = Path(sys.executable).with_name("partition")
    cases = {
        "no such file": [str(tmp_path / "gone.onnx"), "--list-cuts"],
        "not an ONNX model": [str(text), "--list-cuts"],
        "unknown cut 'c99'": [str(model), "--split", "c99", "-o", str(tmp_path / "p")],
        "--rtt: must not be negative (got -5ms)": [
            str(model), "--split", "auto", "-o", str(tmp_path / "p"), "--rtt=-5ms"
        ],
        "expected NAME=DxDxD": [str(model), "--list-cuts", "--input-shape", "x=1by4"],
    }  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop(DEBUG_ENV, None)
    for says, argv in cases.items():
        proc = subprocess.run(
            [str(exe), *argv, "-q"], capture_output=True, text=True, timeout=120, env=env,
            check=False,
        )  # fmt: skip
        lines = proc.stderr.splitlines()
        assert proc.returncode == EXIT_USAGE, (argv, proc.stderr)
        assert len(lines) == 1, (argv, proc.stderr)
        assert lines[0].startswith("partition: error: "), lines
        assert says in lines[0], lines
        assert "Traceback" not in proc.stdout + proc.stderr
