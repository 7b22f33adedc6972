"""Cut choice by minimum s-t cut (DADS) and cut spaces too big to list."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from graphs import f32, make, rand, residual
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper
from ortutil import assert_close, compose, run
from zoo import ZOO

from splitinfer.partitioner.analysis import analyse
from splitinfer.partitioner.cli import main
from splitinfer.partitioner.cuts import CutSpace
from splitinfer.partitioner.cutsearch import articulation_cuts, list_candidates
from splitinfer.partitioner.mincut import (
    INPUT,
    OUTPUT,
    CutProblem,
    Tensor,
    cost_of,
    count_downsets,
    is_downset,
    solve,
)
from splitinfer.partitioner.segments import cloud_model, edge_model
from splitinfer.shared.errors import CutError

# -- the pure solver against enumeration ------------------------------------------------


def brute_force(problem: CutProblem) -> float:
    return min(cost_of(problem, m) for m in range(1 << problem.size))


@st.composite
def problems(draw: st.DrawFn, integral: bool = True) -> CutProblem:
    n = draw(st.integers(1, 9))
    preds = []
    for v in range(n):
        preds.append(tuple(sorted(draw(st.sets(st.integers(0, v - 1), max_size=2))) if v else ()))
    weight = st.integers(0, 50) if integral else st.floats(0, 50, allow_nan=False)
    tensors = []
    for u in range(-1, n):
        later = list(range(max(u + 1, 0), n))
        consumers = draw(st.lists(st.sampled_from(later), max_size=3, unique=True)) if later else []
        if draw(st.booleans()):
            consumers.append(OUTPUT)
        if consumers:
            blocked = u >= 0 and draw(st.integers(0, 6)) == 0
            cost = math.inf if blocked else draw(weight)
            tensors.append(Tensor(u, tuple(consumers), float(cost)))
    edge = tuple(float(draw(weight)) for _ in range(n))
    cloud = tuple(float(draw(weight)) for _ in range(n))
    forced = draw(st.integers(0, (1 << n) - 1)) if draw(st.integers(0, 4)) == 0 else 0
    return CutProblem(tuple(preds), edge, cloud, tuple(tensors), forced_edge=forced)


def assert_optimal(problem: CutProblem, rel: float = 0.0) -> None:
    """The min-cut is a down-set whose cost is the exhaustive optimum (within ``rel``),
    or there is none when every down-set costs infinity."""
    best = brute_force(problem)
    mask = solve(problem)
    if math.isinf(best):
        assert mask is None
        return
    assert mask is not None
    assert is_downset(problem, mask)
    assert cost_of(problem, mask) == pytest.approx(best, rel=rel, abs=rel)


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(problems())
def test_min_cut_equals_the_exhaustive_optimum(problem: CutProblem) -> None:
    assert_optimal(problem)  # integral weights: exactly


@pytest.mark.unit
@settings(max_examples=150, deadline=None)
@given(problems(integral=False))
def test_min_cut_is_optimal_with_real_weights(problem: CutProblem) -> None:
    assert_optimal(problem, rel=1e-9)


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(problems())
def test_count_of_down_sets_is_exact(problem: CutProblem) -> None:
    expected = sum(is_downset(problem, m) for m in range(1 << problem.size))
    assert count_downsets(list(problem.deps)) == expected


@pytest.mark.unit
def test_a_tensor_read_by_many_is_paid_once() -> None:
    # unit 0 feeds units 1, 2, 3 with one tensor of cost 5; cloud is cheaper for 1-3 by 3
    # each: moving them costs 5 once and saves 9
    p = CutProblem(
        ((), (0,), (0,), (0,)),
        edge_cost=(0.0, 4.0, 4.0, 4.0),
        cloud_cost=(10.0, 1.0, 1.0, 1.0),
        tensors=(Tensor(INPUT, (0,), 100.0), Tensor(0, (1, 2, 3), 5.0)),
    )
    assert solve(p) == 0b0001
    assert cost_of(p, 0b0001) == 0 + 3 + 5


@pytest.mark.unit
def test_twenty_parallel_chains_are_counted_without_listing() -> None:
    preds = [0]  # the fork
    ends = 0
    for _ in range(20):
        prev = 0
        for _ in range(3):
            preds.append(1 << prev)
            prev = len(preds) - 1
        ends |= 1 << prev
    preds.append(ends)
    assert count_downsets(preds) == 4**20 + 2
    assert count_downsets(preds, budget=3) is None


# -- ONNX graphs with huge cut spaces -----------------------------------------------------


def branches(k: int = 20, depth: int = 3, width: int = 8) -> onnx.ModelProto:
    """A stem, ``k`` parallel branches of ``depth`` unfused nodes, a join and a head."""
    nodes, inits = [helper.make_node("Relu", ["x"], ["h"])], {}
    ends = []
    for b in range(k):
        prev = "h"
        for d in range(depth):
            out = f"b{b}_{d}"
            if d % 2 == 0:  # a distinct scale per branch, so no pass merges the branches
                inits[f"k{b}_{d}"] = rand(width, seed=100 * b + d)
                nodes.append(helper.make_node("Mul", [prev, f"k{b}_{d}"], [out]))
            else:
                nodes.append(helper.make_node("Tanh", [prev], [out]))
            prev = out
        ends.append(prev)
    nodes.append(helper.make_node("Sum", ends, ["s"]))
    inits["w"] = rand(width, 3)
    nodes.append(helper.make_node("MatMul", ["s", "w"], ["y"]))
    return make(nodes, [f32("x", ["N", width])], [f32("y", ["N", 3])], inits)


def fpn_like() -> onnx.ModelProto:
    """A conv backbone of 4 stages, a top-down neck with lateral 1x1 convs and upsampling,
    a bottom-up path (PAN) and a head per level: cuts cross several levels at once."""
    nodes: list[onnx.NodeProto] = []
    inits: dict[str, np.ndarray] = {}
    seed = [0]

    def conv(x: str, c_in: int, c_out: int, out: str, stride: int = 1, k: int = 3) -> str:
        seed[0] += 1
        inits[f"{out}_w"] = rand(c_out, c_in, k, k, seed=seed[0]) * 0.3
        pad = k // 2
        nodes.append(
            helper.make_node("Conv", [x, f"{out}_w"], [out], strides=[stride] * 2, pads=[pad] * 4)
        )
        return out

    def relu(x: str) -> str:
        nodes.append(helper.make_node("Relu", [x], [x + "_r"]))
        return x + "_r"

    x, feats = "x", []
    for i in range(4):
        x = relu(conv(x, 3 if i == 0 else 4, 4, f"s{i}a", stride=2))
        x = relu(conv(x, 4, 4, f"s{i}b"))
        feats.append(x)
    lat = [conv(f, 4, 4, f"lat{i}", k=1) for i, f in enumerate(feats)]
    top = [lat[3]]
    for i in (2, 1, 0):
        inits[f"up{i}_s"] = np.array([1, 1, 2, 2], np.float32)
        nodes.append(helper.make_node("Resize", [top[0], "", f"up{i}_s"], [f"up{i}"]))
        nodes.append(helper.make_node("Add", [lat[i], f"up{i}"], [f"td{i}"]))
        top.insert(0, f"td{i}")
    outs = [top[0]]
    for i in (1, 2, 3):
        down = conv(outs[-1], 4, 4, f"pan{i}", stride=2)
        nodes.append(helper.make_node("Add", [top[i], down], [f"p{i}"]))
        outs.append(f"p{i}")
    heads = []
    for i, o in enumerate(outs):
        h = conv(o, 4, 2, f"head{i}", k=1)
        nodes.append(helper.make_node("Flatten", [h], [f"y{i}"]))
        heads.append(f"y{i}")
    return make(
        nodes,
        [f32("x", ["N", 3, 32, 32])],
        [f32(h, ["N", None]) for h in heads],
        inits,
    )


def inception_like(blocks: int = 4) -> onnx.ModelProto:
    """Inception blocks of four branches (1x1; 1x1-3x3; 1x1-3x3-3x3; pool-1x1), concat."""
    nodes: list[onnx.NodeProto] = []
    inits: dict[str, np.ndarray] = {}
    n = [0]

    def conv(x: str, c_in: int, c_out: int, k: int) -> str:
        n[0] += 1
        out = f"c{n[0]}"
        inits[out + "_w"] = rand(c_out, c_in, k, k, seed=n[0]) * 0.3
        nodes.append(helper.make_node("Conv", [x, out + "_w"], [out], pads=[k // 2] * 4))
        nodes.append(helper.make_node("Relu", [out], [out + "_r"]))
        return out + "_r"

    x = "x"
    for b in range(blocks):
        a = conv(x, 4, 1, 1)
        bb = conv(conv(x, 4, 1, 1), 1, 1, 3)
        cc = conv(conv(conv(x, 4, 1, 1), 1, 1, 3), 1, 1, 3)
        nodes.append(
            helper.make_node("MaxPool", [x], [f"pool{b}"], kernel_shape=[3, 3], pads=[1] * 4)
        )
        d = conv(f"pool{b}", 4, 1, 1)
        nodes.append(helper.make_node("Concat", [a, bb, cc, d], [f"cat{b}"], axis=1))
        x = f"cat{b}"
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap"]))
    nodes.append(helper.make_node("Flatten", ["gap"], ["y"]))
    return make(nodes, [f32("x", ["N", 4, 8, 8])], [f32("y", ["N", 4])], inits)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("wide") / "branches.onnx"
    onnx.save(branches(), str(path))
    return path


@pytest.mark.unit
def test_twenty_branch_graph_has_a_huge_space_and_no_list() -> None:
    space = CutSpace(analyse(branches(), {}))
    count, exact = space.count()
    # nothing, the stem + any prefix of each branch, then the join, then the head
    assert exact
    assert count == 4**20 + 3 >= 10**6
    assert space.exhaustive() is None
    with pytest.raises(CutError, match="more than 20000 valid cuts"):
        space.plans()
    # lookups that need no list still work
    assert space.find("none").crossing == ("x",)
    assert space.find("all").kind == "all"
    assert space.find("s").crossing == ("s",)
    plan = space.find("b3_0,h")
    assert space.find(plan.id).edge_units == plan.edge_units
    assert plan.id.startswith("u")
    with pytest.raises(CutError, match="use an id from --list-cuts"):
        space.find("c5")


@pytest.mark.unit
def test_a_count_over_budget_is_a_stated_lower_bound() -> None:
    space = CutSpace(analyse(branches(), {}))
    bound, exact = space.count(budget=10)
    assert not exact
    assert 2**20 <= bound <= 4**20 + 3  # the 20 units of one depth, any subset


@pytest.mark.unit
def test_single_tensor_cuts_of_the_wide_graph() -> None:
    space = CutSpace(analyse(branches(), {}))
    crossings = {space.plan_for(m).crossing for m in articulation_cuts(space)}  # type: ignore[union-attr]
    assert crossings == {("h",), ("s",)}


@pytest.mark.unit
@pytest.mark.parametrize("build", [branches, fpn_like, inception_like])
def test_listed_cuts_compose_with_the_model(build: object) -> None:
    model = build()  # type: ignore[operator]
    space = CutSpace(analyse(model, {}), max_cuts=10)
    assert space.exhaustive() is None
    plans, why, found = list_candidates(space, "raspberry-pi-5", "l4", 4.0)
    assert {p.kind for p in plans} >= {"none", "all"}
    assert all(why[p.id] for p in plans)
    assert found.runs > 0
    shape = [int(d.dim_value) for d in model.graph.input[0].type.tensor_type.shape.dim[1:]]
    for plan in plans:
        edge, cloud = edge_model(space.analysis, plan), cloud_model(space.analysis, plan)
        for batch in (1, 3):
            feeds = {"x": rand(batch, *shape, seed=batch)}
            assert_close(compose(edge, cloud, feeds), run(model, feeds))


def min_cut_choices(
    a: Any,
    every: Sequence[Any],
    big: CutSpace,
    edge: dict[str, float],
    cloud: dict[str, float],
    seed: int,
) -> list[tuple[list[Any], Any]]:
    """At four uplink rates: the min-cut path's planned candidates and the one it
    chooses, after checking that choice predicts the latency of the best of the whole
    list ``every`` (its cuts costed by ``edge`` and ``cloud`` node times)."""
    from splitinfer.partitioner.costmodel import WireModel, cut_costs
    from splitinfer.partitioner.cutchoice import Pricing, auto_candidates
    from splitinfer.shared.costs import Constraints, predict_latency, rank
    from splitinfer.shared.links import Link

    pricing = Pricing.of(big, edge, cloud, {}, WireModel())
    out = []
    for uplink in (0.1e6, 2e6, 30e6, 1e9):
        link = Link.fixed(uplink, 1e9, 0.0)
        best = rank(cut_costs(every, a, edge, cloud), link)[0]
        found = auto_candidates(big, pricing, link, "latency", Constraints(), [], lambda _: None)
        plans, _, refused = found.plans(big)
        assert refused == 0
        got = rank(cut_costs(plans, a, edge, cloud), link)[0]
        assert predict_latency(got.cost, link) == pytest.approx(
            predict_latency(best.cost, link), rel=1e-9
        ), (seed, uplink)
        out.append((plans, next(p for p in plans if p.id == got.cost.cut_id)))
    return out


@pytest.mark.unit
def test_min_cut_choice_equals_exhaustive_choice_on_a_branchy_graph() -> None:
    """Both paths choose cuts of the same predicted latency wherever enumeration can run,
    and the min-cut path needs its max-flows for that (not just the single-tensor cuts)."""

    model = inception_like(2)
    for i, node in enumerate(model.graph.node):  # as passes.optimize names them
        node.name = f"{node.op_type}_{i}"
    a = analyse(model, {})
    every = CutSpace(a).exhaustive()
    assert every is not None
    assert len(every) > 100
    big = CutSpace(a, max_cuts=10)
    assert big.exhaustive() is None
    easy = {*articulation_cuts(big), 0, big.full}
    needed_a_flow = 0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        edge = {n.name: float(rng.lognormal(-7, 1.5)) for n in a.nodes}
        cloud = {n.name: float(rng.lognormal(-9, 1.5)) for n in a.nodes}
        for _, chosen in min_cut_choices(a, every, big, edge, cloud, seed):
            needed_a_flow += chosen.edge_units not in easy
    assert needed_a_flow > 0


# -- the command --------------------------------------------------------------------------


@pytest.mark.unit
def test_list_cuts_on_a_huge_space_says_how_many(
    wide: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(wide), "--list-cuts", "-q"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert f"valid cuts: {4**20 + 3:,} (counted, not listed)" in out
    assert f"{4**20 + 3:,} cuts in all" in out
    assert "single tensor" in out
    assert "min-cut at" in out
    assert "fewest bytes at depth" in out
    assert main([str(wide), "--list-cuts", "--json", "-q"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["valid_cuts"] == 4**20 + 3
    assert data["exact"] is True
    ids = [row["id"] for row in data["cuts"]]
    assert ids[0] == "c0"
    assert all(row["why"] for row in data["cuts"])


@pytest.mark.unit
def test_max_cuts_bounds_the_full_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "res.onnx"
    onnx.save(residual(), str(path))  # 5 cuts
    assert main([str(path), "--list-cuts", "--max-cuts", "5", "--json", "-q"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in listed["cuts"]] == [f"c{i}" for i in range(5)]
    assert (listed["listed"], listed["valid_cuts"], listed["note"]) == (5, 5, None)
    assert main([str(path), "--list-cuts", "--max-cuts", "4", "-q"]) == 0
    out = capsys.readouterr().out
    assert "valid cuts: 5 (counted, not listed)" in out
    assert "more than --max-cuts 4" in out


@pytest.mark.integration
def test_split_auto_and_a_listed_id_on_a_huge_space(
    wide: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pkg"
    argv = [str(wide), "--split", "auto", "-o", str(out), "--precision", "fp32"]
    argv += ["--edge-profile", "raspberry-pi-5", "--cloud-profile", "l4", "--candidates", "2"]
    assert main(argv) == 0  # not quiet: counted progress on stderr
    printed = capsys.readouterr()
    assert "cut search: min-cut over" in printed.out
    assert "error" not in printed.err
    for step in ("measuring the codec on 1/", "max-flow 1/", "building cut 1/"):
        assert f"partition: {step}" in printed.err
    manifest = json.loads((out / "manifest.json").read_text())
    search = manifest["planning"]["cut_search"]
    assert search["method"] == "min-cut"
    assert search["space"] == 4**20 + 3
    assert manifest["planning"]["cuts_costed"] == search["cuts"]
    # a listed id names the same cut again
    assert main([str(wide), "--list-cuts", "--json", "-q"]) == 0
    listed = json.loads(capsys.readouterr().out)["cuts"]
    mid = next(r for r in listed if r["kind"] == "split")
    fixed = tmp_path / "fixed"
    assert main([str(wide), "--split", mid["id"], "-o", str(fixed), "-q"]) == 0
    assert f"cut {mid['id']} (split)" in capsys.readouterr().out


@pytest.mark.unit
def test_costs_are_the_same_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    from splitinfer.partitioner import costmodel

    model = inception_like(2)
    for i, node in enumerate(model.graph.node):
        node.name = f"{node.op_type}_{i}"
    a = analyse(model, {})
    plans = CutSpace(a).plans()
    rng = np.random.default_rng(0)
    edge = {n.name: float(rng.random()) for n in a.nodes}
    cloud = {n.name: float(rng.random()) for n in a.nodes}
    by_batch = {8: {k: 4 * v for k, v in cloud.items()}}
    whole = costmodel.cut_costs(plans, a, edge, cloud, cloud_times_by_batch=by_batch)
    monkeypatch.setattr(costmodel, "CHUNK_CUTS", 7)
    parts = costmodel.cut_costs(plans, a, edge, cloud, cloud_times_by_batch=by_batch)
    assert len(parts) == len(whole) > 7
    for got, want in zip(parts, whole, strict=True):  # BLAS may round sums differently
        assert got.cut_id == want.cut_id
        assert got.edge_memory_bytes == want.edge_memory_bytes
        assert got.edge_s == pytest.approx(want.edge_s, rel=1e-12)
        assert got.cloud_s == pytest.approx(want.cloud_s, rel=1e-12)
        assert got.cloud_batch_s[0][1] == pytest.approx(want.cloud_batch_s[0][1], rel=1e-12)


@pytest.mark.integration
def test_split_auto_past_max_cuts_keeps_traces_objectives_and_constraints(
    wide: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "link.up"  # Mahimahi: one 1500-byte opportunity per line (ms)
    ms = [t for t in range(4000) if (t // 1000) % 2 == 0 or t % 20 == 0]
    trace.write_text("\n".join(map(str, ms)) + "\n")
    out = tmp_path / "pkg"
    argv = [str(wide), "--split", "auto", "-o", str(out), "--precision", "fp32", "-q"]
    argv += ["--edge-profile", "raspberry-pi-5", "--cloud-profile", "l4", "--trace", str(trace)]
    argv += ["--objective", "edge-energy", "--max-latency", "5s", "--edge-memory", "400"]
    argv += ["--epsilon", "4", "--clip", "1"]
    assert main(argv) == 0
    capsys.readouterr()
    m = json.loads((out / "manifest.json").read_text())
    search = m["planning"]["cut_search"]
    assert search["method"] == "min-cut"
    assert search["weightings"] == 1 + 5 + 4  # objective, memory sweep, latency sweep
    assert search["link_points"] >= 7  # the trace's mean, quantiles and harmonic mean
    assert m["privacy"]["epsilon"] == 4
    chosen = m["cuts"][0]
    assert chosen["predicted"]["edge_memory_bytes"] <= 400
    assert chosen["predicted"]["latency_p95_s"] <= 5


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(ZOO))
def test_min_cut_path_matches_the_list_on_the_zoo(zoo_dir: Path, name: str) -> None:
    """On every zoo model (attention masks, shape arithmetic, several inputs and outputs):
    the min-cut path's choice is as good as the full list's, and its cuts compose."""
    from splitinfer.partitioner.pipeline import prepare

    p = prepare(zoo_dir / f"{name}.onnx")
    a = p.analysis
    every = p.space.exhaustive()
    assert every is not None
    big = CutSpace(a, max_cuts=1)
    assert big.exhaustive() is None
    seen: set[str] = set()
    for seed in range(3):
        rng = np.random.default_rng(seed)
        # shape arithmetic costs nothing, as the rooflines and the profiler have it
        pairs = list(zip(a.nodes, a.data_node, strict=True))
        edge = {n.name: float(rng.lognormal(-7, 1.5)) * d for n, d in pairs}
        cloud = {n.name: float(rng.lognormal(-9, 1.5)) * d for n, d in pairs}
        for plans, _ in min_cut_choices(a, every, big, edge, cloud, seed):
            for plan in plans:
                if plan.id not in seen:
                    seen.add(plan.id)
                    for batch in (1, 3):
                        feeds = ZOO[name].sample(batch, seed=batch)
                        assert_close(
                            compose(edge_model(a, plan), cloud_model(a, plan), feeds),
                            run(a.model, feeds),
                        )


@pytest.mark.unit
def test_the_codec_is_timed_on_a_bounded_spread_of_tensors() -> None:
    from splitinfer.partitioner.automeasure import TIMING_BYTES, TIMING_TENSORS, timing_sample

    floats = {f"t{i}": np.zeros((16, 64), np.float32) for i in range(300)}
    floats["huge"] = np.zeros((16, TIMING_BYTES // 8), np.float32)
    picked = timing_sample(floats)
    assert 1 < len(picked) <= TIMING_TENSORS
    assert sum(a.nbytes for a in picked.values()) <= TIMING_BYTES
    assert "t0" in picked
    assert "t299" in picked  # spread, not the first few
