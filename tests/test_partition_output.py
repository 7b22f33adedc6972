"""``partition -o`` into a place it cannot write: exit 2 and one line (issue 17)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from graphs import chain

from splitinfer.partitioner.cli import main

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("where", ["a-file/out", "/proc/splitinfer-no-such-place"])
def test_an_unwritable_output_is_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    model = tmp_path / "m.onnx"
    onnx.save(chain(4, width=4), str(model))
    (tmp_path / "a-file").write_text("not a folder")
    out = Path(where) if where.startswith("/") else tmp_path / where
    assert main([str(model), "--split", "none", "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("partition: error: ")
    assert "cannot write there" in err[0]
