"""Provider selection, device detection and the TensorRT cache key (pure; CPU box)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from graphs import chain

from splitinfer.edge.config import RuntimeConfig
from splitinfer.edge.runtime import (
    CPU,
    CUDA,
    TENSORRT,
    DeviceInfo,
    default_cache_dir,
    detect_device,
    engine_cache_path,
    open_segment,
    select_providers,
    tensorrt_version,
)
from splitinfer.shared.errors import ConfigError, ModelError
from splitinfer.shared.manifest import Segment

pytestmark = pytest.mark.unit

SEG = Segment("edge.onnx", "ab" * 32, ("x",), ("t1",), 2, precision="int8")
FP32 = Segment("edge.onnx", "cd" * 32, ("x",), ("t1",), 2, precision="fp32")
JETSON = DeviceInfo(jetson=True, gpu_name="NVIDIA Jetson Orin Nano", tensorrt_version="10.3.0")
DESKTOP = DeviceInfo(jetson=False, gpu_name="NVIDIA L4", tensorrt_version="10.9.0")
ROOT = Path("/cache")


def names(choices: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [n for n, _ in choices]


@pytest.mark.parametrize(
    ("available", "device", "want"),
    [
        ([CPU], DeviceInfo(), [CPU]),
        ([CUDA, CPU], DESKTOP, [CUDA, CPU]),
        # TensorRT only on Jetson-class devices under auto
        ([TENSORRT, CUDA, CPU], DESKTOP, [CUDA, CPU]),
        ([TENSORRT, CUDA, CPU], JETSON, [TENSORRT, CUDA, CPU]),
        ([TENSORRT, CPU], JETSON, [TENSORRT, CPU]),
        ([CPU], JETSON, [CPU]),
    ],
)
def test_auto_selection(available: list[str], device: DeviceInfo, want: list[str]) -> None:
    assert names(select_providers(available, device, RuntimeConfig(), SEG, ROOT)) == want


def test_explicit_choices_and_missing_providers() -> None:
    all3 = [TENSORRT, CUDA, CPU]
    assert names(select_providers(all3, JETSON, RuntimeConfig(providers=("cpu",)), SEG, ROOT)) == [
        CPU
    ]
    assert names(
        select_providers(all3, DESKTOP, RuntimeConfig(providers=("tensorrt",)), SEG, ROOT)
    )[0] == (TENSORRT)
    with pytest.raises(ConfigError, match="onnxruntime-gpu"):
        select_providers([CPU], DESKTOP, RuntimeConfig(providers=("cuda",)), SEG, ROOT)
    with pytest.raises(ConfigError, match="TensorrtExecutionProvider"):
        select_providers([CUDA, CPU], JETSON, RuntimeConfig(providers=("tensorrt",)), SEG, ROOT)
    one = RuntimeConfig(providers=("cuda",), gpu=1)
    cuda = select_providers([CUDA, CPU], DESKTOP, one, SEG, ROOT)
    assert cuda[0] == (CUDA, {"device_id": 1})
    # a list, best first: the first this build has runs the segment
    pref = RuntimeConfig(providers=("tensorrt", "cuda", "cpu"))
    assert names(select_providers([CUDA, CPU], DESKTOP, pref, SEG, ROOT)) == [CUDA, CPU]
    assert names(select_providers([CPU], DESKTOP, pref, SEG, ROOT)) == [CPU]


def test_tensorrt_options_and_cache_key() -> None:
    (name, opts), *_ = select_providers([TENSORRT, CUDA, CPU], JETSON, RuntimeConfig(), SEG, ROOT)
    assert name == TENSORRT
    assert opts["trt_engine_cache_enable"] is True
    assert opts["trt_int8_enable"] is True  # the int8 (Q/DQ) segment
    path = Path(opts["trt_engine_cache_path"])
    assert path.parent == ROOT
    assert path.name.startswith("abababababababab-trt10.3.0-nvidia-jetson-orin-nano")
    # an fp32 segment does not ask for int8; the key changes with the model's hash
    (_, fp32), *_ = select_providers([TENSORRT, CPU], JETSON, RuntimeConfig(), FP32, ROOT)
    assert fp32["trt_int8_enable"] is False
    assert fp32["trt_engine_cache_path"] != opts["trt_engine_cache_path"]
    # a TensorRT upgrade or another GPU never reuses an engine
    keys = {
        engine_cache_path(ROOT, SEG, d, True, True)
        for d in (
            JETSON,
            DeviceInfo(True, "NVIDIA Jetson Orin Nano", "10.4.0"),
            DeviceInfo(True, "NVIDIA Jetson AGX Orin", "10.3.0"),
        )
    }
    assert len(keys) == 3
    off = RuntimeConfig(trt_int8=False, trt_fp16=False)
    (_, plain), *_ = select_providers([TENSORRT, CPU], JETSON, off, SEG, ROOT)
    assert plain["trt_int8_enable"] is False
    assert plain["trt_fp16_enable"] is False
    assert plain["trt_engine_cache_path"].endswith("-fp32")


def test_detect_device_reads_device_tree_and_libraries(tmp_path: Path) -> None:
    (tmp_path / "proc/device-tree").mkdir(parents=True)
    (tmp_path / "proc/device-tree/model").write_bytes(b"NVIDIA Jetson Orin Nano Developer Kit\x00")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/nv_tegra_release").write_text("# R36 (release)\n")
    lib = tmp_path / "usr/lib/aarch64-linux-gnu"
    lib.mkdir(parents=True)
    for v in ("10.3.0", "8.6.2"):
        (lib / f"libnvinfer.so.{v}").write_bytes(b"")

    def no_smi(*args: Any, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        raise AssertionError("nvidia-smi is not asked on a Jetson")

    info = detect_device(tmp_path, run=no_smi)
    assert info.jetson
    assert info.gpu_name == "NVIDIA Jetson Orin Nano Developer Kit"
    if not _trt_wheel():
        assert info.tensorrt_version == "10.3.0"


def _trt_wheel() -> bool:
    from importlib import metadata

    try:
        metadata.version("tensorrt")
    except metadata.PackageNotFoundError:
        return False
    return True


def test_detect_device_on_a_desktop_asks_nvidia_smi(tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def smi(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "NVIDIA L4\n", "")

    info = detect_device(tmp_path, run=smi)
    assert not info.jetson
    assert info.gpu_name == "NVIDIA L4"
    assert calls
    assert calls[0][0] == "nvidia-smi"
    assert detect_device(tmp_path, run=smi, want_gpu=False).gpu_name == ""

    def missing(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(cmd[0])

    assert detect_device(tmp_path, run=missing) == DeviceInfo(
        tensorrt_version=tensorrt_version(tmp_path)
    )


def test_default_cache_dir_follows_systemd_state_directory() -> None:
    env = {"STATE_DIRECTORY": "/var/lib/edge-agent:/var/lib/other", "HOME": "/h"}
    assert default_cache_dir(env) == Path("/var/lib/edge-agent/trt-cache")
    assert default_cache_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/splitinfer/trt")


def test_open_segment_runs_on_cpu(tmp_path: Path) -> None:
    model = chain(4)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    seg = Segment("m.onnx", "00" * 32, ("x",), ("y",), 5)
    runner = open_segment(path, seg, RuntimeConfig(threads=1), DeviceInfo(), [CPU])
    assert runner.providers == (CPU,)
    x = np.ones((2, 4), np.float32)
    out = runner.run({"x": x, "unused": x})
    assert out["y"].shape == (2, 4)
    with pytest.raises(ModelError, match="'x' is missing"):
        runner.run({})
    with pytest.raises(ModelError, match="ONNX Runtime failed"):
        runner.run({"x": np.ones((2, 5), np.float32)})
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelError, match="cannot load"):
        open_segment(bad, seg, RuntimeConfig(), DeviceInfo(), [CPU])
