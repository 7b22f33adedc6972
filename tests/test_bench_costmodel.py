"""bench/bench_costmodel.py --quick, the CI smoke run: a small zoo model through the real
cloud-service and edge-agent; the table has its columns and the oracle is the best."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.integration  # starts cloud-service and an edge-agent

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_costmodel.py"
COLUMNS = ("model", "device", "link", "pred", "best", "auto ms", "/oracle", "/cloud", "/edge")


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_costmodel", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # two daemons, an export and 9 pinned requests: 40 s alone here, 2 min loaded
def test_quick_run_measures_every_cut_and_the_oracle_is_the_best(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _bench()
    out = tmp_path / "rows.json"
    argv = ["--quick", "--runs", "1", "--max-measured", "3", "--work", str(tmp_path), "-q"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.err == ""  # -q: no progress
    header = next(line for line in printed.out.splitlines() if line.startswith("model"))
    for column in COLUMNS:
        assert column in header, header
    assert "acceptance: not judged under --quick" in printed.out
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [r["link"] for r in rows] == ["0.5 Mbit/s", "5 Mbit/s", "50 Mbit/s"]
    for r in rows:
        measured = r["all_ms"]
        assert len(measured) == 3, measured  # cloud-only, edge-only and one split
        assert r["oracle_ms"] == min(measured.values())
        # the oracle is no slower than any strategy: auto, edge-only, cloud-only
        for strategy in (r["auto_ms"], r["edge_ms"], r["cloud_codec_ms"]):
            assert r["oracle_ms"] <= strategy
        assert r["vs_oracle"] >= 1.0
        assert r["predicted"] in measured
    # the fixed rates order the same cut's latency: slower link, no faster answer
    for cut in rows[0]["all_ms"]:
        lat = [r["all_ms"][cut] for r in rows]
        assert lat == sorted(lat, reverse=True), (cut, lat)


@pytest.mark.unit
def test_the_ceiling_recomposes_the_measured_parts_with_a_slower_device() -> None:
    bench = _bench()

    def row(device: str, up_ms: float) -> dict:
        # cloud-only sends the input (up_ms); the split does 10 ms on the device and
        # sends a quarter; all-edge is 100 ms on the device
        device_ms = {"c0": 0.0, "c1": 10.0, "c2": 100.0}
        all_ms = {"c0": up_ms + 50, "c1": 10.0 + up_ms / 4 + 45, "c2": 100.0}
        kinds = {"c0": "none", "c1": "split", "c2": "all"}
        return {"device": device, "all_ms": all_ms, "device_ms": device_ms, "kinds": kinds}

    rows = [row("fast", 30.0), row("fast", 200.0)]
    lines = bench.ceiling(rows)
    by_k = {int(line.split()[0]): line.split()[1:] for line in lines[2:]}
    # k=1: 30 ms up -> all-edge 100, cloud-only 80, split 62.5: interior; 200 ms up -> split
    # 105 vs all-edge 100: all-edge. k=2: all-edge 200, split 72.5 / 115: both interior.
    assert by_k[1][0] == "1/2"
    assert by_k[2][0] == "2/2"
    # a device 100x slower: 1 s on the split's part, the cloud-only cut wins both
    assert by_k[100][0] == "0/2"
    assert lines[1].split()[:3] == ["k", "all", "rows"]


@pytest.mark.unit
def test_trace_uploads_are_what_the_emulated_links_shaper_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = _bench()
    monkeypatch.setattr(bench, "STARTS", 30)
    traces = [c for c in bench.link_cases(False) if c.direction.trace is not None]
    assert len(traces) >= 4
    for case in traces:
        d = case.direction
        starts = [i * d.trace.duration_ms / 1e3 / 30 for i in range(30)]
        for nbytes in (1, 1846, 60_000):
            want = bench.shaper_upload(d, nbytes, starts)
            assert bench._mean_upload(d, nbytes) == pytest.approx(want, abs=1e-9), (case, nbytes)
    fixed = next(c for c in bench.link_cases(False) if c.direction.trace is None)
    assert bench._mean_upload(fixed.direction, 1500) == pytest.approx(
        bench.shaper_upload(fixed.direction, 1500, [0.0])
    )


@pytest.mark.unit
def test_the_raw_baseline_is_a_whole_frame_with_the_inputs_raw() -> None:
    import numpy as np

    bench = _bench()
    feeds = {
        "input_ids": np.ones((1, 128), np.int64),
        "pixels": np.zeros((1, 3, 8, 8), np.float64),  # floats travel at fp32
    }
    raw = bench.raw_input_bytes(feeds)
    assert raw == 128 * 8 + 3 * 8 * 8 * 4
    frame = bench.raw_request_bytes(feeds, "minilm")
    assert raw < frame < raw + 1024  # the frame's header and per-tensor fields
