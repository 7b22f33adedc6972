"""Predicted latency, objectives and constraints, and K cuts across link speeds."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from splitinfer.shared.costs import (
    CloudPricing,
    Constraints,
    CutCost,
    EnergyModel,
    best_across_links,
    choose,
    latency_distribution,
    predict_latency,
    rank,
)
from splitinfer.shared.errors import ConfigError, CutError, PackageError
from splitinfer.shared.links import Link

pytestmark = pytest.mark.unit

#: A small family: all cloud, two splits, all edge.
NONE = CutCost(
    "c0", "none", encode_s=0.001, up_bytes=20_000, cloud_s=0.004, decode_s=0.001,
    down_bytes=40, edge_memory_bytes=12_000, accuracy_drop=0.0,
)  # fmt: skip
EARLY = CutCost(
    "c1", "split", edge_s=0.010, encode_s=0.001, up_bytes=50_000, cloud_s=0.003,
    decode_s=0.001, down_bytes=40, edge_memory_bytes=40_000, accuracy_drop=0.5,
)  # fmt: skip
LATE = CutCost(
    "c2", "split", edge_s=0.040, encode_s=0.0002, up_bytes=2_000, cloud_s=0.001,
    decode_s=0.0001, down_bytes=40, edge_memory_bytes=300_000,
)  # fmt: skip
ALL = CutCost("c3", "all", edge_s=0.150, edge_memory_bytes=400_000, accuracy_drop=1.5)
FAMILY = [NONE, EARLY, LATE, ALL]


def test_predict_latency_by_hand() -> None:
    link = Link.fixed("8mbit", "16mbit", "50ms")
    # edge 10 ms + encode 1 ms + 50 kB at 8 Mbit/s (50 ms) + rtt 50 ms + cloud 3 ms
    # + decode 1 ms + 40 B down at 16 Mbit/s (0.02 ms)
    assert predict_latency(EARLY, link) == pytest.approx(0.010 + 0.001 + 0.05 + 0.05 + 0.004 + 2e-5)
    # edge only: no upload, no round trip
    assert predict_latency(ALL, link) == pytest.approx(0.150)
    # all cloud: the input goes up
    assert predict_latency(NONE, link) == pytest.approx(0.001 + 0.02 + 0.05 + 0.005 + 2e-5)


def test_latency_distribution_by_hand() -> None:
    link = Link(6e6, 8e6, 0.05, uplink_samples=(8e6, 4e6), window_s=1.0)
    # LATE: 2 kB up = 2 ms (fast window) or 4 ms (slow), 40 B down = 0.04 ms
    fixed = 0.040 + 0.0002 + 0.001 + 0.0001
    mean, p50, p95 = latency_distribution(LATE, link)
    assert mean == pytest.approx(fixed + 0.003 + 0.05 + 4e-5)
    assert p50 == pytest.approx(mean)
    assert p95 == pytest.approx(fixed + 0.004 + 0.05 + 4e-5)
    assert latency_distribution(ALL, link) == pytest.approx((0.15, 0.15, 0.15))


def test_choose_latency_follows_the_link_speed() -> None:
    slow = Link.fixed("0.5mbit", "20mbit", "50ms")
    fast = Link.fixed("100mbit", "100mbit", "10ms")
    assert choose(FAMILY, slow).cut_id == "c2"  # little to send
    assert choose(FAMILY, fast).cut_id == "c0"  # ship the input, compute in the cloud
    assert choose(FAMILY, Link.fixed("0.5mbit", "20mbit", "2s")).cut_id == "c3"
    ranked = rank(FAMILY, slow)
    assert ranked[0].cost.cut_id == "c2"
    assert [r.score for r in ranked] == sorted(r.score for r in ranked)


def test_expected_latency_differs_from_the_mean_rate_choice() -> None:
    # uplink alternates 10 s at 10 Mbit/s and 10 s at 0.1 Mbit/s: mean 5.05 Mbit/s
    link = Link(5.05e6, 20e6, 0.02, uplink_samples=(10e6, 0.1e6), window_s=10.0)
    heavy = CutCost("c1", up_bytes=100_000, edge_s=0.001)
    light = CutCost("c2", up_bytes=5_000, edge_s=0.200)
    at_mean = [predict_latency(c, link) for c in (heavy, light)]
    assert at_mean[0] < at_mean[1]  # planning with the mean picks the heavy cut ...
    assert choose([heavy, light], link).cut_id == "c2"  # ... expected latency does not


def test_edge_energy_objective_by_hand() -> None:
    link = Link.fixed("10mbit", "10mbit", "0ms")
    energy = EnergyModel(edge_w=5.0, alpha_up_w_per_mbps=1.0, alpha_down_w_per_mbps=0.0, beta_w=1.0)
    busy_edge = CutCost("c1", edge_s=0.25, up_bytes=1_000)  # 8 kbit: 0.8 ms at 10 Mbit/s
    busy_radio = CutCost("c2", edge_s=0.01, up_bytes=250_000)  # 2 Mbit: 0.2 s at 10 Mbit/s
    # c1: 5 W x 0.25 s + 1 J/Mbit x 0.008 Mbit + 1 W x 0.0008 s = 1.2588 J
    # c2: 5 W x 0.01 s + 1 J/Mbit x 2 Mbit + 1 W x 0.2 s = 2.25 J
    scores = {r.cost.cut_id: r.score for r in rank([busy_edge, busy_radio], link, "edge-energy",
                                                   energy=energy)}  # fmt: skip
    assert scores["c1"] == pytest.approx(1.2588)
    assert scores["c2"] == pytest.approx(2.25)
    assert choose([busy_edge, busy_radio], link, "edge-energy", energy=energy).cut_id == "c1"
    assert choose([busy_edge, busy_radio], link, "latency").cut_id == "c2"


def test_cloud_cost_objective_uses_batched_cloud_time_and_constraints() -> None:
    link = Link.fixed("20mbit", "20mbit", "20ms")
    pricing = CloudPricing(usd_per_hour=3600.0)  # one dollar per second
    assert choose(FAMILY, link, "cloud-cost", pricing=pricing).cut_id == "c3"  # free
    bounded = Constraints(max_latency_s=0.1)
    assert choose(FAMILY, link, "cloud-cost", bounded, pricing=pricing).cut_id == "c2"
    # c0 batches well in the cloud: 16 samples in 8 ms beats c2's 1.1 ms per request
    batched = CutCost(
        "c0", "none", up_bytes=20_000, cloud_s=0.004, decode_s=0.0001, down_bytes=40,
        cloud_batch_s=((16, 0.008),),
    )  # fmt: skip
    ranked = rank([batched, LATE, ALL], link, "cloud-cost", bounded, pricing=pricing)
    assert [r.cost.cut_id for r in ranked] == ["c0", "c2"]
    assert ranked[0].score == pytest.approx(0.008 / 16 + 0.0001)


def test_constraints_filter_and_name_the_one_that_binds() -> None:
    link = Link.fixed("8mbit", "8mbit", "50ms")
    assert choose(FAMILY, link, constraints=Constraints(edge_memory_bytes=50_000)).cut_id in {
        "c0",
        "c1",
    }
    # unknown accuracy (c2) does not satisfy an accuracy bound
    picked = choose(FAMILY, link, constraints=Constraints(max_accuracy_drop=1.0))
    assert picked.cut_id in {"c0", "c1"}
    with pytest.raises(CutError, match="edge memory budget of 1000 bytes") as info:
        choose(FAMILY, link, constraints=Constraints(edge_memory_bytes=1_000))
    assert "12000" in str(info.value)  # the smallest footprint is named
    with pytest.raises(CutError, match="maximum latency of 1 ms"):
        choose(FAMILY, link, constraints=Constraints(max_latency_s=0.001))
    with pytest.raises(CutError, match="no cut has a measured accuracy drop"):
        choose([LATE], link, constraints=Constraints(max_accuracy_drop=1.0))
    # at 2 Mbit/s each alone leaves a cut (c0 and c1 fit in memory, c2 is fast enough),
    # together none
    both = Constraints(edge_memory_bytes=50_000, max_latency_s=0.12)
    slower = Link.fixed("2mbit", "8mbit", "50ms")
    with pytest.raises(CutError, match="50000 bytes and the maximum latency of 120 ms") as info:
        choose(FAMILY, slower, constraints=both)
    assert "\n" not in str(info.value)


def test_latency_constraint_uses_the_quantile() -> None:
    link = Link(5.05e6, 20e6, 0.0, uplink_samples=(10e6, 0.1e6), window_s=1.0)
    heavy = CutCost("c1", up_bytes=100_000)
    mean, _, p95 = latency_distribution(heavy, link)
    limit = (mean + p95) / 2
    assert choose([heavy], link, constraints=Constraints(max_latency_s=limit, latency_quantile=0.5))
    with pytest.raises(CutError, match="p95"):
        choose([heavy], link, constraints=Constraints(max_latency_s=limit))


def test_bad_objective_and_config_values() -> None:
    link = Link.fixed("1mbit", "1mbit")
    with pytest.raises(ConfigError, match="objective 'speed'"):
        choose(FAMILY, link, "speed")
    with pytest.raises(CutError):
        choose([], link)
    with pytest.raises(ConfigError, match="edge memory budget"):
        Constraints(edge_memory_bytes=0)
    with pytest.raises(ConfigError, match="edge_s"):
        CutCost("c1", edge_s=-1.0)
    with pytest.raises(ConfigError, match="up_bytes"):
        CutCost("c1", up_bytes=1.5)
    with pytest.raises(ConfigError, match="kind"):
        CutCost("c1", kind="middle")


def test_cut_cost_round_trips_through_json() -> None:
    cost = CutCost(
        "c7", "split", 0.01, 0.001, 1234, 0.002, 0.0005, 40, 99_000, 10, 20, None, ((8, 0.01),)
    )
    back = CutCost.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert back == cost
    with pytest.raises(PackageError, match="unknown field 'speed'"):
        CutCost.from_dict({**cost.to_dict(), "speed": 1})
    with pytest.raises(PackageError, match=r"candidates\[3\]: .*edge_s"):
        CutCost.from_dict({**cost.to_dict(), "edge_s": "fast"}, "candidates[3]")
    with pytest.raises(PackageError, match="missing field 'cut_id'"):
        CutCost.from_dict({"edge_s": 1.0})


# -- K cuts across link speeds ---------------------------------------------------------


def latency_at(costs: list[CutCost], rate: float, rtt: float, down: float | None) -> np.ndarray:
    link = Link(rate, down if down is not None else rate, rtt)
    return np.array([predict_latency(c, link) for c in costs])


def optimal_somewhere(
    i: int, costs: list[CutCost], lo: float, hi: float, rtt: float, down: float | None
) -> bool:
    """Is there an uplink rate in [lo, hi] where cut ``i`` is no worse than every cut?

    Latency is linear in x = 1/rate: recover each line from two rates, then intersect
    the half-lines where cut ``i`` is below each other cut with [1/hi, 1/lo]."""
    l_lo, l_hi = latency_at(costs, lo, rtt, down), latency_at(costs, hi, rtt, down)
    x_lo, x_hi = 1 / hi, 1 / lo
    slope = (l_lo - l_hi) / (x_hi - x_lo)
    icpt = l_hi - slope * x_lo
    left, right = x_lo, x_hi
    tol = 1e-9 * max(1.0, float(np.abs(l_lo).max()))
    for j in range(len(costs)):
        db, da = slope[i] - slope[j], icpt[j] - icpt[i] + tol  # need db * x <= da
        if abs(db) < 1e-18:
            if da < 0:
                return False
        elif db > 0:
            right = min(right, da / db)
        else:
            left = max(left, da / db)
    return left <= right * (1 + 1e-9)


@st.composite
def cost_families(draw: st.DrawFn) -> list[CutCost]:
    """Cuts that trade edge time for bytes (as real cuts do), with noise and oddities."""
    n = draw(st.integers(1, 12))
    out = []
    for i in range(n):
        kind = draw(st.sampled_from(["split"] * 6 + ["all", "none"]))
        depth = {"none": 0.0, "all": 1.0}.get(kind, draw(st.floats(0, 1)))
        edge = 0.3 * depth**2 * draw(st.floats(0.5, 1.5))
        up = int(2_000_000 * 10 ** (-3.5 * depth) * draw(st.floats(0.5, 2.0))) + 1
        out.append(
            CutCost(
                f"c{i}",
                kind,
                edge_s=edge,
                cloud_s=0.0 if kind == "all" else draw(st.floats(0, 0.02)),
                up_bytes=0 if kind == "all" else up,
                down_bytes=0 if kind == "all" else 40,
            )
        )
    return out


@settings(max_examples=100, deadline=None)
@given(
    costs=cost_families(),
    k=st.integers(1, 4),
    rtt=st.floats(0, 0.1),
    down=st.one_of(st.none(), st.just(20e6)),
)
def test_best_across_links_properties(
    costs: list[CutCost], k: int, rtt: float, down: float | None
) -> None:
    lo, hi = 0.25e6, 100e6
    rates = list(np.geomspace(lo, hi, 9))
    full = best_across_links(costs, rates, rtt, 100, down)
    for c in full:  # every cut of the envelope is optimal somewhere on the range
        assert optimal_somewhere(ids_of(costs).index(c.cut_id), costs, lo, hi, rtt, down)
    # the drawn k, and one less than the envelope so that the reduction is exercised
    for kk in sorted({k, max(1, len(full) - 1)}):
        picked = best_across_links(costs, rates, rtt, kk, down)
        ids = ids_of(picked)
        assert ids == ids_of(best_across_links(costs, rates, rtt, kk, down))  # deterministic
        assert len(set(ids)) == len(ids) == min(kk, len(full))
        assert set(ids) <= set(ids_of(full)) <= set(ids_of(costs))  # subsets of the input
        if kk >= 2:  # the optima at both extremes are kept
            for rate in (lo, hi):
                best = latency_at(costs, rate, rtt, down).min()
                got = latency_at(picked, rate, rtt, down).min()
                assert got == pytest.approx(best, rel=1e-9, abs=1e-12)
        if len(full) <= kk:
            assert ids == ids_of(full)
    event(f"envelope of {min(len(full), 4)}{'+' if len(full) >= 4 else ''} cuts")


def ids_of(costs: list[CutCost]) -> list[str]:
    return [c.cut_id for c in costs]


def envelope_family() -> list[CutCost]:
    """Seven cuts each optimal on its own stretch of 0.25..100 Mbit/s (rtt 0): cut i and
    i+1 cross at 0.25 Mbit/s x 400**((i+1)/7)."""
    ups = [1_000 * 3**i for i in range(7)]
    edge = [0.001] * 7
    for i in range(5, -1, -1):
        x = 1 / (0.25e6 * 400 ** ((i + 1) / 7))
        edge[i] = edge[i + 1] + x * 8 * (ups[i + 1] - ups[i])
    return [CutCost(f"c{i}", edge_s=edge[i], up_bytes=ups[i]) for i in range(7)]


def max_regret(subset: list[CutCost], costs: list[CutCost]) -> float:
    rates = np.geomspace(0.25e6, 100e6, 3001)
    best = np.stack([latency_at(costs, r, 0.0, None) for r in rates]).min(axis=1)
    got = np.stack([latency_at(subset, r, 0.0, None) for r in rates]).min(axis=1)
    return float((got / best).max() - 1)


def test_best_across_links_minimises_worst_case_regret() -> None:
    costs = envelope_family()
    rates = [0.25e6, 100e6]
    assert len(best_across_links(costs, rates, 0.0, 10)) == 7  # all on the envelope
    for k in (2, 3, 4):
        picked = best_across_links(costs, rates, 0.0, k)
        assert picked[0].cut_id == "c0"  # best at the slowest link first
        assert picked[-1].cut_id == "c6"  # best at the fastest link last
        mine = max_regret(picked, costs)
        for middle in itertools.combinations(costs[1:-1], k - 2):
            other = [costs[0], *middle, costs[-1]]
            assert mine <= max_regret(other, costs) + 1e-3


def test_best_across_links_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="--candidates 0"):
        best_across_links(FAMILY, [1e6], 0.0, 0)
    with pytest.raises(ConfigError, match="rates_bps"):
        best_across_links(FAMILY, [], 0.0, 2)
    with pytest.raises(CutError):
        best_across_links([], [1e6], 0.0, 2)
