"""Link estimation and cut switching: pure logic, then the pipeline over an emulated link."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from incloud import CloudFactory
from onnx import helper

from splitinfer.edge.chooser import CutChooser, predict
from splitinfer.edge.config import AdaptConfig, UplinkConfig
from splitinfer.edge.failover import Uplink
from splitinfer.edge.link import LinkEstimator
from splitinfer.edge.model import load_model
from splitinfer.edge.pipeline import Pipeline, server_seconds
from splitinfer.edge.transport import FunctionTransport, Reply
from splitinfer.partitioner.pipeline import CutArtifacts, artifacts_for, prepare, write_package
from splitinfer.shared.costs import CutCost, predict_latency
from splitinfer.shared.links import Link
from splitinfer.shared.manifest import CodecSpec

pytestmark = pytest.mark.unit

# three cuts whose best depends on the uplink: all-cloud sends a lot, the split
# sends less after some edge work, all-edge sends nothing but computes the most
COSTS = {
    "none": CutCost("none", "none", edge_s=0.0, up_bytes=400_000, cloud_s=0.004),
    "mid": CutCost("mid", "split", edge_s=0.030, up_bytes=40_000, cloud_s=0.002),
    "all": CutCost("all", "all", edge_s=0.150),
}


def best(link: Link) -> str:
    return min(COSTS, key=lambda c: predict_latency(COSTS[c], link))


FAST = Link(200e6, 100e6, 0.005)
MEDIUM = Link(10e6, 100e6, 0.02)
SLOW = Link(0.5e6, 100e6, 0.1)


def test_the_three_links_have_three_different_best_cuts() -> None:
    assert [best(x) for x in (FAST, MEDIUM, SLOW)] == ["none", "mid", "all"]


def test_chooser_moves_to_the_best_cut_after_the_dwell() -> None:
    chooser = CutChooser(COSTS, "mid", AdaptConfig(min_dwell=3, hysteresis=0.1))
    picks = [chooser.choose(SLOW, now=0.0).cut_id for _ in range(5)]
    assert picks == ["mid", "mid", "mid", "all", "all"]
    assert chooser.switches == 1
    picks = [chooser.choose(FAST, now=0.0).cut_id for _ in range(4)]
    # three requests on "all" (two above, one here) before it may move again
    assert picks == ["all", "none", "none", "none"]


def test_hysteresis_keeps_the_cut_when_the_gain_is_small() -> None:
    costs = {
        "a": CutCost("a", "split", edge_s=0.010, up_bytes=10_000),
        "b": CutCost("b", "split", edge_s=0.012, up_bytes=5_000),
    }
    # at 10 Mbit/s: a = 0.010 + 0.008 = 18 ms, b = 0.012 + 0.004 = 16 ms (11 % faster)
    link = Link(10e6, 10e6, 0.0)
    assert predict(costs["b"], link) < predict(costs["a"], link)
    sticky = CutChooser(costs, "a", AdaptConfig(min_dwell=0, hysteresis=0.15))
    assert {sticky.choose(link, 0.0).cut_id for _ in range(20)} == {"a"}
    eager = CutChooser(costs, "a", AdaptConfig(min_dwell=0, hysteresis=0.05))
    assert eager.choose(link, 0.0).cut_id == "b"


@settings(max_examples=60, deadline=None)
@given(
    rates=st.lists(st.floats(0.2e6, 500e6), min_size=1, max_size=40),
    hysteresis=st.floats(0.0, 0.5),
    dwell=st.integers(0, 5),
)
def test_switches_are_rare_and_never_for_a_small_gain(
    rates: list[float], hysteresis: float, dwell: int
) -> None:
    chooser = CutChooser(COSTS, "mid", AdaptConfig(min_dwell=dwell, hysteresis=hysteresis))
    last, since = "mid", 0
    for r in rates:
        link = Link(r, 4 * r, 0.02)
        before = chooser.predictions(link)
        choice = chooser.choose(link, 0.0)
        if choice.cut_id != last:
            assert since >= dwell
            assert before[choice.cut_id] < before[last] * (1 - hysteresis)
            since = 0
        last = choice.cut_id
        since += 1


def test_load_moves_work_to_the_device_and_back() -> None:
    config = AdaptConfig(min_dwell=50, hysteresis=0.05, load_factor=20.0, load_half_life_s=10.0)
    costs = {
        "cloudy": CutCost("cloudy", "split", edge_s=0.002, up_bytes=20_000, cloud_s=0.010),
        "edgy": CutCost("edgy", "split", edge_s=0.020, up_bytes=20_000, cloud_s=0.001),
    }
    link = Link(50e6, 50e6, 0.01)
    chooser = CutChooser(costs, "cloudy", config)
    assert chooser.choose(link, 0.0).cut_id == "cloudy"
    for t in range(3):
        chooser.observe_load(0.95, float(t))
    assert chooser.loaded
    # the change of load state overrides the dwell: move at once
    choice = chooser.choose(link, 3.0)
    assert choice.cut_id == "edgy"
    assert choice.switched
    assert choice.loaded
    # light answers bring the estimate down below load_low: move back at once
    for t in range(4, 12):
        chooser.observe_load(0.05, float(t))
    assert not chooser.loaded
    assert chooser.choose(link, 12.0).cut_id == "cloudy"
    # with no answer at all the load decays (half-life 10 s) and the state clears
    for _ in range(15):
        chooser.observe_load(1.0, 100.0)
    assert chooser.loaded
    assert chooser.load(120.0) == pytest.approx(chooser.load(100.0) / 4)
    chooser.choose(link, 200.0)
    assert not chooser.loaded


def test_measured_edge_times_replace_the_predicted_ones() -> None:
    link = MEDIUM
    chooser = CutChooser(COSTS, "mid", AdaptConfig(min_dwell=0, hysteresis=0.0))
    assert chooser.choose(link, 0.0).cut_id == "mid"
    # this device turns out 7x slower at the split's edge segment: 254 ms > 150 ms all-edge
    assert chooser.choose(link, 0.0, {"mid": 0.200}).cut_id == "all"
    # and much faster at the whole model than the package predicted: it stays there
    assert chooser.choose(link, 0.0, {"mid": 0.020, "all": 0.030}).cut_id == "all"


def test_switching_off_or_a_single_candidate_never_moves() -> None:
    off = CutChooser(COSTS, "mid", AdaptConfig(enabled=False, min_dwell=0))
    assert {off.choose(SLOW, 0.0).cut_id for _ in range(5)} == {"mid"}
    alone = CutChooser({"mid": COSTS["mid"]}, "mid", AdaptConfig(min_dwell=0))
    assert alone.choose(SLOW, 0.0).cut_id == "mid"


# -- the estimator -----------------------------------------------------------------


def transfer(link: Link, up: int, down: int, server: float) -> float:
    return server + link.transfer_time(up, down)


@pytest.mark.parametrize("truth", [FAST, MEDIUM, SLOW])
@pytest.mark.parametrize("probes", [True, False])
def test_the_estimator_fits_rtt_and_rate(truth: Link, probes: bool) -> None:
    est = LinkEstimator(Link(10e6, truth.downlink_bps, 0.05), min_rate_bytes=4096)
    rng = np.random.default_rng(1)
    for t in range(40):
        if probes and t % 10 == 0:
            est.observe_rtt(truth.rtt_s * rng.uniform(1.0, 1.05), now=t * 0.1)
        up = int(rng.integers(20_000, 200_000))
        noise = rng.uniform(1.0, 1.02)
        est.observe_transfer(up, 500, transfer(truth, up, 500, 0.003) * noise, 0.003, t * 0.1)
    assert est.uplink_bps == pytest.approx(truth.uplink_bps, rel=0.1)
    assert est.rtt_s == pytest.approx(truth.rtt_s, rel=0.1, abs=1e-3)
    assert est.rate_samples == 40
    assert est.rtt_samples == (4 if probes else 0)


def test_one_transfer_size_takes_the_rtt_from_health_checks() -> None:
    truth = Link(200e6, 100e6, 0.005)
    est = LinkEstimator(Link(10e6, 100e6, 0.02), half_life_s=5.0)
    for t in range(20):  # on another link a while ago
        est.observe_transfer(32_000, 0, Link(10e6, 100e6, 0.02).transfer_time(32_000), 0.0, t)
    assert est.uplink_bps == pytest.approx(10e6, rel=1e-6)
    est.observe_rtt(truth.rtt_s, now=100.0)
    for t in range(5):  # 1.3 ms of upload against a 5 ms round trip
        est.observe_transfer(32_000, 0, truth.transfer_time(32_000), 0.0, 100.0 + t)
    assert est.rtt_s == pytest.approx(0.005, rel=0.05)
    assert est.uplink_bps == pytest.approx(200e6, rel=0.05)


def test_small_transfers_say_nothing_about_the_rate_and_junk_is_ignored() -> None:
    est = LinkEstimator(Link(10e6, 10e6, 0.5), min_rate_bytes=8192)
    est.observe_transfer(100, 100, 0.0302, 0.0, now=1.0)
    assert est.rtt_s == pytest.approx(0.03, abs=1e-3)
    assert est.uplink_bps == 10e6
    assert est.rate_samples == 0
    for bad in (float("nan"), -1.0, float("inf")):
        est.observe_rtt(bad, now=2.0)
        est.observe_transfer(50_000, 0, bad, 0.0, now=2.0)
    assert est.rtt_s == pytest.approx(0.03, abs=1e-3)
    assert est.rate_samples == 0
    # sizes that imply a negative RTT: the line is forced through the origin
    est = LinkEstimator(Link(10e6, 10e6, 0.05), min_rate_bytes=1000)
    est.observe_transfer(10_000, 0, 0.001, 0.0, now=0.0)
    est.observe_transfer(100_000, 0, 0.050, 0.0, now=0.0)
    assert est.rtt_s == 0.0
    assert est.uplink_bps > 0


# -- the pipeline over an emulated link ----------------------------------------------


def wide(width: int) -> onnx.ModelProto:
    """x[N, width] through six elementwise ops: every cut carries width floats."""
    nodes, prev = [], "x"
    for i, op in enumerate(["Sigmoid", "Tanh", "Relu", "Sigmoid", "Tanh", "Relu"]):
        nodes.append(helper.make_node(op, [prev], [f"t{i}"]))
        prev = f"t{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    io = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["N", width]) for n in "xy"]
    graph = helper.make_graph(nodes, "wide", io[:1], io[1:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def adaptive_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("adapt")
    onnx.save(wide(8192), str(tmp / "wide.onnx"))
    prepared = prepare(tmp / "wide.onnx")
    plans = prepared.space.plans()
    mid = len(plans) // 2
    arts: list[CutArtifacts] = []
    for i, key in ((mid, "mid"), (0, "none"), (len(plans) - 1, "all")):
        art = artifacts_for(prepared, plans[i])
        art.codec = CodecSpec("raw")
        cost = COSTS[key]
        art.predicted = CutCost(
            plans[i].id,
            plans[i].kind,
            **{k: getattr(cost, k) for k in ("edge_s", "up_bytes", "cloud_s")},
        ).to_dict()
        arts.append(art)
    write_package(prepared, arts, tmp / "pkg")
    return tmp / "pkg"


async def test_the_pipeline_follows_the_link(
    adaptive_pkg: Path, cloud_factory: CloudFactory
) -> None:
    model = load_model(adaptive_pkg)
    ids = {rt.cost.cut_id: rt.cut.kind for rt in model.cuts.values() if rt.cost}
    by_kind = {kind: cut_id for cut_id, kind in ids.items()}
    cloud = await cloud_factory(adaptive_pkg)
    now = [0.0]
    truth = [MEDIUM]

    async def emulated(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        reply = await cloud(method, path, body, headers)
        # the emulated link's time, plus the time the real cloud says it spent (the edge
        # takes that share out of the round trip by its Server-Timing)
        server = server_seconds(reply.header("Server-Timing"))
        assert server is not None
        now[0] += transfer(truth[0], len(body), len(reply.body), server)
        return reply

    uplink = Uplink([FunctionTransport(emulated)], UplinkConfig(), clock=lambda: now[0])
    adapt = AdaptConfig(
        min_dwell=3,
        hysteresis=0.1,
        measured_edge=False,
        prior_downlink="100mbit",
        link_half_life_s=2.0,
    )
    pipe = Pipeline(model, uplink, adapt=adapt, clock=lambda: now[0])
    x = {"x": np.zeros((1, 8192), np.float32)}
    kinds = []
    for phase in (MEDIUM, FAST, SLOW):
        truth[0] = phase
        pipe.estimator.observe_rtt(phase.rtt_s, now[0])  # a health check
        for _ in range(20):
            result = await pipe.infer(x)
            kinds.append(ids[result.cut_id])
            now[0] += 1.0  # the application asks once a second
            if result.local:
                pipe.estimator.observe_rtt(phase.rtt_s, now[0])  # health checks meanwhile
        assert kinds[-1] == COSTS[best(phase)].kind, kinds
        if kinds[-1] != "all":  # still sending: the estimate has caught up with the link
            est = pipe.estimate().link
            assert est.uplink_bps == pytest.approx(phase.uplink_bps, rel=0.1), kinds
    assert by_kind["split"] in pipe.model.cuts
    assert pipe.chooser.switches >= 2


def test_the_planning_link_is_read_from_the_manifest() -> None:
    from splitinfer.edge.link import planned_link

    as_dict = {"uplink_bps": 1e6, "downlink_bps": 2e6, "rtt_s": 0.1}
    assert planned_link({"link": as_dict}) == (1e6, 2e6, 0.1)
    assert planned_link({}) is None
    assert planned_link({"link": "fast"}) is None
    assert planned_link({"link": {"uplink_bps": -1, "downlink_bps": 1, "rtt_s": 0}}) is None
