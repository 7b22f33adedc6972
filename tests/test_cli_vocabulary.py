"""One vocabulary across the six commands (docs/options.md).

Every tool's parser is built the way ``splitinfer.completion`` builds it (its
``TOOLS`` table), subcommands included, and walked. It fails on:

* an option or positional without help;
* a default not shown. The rule: an option that takes a value, and every ``--x/--no-x``
  switch, says ``(default: ...)`` in its help, unless it is required or its argparse
  default is None or empty (absent means unset; plain ``store_true`` switches are off
  unless given). An argparse default of ``SUPPRESS`` (the options system's flags,
  whose default lives in the dataclass) is not known to be empty, so it must show, or
  say ``(required)``;
* one setting spelled two ways: :data:`SETTINGS` maps each setting more than one tool
  has to its one flag; a tool that has the setting spells it so, and no tool shows a
  former spelling (:data:`SETTINGS`' aliases) in ``--help``;
* a hidden option that is not a deprecated spelling (hidden means deprecated);
* a tool without ``--version`` printing ``TOOL splitinfer X.Y.Z``;
* an epilog without 2 to 4 example lines (``TOOL ...``), or an example its parser
  refuses.

And each former spelling still works, meaning what it meant, with one warning line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitinfer import __version__
from splitinfer.completion import TOOLS
from splitinfer.shared.options import DEFAULT_SHOWN, REQUIRED_SHOWN, Deprecated

pytestmark = pytest.mark.unit

#: setting -> (its one flag, former spellings that must not show in any --help)
SETTINGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "execution providers": ("--providers", ("--runtime-provider",)),
    "intra-op threads": ("--threads", ("--runtime-threads", "--intra-op-threads")),
    "idle threads spin": ("--spin", ("--runtime-spin", "--spinning")),
    "GPU index": ("--gpu", ("--runtime-gpu",)),
    "TensorRT fp16": ("--trt-fp16", ("--runtime-trt-fp16",)),
    "TensorRT engine cache": ("--trt-cache-dir", ("--runtime-trt-cache-dir",)),
    "TensorRT workspace": ("--trt-workspace", ("--runtime-trt-workspace-mb",)),
    "privacy budget": (
        "--privacy-budget-epsilon",
        ("--privacy-max-epsilon",),
    ),
    "privacy budget window": (
        "--privacy-budget-window",
        ("--privacy-window-s", "--privacy-budget-window-s"),
    ),
    "privacy budget delta": ("--privacy-budget-delta", ("--privacy-delta",)),
    "batch queue delay": (
        "--max-queue-delay",
        ("--max-queue-delay-ms", "--max-queue-delay-us"),
    ),
    "largest batch": ("--max-batch-size", ()),
    "listen address (HOST:PORT)": ("--listen", ("--host",)),
    "uplink": ("--uplink", ()),
    "downlink": ("--downlink", ()),
    "output folder or file": ("--output", ("--out",)),
    "config file": ("--config", ()),
    "log level": ("--log-level", ()),
    "model version folder": ("--model-version", ()),
    "fine-tune time": ("--adapt-time", ("--adapt-seconds",)),
    "quiet": ("--quiet", ()),
}
#: flags whose name still carries a unit: none may (values carry units)
UNIT_SUFFIXES = ("-s", "-ms", "-us", "-bytes", "-mb", "-seconds")


def parser(tool: str) -> argparse.ArgumentParser:
    module, function = TOOLS[tool].split(":")
    build = getattr(importlib.import_module(module), function)
    result: argparse.ArgumentParser = build()
    return result


def walk(p: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.Action]]:
    """``(command, action)`` of ``p`` and of its subcommands."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from walk(sub, f"{name} {sub_name}")
        else:
            yield name, action


def visible(tool: str) -> set[str]:
    return {
        flag
        for _, a in walk(parser(tool), tool)
        if a.help != argparse.SUPPRESS
        for flag in a.option_strings
    }


