"""The GPU paths of the edge runtime: CUDA, and TensorRT with its engine cache.

Skipped where this onnxruntime has no CUDA or TensorRT provider (CI, CPU boxes).
On a Jetson or a CUDA machine with onnxruntime-gpu:

    pytest -m gpu tests/test_edge_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from graphs import chain

from splitinfer.edge.config import RuntimeConfig
from splitinfer.edge.model import load_model
from splitinfer.edge.runtime import CUDA, TENSORRT, detect_device
from splitinfer.partitioner.pipeline import artifacts_for, prepare, write_package

AVAILABLE = ort.get_available_providers()

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("gpu")
    onnx.save(chain(6, width=64), str(tmp / "m.onnx"))
    prepared = prepare(tmp / "m.onnx")
    plans = prepared.space.plans()
    write_package(prepared, [artifacts_for(prepared, plans[2])], tmp / "pkg")
    return tmp / "pkg"


def _outputs(package: Path, config: RuntimeConfig) -> tuple[np.ndarray, tuple[str, ...]]:
    model = load_model(package, config)
    rt = model.cuts[model.manifest.default_cut]
    assert rt.edge is not None
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    out = next(iter(rt.edge.run({"x": x}).values()))
    return out, rt.edge.providers


@pytest.mark.skipif(CUDA not in AVAILABLE, reason="no CUDAExecutionProvider here")
def test_cuda_matches_cpu(package: Path) -> None:
    want, _ = _outputs(package, RuntimeConfig(provider="cpu"))
    got, providers = _outputs(package, RuntimeConfig(provider="cuda"))
    assert providers[0] == CUDA
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(TENSORRT not in AVAILABLE, reason="no TensorrtExecutionProvider here")
def test_tensorrt_builds_then_reuses_its_engine(package: Path, tmp_path: Path) -> None:
    cache = tmp_path / "trt"
    config = RuntimeConfig(provider="tensorrt", trt_cache_dir=cache)
    want, _ = _outputs(package, RuntimeConfig(provider="cpu"))
    got, providers = _outputs(package, config)
    assert providers[0] == TENSORRT
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-3)
    engines = sorted(cache.rglob("*.engine"))
    assert engines, f"no engine cached under {cache}"
    device = detect_device()
    assert device.tensorrt_version, "the TensorRT version is part of the cache key"
    stamps = {p: p.stat().st_mtime_ns for p in engines}
    again, _ = _outputs(package, config)  # a second start loads the engine, builds nothing
    np.testing.assert_allclose(again, got, rtol=0, atol=0)
    assert {p: p.stat().st_mtime_ns for p in sorted(cache.rglob("*.engine"))} == stamps
