"""Why the agent uses its cut: the chooser's own predictions and the rule that moved it.

Pure logic: the chooser with made-up costs, links and times; no sockets.
"""

from __future__ import annotations

import pytest

from splitinfer.edge.chooser import CutChooser, predict
from splitinfer.edge.config import AdaptConfig
from splitinfer.shared.costs import CutCost
from splitinfer.shared.links import Link

pytestmark = pytest.mark.unit

# as in test_edge_adapt: all-cloud sends a lot, the split less, all-edge nothing
COSTS = {
    "none": CutCost("none", "none", edge_s=0.0, up_bytes=400_000, cloud_s=0.004),
    "mid": CutCost("mid", "split", edge_s=0.030, up_bytes=40_000, cloud_s=0.002),
    "all": CutCost("all", "all", edge_s=0.150),
}
MEDIUM = Link(10e6, 100e6, 0.02)
SLOW = Link(0.5e6, 100e6, 0.1)


def test_every_candidate_gets_the_prediction_the_choice_uses() -> None:
    chooser = CutChooser(COSTS, "mid", AdaptConfig(min_dwell=0), reason="the default cut")
    edge = {"mid": 0.040}
    doc = chooser.explain(MEDIUM, now=0.0, edge_s=edge)
    assert doc["cut"] == "mid"
    assert doc["rule"] == "start"
    assert doc["reason"] == "the default cut"
    assert doc["since_s"] is None
    assert doc["adapting"] is True
    assert doc["fixed_because"] is None
    assert set(doc["candidates"]) == set(COSTS)
    want = chooser.predictions(MEDIUM, edge)
    for cut_id, c in doc["candidates"].items():
        assert c["predicted_ms"] == pytest.approx(want[cut_id] * 1e3)
        assert c["predicted_ms"] == pytest.approx(
            predict(COSTS[cut_id], MEDIUM, 1.0, edge.get(cut_id)) * 1e3
        )
        assert c["kind"] == COSTS[cut_id].kind
        assert c["up_bytes"] == COSTS[cut_id].up_bytes
    assert doc["candidates"]["mid"]["edge_ms"] == pytest.approx(40.0)
    assert doc["candidates"]["mid"]["edge_measured"] is True
    assert doc["candidates"]["none"]["edge_measured"] is False
    assert doc["candidates"]["all"]["transfer_ms"] == 0.0  # nothing crosses
    assert doc["best"] == min(want, key=lambda c: want[c])
    # explaining changes nothing
    assert chooser.explain(MEDIUM, now=0.0, edge_s=edge) == doc
    assert chooser.since_switch == 0


def test_a_switch_on_a_slower_link_says_below_which_uplink_and_when() -> None:
    chooser = CutChooser(COSTS, "mid", AdaptConfig(min_dwell=0, hysteresis=0.1))
    assert chooser.choose(MEDIUM, now=1.0).cut_id == "mid"
    assert chooser.choose(SLOW, now=5.0).cut_id == "all"
    doc = chooser.explain(SLOW, now=7.5)
    assert doc["cut"] == "all"
    assert doc["rule"] == "link"
    assert doc["from"] == "mid"
    assert doc["since_s"] == pytest.approx(2.5)
    assert doc["switches"] == 1
    assert "the uplink estimate fell below" in doc["reason"]
    assert "all predicted 150.0 ms against mid" in doc["reason"]
    # the threshold is where "all" stops being 10 % faster than "mid", by predict() itself
    crossing = chooser.crossing("all", "mid", SLOW)
    assert crossing is not None
    bps, below = crossing
    assert below
    assert SLOW.uplink_bps < bps < MEDIUM.uplink_bps

    def margin(rate: float) -> float:
        at = SLOW.at_uplink(rate)
        return predict(COSTS["all"], at) - 0.9 * predict(COSTS["mid"], at)

    assert margin(bps * 0.99) < 0 < margin(bps * 1.01)
    rate = f"{bps / 1e6:.3g} Mbit/s"
    assert rate in doc["reason"]


def test_a_switch_on_a_faster_link_says_above() -> None:
    chooser = CutChooser(COSTS, "all", AdaptConfig(min_dwell=0, hysteresis=0.1))
    assert chooser.choose(MEDIUM, now=0.0).cut_id == "mid"
    assert "the uplink estimate rose above" in chooser.last.reason
    # no uplink makes the all-edge cut lose to itself: no crossing to name
    assert chooser.crossing("all", "all", MEDIUM) is None


def test_a_switch_for_the_cloud_load_says_so() -> None:
    config = AdaptConfig(min_dwell=50, hysteresis=0.05, load_factor=20.0, load_high=0.8)
    costs = {
        "cloudy": CutCost("cloudy", "split", edge_s=0.002, up_bytes=20_000, cloud_s=0.010),
        "edgy": CutCost("edgy", "split", edge_s=0.020, up_bytes=20_000, cloud_s=0.001),
    }
    link = Link(50e6, 50e6, 0.01)
    chooser = CutChooser(costs, "cloudy", config)
    chooser.choose(link, 0.0)
    for t in range(3):
        chooser.observe_load(0.95, float(t))
    assert chooser.choose(link, 3.0).cut_id == "edgy"
    doc = chooser.explain(link, 4.0)
    assert doc["rule"] == "cloud load"
    assert doc["cloud_overloaded"] is True
    assert "overloaded" in doc["reason"]
    assert "adapt.load_high 0.8" in doc["reason"]
    # under load the cloud part of each prediction is x20, as the choice saw it
    assert doc["candidates"]["cloudy"]["predicted_ms"] == pytest.approx(
        predict(costs["cloudy"], link, 20.0) * 1e3
    )


def test_a_pinned_cut_still_shows_every_prediction_and_never_moves() -> None:
    chooser = CutChooser(COSTS, "mid", AdaptConfig(cut="mid", min_dwell=0), reason="pinned")
    assert not chooser.adapting
    assert {chooser.choose(SLOW, 0.0).cut_id for _ in range(5)} == {"mid"}
    doc = chooser.explain(SLOW, 1.0)
    assert doc["fixed_because"] == "adapt.cut=mid pins the cut"
    assert doc["best"] == "all"
    assert set(doc["candidates"]) == set(COSTS)
    assert "waiting" not in doc
    off = CutChooser(COSTS, "mid", AdaptConfig(enabled=False))
    assert "adapt.enabled=false" in str(off.explain(SLOW, 0.0)["fixed_because"])
    alone = CutChooser({"mid": COSTS["mid"]}, "mid", AdaptConfig())
    assert "fewer than two" in str(alone.explain(SLOW, 0.0)["fixed_because"])
    nothing = CutChooser({}, "mid", AdaptConfig())
    assert nothing.explain(SLOW, 0.0)["candidates"] == {}
    assert nothing.explain(SLOW, 0.0)["best"] is None


def test_a_faster_cut_not_yet_taken_says_why() -> None:
    chooser = CutChooser(COSTS, "mid", AdaptConfig(min_dwell=3, hysteresis=0.1))
    chooser.choose(SLOW, 0.0)
    doc = chooser.explain(SLOW, 0.0)
    assert doc["cut"] == "mid"
    assert doc["waiting"].startswith("all is predicted")
    assert "2 more request(s)" in doc["waiting"]
    sticky = CutChooser(COSTS, "mid", AdaptConfig(min_dwell=0, hysteresis=0.99))
    assert "within adapt.hysteresis 0.99" in sticky.explain(SLOW, 0.0)["waiting"]
