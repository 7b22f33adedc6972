"""Every cut of every zoo model: the two fp32 segments composed reproduce the model."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from ortutil import assert_close, run, session
from zoo import ZOO

from splitinfer.partitioner.pipeline import prepare
from splitinfer.partitioner.segments import cloud_model, edge_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("name", list(ZOO))
def test_every_cut_round_trips(zoo_dir: Path, name: str) -> None:
    path = zoo_dir / f"{name}.onnx"
    prepared = prepare(path)
    plans = prepared.space.plans()
    assert plans[0].kind == "none"
    assert plans[-1].kind == "all"
    feeds = {b: ZOO[name].sample(b, seed=b) for b in (1, 4)}
    want = {b: run(path, f) for b, f in feeds.items()}
    for plan in plans:
        edge = session(edge_model(prepared.analysis, plan))
        cloud = session(cloud_model(prepared.analysis, plan))
        assert [o.name for o in edge.get_outputs()] == list(plan.crossing)
        assert [i.name for i in cloud.get_inputs()] == list(plan.crossing)
        for b, f in feeds.items():
            mid = dict(zip(plan.crossing, edge.run(list(plan.crossing), f), strict=True))
            names = [o.name for o in cloud.get_outputs()]
            got = dict(zip(names, cloud.run(names, mid), strict=True))
            try:
                assert_close(got, want[b])
            except AssertionError as exc:
                raise AssertionError(f"cut {plan.id} {plan.crossing} batch {b}: {exc}") from exc


def test_optimization_never_grows_the_zoo_and_folds_batchnorm(zoo_dir: Path) -> None:
    for name in ZOO:
        prepared = prepare(zoo_dir / f"{name}.onnx")
        assert prepared.nodes_after <= prepared.nodes_before, name
        ops = {n.op_type for n in prepared.optimized.graph.node}
        assert not ops & {"BatchNormalization", "Dropout", "Identity"}, (name, ops)
        onnx.checker.check_model(prepared.optimized)


def test_multi_branch_and_residual_models_have_multi_tensor_cuts(zoo_dir: Path) -> None:
    for name in ("resnet", "inception", "transformer", "two_io"):
        plans = prepare(zoo_dir / f"{name}.onnx").space.plans()
        assert any(len(p.crossing) >= 2 and p.kind == "split" for p in plans), name
    mask_cuts = prepare(zoo_dir / "transformer.onnx").space.plans()
    # the attention mask is read in every layer and by the pooling: most cuts carry it
    assert sum("mask" in p.crossing for p in mask_cuts) > len(mask_cuts) // 2
