"""The GPU paths of the edge runtime and bench/gpu_check.py.

The ``gpu`` tests are skipped where this onnxruntime has no CUDA or TensorRT
provider (CI, CPU boxes). On a Jetson or a CUDA machine with onnxruntime-gpu:

    pytest -m gpu tests/test_edge_gpu.py

The rest checks what runs without a GPU: strict provider selection, and
gpu_check's model selection, comparison, table, its no-GPU exit, and one model
end to end with ONNX Runtime's CPU provider standing in for TensorRT.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from graphs import chain

from splitinfer.edge.config import RuntimeConfig
from splitinfer.edge.model import load_model
from splitinfer.edge.runtime import (
    CPU,
    CUDA,
    TENSORRT,
    DeviceInfo,
    detect_device,
    open_segment,
    select_providers,
)
from splitinfer.partitioner.pipeline import artifacts_for, prepare, write_package
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.manifest import Segment

pytestmark = pytest.mark.unit

AVAILABLE = ort.get_available_providers()
ROOT = Path(__file__).resolve().parent.parent


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


@pytest.mark.gpu
@pytest.mark.skipif(CUDA not in AVAILABLE, reason="no CUDAExecutionProvider here")
def test_cuda_matches_cpu(package: Path) -> None:
    want, _ = _outputs(package, RuntimeConfig(providers=("cpu",)))
    got, providers = _outputs(package, RuntimeConfig(providers=("cuda",)))
    assert providers[0] == CUDA
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(TENSORRT not in AVAILABLE, reason="no TensorrtExecutionProvider here")
def test_tensorrt_builds_then_reuses_its_engine(package: Path, tmp_path: Path) -> None:
    cache = tmp_path / "trt"
    config = RuntimeConfig(providers=("tensorrt",), trt_cache_dir=cache)
    want, _ = _outputs(package, RuntimeConfig(providers=("cpu",)))
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


# --- strict TensorRT selection (pure) ---------------------------------------------------


def test_strict_tensorrt_has_no_fallback(tmp_path: Path) -> None:
    seg = Segment("edge.onnx", "ab" * 32, ("x",), ("y",), 2, precision="int8")
    device = DeviceInfo(gpu_name="NVIDIA L4", tensorrt_version="10.9.0")
    config = RuntimeConfig(providers=("tensorrt",))
    every = [TENSORRT, CUDA, CPU]
    loose = select_providers(every, device, config, seg, tmp_path)
    strict = select_providers(every, device, config, seg, tmp_path, strict=True)
    assert [name for name, _ in loose] == [TENSORRT, CUDA, CPU]
    assert [name for name, _ in strict] == [TENSORRT]
    assert strict[0][1] == loose[0][1]  # the same engine options and cache folder
    assert strict[0][1]["trt_int8_enable"] is True
    # strict changes nothing for the other providers
    cpu = RuntimeConfig(providers=("cpu",))
    assert select_providers(every, device, cpu, seg, tmp_path, strict=True) == [(CPU, {})]


# --- bench/gpu_check.py ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def test_missing_pieces_and_the_message(gpu_check: ModuleType) -> None:
    assert gpu_check.missing_pieces([TENSORRT, CUDA, CPU], "NVIDIA H200", True) == []
    missing = gpu_check.missing_pieces([CPU], "", False)
    assert missing == [
        "no CUDA GPU (nvidia-smi found none)",
        "onnxruntime has no TensorrtExecutionProvider (it has CPUExecutionProvider)",
        "the tensorrt Python package is not installed",
    ]
    assert gpu_check.missing_pieces([CUDA, CPU], "NVIDIA L4", True) == [
        "onnxruntime has no TensorrtExecutionProvider "
        "(it has CUDAExecutionProvider, CPUExecutionProvider)"
    ]
    text = gpu_check.no_gpu_message(missing[:1])
    assert text.startswith("gpu_check: not run: no CUDA GPU")
    assert "Nothing was built or timed" in text
    assert "pip install onnxruntime-gpu tensorrt-cu12" in text


def test_model_selection(gpu_check: ModuleType) -> None:
    zoo = ["chain", "resnet", "transformer"]
    assert gpu_check.select_models(None, zoo) == zoo
    assert gpu_check.select_models("transformer, chain,chain", zoo) == ["transformer", "chain"]
    with pytest.raises(ConfigError, match=r"unknown model 'vgg'; the zoo has chain, resnet"):
        gpu_check.select_models("chain,vgg", zoo)


def test_compare(gpu_check: ModuleType) -> None:
    want = {"y": np.array([[1.0, -2.0], [4.0, 0.0]], np.float32)}
    assert gpu_check.compare(want, want) == (0.0, 1.0)
    err, cos = gpu_check.compare(want, {"y": want["y"] + np.float32(0.4)})
    assert err == pytest.approx(0.1)  # 0.4 / max(1, 4)
    assert 0.9 < cos < 1.0


def test_the_table(gpu_check: ModuleType) -> None:
    row = gpu_check.Row
    rows = [
        row("resnet", "edge", "int8", True, 12.0, 0.25, 2.4, 3e-3, 0.99991),
        row("resnet", "edge", "fp32", True, 3.5, 0.6, 1.0, 1e-6, 1.0),
        row("resnet", "cloud", "fp16", False, note="TensorRT did not take node 'x'"),
    ]
    text = gpu_check.format_table(rows, skipped=["transformer"])
    lines = text.splitlines()
    assert (
        " ".join(lines[0].split()) == "model segment precision built build s ms x fp32 max err cos"
    )
    assert lines[2].split() == [
        "resnet", "edge", "int8", "yes", "12.0", "0.250", "2.40", "3.0e-03", "0.99991"
    ]  # fmt: skip
    assert lines[4].split() == ["resnet", "cloud", "fp16", "NO", "-", "-", "-", "-", "-"]
    assert "  resnet cloud fp16: TensorRT did not take node 'x'" in lines
    assert lines[-1] == "skipped (time budget spent): transformer"
    widths = {len(line) for line in lines[:5]}
    assert len(widths) == 1  # aligned columns


def test_main_without_a_gpu_says_so_and_exits_0(
    gpu_check: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    code = gpu_check.main([], probe=lambda: ["no CUDA GPU (nvidia-smi found none)"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("gpu_check: not run: no CUDA GPU (nvidia-smi found none).")
    assert gpu_check.main(["--models", "vgg"], probe=lambda: []) == 2
    assert "gpu_check: error: unknown model 'vgg'" in capsys.readouterr().err


@pytest.mark.integration  # starts the script as a process
@pytest.mark.skipif(TENSORRT in AVAILABLE, reason="this machine can run the check for real")
def test_gpu_check_on_this_machine_exits_0_with_the_reason() -> None:
    env = {"PYTHONPATH": str(Path(__import__("splitinfer").__file__).parent.parent)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, **env},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gpu_check: not run: ")
    assert "onnxruntime has no TensorrtExecutionProvider" in done.stdout


@pytest.mark.integration
def test_one_model_end_to_end_with_the_cpu_standing_in_for_tensorrt(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from splitinfer.edge import runtime

    seen: list[tuple[str, bool, bool, bool]] = []

    def cpu_open(path: Path, segment: Segment, config: RuntimeConfig, *a: Any, **k: Any) -> Any:
        seen.append((segment.precision, config.trt_int8, config.trt_fp16, k["strict"]))
        return open_segment(path, segment, RuntimeConfig(providers=("cpu",)), DeviceInfo(), [CPU])

    monkeypatch.setattr(runtime, "open_segment", cpu_open)
    monkeypatch.setattr(runtime, "tensorrt_parse_errors", lambda path: [])
    rows = gpu_check.check_model("resnet", tmp_path, runs=2, batch=2)
    assert [(r.segment, r.precision) for r in rows] == [
        ("edge", "int8"),
        ("edge", "fp16"),
        ("edge", "fp32"),
        ("cloud", "fp16"),
    ]
    assert seen == [
        ("int8", True, True, True),
        ("fp32", False, True, True),
        ("fp32", False, False, True),
        ("fp32", False, True, True),
    ]
    assert all(r.built and r.median_ms and r.median_ms > 0 for r in rows), rows
    by = {(r.segment, r.precision): r for r in rows}
    assert by[("edge", "fp32")].max_rel_err == 0.0  # the same fp32 segment on the same CPU
    assert by[("edge", "fp32")].speedup == 1.0
    assert by[("cloud", "fp16")].speedup is None
    int8 = by[("edge", "int8")]
    assert int8.cosine is not None
    assert int8.cosine > 0.99
    assert 0 < (int8.max_rel_err or 0) < 0.2
    assert int8.note == ""  # no parser error, no rule broken
    assert "resnet  edge" in gpu_check.format_table(rows)
