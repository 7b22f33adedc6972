"""Device profiles and the per-node roofline estimate.

A :class:`DeviceProfile` holds a device's published dense peak throughput per
precision, its memory bandwidth, and a few documented assumptions (the
fraction of peak small-batch inference reaches, a per-node launch cost). The
roofline time of a node is

    max(FLOPs / (peak x efficiency), bytes moved / bandwidth) + launch overhead

with bytes moved = input and output activations at the batch size (float
tensors at the precision's element size) + the weights the node reads. The
formula runs on a :class:`NodeWork` table (a node's op, FLOPs and tensors), so
anything that can describe a graph's nodes gets the same estimate: the
partitioner builds the table from its graph analysis
(:func:`splitinfer.partitioner.profiles.roofline_times`). A measured
:class:`~splitinfer.shared.nodeprofile.NodeProfile` of the real device
overrides the estimate. The figures and their sources are tabulated in
``docs/profiles.md``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from splitinfer.shared.errors import ConfigError
from splitinfer.shared.manifest import PRECISIONS
from splitinfer.shared.nodeprofile import NodeProfile

KINDS = ("edge", "cloud")
RUNTIMES = ("tensorrt", "onnxruntime-cpu", "onnxruntime-cuda")
ELEMENT_BYTES = {"int8": 1, "fp16": 2, "fp32": 4}
#: Ops that run on matrix units (tensor cores, VNNI/SDOT) at the precision's peak;
#: every other op runs on vector units at the fp32 rate.
MATRIX_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "Einsum"})
#: Ops that only change a tensor's view: no data moves (TensorRT and ORT alias them).
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"})

GiB = 1024**3


@dataclass(frozen=True)
class DeviceProfile:
    """One device's datasheet figures and the assumptions the roofline adds."""

    name: str
    kind: str  # "edge" | "cloud"
    runtime: str  # "tensorrt" | "onnxruntime-cpu" | "onnxruntime-cuda"
    #: dense peak ops/s per precision ("int8", "fp16", "fp32"); int8 in ops/s
    peak_flops: Mapping[str, float]
    mem_bandwidth: float  # bytes/s, theoretical
    memory_bytes: int
    #: fraction of peak small-batch inference reaches (an assumption, see docs)
    efficiency: float
    launch_overhead_s: float  # per node
    power_w: float  # for the edge-energy objective
    #: on-demand list price in USD per hour (cloud profiles only)
    cost_per_hour: float | None
    source: str  # datasheet and price citations
    description: str = ""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        where = f"device profile {self.name!r}"
        if not self.name:
            raise ConfigError("device profile: name must not be empty")
        if self.kind not in KINDS:
            raise ConfigError(f"{where}: kind {self.kind!r}, use one of {', '.join(KINDS)}")
        if self.runtime not in RUNTIMES:
            raise ConfigError(
                f"{where}: runtime {self.runtime!r}, use one of {', '.join(RUNTIMES)}"
            )
        if set(self.peak_flops) != set(PRECISIONS):
            raise ConfigError(
                f"{where}: peak_flops must give {', '.join(PRECISIONS)}, "
                f"got {', '.join(sorted(self.peak_flops))}"
            )
        positive = {
            **{f"peak_flops[{p}]": v for p, v in self.peak_flops.items()},
            "mem_bandwidth": self.mem_bandwidth,
            "memory_bytes": self.memory_bytes,
            "power_w": self.power_w,
        }
        for label, value in positive.items():
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{where}: {label} is {value!r}, must be a positive number")
        if not 0 < self.efficiency <= 1:
            raise ConfigError(
                f"{where}: efficiency {self.efficiency!r} must be in (0, 1] (a fraction of peak)"
            )
        if not self.launch_overhead_s >= 0:
            raise ConfigError(f"{where}: launch_overhead_s must be >= 0")
        if self.kind == "cloud" and (self.cost_per_hour is None or not self.cost_per_hour > 0):
            raise ConfigError(f"{where}: a cloud profile needs a positive cost_per_hour")
        if self.kind == "edge" and self.cost_per_hour is not None:
            raise ConfigError(f"{where}: cost_per_hour is for cloud profiles only")


def _dense(sparse: float) -> float:
    """NVIDIA quotes Tensor Core rates with 2:4 structured sparsity; dense is half."""
    return sparse / 2


