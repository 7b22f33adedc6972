"""The main job (`splitinfer-demo`) end to end, small: real daemons, real link emulation.

Two runs: the digits job (``--quick``, about a minute) and the default OCR job on
ddddocr's trained network (a few minutes; skipped where the ``demo`` extra's
``ddddocr`` wheel is not installed).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROWS = ("fp32 model (reference)", "auto (its choice)", "cloud-only", "edge-only")


def _running(path: Path) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if str(path) in line and "pytest" not in line]


def _demo(out: Path, *args: str, timeout: float) -> str:
    exe = Path(sys.executable).with_name("splitinfer-demo")
    proc = subprocess.run(
        [str(exe), "--out", str(out), *args],
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


def test_quick_digits_demo_runs_every_strategy_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    rows = _rows(_demo(out, "--quick", "--samples", "40", timeout=280))
    for row in ROWS:
        assert row in rows
    cloud_only = rows["cloud-only"]
    assert cloud_only[0] == "c0"
    assert float(cloud_only[3]) == 1.0  # the fp32 cloud model agrees with itself
    assert int(cloud_only[6]) > 0  # bytes went over the emulated uplink
    assert cloud_only[8] == "0"
    assert (out / "packages" / "auto" / "manifest.json").is_file()
    assert (out / "latency-cdf.png").stat().st_size > 1000


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
