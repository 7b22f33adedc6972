"""The main job (`splitinfer-demo`) end to end, small: real daemons, real link emulation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _running(path: Path) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if str(path) in line and "pytest" not in line]


def test_demo_runs_every_strategy_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    exe = Path(sys.executable).with_name("splitinfer-demo")
    proc = subprocess.run(
        [str(exe), "--out", str(out), "--samples", "40"],
        capture_output=True,
        text=True,
        timeout=280,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout
    for row in ("fp32 model (reference)", "auto (its choice)", "cloud-only", "edge-only"):
        assert row in table
    lines = {line.split("  ")[0].strip(): line for line in table.splitlines()}
    cloud_only = lines["cloud-only"].split()
    # cut, accuracy, agreement, p50, p99, bytes up, bytes down, errors
    assert cloud_only[1] == "c0"
    assert float(cloud_only[3]) == 1.0  # the fp32 cloud model agrees with itself
    assert int(cloud_only[6]) > 0  # bytes went over the emulated uplink
    assert cloud_only[8] == "0"
    assert not _running(out), "the demo left processes behind"
    assert (out / "packages" / "auto" / "manifest.json").is_file()
