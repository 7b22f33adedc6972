"""The Python API (``splitinfer.partition``, ``list_cuts``, ``load_package``): the
``partition`` command's own path, its answers typed, its errors the command's lines."""

from __future__ import annotations

import inspect
import json
import os
import pydoc
import re
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from graphs import rand, residual
from ortutil import assert_close, compose, run

import splitinfer
from splitinfer.partitioner.cli import main
from splitinfer.partitioner.request import PartitionRequest
from splitinfer.shared.errors import ConfigError, CutError, PackageError, SplitInferError
from splitinfer.shared.manifest import MANIFEST_NAME, load_manifest
from splitinfer.shared.options import options

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
#: Built-in rooflines, so that --split auto measures nothing on this machine.
PROFILES = {"edge_profile": "raspberry-pi-5", "cloud_profile": "l4"}
PROFILE_FLAGS = ["--edge-profile", "raspberry-pi-5", "--cloud-profile", "l4"]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "res.onnx"
    onnx.save(residual(), str(path))
    return path


def cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The message of the one line ``partition ARGV`` prints on stderr (exit 2)."""
    assert main([*argv, "-q"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("partition: error: "), lines
    return lines[0].removeprefix("partition: error: ")


def readme_example() -> str:
    """The fenced ``python`` block under README.md's "Python API" heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"^```python\n(.*?)^```$", section, re.S | re.M)
    assert found, "README.md's Python API section has no ```python block"
    return found.group(1)


@pytest.mark.unit
def test_every_exported_name_exists_and_help_lists_the_api() -> None:
    assert set(splitinfer.__all__) >= {
        "partition",
        "list_cuts",
        "load_package",
        "PartitionResult",
        "Package",
        "SplitInferError",
        "__version__",
    }
    for name in splitinfer.__all__:
        assert getattr(splitinfer, name) is not None, name
    assert splitinfer.SplitInferError is SplitInferError
    assert isinstance(splitinfer.__version__, str)
    assert set(splitinfer.__all__) <= set(dir(splitinfer))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = splitinfer.nothing  # type: ignore[attr-defined]
    text = pydoc.render_doc(splitinfer)
    assert "partition" in text
    assert "load_package" in text


