"""The soak run (issue 29): its pure logic (``sim/soak.py``: the fault schedule, the
ledger, the answer rules, the verdicts on the processes' samples) and, marked slow,
``bench/bench_soak.py --minutes 3`` for real: every fault kind happens, nothing is
lost, nothing is wrong, nothing grows."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from splitinfer.shared.errors import ConfigError
from splitinfer.sim.soak import (
    EXCLUSIVE,
    FAULT_KINDS,
    Agreement,
    Exact,
    Ledger,
    Sample,
    error_kind,
    fd_findings,
    format_window,
    grows,
    judge,
    nonce_bound,
    nonce_findings,
    outages_of,
    rss_findings,
    rule_of,
    schedule,
)

ROOT = Path(__file__).resolve().parent.parent
unit = pytest.mark.unit


# -- the schedule ---------------------------------------------------------------------------


@unit
@pytest.mark.parametrize("minutes", [3, 5, 10, 20, 60, 240])
def test_every_fault_kind_happens_and_the_cloud_faults_never_overlap(minutes: int) -> None:
    duration = minutes * 60.0
    faults = schedule(duration, devices=8)
    kinds = Counter(f.kind for f in faults)
    assert set(kinds) == set(FAULT_KINDS)
    for once in ("cloud-stop", "nonce-restart", "disk-full"):
        assert kinds[once] == 1
    assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)
    assert all(f.at_s >= 10.0 and f.end_s <= duration - 10.0 + 1e-9 for f in faults)
    exclusive = sorted((f.at_s, f.end_s) for f in faults if f.kind in EXCLUSIVE)
    for (_, end), (start, _) in itertools.pairwise(exclusive):
        assert start >= end, exclusive
    outages = [f for f in faults if f.kind == "link-outage"]
    assert all(f.duration_s > 0 for f in outages)
    assert {f.device for f in outages} <= set(range(8))


@unit
def test_an_hour_keeps_the_nominal_cadence() -> None:
    faults = schedule(3600.0, devices=8)
    kinds = Counter(f.kind for f in faults)
    assert kinds["hot-swap"] == 59  # every minute, none in the last 10 s
    assert kinds["cloud-kill"] == 19  # every 3 minutes
    assert kinds["link-outage"] == 30  # every 2 minutes
    assert all(10 <= f.duration_s <= 30 for f in faults if f.kind == "link-outage")
    stop = next(f for f in faults if f.kind == "cloud-stop")
    assert stop.duration_s == 15
    # the outages go round the devices
    assert [f.device for f in faults if f.kind == "link-outage"][:9] == [0, 1, 2, 3, 4, 5, 6, 7, 0]


@unit
def test_shorter_runs_are_compressed_and_too_short_ones_refused() -> None:
    three = Counter(f.kind for f in schedule(180.0, devices=8))
    assert three["hot-swap"] > 3
    assert three["cloud-kill"] >= 2
    assert three["link-outage"] >= 2
    assert schedule(180.0, 8, seed=1) != schedule(180.0, 8, seed=2)  # outage lengths drawn
    assert schedule(180.0, 8, seed=1) == schedule(180.0, 8, seed=1)
    with pytest.raises(ConfigError, match="at least 3 minutes"):
        schedule(60.0, devices=8)
    with pytest.raises(ConfigError, match="at least one device"):
        schedule(600.0, devices=0)


@unit
def test_outages_of_a_device_are_its_link_configs_outages() -> None:
    faults = schedule(600.0, devices=3)
    mine = outages_of(faults, 1)
    assert mine
    assert all(d > 0 for _, d in mine)
    assert sum(len(outages_of(faults, k)) for k in range(3)) == sum(
        f.kind == "link-outage" for f in faults
    )


# -- answers ---------------------------------------------------------------------------------


def manifest(codec: str, precision: str = "fp32", privacy: bool = False) -> dict:
    quality = {"metric": "top1", "value": 0.98, "samples": 200}
    if privacy:
        quality["private"] = {"metric": "top1", "value": 0.6, "epsilon": 64.0}
    return {
        "model_name": "m",
        "privacy": {"epsilon": 64.0} if privacy else None,
        "cuts": [
            {
                "id": "c1",
                "codec": {"name": codec},
                "edge": {"precision": precision},
                "quality": quality,
            }
        ],
    }


@unit
def test_the_rule_follows_the_package() -> None:
    assert rule_of(manifest("raw"), "c1") == Exact()
    int8 = rule_of(manifest("raw", "int8"), "c1")
    assert isinstance(int8, Agreement)
    assert int8.stated == 0.98
    assert int8.samples == 200
    assert not int8.noised
    lossy = rule_of(manifest("int8+zstd"), "c1")
    assert isinstance(lossy, Agreement)
    assert "int8+zstd" in lossy.why
    private = rule_of(manifest("raw", privacy=True), "c1")
    assert isinstance(private, Agreement)
    assert private.stated == 0.6
    assert private.noised
    with pytest.raises(ConfigError, match="no cut"):
        rule_of(manifest("raw"), "c9")
    bare = manifest("int8+zstd")
    bare["cuts"][0]["quality"] = {}
    with pytest.raises(ConfigError, match="states no top-1 agreement"):
        rule_of(bare, "c1")


@unit
def test_judging_answers() -> None:
    ref = {"logits": np.array([[0.1, 0.9, 0.3]], np.float32)}
    assert judge(Exact(), {"logits": ref["logits"] + 5e-6}, ref) == "ok"
    assert judge(Exact(), {"logits": ref["logits"] + 1e-3}, ref) == "wrong"
    assert judge(Exact(), {"other": ref["logits"]}, ref) == "wrong"
    assert judge(Exact(), {"logits": ref["logits"][:, :2]}, ref) == "wrong"
    rule = Agreement(0.98, 200)
    assert judge(rule, {"logits": np.array([[0.0, 0.5, 0.4]])}, ref) == "ok"
    assert judge(rule, {"logits": np.array([[0.0, 0.5, 0.6]])}, ref) == "disagree"


@unit
def test_agreement_floor_is_the_statement_at_three_sigma() -> None:
    rule = Agreement(1.0, 205)
    # zero disagreements on 205 samples do not promise zero: about 96 % at three sigma
    assert 0.94 < rule.floor(10_000) < 0.97
    assert rule.floor(50) < rule.floor(5_000)  # fewer answers, more room
    assert rule.holds(0, 0)
    assert rule.holds(960, 1000)
    assert not rule.holds(900, 1000)
    # repeated inputs are not independent: judged on the distinct ones, more room
    assert rule.holds(2650, 2800, independent=60)
    assert not rule.holds(2650, 2800)
    private = Agreement(0.52, 205, noised=True)
    assert private.holds(500, 1000)
    assert not private.holds(300, 1000)


# -- the ledger ----------------------------------------------------------------------------------


@unit
def test_the_ledger_counts_every_request_and_its_answer() -> None:
    ledger = Ledger()
    a = ledger.sent(0, "chain", 3, 1.0)
    b = ledger.sent(0, "chain", 4, 2.0)
    c = ledger.sent(1, "moe", 0, 2.5)
    d = ledger.sent(1, "moe", 1, 70.0)
    ledger.answered(a, 1.05, local=False, verdict="ok", version="2", cut="c0")
    ledger.attempt_failed(b, "503: no cloud endpoint answered (http://x:1: refused)", 3.0, False)
    ledger.answered(b, 4.0, local=True, verdict="ok", reason="cloud unavailable")
    ledger.attempt_failed(c, "503: no cloud endpoint answered (http://x:1: refused)", 3.0, False)
    ledger.attempt_failed(c, "400: bad frame", 5.0, True)
    assert [e.seq for e in ledger.devices[0]] == [0, 1]
    assert ledger.counts() == Counter({"cloud": 1, "local": 1, "failed": 1, "pending": 1})
    assert {(e.device, e.seq) for e in ledger.lost()} == {(1, 0), (1, 1)}
    assert (b.attempts, c.attempts) == (2, 2)
    w = ledger.window(1, 0.0, 60.0)
    assert (w.sent, w.cloud, w.local, w.failed) == (3, 1, 1, 1)
    assert w.errors == {"503: no cloud endpoint answered": 2, "400: bad frame": 1}
    assert w.local_reasons == {"cloud unavailable": 1}
    assert w.p50_ms == pytest.approx(1025.0)
    assert d.outcome == "pending"
    assert ledger.window(2, 60.0, 120.0).sent == 1
    text = format_window(w, pending=1)
    assert "sent 3" in text
    assert "cloud unavailable x1" in text
    assert "errors" in text
    assert a.record()["version"] == "2"
    assert b.record()["reason"] == "cloud unavailable"
    with pytest.raises(ValueError, match="reason"):
        ledger.answered(d, 71.0, local=True, verdict="ok")


@unit
def test_error_kinds_drop_urls_numbers_and_detail() -> None:
    assert error_kind("503: no cloud endpoint answered (http://127.0.0.1:4242: x3)") == (
        "503: no cloud endpoint answered"
    )
    assert error_kind("Cannot connect to host 127.0.0.1:39347 ssl:default") == (
        "Cannot connect to host N.N:N ssl:default"
    )
    assert error_kind("") == "empty error"
    assert len(error_kind("x" * 500)) == 60


# -- the processes ------------------------------------------------------------------------------


def samples(role: str, pid: int, values: list[tuple[float, int, int]]) -> list[Sample]:
    return [Sample(t, role, pid, rss, fds) for t, rss, fds in values]


@unit
def test_rss_is_judged_against_minute_ten_on_long_runs_only() -> None:
    mb = 2**20
    steady = samples("agent sim-0", 10, [(300, 100 * mb, 20), (600, 100 * mb, 20),
                                         (1800, 108 * mb, 20)])  # fmt: skip
    leaky = samples("cloud", 11, [(300, 100 * mb, 30), (600, 100 * mb, 30), (1800, 130 * mb, 30)])
    restarted = samples("redis", 12, [(900, 10 * mb, 8), (1800, 40 * mb, 8)])
    gone = samples("agent sim-1", 13, [(300, 10 * mb, 8), (600, 10 * mb, 8)])
    every = steady + leaky + restarted + gone
    found = rss_findings(every, run_s=1800)
    assert len(found) == 1
    assert found[0].startswith("cloud (pid 11)")
    assert "+30%" in found[0]
    assert rss_findings(every, run_s=600) == []  # under 20 minutes: not judged
    assert rss_findings(every, run_s=1800, exclude=("cloud",)) == []


@unit
def test_open_fds_must_not_trend_up() -> None:
    assert grows([10, 20, 30, 40, 50, 60], slack=5)
    assert not grows([10, 40, 20, 21, 20, 22], slack=5)  # a burst, then flat
    assert not grows([30, 30], slack=0)  # too few to tell
    flat = samples("agent sim-7", 1, [(60, 1, 15), (120, 1, 36), (180, 1, 25), (182, 1, 25)])
    leak = samples("cloud", 2, [(60, 1, 20), (120, 1, 60), (180, 1, 100), (240, 1, 140)])
    found = fd_findings(flat + leak, warmup_s=60)
    assert len(found) == 1
    assert found[0].startswith("cloud (pid 2)")
    assert fd_findings(leak, exclude=("cloud",)) == []


@unit
def test_the_nonce_store_is_bounded() -> None:
    bound = nonce_bound(12.0, attempts=3, window_s=30.0)
    assert bound == 2 * 3 * 12 * 31 + 100
    calm = [(60.0, 350), (120.0, None), (180.0, 380), (240.0, 340)]
    assert nonce_findings(calm, bound) == []
    assert nonce_findings([(60.0, bound + 1)], bound)
    growing = [(60.0 * k, 100 * k) for k in range(1, 10)]
    assert any("grows" in line for line in nonce_findings(growing, 1000))


# -- the real thing -----------------------------------------------------------------------------


@pytest.mark.sim
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_three_minute_soak_loses_nothing_and_grows_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_soak.py"), "--minutes", "3", "--window", "1",
         "--out", str(out)],
        check=False, capture_output=True, text=True, timeout=1100,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    report = f"stdout:\n{done.stdout[-6000:]}\nstderr:\n{done.stderr[-4000:]}"
    result = json.loads((out / "result.json").read_text())
    assert done.returncode == 0, report
    assert result["passed"], report
    assert (result["lost"], result["wrong"]) == (0, 0), report
    counts = result["counts"]
    assert counts.get("cloud", 0) > 500, report
    assert counts.get("local", 0) > 0, report
    done_kinds = result["faults_done"]
    skipped = set(result["faults_skipped"])
    assert all(done_kinds[k] >= 1 for k in FAULT_KINDS if k not in skipped), done_kinds
    if os.geteuid() == 0:
        assert not skipped, result["faults_skipped"]  # root mounts the tmpfs: disk-full is real
    # every window was reported, with every process measured
    assert [w["index"] for w in result["windows"]][:3] == [1, 2, 3]
    roles = {p["role"] for p in result["windows"][0]["processes"]}
    assert {"cloud", "redis", "harness"} <= roles
    assert sum(r.startswith("agent") for r in roles) == 8
    assert all(w["nonce_keys"] is not None for w in result["windows"])
    # the hot-swapped model answered from several versions, each checked against its weights
    assert len(result["models"]["chain"]["versions"]) >= 3
    assert result["models"]["moe"]["cloud"] > 0
    ledgers = list((out / "ledgers").glob("sim-*.jsonl"))
    assert len(ledgers) == 8
    lines = [json.loads(x) for f in ledgers for x in f.read_text().splitlines()]
    assert len(lines) == sum(counts.values())
    assert all(e["outcome"] == "cloud" or e["reason"] for e in lines)
    assert not (out / "repository").is_mount()
