"""shared/options.py: one definition gives the TOML schema, the flags, the bounds and the
docs tables of cloud-service, edge-agent, the Ray ingress and partition."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from splitinfer.cloud.config import ServiceConfig
from splitinfer.edge.config import EdgeConfig
from splitinfer.partitioner.request import PartitionRequest
from splitinfer.shared.cli import ArgumentParser
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.options import (
    add_flags,
    build,
    check,
    markdown_block,
    merge_flags,
    option,
    options,
    section,
)

pytestmark = pytest.mark.unit
DOCS = Path(__file__).resolve().parents[1] / "docs"


@dataclass(frozen=True)
class Inner:
    rate: float = option(1.5, "a rate", minimum=0.0)
    mode: str = option("a", "a mode", choices=("a", "b"))
    names: tuple[str, ...] = option((), "some names")

    def __post_init__(self) -> None:
        check(self, "inner.")


@dataclass(frozen=True)
class Outer:
    where: Path = option(help="a folder", metavar="DIR")
    count: int = option(3, "how many", minimum=1)
    verbose: bool = option(False, "say more")
    label: str | None = option(None, "a label")
    inner: Inner = section(Inner)

    def __post_init__(self) -> None:
        check(self)


def parse(argv: list[str]) -> argparse.Namespace:
    p = ArgumentParser(prog="t")
    add_flags(p, Outer)
    return p.parse_args(argv)


def test_one_definition_gives_toml_keys_flags_and_types() -> None:
    keys = [o.key for o in options(Outer)]
    assert keys == ["where", "count", "verbose", "label", "inner.rate", "inner.mode", "inner.names"]
    assert [o.flag for o in options(Outer)][-3:] == [
        "--inner-rate",
        "--inner-mode",
        "--inner-names",
    ]
    data = {"where": "/x", "count": 4, "inner": {"rate": 2, "names": ["p", "q"]}}
    args = parse(["--count", "7", "--inner-mode", "b", "--verbose"])
    got = build(Outer, merge_flags(data, args, Outer))
    assert got == Outer(Path("/x"), 7, True, None, Inner(2.0, "b", ("p", "q")))
    assert isinstance(got.inner.rate, float)
    untouched = build(Outer, merge_flags({"where": "/x", "count": 4}, parse([]), Outer))
    assert untouched.count == 4  # a flag not given never hides the file's value


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "config: where: missing; give --where DIR"),
        ({"where": "w", "nope": 1}, "config: nope: unknown option (known: where, count,"),
        ({"where": "w", "inner": {"nope": 1}}, "config: inner.nope: unknown option"),
        ({"where": "w", "inner": 3}, "config: [inner] must be a table"),
        ({"where": "w", "count": "3"}, "config: count: '3' is not a int"),
        ({"where": "w", "count": True}, "config: count: True is not a int"),
        ({"where": "w", "inner": {"names": [1]}}, "inner.names: [1] is not a list of strings"),
        ({"where": "w", "count": 0}, "count=0: must be an integer >= 1"),
        ({"where": "w", "inner": {"rate": -1}}, "inner.rate=-1.0: must be a finite number >= 0"),
        ({"where": "w", "inner": {"mode": "c"}}, "inner.mode='c': give one of a, b"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_key(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(Outer, data)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    # a key the loader rejects says where it came from; a value the class refuses is
    # the class's own message, which names the option and the value
    assert str(info.value).startswith("config: ") == ("=" not in message)


def test_flags_are_typed_and_bools_negatable() -> None:
    with pytest.raises(ConfigError, match="argument --count: invalid int value: 'x' is not an"):
        parse(["--count", "x"])
    with pytest.raises(ConfigError, match="argument --inner-rate: invalid float value"):
        parse(["--inner-rate", "fast"])
    with pytest.raises(ConfigError, match="invalid choice: 'c'"):
        parse(["--inner-mode", "c"])
    assert vars(parse(["--no-verbose"]))["verbose"] is False
    assert vars(parse(["--inner-names", "a,b"]))["inner.names"] == ("a", "b")
    text = ArgumentParser(prog="t")
    add_flags(text, Outer)
    assert "how many (default: 3)" in text.format_help()


def test_the_daemons_share_the_system() -> None:
    cloud = {o.flag for o in options(ServiceConfig)}
    assert {"--max-batch-size", "--batching", "--providers", "--privacy-budget-epsilon"} <= cloud
    edge = {o.flag for o in options(EdgeConfig)}
    assert {"--package", "--uplink-timeout", "--providers", "--queue-max-queue"} <= edge
    assert {o.flag for o in options(PartitionRequest)} >= {"model", "--split", "--edge-profile"}
    # the shared settings: one key, one flag in both daemons
    shared = {"runtime.providers", "runtime.threads", "runtime.gpu", "runtime.trt_fp16"}
    shared |= {"runtime.trt_workspace", "privacy.budget_epsilon", "privacy.budget_window"}
    for key in shared:
        flags = {o.flag for c in (ServiceConfig, EdgeConfig) for o in options(c) if o.key == key}
        assert len(flags) == 1, (key, flags)


@dataclass(frozen=True)
class Timed:
    wait_ms: float = option(2.0, "a wait", minimum=0.0)
    size_bytes: int = option(1024, "a size", minimum=1)
    tries: int = option(1, "tries", old=("attempts",))

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class Holder:
    timed: Timed = section(Timed, prefix="", old_prefix="t", old={"tries": ["retries"]})


def test_a_unit_in_the_field_name_is_a_value_with_units() -> None:
    opts = {o.name: o for o in options(Timed)}
    assert (opts["wait_ms"].key, opts["wait_ms"].flag, opts["wait_ms"].unit) == (
        "wait",
        "--wait",
        "ms",
    )
    assert opts["size_bytes"].flag == "--size"
    assert build(Timed, {"wait": "1s", "size": "2KiB"}) == Timed(1000.0, 2048)
    assert build(Timed, {"wait": 0, "size": 4096}) == Timed(0.0, 4096)  # 0, and bare bytes
    with pytest.raises(ConfigError, match=r'wait=5: give it with units, e\.g\. "5ms"'):
        build(Timed, {"wait": 5})
    with pytest.raises(ConfigError, match="wait=-1ms: must be at least 0"):
        Timed(wait_ms=-1.0)
    text = ArgumentParser(prog="t")
    add_flags(text, Timed)
    assert "a wait (default: 2ms)" in text.format_help()
    assert "a size (default: 1KiB)" in text.format_help()


def test_former_names_still_work_once_warned(capsys: pytest.CaptureFixture[str]) -> None:
    told: list[str] = []
    got = build(Timed, {"wait_ms": 5, "attempts": 2}, "f.toml", told.append)
    assert got == Timed(5.0, 1024, 2)
    assert told == [
        'f.toml: wait_ms is deprecated; use wait = "5ms"',
        "f.toml: attempts is deprecated; use tries",
    ]
    with pytest.raises(ConfigError, match="given twice"):
        build(Timed, {"wait_ms": 5, "wait": "5ms"})
    p = ArgumentParser(prog="t")
    add_flags(p, Holder)
    # the section's flags had the prefix t: --t-wait-ms, --t-retries (its former name)
    args = p.parse_args(["--t-wait-ms", "7", "--t-retries", "3", "--t-wait-ms", "8"])
    assert build(Holder, merge_flags({}, args, Holder)).timed == Timed(8.0, 1024, 3)
    assert capsys.readouterr().err.splitlines() == [
        "t: warning: --t-wait-ms is deprecated; use --wait",
        "t: warning: --t-retries is deprecated; use --tries",
    ]
    assert "--t-wait-ms" not in p.format_help()  # hidden
    # a flag overrides the file's value given under the former key
    args = p.parse_args(["--wait", "3ms"])
    assert build(Holder, merge_flags({"timed": {"wait_ms": 9}}, args, Holder)).timed.wait_ms == 3


@pytest.mark.parametrize(
    ("page", "name", "cls"),
    [("edge-agent.md", "edge", EdgeConfig), ("cloud-service.md", "cloud", ServiceConfig)],
)
def test_the_docs_table_is_the_definition(page: str, name: str, cls: type) -> None:
    found, want = markdown_block(cls, (DOCS / page).read_text(encoding="utf-8"), name)
    fix = f"python -m splitinfer.shared.options {cls.__module__}:{cls.__name__}"
    assert found == want, f"docs/{page} options table is stale; paste the output of `{fix}`"
