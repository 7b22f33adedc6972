"""ONNX Runtime sessions for the package's segments, and which provider runs them.

Provider selection is a pure function of (the providers this onnxruntime build
offers, what the device is, the config), so it is tested on a CPU box. The config's
``providers`` lists them best first; the first one this build has runs the segment:

* ``cpu``: CPU only.
* ``cuda``: CUDA, then CPU for any node CUDA lacks.
* ``tensorrt``: ONNX Runtime's TensorRT provider, then CUDA, then CPU. The
  engine is built on the device from the segment (its Q/DQ nodes give the int8
  precision) on first start and cached by ORT (``trt_engine_cache_enable``) in a
  folder keyed by the segment's sha256, the TensorRT version and the GPU name,
  so a new model, a TensorRT upgrade or a different GPU never loads a stale
  engine.
* ``auto``: TensorRT on Jetson-class devices when the provider exists, else
  CUDA when present, else CPU.

A segment that holds ops outside the default ONNX domain (the manifest's
``nonstandard_ops``: a source model's ``com.microsoft`` op) is never given to
TensorRT, which cannot build it: where TensorRT would run it, ONNX Runtime's
CUDA (else CPU) provider does, and one log line says why (:func:`tensorrt_refusal`).

Asking for a provider this build lacks is a :class:`ConfigError` naming the
package to install. ``strict=True`` (``bench/gpu_check.py``) gives TensorRT no
CUDA or CPU fallback: a segment it cannot take whole fails to load instead of
running partly elsewhere. :func:`tensorrt_parse_errors` asks TensorRT's own ONNX
parser about a segment.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.edge.config import RuntimeConfig
from splitinfer.shared.errors import ConfigError, ModelError
from splitinfer.shared.manifest import Segment
from splitinfer.shared.ortsession import open_session
from splitinfer.shared.settings import AUTO

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
_ORT_NAMES = {"cpu": CPU, "cuda": CUDA, "tensorrt": TENSORRT}

#: (provider name, provider options) in ONNX Runtime's order of preference.
ProviderChoice = tuple[str, dict[str, Any]]
Array = np.ndarray[Any, Any]

_LIB_DIRS = ("usr/lib/aarch64-linux-gnu", "usr/lib/x86_64-linux-gnu", "usr/lib", "usr/local/lib")


@dataclass(frozen=True)
class DeviceInfo:
    """What the agent runs on, as far as provider selection cares."""

    #: A Jetson (or other Tegra) board.
    jetson: bool = False
    #: The board or GPU name ("NVIDIA Jetson Orin Nano Developer Kit", "NVIDIA L4").
    gpu_name: str = ""
    #: The TensorRT library version, or "" when none was found.
    tensorrt_version: str = ""


def detect_device(
    root: Path = Path("/"),
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
    want_gpu: bool = True,
) -> DeviceInfo:
    """Read the board model (device tree), the GPU name and the TensorRT version.

    ``want_gpu=False`` skips ``nvidia-smi`` (no GPU provider in this build).
    Nothing here fails: an unknown field stays empty.
    """
    model = ""
    try:
        model = (root / "proc/device-tree/model").read_bytes().decode(errors="replace")
        model = model.strip("\x00 \n")
    except OSError:
        pass
    jetson = (root / "etc/nv_tegra_release").exists() or "jetson" in model.lower()
    gpu = model if jetson else ""
    if want_gpu and not gpu:
        try:
            done = run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
            if done.returncode == 0 and done.stdout.strip():
                gpu = done.stdout.strip().splitlines()[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return DeviceInfo(jetson=jetson, gpu_name=gpu, tensorrt_version=tensorrt_version(root))


def tensorrt_version(root: Path = Path("/")) -> str:
    """TensorRT's version from the installed wheel, else from ``libnvinfer.so.X.Y.Z``."""
    from importlib import metadata

    for dist in ("tensorrt", "tensorrt-cu12", "tensorrt-cu11", "tensorrt-libs"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    found: list[tuple[int, ...]] = []
    for folder in _LIB_DIRS:
        for lib in (root / folder).glob("libnvinfer.so.*.*.*"):
            m = re.fullmatch(r"libnvinfer\.so\.(\d+)\.(\d+)\.(\d+)", lib.name)
            if m:
                found.append(tuple(int(g) for g in m.groups()))
    return ".".join(map(str, max(found))) if found else ""


def default_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """$STATE_DIRECTORY/trt-cache under systemd, else ~/.cache/splitinfer/trt."""
    state = env.get("STATE_DIRECTORY")
    if state:
        return Path(state.split(":")[0]) / "trt-cache"
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "splitinfer" / "trt"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower() or "unknown"


def engine_cache_path(
    root: Path, segment: Segment, device: DeviceInfo, fp16: bool, int8: bool
) -> Path:
    """The engine folder of one segment: sha256 + TensorRT version + GPU (+ precision)."""
    flags = "-".join(p for p, on in (("fp16", fp16), ("int8", int8)) if on) or "fp32"
    key = (
        f"{segment.sha256[:16]}-trt{_slug(device.tensorrt_version)}-"
        f"{_slug(device.gpu_name)}-{flags}"
    )
    return root / key


def select_providers(
    available: Sequence[str],
    device: DeviceInfo,
    config: RuntimeConfig,
    segment: Segment,
    cache_root: Path,
    strict: bool = False,
) -> list[ProviderChoice]:
    """The providers, with options, that run ``segment`` on this device. Pure.

    ``strict``: with the TensorRT provider, it alone (no CUDA or CPU fallback).
    """
    have = set(available)
    listed = tuple(config.providers)
    # the first listed that this build has; none: the first, which is refused below
    want = next((p for p in listed if _ORT_NAMES.get(p) in have), listed[0])
    if listed == (AUTO,):
        if TENSORRT in have and device.jetson:
            want = "tensorrt"
        elif CUDA in have:
            want = "cuda"
        else:
            want = "cpu"
    cpu: ProviderChoice = (CPU, {})
    if want == "cpu":
        return [cpu]
    if want == "cuda" and CUDA not in have:
        raise ConfigError(
            f"runtime.providers={','.join(listed)}, but this onnxruntime has no "
            f"CUDAExecutionProvider (it has {', '.join(sorted(have))}); install onnxruntime-gpu "
            "or use --providers cpu"
        )
    cuda: ProviderChoice = (CUDA, {"device_id": config.gpu})
    if want == "cuda":
        return [cuda, cpu]
    refusal = tensorrt_refusal(segment)
    if refusal is not None:
        if strict:
            raise ConfigError(refusal)
        log.warning(
            "%s; running it on ONNX Runtime's %s provider",
            refusal,
            "CUDA" if CUDA in have else "CPU",
        )
        return [cuda, cpu] if CUDA in have else [cpu]
    if TENSORRT not in have:
        raise ConfigError(
            f"runtime.providers={','.join(listed)}, but this onnxruntime has no "
            "TensorrtExecutionProvider; install onnxruntime-gpu with TensorRT (on Jetson: the "
            "Jetson Zoo wheel) or use --providers cuda"
        )
    int8 = config.trt_int8 and segment.precision == "int8"
    fp16 = config.trt_fp16
    cache = engine_cache_path(cache_root, segment, device, fp16, int8)
    trt: ProviderChoice = (
        TENSORRT,
        {
            "device_id": config.gpu,
            "trt_engine_cache_enable": True,
            "trt_engine_cache_path": str(cache),
            "trt_timing_cache_enable": True,
            "trt_timing_cache_path": str(cache_root),
            "trt_fp16_enable": fp16,
            # Q/DQ nodes carry the scales: TensorRT builds explicit-precision int8 layers.
            "trt_int8_enable": int8,
            "trt_max_workspace_size": config.trt_workspace_mb * 2**20,
        },
    )
    if strict:
        return [trt]
    return [trt, cuda, cpu] if CUDA in have else [trt, cpu]


def tensorrt_refusal(segment: Segment) -> str | None:
    """Why TensorRT cannot run ``segment`` (one line), or None when it can as far as the
    manifest tells: a segment holding ops outside the default ONNX domain needs ONNX Runtime."""
    if not segment.needs_onnxruntime:
        return None
    return (
        f"{segment.file}: TensorRT cannot run {', '.join(segment.nonstandard_ops)} "
        "(not a default-domain ONNX op; the package marks the segment ONNX Runtime only)"
    )


class SegmentRunner:
    """One ONNX Runtime session: named feeds in, named outputs out."""

    def __init__(self, session: Any, name: str) -> None:
        self.session = session
        self.name = name
        self.input_names = tuple(i.name for i in session.get_inputs())
        self.output_names = tuple(o.name for o in session.get_outputs())
        self.providers = tuple(session.get_providers())

    def run(self, feeds: Mapping[str, Array]) -> dict[str, Array]:
        """Run with the inputs the session takes (extra feeds are ignored)."""
        try:
            wanted = {n: feeds[n] for n in self.input_names}
        except KeyError as exc:
            raise ModelError(f"{self.name}: input {exc.args[0]!r} is missing") from None
        try:
            outs = self.session.run(list(self.output_names), wanted)
        except Exception as exc:  # onnxruntime raises its own, untyped errors
            message = " ".join(str(exc).split())[:400]
            raise ModelError(f"{self.name}: ONNX Runtime failed: {message}") from exc
        return dict(zip(self.output_names, outs, strict=True))


def available_providers() -> list[str]:
    import onnxruntime as ort

    return list(ort.get_available_providers())


def open_segment(
    path: Path,
    segment: Segment,
    config: RuntimeConfig,
    device: DeviceInfo,
    available: Sequence[str],
    cache_root: Path | None = None,
    strict: bool = False,
) -> SegmentRunner:
    """A session for one segment file on the selected providers.

    The TensorRT engine cache folder is created here; the first session on a
    new device builds the engine (minutes on a Jetson), later ones load it.
    ``strict``: TensorRT must take every node (ONNX Runtime may place none on
    the CPU), else a :class:`ModelError`.
    """

    root = cache_root or config.trt_cache_dir or default_cache_dir()
    choices = select_providers(available, device, config, segment, root, strict=strict)
    if choices[0][0] == TENSORRT:
        Path(choices[0][1]["trt_engine_cache_path"]).mkdir(parents=True, exist_ok=True)
    no_fallback = strict and choices[0][0] == TENSORRT
    started = time.perf_counter()
    session = open_session(
        path,
        providers=choices,
        name=segment.file,
        threads=config.threads or None,
        spinning=config.spin,
        config={"session.disable_cpu_ep_fallback": "1"} if no_fallback else None,
    )
    runner = SegmentRunner(session, segment.file)
    wanted = choices[0][0]
    if runner.providers[0] != wanted:
        log.warning(
            "%s: asked for %s, ONNX Runtime runs it on %s",
            segment.file,
            wanted,
            ", ".join(runner.providers),
        )
    log.info(
        "%s loaded on %s in %.2f s",
        segment.file,
        ", ".join(runner.providers),
        time.perf_counter() - started,
    )
    return runner


def tensorrt_parse_errors(path: Path) -> list[str]:
    """What TensorRT's own ONNX parser says against ``path``: one line per error, [] if none.

    Parses only (no engine build, no GPU memory), with the ``tensorrt`` Python
    package, imported here.
    """
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    flag = getattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH", None)
    network = builder.create_network(0 if flag is None else 1 << int(flag))
    parser = trt.OnnxParser(network, logger)
    if parser.parse_from_file(str(path)):
        return []
    errors = [" ".join(str(parser.get_error(i)).split()) for i in range(parser.num_errors)]
    return errors or [f"{path.name}: TensorRT's ONNX parser failed without saying why"]