def test_every_tool_is_walked() -> None:
    assert set(TOOLS) == {
        "partition",
        "edge-agent",
        "cloud-service",
        "netsim",
        "splitinfer-demo",
        "splitinfer-triton",
    }
    subs = {name for tool in TOOLS for name, _ in walk(parser(tool), tool)}
    assert {"edge-agent profile", "netsim link", "netsim run", "netsim compare"} <= subs


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_option_has_help_and_shows_its_default(tool: str) -> None:
    problems = []
    for command, a in walk(parser(tool), tool):
        name = "/".join(a.option_strings) or a.dest
        if a.help == argparse.SUPPRESS:
            if not isinstance(a, Deprecated):
                problems.append(f"{command} {name}: hidden, but not a deprecated spelling")
            continue
        if not a.help or not a.help.strip():
            problems.append(f"{command} {name}: no help")
            continue
        if not a.option_strings or a.required:
            continue
        if isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
            continue
        switch = isinstance(a, argparse.BooleanOptionalAction)
        if a.nargs == 0 and not switch:
            continue  # store_true and the like: off unless given
        if a.default is None or (a.default in ("", [], ()) and not switch):
            continue
        if DEFAULT_SHOWN not in a.help and REQUIRED_SHOWN not in a.help:
            problems.append(f"{command} {name}: help does not show its default ({a.help!r})")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_one_setting_one_spelling(tool: str) -> None:
    flags = visible(tool)
    for setting, (flag, aliases) in SETTINGS.items():
        shown = sorted(set(aliases) & flags)
        assert not shown, f"{tool} shows {shown}, former spellings of {setting}: use {flag}"
    unit_named = sorted(f for f in flags if f.endswith(UNIT_SUFFIXES))
    assert not unit_named, f"{tool}: {unit_named} name a unit; the value carries it"


