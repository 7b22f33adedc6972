"""``netsim fleet``: the vectorised links against the shaper, the replica against the
engine's way of driving the batcher, the choosers' shortcut against asking every time,
hand-checkable tiny fleets, determinism, the capacity search, the scenario format, and
that the real batcher and the real CutChooser are the ones used."""

from __future__ import annotations

import ast
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest

from splitinfer.cloud import batcher as cloud_batcher
from splitinfer.cloud.config import BatchingConfig, OverloadConfig
from splitinfer.edge import chooser as edge_chooser
from splitinfer.edge.config import AdaptConfig
from splitinfer.edge.link import LinkEstimator
from splitinfer.shared.costs import CutCost
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.links import Link, MahimahiTrace
from splitinfer.sim import traces
from splitinfer.sim.fleet import capacity, devices, engine, replica, report
from splitinfer.sim.fleet.links import RATE, TRACE, Capacities, fifo, transfer
from splitinfer.sim.fleet.reading import load_fleet
from splitinfer.sim.fleet.scenario import BatchLatency, FleetScenario
from splitinfer.sim.shaper import OutageCapacity, TraceCapacity

pytestmark = pytest.mark.sim

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "sim" / "scenarios" / "fleet_demo.toml"
ATT = "ATT-LTE-driving-2016.up"

TINY = """
name = "tiny"
seed = 7
duration = "60s"
[package]
start = "c1"
[[package.cuts]]
id = "c1"
kind = "split"
edge = "50ms"
up_bytes = 1000
cloud = "4ms"
down_bytes = 400
batch = { 32 = "4ms" }
[[devices]]
count = 20
arrivals = { kind = "trace", file = "every2s.txt" }
uplink = "unlimited"
downlink = "unlimited"
[cloud]
profile = "l4"
replicas = 1
"""

ADAPTIVE = """
name = "adaptive"
seed = 3
duration = "90s"
[package]
start = "c0"
fallback = true
[[package.cuts]]
id = "c0"
kind = "none"
up_bytes = 2000
cloud = "20ms"
down_bytes = 1500
batch = { 8 = "150ms" }
[[package.cuts]]
id = "c5"
kind = "split"
edge = "30ms"
up_bytes = 600
cloud = "1ms"
down_bytes = 1500
batch = { 8 = "3ms", 32 = "9ms" }
[[package.cuts]]
id = "c9"
kind = "all"
edge = "120ms"
[[devices]]
count = 60
arrivals = { kind = "poisson", rate = 2 }
uplink = { traces = ["ATT-LTE-driving-2016.up", "TMobile-LTE-short.up"] }
downlink = "20mbit"
delay = "20ms"
fallback = true
jitter = 0.1
[[degrade]]
share = 0.33
start = "30s"
end = "60s"
factor = 0.05
[adapt]
min_rate_sample = 512
min_dwell = 3
[cloud]
profile = "l4"
replicas = 1
[cloud.batching]
max_batch_size = 8
max_queue_size = 16
"""


def scenario(tmp_path: Path, text: str, **extra: str) -> FleetScenario:
    (tmp_path / "every2s.txt").write_text("\n".join(str(t) for t in range(0, 62, 2)) + "\n")
    path = tmp_path / "fleet.toml"
    path.write_text(textwrap.dedent(text))
    for name, body in extra.items():
        (tmp_path / name).write_text(body)
    return load_fleet(path)


# -- links ----------------------------------------------------------------------------------


def _one_device(kind: int, trace: MahimahiTrace | None, offset_s: float, rate: float = 1e6):
    return Capacities(
        np.array([kind], np.int8),
        np.array([rate]),
        np.zeros(1, np.int64),
        np.array([offset_s]),
        [trace] if trace is not None else [],
    )


def test_trace_capacity_is_the_shapers() -> None:
    trace = MahimahiTrace.load(traces.path(ATT))
    cap = _one_device(TRACE, trace, 12.345)
    ref = TraceCapacity(trace, offset_s=12.345)
    rng = np.random.default_rng(0)
    t = rng.uniform(0, 400, 300)
    dev = np.zeros(t.size, np.int64)
    got = cap.bytes_before(dev, t)
    assert got.tolist() == [ref.bytes_before(x) for x in t]
    pos = rng.uniform(1, 5e7, 300)
    assert np.allclose(cap.time_of(dev, pos), [ref.time_of(p) for p in pos], rtol=0, atol=1e-9)


