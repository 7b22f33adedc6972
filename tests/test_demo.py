"""The main job (`splitinfer-demo`) end to end, small: real daemons, real link emulation.

Two runs: the digits job (``--quick``, about a minute) and the default OCR job on
ddddocr's trained network (a few minutes; skipped where the ``demo`` extra's
``ddddocr`` wheel is not installed). Unit tests beside them: the ``--out`` folder it
owns, and how it writes small times.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from splitinfer.demo import main
from splitinfer.demo_console import MARKER, format_ms, prepare_out
from splitinfer.shared.errors import ConfigError

pytestmark = pytest.mark.integration

ROWS = ("fp32 model (reference)", "auto (its choice)", "cloud-only", "edge-only")


def _running(path: Path) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if str(path) in line and "pytest" not in line]


def _demo(out: Path, *args: str, timeout: float) -> str:
    exe = Path(sys.executable).with_name("splitinfer-demo")
    proc = subprocess.run(
        [str(exe), "-o", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not _running(out), "the demo left processes behind"
    return proc.stdout


def _rows(table: str) -> dict[str, list[str]]:
    """Row name -> fields: cut, accuracy, exact, = fp32, p50, p99, B up, B down, errors."""
    rows = {}
    for line in table.splitlines():
        name = next((r for r in ROWS if line.startswith(f"{r} ")), None)
        split = re.match(r"split at \S+?(?:, DP)?(?=\s)", line)
        if name is None and split is not None:
            name = split.group(0)
        if name is not None:
            rows[name] = line[len(name) :].split()
    return rows


@pytest.mark.slow
def test_quick_digits_demo_runs_every_strategy_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    stdout = _demo(out, "--quick", "--samples", "40", timeout=280)
    rows = _rows(stdout)
    for row in ROWS:
        assert row in rows
    # stdout holds the demo's table and sentences only: no partitioner output
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines[0].startswith("40 held-out digits through each edge agent; "), stdout
    assert lines[1].startswith("strategy "), stdout
    body = lines[2 : 2 + len(rows)]
    assert len(_rows("\n".join(body))) == len(rows), stdout
    sentence, *rest = lines[2 + len(rows) :]
    assert sentence.startswith("--split auto chose "), stdout
    assert rest[:-1] == [f"picture: {out / 'cuts.png'}", f"picture: {out / 'latency-cdf.png'}"]
    assert rest[-1].startswith("done in "), stdout
    # the digits network runs in well under a millisecond: no "0 ms", no share of nothing
    assert not re.search(r"(?<![\d.])0 ms", sentence), sentence
    assert "%" not in sentence, sentence
    edge = rows["edge-only"]
    assert edge[0] == "c7"
    assert edge[6:8] == ["0", "0"]  # answered on the device: nothing on the wire
    cloud_only = rows["cloud-only"]
    assert cloud_only[0] == "c0"
    assert float(cloud_only[3]) == 1.0  # the fp32 cloud model agrees with itself
    assert int(cloud_only[6]) > 0  # bytes went over the emulated uplink
    assert cloud_only[8] == "0"
    assert (out / "packages" / "auto" / "manifest.json").is_file()
    assert (out / "latency-cdf.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    importlib.util.find_spec("ddddocr") is None, reason="needs the demo extra (ddddocr wheel)"
)
def test_ocr_demo_table_says_what_the_split_earns(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    stdout = _demo(out, "--samples", "24", "--no-private", timeout=580)
    rows = _rows(stdout)
    for row in ROWS:
        assert row in rows, stdout[-2000:]
    fp32 = float(rows["fp32 model (reference)"][1])
    assert fp32 > 0.7  # the trained recogniser reads the captchas
    auto, cloud, edge = rows["auto (its choice)"], rows["cloud-only"], rows["edge-only"]
    assert all(r[8] == "0" for r in (auto, cloud, edge))
    assert edge[6:8] == ["0", "0"]  # answered on the device: nothing on the wire
    assert float(cloud[3]) == 1.0  # fp32 in the cloud: the source's answers
    assert abs(float(auto[1]) - fp32) <= 0.05
    p50 = {name: float(r[4]) for name, r in rows.items() if len(r) > 4}
    # auto is never worse than the worse baseline, and close to the better one
    assert p50["auto (its choice)"] <= 1.5 * min(p50["cloud-only"], p50["edge-only"]) + 20
    chose = re.search(r"--split auto chose (c\d+) \((\w+)\)", stdout)
    assert chose is not None, stdout[-2000:]
    assert chose.group(1) == auto[0]
    if chose.group(2) != "split":
        assert "Not interior: the best interior cut" in stdout
    for picture in ("cuts.png", "latency-cdf.png"):
        assert f"picture: {out / picture}" in stdout
        assert (out / picture).stat().st_size > 1000


@pytest.mark.unit
def test_the_demo_refuses_an_out_folder_it_did_not_write(tmp_path: Path) -> None:
    mine = tmp_path / "notes.txt"
    mine.write_text("keep me")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path))}: .*did not write"):
        prepare_out(tmp_path)
    assert mine.read_text() == "keep me"
    assert not (tmp_path / MARKER).exists()


@pytest.mark.unit
def test_the_cli_refusal_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    assert main(["--quick", "-o", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"splitinfer-demo: error: {tmp_path}: the folder holds files ")
    assert "give the demo a new or empty folder (-o DIR), or remove this one" in err
    assert (tmp_path / "notes.txt").is_file()


@pytest.mark.unit
def test_the_demo_empties_and_reuses_its_own_folder(tmp_path: Path) -> None:
    out = tmp_path / "new" / "demo"
    prepare_out(out)  # a new folder: created and marked
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "logs"]
    (out / "logs" / "cloud-service.log").write_text("old")
    (out / "packages" / "auto").mkdir(parents=True)
    (out / "credentials.toml").write_text("old")
    prepare_out(out)  # an earlier run's: emptied
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "logs"]
    assert not any((out / "logs").iterdir())
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare_out(empty)  # an empty folder is used as it is
    assert (empty / MARKER).is_file()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0 ms"),
        (2e-6, "<0.01 ms"),
        (0.12e-3, "0.12 ms"),
        (3.44e-3, "3.4 ms"),
        (0.28561, "286 ms"),
        (2.5111, "2,511 ms"),
    ],
)
def test_small_times_keep_their_digits(seconds: float, text: str) -> None:
    assert format_ms(seconds) == text
