"""Cut enumeration and segment extraction on hand-built graphs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from graphs import chain, control_flow, free_dims, late_mask, rand, residual, shape_subgraph
from ortutil import assert_close, compose, run

from splitinfer.partitioner.analysis import analyse
from splitinfer.partitioner.cuts import CutSpace
from splitinfer.partitioner.segments import cloud_model, edge_model
from splitinfer.shared.errors import ConfigError, CutError

pytestmark = pytest.mark.unit


def space_of(model: onnx.ModelProto, shapes: dict[str, list[int]] | None = None) -> CutSpace:
    return CutSpace(analyse(model, shapes or {}))


def roundtrip_all(space: CutSpace, feeds_for: dict[int, dict[str, np.ndarray]]) -> None:
    model = space.analysis.model
    for plan in space.plans():
        edge, cloud = edge_model(space.analysis, plan), cloud_model(space.analysis, plan)
        onnx.checker.check_model(edge)
        onnx.checker.check_model(cloud)
        assert [o.name for o in edge.graph.output] == list(plan.crossing)
        assert [i.name for i in cloud.graph.input] == list(plan.crossing)
        for feeds in feeds_for.values():
            assert_close(compose(edge, cloud, feeds), run(model, feeds))


def test_chain_has_one_cut_per_unit_plus_one() -> None:
    space = space_of(chain(10))
    # 5 MatMul+Sigmoid? no: Sigmoid fuses with MatMul into one unit, Identity is its own
    assert len(space.units) == 6
    plans = space.plans()
    assert len(plans) == len(space.units) + 1
    assert plans[0].kind == "none"
    assert plans[0].crossing == ("x",)
    assert plans[-1].kind == "all"
    assert plans[-1].crossing == ("y",)
    assert [p.id for p in plans] == [f"c{i}" for i in range(len(plans))]
    edge_flops = [p.edge_flops for p in plans]
    assert edge_flops == sorted(edge_flops)
    assert plans[0].cloud_flops == plans[-1].edge_flops > 0
    roundtrip_all(space, {b: {"x": rand(b, 4, seed=b)} for b in (1, 4)})


def test_residual_block_gives_a_two_tensor_cut() -> None:
    space = space_of(residual())
    crossings = {p.crossing for p in space.plans()}
    assert ("a", "b") in crossings  # inside the block: the skip and the branch both cross
    assert crossings == {("x",), ("a",), ("a", "b"), ("c",), ("y",)}
    assert next(p for p in space.plans() if p.crossing == ("a", "b")).bytes_per_sample == 32
    roundtrip_all(space, {b: {"x": rand(b, 4, seed=b)} for b in (1, 4)})


def test_an_edge_set_not_closed_under_dependencies_is_no_cut() -> None:
    space = space_of(chain(10))
    last = len(space.units) - 1  # the last unit without what it reads
    assert space.plan(1 << last, "?") is None
    assert "not closed under dependencies" in space.explain(1 << last)
    assert space.plan_for(1 << last) is None
    whole = space.plan(space.full, "?")
    assert whole is not None
    assert whole.kind == "all"


def test_shape_arithmetic_is_rebuilt_on_the_cloud_not_shipped() -> None:
    space = space_of(shape_subgraph())
    for plan in space.plans():
        info = [space.analysis.tensors[n] for n in plan.crossing]
        assert all(t.batched for t in info), plan  # no shape tensor crosses
    mid = next(p for p in space.plans() if p.crossing == ("r",))
    assert mid.remat == ("target",)
    roundtrip_all(space, {b: {"x": rand(b, 4, 6, seed=b)} for b in (1, 4, 7)})


def test_control_flow_node_is_never_split_and_outer_scope_reads_cross() -> None:
    space = space_of(control_flow())
    crossings = [p.crossing for p in space.plans()]
    assert ("flag", "a") in crossings  # the If reads `a` from its branches' outer scope
    for flag in (True, False):
        roundtrip_all(
            space,
            {b: {"x": rand(b, 4, seed=b), "flag": np.array([flag])} for b in (1, 4)},
        )


def test_input_read_late_crosses_the_cut() -> None:
    space = space_of(late_mask())
    for plan in space.plans()[:-1]:
        assert "mask" in plan.crossing
    roundtrip_all(
        space, {b: {"x": rand(b, 4, seed=b), "mask": rand(b, 4, seed=9 + b)} for b in (1, 3)}
    )


def test_find_by_id_name_and_tensor_names() -> None:
    space = space_of(residual())
    plans = space.plans()
    assert space.find("none") is plans[0]
    assert space.find("all") is plans[-1]
    assert space.find("c2") is plans[2]
    assert space.find("a,b").crossing == ("a", "b")
    assert space.find(" c ").crossing == ("c",)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("c99", "unknown cut 'c99': ids run from c0 to c4"),
        ("nope", "no tensor 'nope'"),
        ("b", "tensors b do not separate the graph: the cut also carries a"),
    ],
)
def test_bad_cuts_are_cut_errors(spec: str, message: str) -> None:
    with pytest.raises(CutError, match=message):
        space_of(residual()).find(spec)


def test_free_dimensions_need_an_input_shape() -> None:
    with pytest.raises(
        ConfigError, match=r"free dimension H at axis 2 .*--input-shape x=1x3x<H>x<W>"
    ):
        space_of(free_dims())


def test_input_shape_fixes_analysis_and_segments_keep_free_dims() -> None:
    space = space_of(free_dims(), {"x": [1, 3, 10, 12]})
    plan = next(p for p in space.plans() if p.crossing == ("r",))
    assert plan.bytes_per_sample == 4 * 10 * 12 * 4
    edge = edge_model(space.analysis, plan)
    dims = edge.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ["N", "", "H", "W"]
    for h, w in ((10, 12), (17, 9)):  # a size it was not analysed at still runs
        feeds = {"x": rand(2, 3, h, w)}
        assert_close(
            compose(edge, cloud_model(space.analysis, plan), feeds),
            run(space.analysis.model, feeds),
        )


def test_too_many_cuts_is_a_clear_error() -> None:
    with pytest.raises(CutError, match="more than 3 valid cuts"):
        CutSpace(analyse(chain(10), {}), max_cuts=3).plans()


def test_500_node_chain_enumerates_every_cut() -> None:
    space = space_of(chain(500, width=2))
    assert len(space.plans()) == len(space.units) + 1 == 252


def test_frontier_ids_name_the_same_cuts_as_the_list() -> None:
    space = space_of(residual())
    plans = space.plans()
    assert space.count() == (len(plans), True)
    assert space.frontier_id(0) == "c0"
    for plan in plans[1:]:
        fid = space.frontier_id(plan.edge_units)
        assert fid.startswith("u")
        assert space.find(fid) is plan  # the listed plan, with its cN id
    two = next(p for p in plans if p.crossing == ("a", "b"))
    assert space.frontier_id(two.edge_units) == "u1"  # b's unit; a's is below it


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("u9", r"the graph has units 0..3 \(no unit 9\)"),
        ("u0.1", "its units are not the last ones of an edge set .*u1"),
    ],
)
def test_bad_frontier_ids(spec: str, message: str) -> None:
    with pytest.raises(CutError, match=message):
        space_of(residual()).find(spec)


def test_count_without_listing_matches_the_list() -> None:
    for model in (residual(), chain(12), control_flow(), late_mask()):
        listed = len(CutSpace(analyse(model, {})).plans())
        unlisted = CutSpace(analyse(model, {}), max_cuts=1)
        assert unlisted.exhaustive() is None
        assert unlisted.count() == (listed, True)