BUILTIN: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile(
            name="jetson-orin-nano",
            kind="edge",
            runtime="tensorrt",
            description="Jetson Orin Nano 8GB module, 15 W mode (original clocks, not 'Super')",
            # GPU: 1024 CUDA cores, 32 Tensor Cores, 625 MHz; no DLA on the Nano.
            peak_flops={"int8": _dense(40e12), "fp16": _dense(40e12) / 2, "fp32": 1.28e12},
            mem_bandwidth=68e9,  # 128-bit LPDDR5
            memory_bytes=8 * GiB,
            efficiency=0.4,
            launch_overhead_s=10e-6,
            power_w=15.0,
            cost_per_hour=None,
            source=(
                "NVIDIA Jetson Orin Nano Series data sheet and "
                "https://www.nvidia.com/en-us/autonomous-machines/embedded-systems/jetson-orin/ "
                "(8GB: 40 sparse / 20 dense INT8 TOPS, 1024 CUDA + 32 Tensor Cores at 625 MHz, "
                "68 GB/s, 7-15 W); FP16 = dense INT8 / 2; FP32 = 1024 x 2 x 625 MHz"
            ),
            notes=(
                "JetPack 6.2 'Super' mode raises this module to 67 sparse TOPS, 102 GB/s, 25 W",
            ),
        ),
        DeviceProfile(
            name="jetson-orin-nx",
            kind="edge",
            runtime="tensorrt",
            description="Jetson Orin NX 16GB module, 25 W mode, GPU only (DLAs not used)",
            # GPU: 1024 CUDA cores, 32 Tensor Cores, 918 MHz: 60 sparse INT8 TOPS;
            # the module's 100 sparse TOPS include 2 NVDLA v2 (40 sparse TOPS).
            peak_flops={"int8": _dense(60e12), "fp16": _dense(60e12) / 2, "fp32": 1.88e12},
            mem_bandwidth=102.4e9,  # 128-bit LPDDR5
            memory_bytes=16 * GiB,
            efficiency=0.4,
            launch_overhead_s=10e-6,
            power_w=25.0,
            cost_per_hour=None,
            source=(
                "NVIDIA Jetson Orin NX Series data sheet and "
                "https://www.nvidia.com/en-us/autonomous-machines/embedded-systems/jetson-orin/ "
                "(16GB: 100 sparse INT8 TOPS with DLAs, GPU 1024 CUDA + 32 Tensor Cores at "
                "918 MHz, 102.4 GB/s, 10-25 W); GPU INT8 = 8 SMs x 4096 dense ops/clk x 918 MHz"
            ),
        ),
        DeviceProfile(
            name="raspberry-pi-5",
            kind="edge",
            runtime="onnxruntime-cpu",
            description="Raspberry Pi 5 8GB: BCM2712, 4x Cortex-A76 at 2.4 GHz",
            # per core and cycle: 2 x 128-bit NEON pipes = 16 fp32 FLOPs (FMA),
            # 32 fp16 FLOPs, 64 int8 ops (SDOT)
            peak_flops={"int8": 4 * 2.4e9 * 64, "fp16": 4 * 2.4e9 * 32, "fp32": 4 * 2.4e9 * 16},
            mem_bandwidth=17.07e9,  # 32-bit LPDDR4X-4267
            memory_bytes=8 * GiB,
            efficiency=0.4,
            launch_overhead_s=5e-6,
            power_w=8.0,
            cost_per_hour=None,
            source=(
                "Raspberry Pi 5 product brief, "
                "https://www.raspberrypi.com/products/raspberry-pi-5/ "
                "(BCM2712 quad Cortex-A76 2.4 GHz, LPDDR4X-4267); peak rates from the "
                "Cortex-A76 pipeline (Arm Cortex-A76 Software Optimization Guide: "
                "2 ASIMD/FP pipes); "
                "power is a typical full-load board draw, not a datasheet figure"
            ),
        ),
        DeviceProfile(
            name="x86-server",
            kind="cloud",
            runtime="onnxruntime-cpu",
            description=(
                "Intel Xeon Gold 6326: 16 cores Ice Lake-SP, AVX-512 with VNNI, "
                "2 FMA units per core, 2.9 GHz base, 8x DDR4-3200"
            ),
            # per core and cycle: 2 x 16 fp32 FMA = 64 FLOPs; VNNI VPDPBUSD 2 x 64 MACs
            # = 256 int8 ops; no AVX-512 FP16 on Ice Lake, so fp16 runs at the fp32 rate
            peak_flops={
                "int8": 16 * 2.9e9 * 256,
                "fp16": 16 * 2.9e9 * 64,
                "fp32": 16 * 2.9e9 * 64,
            },
            mem_bandwidth=204.8e9,
            memory_bytes=256 * GiB,
            efficiency=0.4,
            launch_overhead_s=2e-6,
            power_w=185.0,
            cost_per_hour=1.36,
            source=(
                "Intel ARK, Xeon Gold 6326 (16 cores, 2.9/3.5 GHz, 8 channels DDR4-3200, 185 W), "
                "https://ark.intel.com/; price: AWS c6i.8xlarge (16 Ice Lake cores / 32 vCPU) "
                "on-demand Linux us-east-1, USD 1.36/h, 2024 list price"
            ),
        ),
        DeviceProfile(
            name="l4",
            kind="cloud",
            runtime="tensorrt",
            description="NVIDIA L4 24GB (Ada, PCIe, 72 W)",
            peak_flops={"int8": _dense(485e12), "fp16": _dense(242e12), "fp32": 30.3e12},
            mem_bandwidth=300e9,
            memory_bytes=24 * GiB,
            efficiency=0.35,
            launch_overhead_s=5e-6,
            power_w=72.0,
            cost_per_hour=0.8048,
            source=(
                "NVIDIA L4 datasheet, https://www.nvidia.com/en-us/data-center/l4/ "
                "(FP32 30.3 TFLOPS; FP16 242 and INT8 485 Tensor TOPS with sparsity, halved; "
                "300 GB/s; 72 W); price: AWS g6.xlarge (1x L4) on-demand us-east-1, "
                "USD 0.8048/h, 2024 list price"
            ),
        ),
        DeviceProfile(
            name="a100",
            kind="cloud",
            runtime="tensorrt",
            description="NVIDIA A100 SXM4 40GB",
            peak_flops={"int8": 624e12, "fp16": 312e12, "fp32": 19.5e12},
            mem_bandwidth=1555e9,
            memory_bytes=40 * GiB,
            efficiency=0.3,
            launch_overhead_s=5e-6,
            power_w=400.0,
            cost_per_hour=32.7726 / 8,
            source=(
                "NVIDIA A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/ "
                "(dense: FP32 19.5 TFLOPS, FP16 312, INT8 624 TOPS; 40GB SXM 1,555 GB/s; 400 W); "
                "price: AWS p4d.24xlarge (8x A100 40GB) on-demand us-east-1 USD 32.7726/h / 8, "
                "2024 list price"
            ),
        ),
        DeviceProfile(
            name="h100",
            kind="cloud",
            runtime="tensorrt",
            description="NVIDIA H100 SXM5 80GB",
            peak_flops={"int8": _dense(3958e12), "fp16": _dense(1979e12), "fp32": 67e12},
            mem_bandwidth=3.35e12,
            memory_bytes=80 * GiB,
            efficiency=0.25,
            launch_overhead_s=4e-6,
            power_w=700.0,
            cost_per_hour=98.32 / 8,
            source=(
                "NVIDIA H100 datasheet, https://www.nvidia.com/en-us/data-center/h100/ "
                "(SXM: FP32 67 TFLOPS; FP16 1,979 and INT8 3,958 Tensor TOPS with sparsity, "
                "halved; 3.35 TB/s; 700 W); price: AWS p5.48xlarge (8x H100 SXM) on-demand "
                "us-east-1 USD 98.32/h / 8, 2024 list price (cut in June 2025)"
            ),
        ),
    )
}


