"""Free dimensions survive every cut; the package returns what the model returns.

A transformer partitioned at 16 tokens composes at 7, 16 and 100; a fully
convolutional net partitioned at one H x W composes at another; models whose
output is sequence-first, or whose declared output shape is wrong, return
exactly what ONNX Runtime returns for the source, at every cut.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from dynmodels import encoder, encoder_feeds, fully_conv, recognizer, wrong_declared_output
from ortutil import assert_close, run, session

from splitinfer.partitioner.pipeline import Prepared, prepare, write_package
from splitinfer.partitioner.segments import cloud_model, edge_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def enc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, hidden-64 BERT-like encoder with free batch and sequence axes."""
    return encoder(tmp_path_factory.mktemp("enc") / "encoder.onnx")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dyn")
    fully_conv(out / "conv.onnx")
    recognizer(out / "rec.onnx")
    rec = onnx.load(str(out / "rec.onnx"))
    # the exporter's own output shape is right here; make it wrong as real exporters do
    out_vi = rec.graph.output[0].type.tensor_type.shape
    del out_vi.dim[:]
    out_vi.dim.add().dim_value = 1
    out_vi.dim.add().dim_param = "seqlen"
    onnx.save(rec, str(out / "rec_wrong.onnx"))
    onnx.save(wrong_declared_output(), str(out / "wrong.onnx"))
    return out


def _every_cut(prepared: Prepared, path: Path, feeds_list: list[dict[str, np.ndarray]]) -> None:
    a = prepared.analysis
    want = [run(path, f) for f in feeds_list]
    for plan in prepared.space.plans():
        edge = None if plan.kind == "none" else session(edge_model(a, plan))
        cloud = None if plan.kind == "all" else session(cloud_model(a, plan))
        for feeds, ref in zip(feeds_list, want, strict=True):
            mid = dict(feeds)
            if edge is not None:
                names = [o.name for o in edge.get_outputs()]
                wanted = {i.name: feeds[i.name] for i in edge.get_inputs()}
                mid.update(zip(names, edge.run(names, wanted), strict=True))
            if cloud is None:
                got = {k: mid[k] for k in a.outputs}
            else:
                names = [o.name for o in cloud.get_outputs()]
                wanted = {i.name: mid[i.name] for i in cloud.get_inputs()}
                got = dict(zip(names, cloud.run(names, wanted), strict=True))
            shapes = {k: v.shape for k, v in feeds.items()}
            try:
                assert_close(got, ref)
            except AssertionError as exc:
                raise AssertionError(f"cut {plan.id} {plan.crossing} at {shapes}: {exc}") from exc


@pytest.mark.slow
def test_every_split_of_the_encoder_composes_at_every_length(enc: Path) -> None:
    path = enc
    prepared = prepare(path, {"ids": [1, 16], "mask": [1, 16]})
    [seq] = prepared.analysis.free_dims
    assert (seq.symbol, seq.size) == ("seq", 16)
    assert seq.alt is not None
    plans = prepared.space.plans()
    assert len(plans) > 100
    # the middle of the encoder reshapes by shape values that follow the length
    assert sum(bool(p.rebuilt) for p in plans) > len(plans) // 2
    feeds = [encoder_feeds(b, s, seed=s) for b in (1, 3) for s in (7, 16, 100)]
    _every_cut(prepared, path, feeds)


def test_a_cut_tensor_spec_names_the_free_dimension(enc: Path, tmp_path: Path) -> None:
    prepared = prepare(enc, {"ids": [1, 16], "mask": [1, 16]})
    plan = next(p for p in prepared.space.plans() if p.kind == "split" and p.rebuilt)
    manifest = write_package(prepared, plan, tmp_path / "pkg")
    hidden = [t for t in manifest.cuts[0].tensors if len(t.shape) == 3]
    assert hidden
    assert all(t.shape[:2] == ("batch", "seq") for t in hidden)
    assert manifest.outputs[0].shape == ("batch", "seq", 64)


def test_a_fully_convolutional_net_composes_at_another_size(models: Path) -> None:
    path = models / "conv.onnx"
    prepared = prepare(path, {"x": [1, 3, 16, 24]})
    assert [(f.size, f.alt is not None) for f in prepared.analysis.free_dims] == [
        (16, True),
        (24, True),
    ]
    rng = np.random.default_rng(0)
    feeds = [
        {"x": rng.standard_normal(s).astype(np.float32)}
        for s in ((1, 3, 16, 24), (3, 3, 40, 18), (2, 3, 8, 64))
    ]
    _every_cut(prepared, path, feeds)


@pytest.mark.parametrize(
    ("name", "shapes", "spec"),
    [
        # (N, 4, W) -> (W, N, 8), declared [1, 'len']
        ("wrong", {"x": [1, 4, 5]}, ("W", "N", 8)),
        # conv + BiLSTM, seq-first (16, 1, 37), declared [1, 'seqlen']
        ("rec_wrong", {"image": [1, 1, 32, 64]}, (16, 1, 37)),
    ],
)
def test_declared_output_shapes_are_not_trusted(
    models: Path, tmp_path: Path, name: str, shapes: dict[str, list[int]], spec: tuple
) -> None:
    """Every cut, packaged and read back, returns exactly what ONNX Runtime returns."""
    path = models / f"{name}.onnx"
    prepared = prepare(path, shapes)
    rng = np.random.default_rng(1)
    sizes = [(1, 4, 5), (3, 4, 9)] if name == "wrong" else [(1, 1, 32, 64)]
    feeds = [{next(iter(shapes)): rng.standard_normal(s).astype(np.float32)} for s in sizes]
    want = [run(path, f) for f in feeds]
    plans = prepared.space.plans()
    assert plans[0].kind == "none"
    assert plans[-1].kind == "all"
    for plan in plans:
        out = tmp_path / plan.id
        manifest = write_package(prepared, plan, out)
        assert manifest.outputs[0].shape == spec, plan.id
        if plan.kind == "split" and manifest.batch_dim:  # nothing seq-first crosses
            assert all(t.shape[0] == manifest.batch_dim for t in manifest.cuts[0].tensors)
        for feed, ref in zip(feeds, want, strict=True):
            mid = dict(feed)
            if (out / "edge.onnx").exists():
                mid.update(run(out / "edge.onnx", feed))
            got = run(out / "cloud.onnx", mid) if (out / "cloud.onnx").exists() else mid
            try:
                assert_close({k: got[k] for k in ref}, ref)
            except AssertionError as exc:
                raise AssertionError(f"cut {plan.id} {plan.crossing}: {exc}") from exc