def test_an_outage_is_the_shapers_outage() -> None:
    trace = MahimahiTrace.load(traces.path("TMobile-LTE-short.up"))
    cap = _one_device(TRACE, trace, 3.0)
    cap.degrade(np.array([True]), 10.0, 15.0, 0.0)
    ref = OutageCapacity(TraceCapacity(trace, offset_s=3.0), [(10.0, 5.0)])
    t = np.linspace(0, 40, 401)
    dev = np.zeros(t.size, np.int64)
    assert np.allclose(cap.bytes_before(dev, t), [ref.bytes_before(x) for x in t])
    pos = np.linspace(1, float(ref.bytes_before(40.0)), 500)
    dev = np.zeros(pos.size, np.int64)
    assert np.allclose(cap.time_of(dev, pos), [ref.time_of(p) for p in pos], atol=1e-9)


def test_a_degraded_rate_serves_the_factor_of_its_bytes() -> None:
    cap = _one_device(RATE, None, 0.0, rate=8e6)  # 1 MB/s
    cap.degrade(np.array([True]), 1.0, 3.0, 0.25)
    dev = np.zeros(4, np.int64)
    before = cap.bytes_before(dev, np.array([0.5, 2.0, 3.0, 4.0]))
    assert before.tolist() == pytest.approx([5e5, 1.25e6, 1.5e6, 2.5e6])
    assert cap.time_of(dev, before).tolist() == pytest.approx([0.5, 2.0, 3.0, 4.0])


def test_fifo_is_lindleys_recursion() -> None:
    rng = np.random.default_rng(1)
    dev = rng.integers(0, 5, 200)
    ready = rng.uniform(0, 10, 200)
    service = rng.uniform(0, 0.5, 200)
    carry = np.full(5, -math.inf)
    start, end = fifo(dev, ready, service, carry)
    free = dict.fromkeys(range(5), -math.inf)
    for i in sorted(range(200), key=lambda i: (dev[i], ready[i])):
        s = max(ready[i], free[int(dev[i])])
        assert start[i] == s
        assert end[i] == s + service[i]
        free[int(dev[i])] = end[i]
    assert carry.tolist() == [free[d] for d in range(5)]


def test_transfers_queue_on_their_own_link() -> None:
    cap = _one_device(RATE, None, 0.0, rate=8e6)
    pos = np.zeros(1)
    dev = np.zeros(3, np.int64)
    sent = transfer(cap, dev, np.array([0.0, 0.0, 5.0]), np.array([1e6, 5e5, 1e5]), pos)
    assert sent.tolist() == pytest.approx([1.0, 1.5, 5.1])


# -- the uplink estimate -------------------------------------------------------------------


def test_the_uplink_estimate_follows_the_agents_estimator() -> None:
    rtt, half = 0.04, 3.0
    real = LinkEstimator(Link(1e6, 20e6, rtt), half_life_s=half, min_rate_bytes=1024)
    mine = devices.LinkEstimates(1, 1e6, np.array([rtt]), half, 1024)
    bits, t = 16_000.0, 0.0
    for step in range(60):
        t = step * 1.0
        rate = 2e6 if t < 30 else 0.5e6
        y = rtt + bits / rate
        real.observe_rtt(rtt, t)
        real.observe_transfer(2000, 0, y, 0.0, t)
        mine.update(np.zeros(1, np.int64), np.array([t]), np.array([bits]), np.array([y]), t)
        assert mine.uplink_bps[0] == pytest.approx(real.estimate().link.uplink_bps, rel=0.02)
    assert mine.uplink_bps[0] == pytest.approx(0.5e6, rel=0.05)


def test_the_shortcut_predicts_what_the_chooser_predicts() -> None:
    costs = {
        "c0": CutCost("c0", "none", up_bytes=4000, cloud_s=0.002, down_bytes=100),
        "c3": CutCost("c3", "split", 0.03, 0.001, 800, 0.001, 0.0002, 100),
        "c9": CutCost("c9", "all", 0.12),
    }
    cfg = AdaptConfig()
    ch = devices.Choosers(costs, "c0", cfg, [{"c3": 0.05, "c9": 0.2}], np.zeros(4, np.int64), 2e7)
    ch.loaded[2] = True
    ups = np.array([1e5, 1e6, 5e6, 3e7])
    rtt = np.array([0.04, 0.05, 0.06, 0.01])
    got = ch.predictions(np.arange(4), ups, rtt)
    for d in range(4):
        link = Link(ups[d], 2e7, rtt[d])
        factor = cfg.load_factor if d == 2 else 1.0
        edge = {"c3": 0.05, "c9": 0.2}
        want = [edge_chooser.predict(c, link, factor, edge.get(k)) for k, c in costs.items()]
        assert got[d].tolist() == want