def _looks_like_path(spec: str) -> bool:
    return spec.endswith(".json") or os.sep in spec or "/" in spec or Path(spec).exists()


def resolve_profile(spec: str, kind: str) -> DeviceProfile | NodeProfile:
    """A built-in profile by name, or a measured profile JSON by path."""
    if kind not in KINDS:
        raise ConfigError(f"profile kind {kind!r}: use one of {', '.join(KINDS)}")
    if spec in BUILTIN:
        return BUILTIN[spec]
    if _looks_like_path(spec):
        return NodeProfile.load(Path(spec))
    names = ", ".join(f"{p.name} ({p.kind})" for p in BUILTIN.values())
    raise ConfigError(
        f"unknown {kind} profile {spec!r}; built-in profiles: {names}; "
        "or give the path of a measured profile JSON"
    )


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")


@dataclass(frozen=True)
class TensorWork:
    """A tensor a node reads or writes: elements (per sample when ``batched``),
    element size and whether it is a float (float tensors move at the precision's size)."""

    elements: int
    itemsize: int
    is_float: bool
    batched: bool

    def bytes(self, precision: str, batch: int) -> float:
        size = ELEMENT_BYTES[precision] if self.is_float else self.itemsize
        return float(self.elements * (batch if self.batched else 1) * size)


@dataclass(frozen=True)
class NodeWork:
    """One node as the roofline sees it: its key, op, whether it does device work
    (``data``: False for shape arithmetic), FLOPs per sample and the tensors it touches."""

    key: str
    op_type: str
    data: bool
    flops: int
    tensors: tuple[TensorWork, ...] = ()


def roofline_seconds(
    work: Sequence[NodeWork], profile: DeviceProfile, precision: str, batch: int = 1
) -> dict[str, float]:
    """Estimated seconds per node (by key) for one forward pass of ``batch`` samples."""
    check_precision(precision)
    if batch < 1:
        raise ConfigError(f"batch {batch}: must be a positive integer")
    times: dict[str, float] = {}
    for node in work:
        if not node.data:
            times[node.key] = 0.0  # shape arithmetic: folded or rebuilt, no device work
            continue
        if node.op_type in VIEW_OPS:
            times[node.key] = profile.launch_overhead_s
            continue
        moved = sum(t.bytes(precision, batch) for t in node.tensors)
        peak = profile.peak_flops[precision if node.op_type in MATRIX_OPS else "fp32"]
        compute = node.flops * batch / (peak * profile.efficiency)
        memory = moved / profile.mem_bandwidth
        times[node.key] = max(compute, memory) + profile.launch_overhead_s
    return times
