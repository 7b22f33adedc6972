"""``partition --list-cuts --json``: one object, checked against its committed JSON Schema."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jsonschema
import onnx
import pytest
from graphs import f32, make, rand, residual
from onnx import helper

from splitinfer.partitioner import cli
from splitinfer.partitioner.cli import LIST_CUTS_SCHEMA, main

pytestmark = pytest.mark.unit


def wide(k: int = 16, width: int = 4) -> onnx.ModelProto:
    """A stem, ``k`` parallel two-node branches and a join: 3**k + 2 cuts, far past any list."""
    nodes, inits, ends = [helper.make_node("Relu", ["x"], ["h"])], {}, []
    for b in range(k):
        inits[f"k{b}"] = rand(width, seed=b)  # a distinct scale per branch: no pass merges them
        nodes.append(helper.make_node("Mul", ["h", f"k{b}"], [f"m{b}"]))
        nodes.append(helper.make_node("Tanh", [f"m{b}"], [f"t{b}"]))
        ends.append(f"t{b}")
    nodes.append(helper.make_node("Sum", ends, ["y"]))
    return make(nodes, [f32("x", ["N", width])], [f32("y", ["N", width])], inits)


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(LIST_CUTS_SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(doc)
    return doc


def listed(
    capsys: pytest.CaptureFixture[str], schema: dict[str, Any], argv: list[str]
) -> dict[str, Any]:
    """The JSON ``partition ARGV --list-cuts --json`` prints, validated."""
    assert main([*argv, "--list-cuts", "--json", "-q"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    doc: dict[str, Any] = json.loads(out)
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    return doc


def test_the_schema_ships_in_the_package() -> None:
    text = Path(__file__).parent.parent.joinpath("pyproject.toml").read_text(encoding="utf-8")
    assert '"splitinfer.partitioner" = ["*.json"]' in text
    assert LIST_CUTS_SCHEMA.is_file()


def test_a_small_space_lists_every_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], schema: dict[str, Any]
) -> None:
    path = tmp_path / "res.onnx"
    onnx.save(residual(), str(path))
    doc = listed(capsys, schema, [str(path)])
    assert doc["format"] == 1
    assert doc["model"] == "res.onnx"
    assert (doc["valid_cuts"], doc["exact"], doc["listed"], doc["note"]) == (5, True, 5, None)
    assert doc["max_cuts"] == 20000
    assert doc["optimization"]["nodes_before"] == 4
    assert [p["name"] for p in doc["optimization"]["passes"]]
    assert doc["nonstandard_ops"] == []
    assert [r["id"] for r in doc["cuts"]] == [f"c{i}" for i in range(5)]
    assert all("why" not in r for r in doc["cuts"])


def test_a_huge_space_lists_the_cuts_worth_a_look(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], schema: dict[str, Any]
) -> None:
    path = tmp_path / "wide.onnx"
    onnx.save(wide(), str(path))
    doc = listed(capsys, schema, [str(path), "--max-cuts", "50"])
    assert doc["exact"] is True
    assert doc["valid_cuts"] == 3**16 + 2
    assert doc["max_cuts"] == 50
    assert doc["listed"] == len(doc["cuts"]) < doc["valid_cuts"]
    assert doc["note"].startswith(f"{3**16 + 2:,} cuts in all")
    assert all(r["why"] for r in doc["cuts"])
    kinds = [r["kind"] for r in doc["cuts"]]
    assert (kinds.count("none"), kinds.count("all")) == (1, 1)


def test_nonstandard_ops_are_listed_and_noted(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    schema: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "res.onnx"
    onnx.save(residual(), str(path))
    ops = ("com.microsoft::FusedMatMul", "custom.ops::Gelu")
    real = cli.prepare

    def prepare(*args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(real(*args, **kwargs), nonstandard_ops=ops)

    monkeypatch.setattr(cli, "prepare", prepare)
    assert listed(capsys, schema, [str(path)])["nonstandard_ops"] == list(ops)
    assert main([str(path), "--list-cuts", "-q"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "non-standard" in line]
    assert notes == [
        "note: the source holds non-standard ops com.microsoft::FusedMatMul, custom.ops::Gelu: "
        "a segment holding them runs on ONNX Runtime, not TensorRT"
    ]