# -- the replica -----------------------------------------------------------------------------


@pytest.mark.parametrize("slots", [1, 2])
def test_the_replica_batches_as_the_engine_would(slots: int) -> None:
    rng = np.random.default_rng(slots)
    n = 3000
    times = np.cumsum(rng.exponential(1 / 800, n)).tolist()
    cuts = rng.integers(0, 2, n).tolist()
    table = {
        "a": BatchLatency(((1, 0.002), (8, 0.006), (32, 0.02))).table(16),
        "b": BatchLatency(((1, 0.001), (16, 0.004))).table(16),
    }
    cfg = BatchingConfig(max_batch_size=16, max_concurrent_batches=slots)
    runs = []
    for exact in (True, False):
        r = replica.Replica(cfg, OverloadConfig(), ["a", "b"], table, exact=exact)
        out = r.advance(times, list(range(n)), cuts, None, None, times[-1] + 10)
        runs.append((out.started, out.ended, out.rows, out.ids))
    assert runs[0] == runs[1]
    assert sorted(runs[0][3]) == list(range(n))


def test_the_replica_refuses_past_its_queue() -> None:
    table = {"a": BatchLatency(((1, 0.05),)).table(4)}
    cfg = BatchingConfig(max_batch_size=4, max_queue_size=8)
    r = replica.Replica(cfg, OverloadConfig(), ["a"], table)
    times = [i * 0.001 for i in range(100)]
    out = r.advance(times, list(range(100)), [0] * 100, None, None, 100.0)
    assert out.refused
    assert set(out.refused_why) == {"QueueFull"}
    assert sorted(out.ids + out.refused) == list(range(100))


