"""Helpers for the cloud service tests: small real packages in a repository, signed frames."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from graphs import chain, f32, make, rand
from onnx import helper

from splitinfer.cloud.config import BatchingConfig, ModelPolicy, ServiceConfig
from splitinfer.partitioner.pipeline import prepare, write_package
from splitinfer.shared.auth import Credential, CredentialStore, render_toml
from splitinfer.shared.codecs import RAW
from splitinfer.shared.frame import Request, WireTensor, encode_request
from splitinfer.shared.manifest import Manifest, load_manifest

DEVICE = Credential("cam-01", "k1", b"0123456789abcdef0123456789abcdef")
OTHER = Credential("gate-7", "k1", b"fedcba9876543210fedcba9876543210")


def variable_length() -> onnx.ModelProto:
    """Masked mean of a projected sequence: x [N, S, 4], mask [N, S] -> y [N, 4]."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Unsqueeze", ["mask", "ax2"], ["m3"]),
        helper.make_node("Mul", ["r", "m3"], ["rm"]),
        helper.make_node("ReduceSum", ["rm", "ax1"], ["s"], keepdims=0),
        helper.make_node("ReduceSum", ["mask", "ax1"], ["cnt"], keepdims=1),
        helper.make_node("Div", ["s", "cnt"], ["y"]),
    ]
    inits = {"w": rand(4, 4), "ax2": np.array([2], np.int64), "ax1": np.array([1], np.int64)}
    return make(
        nodes, [f32("x", ["N", "S", 4]), f32("mask", ["N", "S"])], [f32("y", ["N", 4])], inits
    )


def cnn() -> onnx.ModelProto:
    """A small CNN: conv-relu-pool-conv-relu-gap-gemm on x [N, 3, 16, 16] -> y [N, 10]."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "w3", "b3"], ["y"], transB=1),
    ]
    inits = {
        "w1": rand(8, 3, 3, 3, seed=1) * 0.3,
        "b1": rand(8, seed=2),
        "w2": rand(16, 8, 3, 3, seed=3) * 0.2,
        "b2": rand(16, seed=4),
        "w3": rand(10, 16, seed=5),
        "b3": rand(10, seed=6),
    }
    return make(nodes, [f32("x", ["N", 3, 16, 16])], [f32("y", ["N", 10])], inits)


def write(
    model: onnx.ModelProto | Path,
    repo: Path,
    name: str,
    version: str,
    cuts: Sequence[str] = ("none",),
    shapes: dict[str, list[int]] | None = None,
) -> Manifest:
    """Partition ``model`` and write the package to ``repo/name/version``."""
    work = repo.parent / f".src-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    src = work / f"{name}.onnx"
    if isinstance(model, Path):
        shutil.copy(model, src)
    else:
        onnx.save(model, str(src))
    prepared = prepare(src, shapes)
    plans = [prepared.space.find(c) for c in cuts]
    manifest = write_package(prepared, plans, repo / name / version)
    shutil.rmtree(work)
    return manifest


def chain_repo(repo: Path, name: str = "chain", versions: Sequence[str] = ("1",)) -> Manifest:
    """A 6-node MatMul/Sigmoid chain, cuts none and c2, one package per version.

    Each version gets different weights (seeded by its position), so answers
    tell the versions apart.
    """
    manifest = None
    for i, v in enumerate(versions):
        g = chain(6, width=4)
        for init in g.graph.initializer:
            arr = onnx.numpy_helper.to_array(init) * (1.0 + i)
            init.CopyFrom(onnx.numpy_helper.from_array(arr.astype(np.float32), init.name))
        manifest = write(g, repo, name, v, cuts=("none", "c2"))
    assert manifest is not None
    return manifest


def config(repo: Path, **kw: object) -> ServiceConfig:
    """A loopback config with auth off unless credentials are given."""
    batching = kw.pop("batching", BatchingConfig())
    models = kw.pop("models", {})
    kw.setdefault("no_auth", "credentials" not in kw)
    kw.setdefault("listen", "127.0.0.1:0")
    kw.setdefault("accept_raw", True)  # frame() below sends every tensor raw
    return ServiceConfig(
        repository=str(repo),
        batching=batching,  # type: ignore[arg-type]
        models=models,  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def credentials_file(path: Path, creds: Sequence[Credential] = (DEVICE, OTHER)) -> Path:
    path.write_text("".join(render_toml(c) for c in creds))
    CredentialStore.from_file(path)  # it parses
    return path


def frame(
    manifest: Manifest,
    arrays: dict[str, np.ndarray],
    cut: str | None = None,
    version: str = "",
    deadline_ms: int = 0,
    model: str | None = None,
) -> bytes:
    cut_id = cut or manifest.default_cut
    spec = manifest.find_cut(cut_id)
    assert spec is not None
    tensors = tuple(WireTensor(t.name, arrays[t.name], RAW) for t in spec.tensors)
    return encode_request(
        Request(
            uuid.uuid4().hex,
            model or manifest.model_name,
            version,
            cut_id,
            tensors,
            deadline_ms=deadline_ms,
        )
    )


def policy(**kw: object) -> ModelPolicy:
    return ModelPolicy(**kw)  # type: ignore[arg-type]


def load(repo: Path, name: str, version: str) -> Manifest:
    return load_manifest(repo / name / version)


def coded_frame(repo: Path, codec: int, model: str = "chain") -> bytes:
    """A request frame for the default cut of ``repo/model/1`` with every tensor in ``codec``
    (int8 ones quantized with the cut's calibrated parameters where it has them)."""
    from splitinfer.shared.codecs import QuantParams
    from splitinfer.shared.package import quant_params

    m = load_manifest(repo / model / "1")
    cut = m.find_cut(m.default_cut)
    assert cut is not None
    tensors = []
    for spec in cut.tensors:
        x = np.random.default_rng(3).standard_normal((1, 4)).astype(np.float32)
        q = quant_params(cut, spec.name)
        ref = q is not None
        q = q or QuantParams((float(np.abs(x).max()) / 127,), (0,))
        tensors.append(WireTensor(spec.name, x, codec, q if codec != RAW else None, ref))
    return encode_request(Request("r1", model, "", cut.id, tuple(tensors)))


def neck() -> onnx.ModelProto:
    """x [N, 2, H, W] -> a stride-2 conv (the edge) -> a pooled, upsampled branch concatenated
    with its own input (the cloud): a cut tensor whose H/2 and W/2 are symbols of its own."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Resize", ["p", "", "scales"], ["u"], mode="nearest"),
        helper.make_node("Concat", ["r", "u"], ["y"], axis=1),
    ]
    inits = {"w": rand(4, 2, 3, 3, seed=7), "scales": np.array([1, 1, 2, 2], np.float32)}
    return make(nodes, [f32("x", ["N", 2, "H", "W"])], [f32("y", ["N", 8, "h", "w"])], inits)