def test_import_splitinfer_loads_no_runtime() -> None:
    code = (
        "import splitinfer, sys; heavy = [m for m in ('onnx', 'onnxruntime', 'torch') "
        "if m in sys.modules]; assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.unit
def test_every_keyword_is_a_flag_with_the_commands_default() -> None:
    """partition()'s and list_cuts()'s keywords are PartitionRequest fields (``out`` is
    ``output``), and each default is the command's (None: the command's default)."""
    fields = {o.name: o.default for o in options(PartitionRequest)}
    own = {"model", "progress", "split"}
    for fn in (splitinfer.partition, splitinfer.list_cuts):
        for name, param in inspect.signature(fn).parameters.items():
            if name in own:
                continue
            field = "output" if name == "out" else name
            assert field in fields, f"{fn.__name__}({name}=...) is no partition flag"
            if param.default not in (None, inspect.Parameter.empty, True):
                assert param.default == fields[field], name


def test_partition_chooses_what_the_cli_chooses(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pkg"
    link = ["--uplink", "1gbit", "--rtt", "1ms"]
    assert main([str(model), "--split", "auto", "-o", str(out), *PROFILE_FLAGS, *link, "-q"]) == 0
    printed = capsys.readouterr().out.strip()
    by_cli = load_manifest(out)
    heard: list[str] = []
    result = splitinfer.partition(
        model, split="auto", out=out, uplink="1gbit", rtt="1ms", progress=heard.append, **PROFILES
    )
    assert capsys.readouterr().out == ""  # nothing printed
    assert any("loading" in m for m in heard)
    assert result.cut == by_cli.default_cut
    assert result.candidates == by_cli.cut_ids
    assert result.kind == by_cli.cut.kind
    # what the command printed, but the measured encode/decode milliseconds
    said, told = result.summary.splitlines(), printed.splitlines()
    assert said[-2] == told[-2] == f"cut search: {result.search}"
    assert said[-1].split(":")[0] == told[-1].split(":")[0]
    assert said[-1].startswith(f"chose {result.cut} ({result.kind}) for ")
    assert result.search.startswith("exhaustive over")
    assert result.package == out.resolve()
    assert result.manifest.default_cut == result.cut
    chosen = [row for row in result.table if row["chosen"]]
    assert [row["cut"] for row in chosen] == [result.cut]
    assert result.predicted_ms == pytest.approx(chosen[0]["total_ms"])
    assert {row["cut"] for row in result.table} == {f"c{i}" for i in range(5)}


def test_a_fixed_cut_and_load_package_round_trip(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "pkg"
    result = splitinfer.partition(model, split="a,b", out=out)
    assert (result.kind, result.table, result.predicted_ms, result.search) == (
        "split",
        [],
        None,
        "",
    )
    pkg = splitinfer.load_package(out)
    assert pkg.path == result.package
    assert pkg.manifest.to_json() == result.manifest.to_json()
    assert (pkg.cut, pkg.cuts) == (result.cut, result.candidates)
    assert pkg.edge == out.resolve() / "edge.onnx"
    assert pkg.cloud == out.resolve() / "cloud.onnx"
    assert pkg.segments(result.cut) == (pkg.edge, pkg.cloud)
    feeds = {"x": rand(3, 4)}
    assert_close(compose(pkg.edge, pkg.cloud, feeds), run(model, feeds))
    with pytest.raises(PackageError, match="no cut 'c99'"):
        pkg.segments("c99")
    # an edited package is refused, as the daemons refuse it
    pkg.edge.write_bytes(pkg.edge.read_bytes() + b"\0")
    with pytest.raises(PackageError, match="does not match its sha256"):
        splitinfer.load_package(out)
    assert splitinfer.load_package(out, verify=False).cut == result.cut
    with pytest.raises(PackageError):
        splitinfer.load_package(tmp_path / "nothing-here")


def test_list_cuts_is_the_commands_json(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(model), "--list-cuts", "--json", "-q"]) == 0
    doc = json.loads(capsys.readouterr().out)
    listing = splitinfer.list_cuts(model)
    assert listing.document == doc
    assert listing.cuts == doc["cuts"]
    assert listing.ids == ("c0", "c1", "c2", "c3", "c4")
    assert (listing.count, listing.exact, listing.note) == (5, True, None)
    assert "valid cuts: 5" in listing.text


@pytest.mark.parametrize(
    ("kwargs", "argv", "error"),
    [
        ({"split": "c2", "cloud_profile": "l4"}, ["--split", "c2", "--cloud-profile", "l4"],
         ConfigError),
        ({"precision": "int4"}, ["--split", "auto", "--precision", "int4"], ConfigError),
        ({"uplink": "-5mbit"}, ["--split", "auto", "--uplink=-5mbit"], ConfigError),
        ({"epsilon": 1.0}, ["--split", "auto", "--epsilon", "1.0"], ConfigError),
        ({"split": "c99"}, ["--split", "c99"], CutError),
    ],
)  # fmt: skip
def test_a_bad_option_raises_the_commands_message(
    model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    kwargs: dict[str, object],
    argv: list[str],
    error: type[SplitInferError],
) -> None:
    out = tmp_path / "never"
    message = cli_error(capsys, [str(model), "-o", str(out), *argv])
    with pytest.raises(error) as raised:
        splitinfer.partition(model, out=out, **kwargs)  # type: ignore[arg-type]
    assert str(raised.value) == message
    assert not out.exists()


def test_the_readme_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code = readme_example()
    assert len(code.strip().splitlines()) <= 8
    onnx.save(residual(), str(tmp_path / "model.onnx"))  # the name the example uses
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out
    manifest = load_manifest(tmp_path / "pkg")
    assert printed.startswith(f"{manifest.default_cut} {manifest.cut.kind} ")
    assert (tmp_path / "pkg" / MANIFEST_NAME).is_file()
    assert os.fspath(tmp_path / "pkg") in printed  # the segment paths