def test_the_real_batcher_and_chooser_are_the_ones_used(tmp_path: Path) -> None:
    assert replica.Batcher is cloud_batcher.Batcher
    assert replica.Item is cloud_batcher.Item
    assert devices.CutChooser is edge_chooser.CutChooser
    sim = engine.FleetSim(scenario(tmp_path, ADAPTIVE))
    assert all(type(r.batcher) is cloud_batcher.Batcher for r in sim.replicas)
    assert all(type(c) is edge_chooser.CutChooser for c in sim.choosers.choosers)
    for path in (ROOT / "sim" / "fleet").glob("*.py"):  # no copy of either class
        tree = ast.parse(path.read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        assert not names & {"Batcher", "CutChooser", "LatencyModel", "RateLimiter"}, path


# -- fleets ------------------------------------------------------------------------------------


def test_a_tiny_fleet_adds_up_by_hand(tmp_path: Path) -> None:
    run = engine.run_fleet(scenario(tmp_path, TINY))
    req = run.requests
    assert req.n == 20 * 30  # every 2 s for 60 s, each device from its own offset
    assert (req.outcome == engine.CLOUD).all()
    device, uplink, queue, batch, downlink = req.parts.astype(np.float64)
    assert np.allclose(device, 0.05)  # 2 s apart: a device never waits for itself
    assert (uplink == 0).all()
    assert (downlink == 0).all()
    assert np.allclose(batch, 0.004)
    assert (queue >= 0).all()
    assert queue.max() <= 0.008 + 1e-9
    assert np.allclose(req.e2e, device + queue + batch, atol=1e-6)
    assert run.batches["rows"].sum() == req.n
    doc = report.summary(run)
    assert doc["outcomes"]["cloud"] == 600
    assert doc["errors"] == 0
    assert doc["cost"]["usd"] == pytest.approx(0.8048 / 60)
    assert doc["replica"][0]["utilization"] == pytest.approx(run.batches["rows"].size * 0.004 / 60)


def test_a_seed_makes_a_run_repeat(tmp_path: Path) -> None:
    sc = scenario(tmp_path, ADAPTIVE)
    a, b = engine.run_fleet(sc), engine.run_fleet(sc)
    assert a.requests.n == b.requests.n > 5000
    assert np.array_equal(a.requests.e2e, b.requests.e2e, equal_nan=True)
    assert np.array_equal(a.requests.cut, b.requests.cut)
    assert a.switches == b.switches > 0
    import dataclasses

    c = engine.run_fleet(dataclasses.replace(sc, seed=8))
    assert not np.array_equal(a.requests.arrival[:100], c.requests.arrival[:100])


def test_the_shortcuts_change_nothing(tmp_path: Path) -> None:
    """Asking only some choosers, and the batcher only when it can answer otherwise,
    gives the run that asking everything every time gives."""
    sc = scenario(tmp_path, ADAPTIVE)
    fast, exact = engine.run_fleet(sc), engine.run_fleet(sc, exact=True)
    assert np.array_equal(fast.requests.e2e, exact.requests.e2e, equal_nan=True)
    assert np.array_equal(fast.requests.outcome, exact.requests.outcome)
    assert fast.switches == exact.switches
    assert fast.chooser_calls < exact.chooser_calls
    doc = report.summary(fast)
    assert doc["answered_on_device_by_fallback"] > 0  # the queue bound refused some
    assert len(doc["cuts"]) == 3


def test_the_capacity_search_is_monotone(tmp_path: Path) -> None:
    heavy = (
        TINY.replace('batch = { 32 = "4ms" }', 'batch = { 1 = "6ms", 32 = "40ms" }')
        .replace("count = 20", "count = 150")
        .replace('duration = "60s"', 'duration = "30s"')
    )
    sc = scenario(tmp_path, heavy)
    p99 = {r: report.latency_quantile(engine.run_fleet(sc.with_replicas(r))) for r in (1, 2, 3, 4)}
    assert all(p99[r + 1] <= p99[r] for r in (1, 2, 3))
    target = (p99[2] + p99[1]) / 2
    found = capacity.search(sc, target)
    assert found.replicas == 2
    assert found.p99_s <= target < found.tried[1]
    assert 0 <= found.margin < 1
    assert "2 replica(s) meet" in found.describe()


def test_compare_with_a_real_run(tmp_path: Path) -> None:
    run = engine.run_fleet(scenario(tmp_path, TINY))
    req = run.requests
    same = {"e2e": req.e2e, "queue": req.parts[2], "batch_rows": run.batches["rows"]}
    text, ok = report.compare(same, run)
    assert ok
    assert "e2e p99 ms" in text
    slower = dict(same, e2e=req.e2e * 1.3)
    assert not report.compare(slower, run)[1]


# -- the format --------------------------------------------------------------------------------


def test_the_demo_scenario_reads() -> None:
    sc = load_fleet(DEMO)
    assert list(sc.costs) == ["c7526", "c32", "c0"]
    assert sc.devices == 10_000
    assert sc.duration_s == 3600
    assert sc.cloud.profile == "l4"
    assert sc.cloud.price_per_hour == pytest.approx(0.8048)
    assert sc.local_s == pytest.approx(sc.costs["c7526"].edge_s)
    assert sc.cloud.latency["c0"].points[0][0] == 1
    assert sc.adapt.min_rate_bytes == 1024


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (("[cloud]", "[cloud]\ncolour = 1"), "unknown key 'colour'"),
        (('profile = "l4"', 'profile = "raspberry-pi-5"'), "not a built-in cloud"),
        (('uplink = "unlimited"', 'uplink = "5kbps"'), "ambiguous"),
        (('duration = "60s"', 'duration = "1 week"'), "duration"),
    ],
)
def test_a_bad_scenario_is_one_line(tmp_path: Path, edit: tuple[str, str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        scenario(tmp_path, TINY.replace(*edit))


def test_degradations_may_not_overlap(tmp_path: Path) -> None:
    second = '[[degrade]]\nshare = 0.5\nstart = "50s"\nend = "70s"\nfactor = 0.5\n[adapt]'
    with pytest.raises(ConfigError, match="overlap"):
        scenario(tmp_path, ADAPTIVE.replace("[adapt]", second))


def test_netsim_fleet_writes_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from splitinfer.sim.cli import main

    sc = scenario(tmp_path, ADAPTIVE)
    assert sc.name == "adaptive"
    code = main(
        [
            "fleet",
            str(tmp_path / "fleet.toml"),
            "--devices",
            "30",
            "--duration",
            "20s",
            "-o",
            str(tmp_path / "out"),
            "-q",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "end to end" in printed
    assert "cost: USD" in printed
    for name in ("report.json", "latency-cdf.png", "p99-over-time.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