def test_each_shared_setting_is_one_definition() -> None:
    """The daemons' shared settings come from the same dataclass fields."""
    from splitinfer.cloud.config import PrivacyConfig as CloudPrivacy
    from splitinfer.cloud.config import RuntimeConfig as CloudRuntime
    from splitinfer.edge.config import PrivacyConfig as EdgePrivacy
    from splitinfer.edge.config import RuntimeConfig as EdgeRuntime
    from splitinfer.shared.settings import PrivacyBudget, RuntimeOptions

    shared = [(RuntimeOptions, (EdgeRuntime, CloudRuntime))]
    shared.append((PrivacyBudget, (EdgePrivacy, CloudPrivacy)))
    for base, subs in shared:
        names = [f.name for f in dataclasses.fields(base)]
        for sub in subs:
            assert issubclass(sub, base)
            assert [f.name for f in dataclasses.fields(sub)][: len(names)] == names
    edge, cloud = visible("edge-agent"), visible("cloud-service")
    for flag in ("--providers", "--threads", "--gpu", "--trt-fp16", "--trt-workspace"):
        assert flag in edge
        assert flag in cloud
    assert "--privacy-budget-epsilon" in edge
    assert "--privacy-budget-epsilon" in cloud
    assert "--device-id" in edge  # the device's id in the credentials, its one meaning
    assert "--device-id" not in cloud  # the GPU's index is --gpu


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_tool_prints_its_version(tool: str, capsys: pytest.CaptureFixture[str]) -> None:
    p = parser(tool)
    assert any(isinstance(a, argparse._VersionAction) for a in p._actions), tool
    with pytest.raises(SystemExit) as info:
        p.parse_args(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"{tool} splitinfer {__version__}"


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_help_ends_with_examples_that_parse(tool: str) -> None:
    p = parser(tool)
    lines = (p.epilog or "").splitlines()
    examples = [line.strip() for line in lines if line.strip().startswith(f"{tool}")]
    assert 2 <= len(examples) <= 4, f"{tool}: {len(examples)} examples in its epilog"
    assert p.format_help().rstrip().endswith(examples[-1])
    for example in examples:
        argv = shlex.split(example)[1:]
        if tool == "edge-agent" and argv[:1] == ["profile"]:
            from splitinfer.edge.cli import profile_parser

            profile_parser().parse_args(argv[1:])
        else:
            parser(tool).parse_args(argv)


def test_edge_agent_lists_its_profile_command() -> None:
    text = parser("edge-agent").format_help()
    head, _, _ = text.partition("examples:")
    assert "commands:" in head
    assert "profile" in head.split("commands:")[1]


# -- the former spellings ----------------------------------------------------------------


def _warned(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.splitlines()


EDGE = ["--package", "p", "--cloud", "http://a:1"]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (["--runtime-provider", "cpu"], ["--providers", "cpu"]),
        (["--runtime-threads", "2"], ["--threads", "2"]),
        (["--runtime-spin"], ["--spin"]),
        (["--runtime-gpu", "1"], ["--gpu", "1"]),
        (["--no-runtime-trt-fp16"], ["--no-trt-fp16"]),
        (["--runtime-trt-cache-dir", "/c"], ["--trt-cache-dir", "/c"]),
        (["--runtime-trt-workspace-mb", "512"], ["--trt-workspace", "512MiB"]),
        (["--no-runtime-verify"], ["--no-verify"]),
        (["--runtime-emulate-device", "x"], ["--emulate-device", "x"]),
        (["--uplink-timeout-s", "3"], ["--uplink-timeout", "3s"]),
        (["--uplink-max-response-bytes", "4096"], ["--uplink-max-response", "4KiB"]),
        (["--adapt-min-rate-bytes", "100"], ["--adapt-min-rate-sample", "100"]),
        (["--queue-inline-below-ms", "0.5"], ["--queue-inline-below", "500us"]),
        (["--privacy-budget-window-s", "60"], ["--privacy-budget-window", "60s"]),
    ],
)
def test_edge_agent_former_flags(
    old: list[str], new: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from splitinfer.edge.cli import resolve

    got, _ = resolve([*EDGE, *old])
    warned = _warned(capsys)
    want, _ = resolve([*EDGE, *new])
    assert got == want
    assert warned == [f"edge-agent: warning: {old[0]} is deprecated; use {new[0]}"]
    assert not _warned(capsys)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (["--intra-op-threads", "2"], ["--threads", "2"]),
        (["--spinning"], ["--spin"]),
        (["--device-id", "1"], ["--gpu", "1"]),
        (["--max-queue-delay-ms", "5"], ["--max-queue-delay", "5ms"]),
        (["--aimd-target-ms", "20"], ["--aimd-target", "20ms"]),
        (["--expert-cache-bytes", "1048576"], ["--expert-cache", "1MiB"]),
        (["--max-body-bytes", "4096"], ["--max-body", "4KiB"]),
        (["--header-timeout-s", "2"], ["--header-timeout", "2s"]),
        (["--watch-interval-s", "10"], ["--watch-interval", "10s"]),
        (["--breaker-cooldown-s", "1.5"], ["--breaker-cooldown", "1500ms"]),
        (["--privacy-max-epsilon", "8"], ["--privacy-budget-epsilon", "8"]),
        (["--privacy-window-s", "60"], ["--privacy-budget-window", "60s"]),
        (["--privacy-delta", "1e-6"], ["--privacy-budget-delta", "1e-6"]),
    ],
)
def test_cloud_service_former_flags(
    old: list[str], new: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from splitinfer.cloud.cli import build_parser, config_from_args

    def config(argv: list[str]) -> object:
        return config_from_args(build_parser().parse_args(["--repository", "r", *argv]))

    got = config(old)
    warned = _warned(capsys)
    assert got == config(new)
    assert warned == [f"cloud-service: warning: {old[0]} is deprecated; use {new[0]}"]


def test_former_toml_keys_keep_their_meaning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from splitinfer.cloud.cli import build_parser, config_from_args
    from splitinfer.edge.cli import resolve

    cloud = tmp_path / "cloud.toml"
    cloud.write_text(
        'repository = "r"\n[batching]\nmax_queue_delay_ms = 5\n'
        "[runtime]\nintra_op_threads = 2\ndevice_id = 1\n[privacy]\nmax_epsilon = 0\n"
    )
    c = config_from_args(build_parser().parse_args(["--config", str(cloud)]))
    assert (c.batching.max_queue_delay_ms, c.runtime.threads, c.runtime.gpu) == (5.0, 2, 1)
    assert not c.privacy.enforced  # max_epsilon = 0 was "not enforced", as unset is now
    assert _warned(capsys) == [
        f"cloud-service: warning: {cloud}: batching.max_queue_delay_ms is deprecated; "
        'use batching.max_queue_delay = "5ms"',
        f"cloud-service: warning: {cloud}: runtime.intra_op_threads is deprecated; "
        "use runtime.threads",
        f"cloud-service: warning: {cloud}: runtime.device_id is deprecated; use runtime.gpu",
        f"cloud-service: warning: {cloud}: privacy.max_epsilon is deprecated; "
        "use privacy.budget_epsilon",
    ]
    edge = tmp_path / "edge.toml"
    edge.write_text("[runtime]\nprovider = 'cpu'\ntrt_workspace_mb = 64\n")
    e, _ = resolve(["--config", str(edge), *EDGE])
    assert (e.runtime.providers, e.runtime.trt_workspace_mb) == (("cpu",), 64)
    assert len(_warned(capsys)) == 2


def test_the_other_tools_former_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from splitinfer import demo
    from splitinfer.cloud.triton import build_parser as triton_parser
    from splitinfer.cloud.triton import former_version
    from splitinfer.edge.cli import profile_parser
    from splitinfer.partitioner.request import PartitionRequest
    from splitinfer.sim.cli import build_parser as netsim_parser
    from splitinfer.sim.cli import parse_listen

    auto = ["m.onnx", "--split", "auto", "-o", "o", "--epsilon", "8", "--clip", "1"]
    old = PartitionRequest.from_argv([*auto, "--adapt-cloud", "--adapt-seconds", "5"])
    assert old == PartitionRequest.from_argv([*auto, "--adapt-cloud", "--adapt-time", "5s"])
    assert old.adapt_seconds == 5.0
    assert _warned(capsys) == [
        "partition: warning: --adapt-seconds is deprecated; use --adapt-time"
    ]

    args = profile_parser().parse_args(["--package", "p", "-o", "x", "--runtime-provider", "cuda"])
    assert args.providers == "cuda"
    assert _warned(capsys) == [
        "edge-agent: warning: --runtime-provider is deprecated; use --providers"
    ]

    link = ["link", "--target", "127.0.0.1:8080"]
    args = netsim_parser().parse_args([*link, "--listen", "9000", "--host", "0.0.0.0"])
    assert parse_listen(args) == ("0.0.0.0", 9000)
    assert _warned(capsys) == [
        "netsim: warning: --host is deprecated; use --listen HOST:PORT",
        "netsim: warning: --listen PORT is deprecated; use --listen HOST:PORT",
    ]
    args = netsim_parser().parse_args([*link, "--listen", "0.0.0.0:9000"])
    assert parse_listen(args) == ("0.0.0.0", 9000)
    assert not _warned(capsys)

    base = ["pkg", "-o", "repo"]
    args = triton_parser().parse_args(former_version([*base, "--version", "3"]))
    assert args.model_version == 3
    args = triton_parser().parse_args([*base, "--max-queue-delay-us", "700"])
    assert args.max_queue_delay == 700
    assert triton_parser().parse_args([*base, "--max-queue-delay", "700us"]).max_queue_delay == 700
    assert _warned(capsys) == [
        "splitinfer-triton: warning: --version N is deprecated; use --model-version N",
        "splitinfer-triton: warning: --max-queue-delay-us is deprecated; use --max-queue-delay",
    ]

    assert demo.build_parser().parse_args(["--out", str(tmp_path)]).out == tmp_path
    assert demo.build_parser().parse_args(["-o", str(tmp_path)]).out == tmp_path
    assert _warned(capsys) == ["splitinfer-demo: warning: --out is deprecated; use --output"]
