"""From planned cuts and per-node times to the :class:`CutCost` of every cut.

Inputs are seconds per node name for one forward pass at batch 1: edge times on
the edge device at the edge precision, cloud times on the cloud device. How
they were produced (ONNX Runtime's profiler, a device roofline, a measured
device profile) does not matter here.

Per cut (all vectorised over a cuts x nodes membership matrix, so thousands of
cuts of a graph of hundreds of nodes take milliseconds):

* ``edge_s`` / ``cloud_s``: the sum of the node times on each side, plus
  ``run_overhead_s`` for each side that runs at least one node (a runtime's
  fixed cost per call). Rebuilt shape values on the cloud cost nothing.
* ``up_bytes``: float cut tensors as fp32 bytes divided by the codec's
  compression ratio (one ratio, or one per tensor name); other dtypes (token
  ids, masks) travel raw. ``encode_s``/``decode_s``: fp32 bits of the float cut
  tensors over the codec's throughput, plus a fixed cost per tensor. An
  edge-only cut (``all``) sends nothing.
* ``down_bytes``: the model outputs, raw (zero for ``all``).
* ``edge_memory_bytes``, an estimate: the fp32 weights the edge nodes read,
  each initializer once, plus the peak of live activations. An activation
  produced on the edge (or a model input) counts as live from its producer to
  its last consumer in the optimized graph's topological order; the peak is
  the largest such sum at an edge node, and at least the cut tensors
  themselves. It ignores runtime workspace and arena rounding, and an int8
  edge segment needs about a quarter of the weight bytes.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from splitinfer.partitioner.analysis import GraphAnalysis, TensorInfo
from splitinfer.partitioner.cuts import CutPlan, CutSpace, fp32_bytes
from splitinfer.partitioner.flops import all_flops
from splitinfer.shared.codecs import Codec, calibrate_params
from splitinfer.shared.costs import CutCost, latency_table
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.links import Link

#: int8 + zstd on the zoo's cut activations compresses fp32 about 6x (bench_codecs);
#: 4 is the conservative default until it is measured on calibration data.
DEFAULT_CODEC_RATIO = 4.0
#: fp32 input bits per second of int8+zstd encode / decode on one x86 core, marginal.
DEFAULT_ENCODE_BPS = 2e9
DEFAULT_DECODE_BPS = 4e9
#: Cuts costed at a time (the membership matrices are cuts x nodes).
CHUNK_CUTS = 512

F64 = npt.NDArray[np.float64]
Array = npt.NDArray[Any]


@dataclass(frozen=True)
class WireModel:
    """What sending one tensor costs, as :func:`cut_costs` prices it.

    Float tensors go through the codec: fp32 bytes / their ratio on the wire
    (``ratios`` by tensor name, else ``default_ratio``), fp32 bits over the
    codec's throughput plus a fixed cost per call to encode and decode. Other
    dtypes (token ids, masks) travel raw and cost no codec time.
    """

    ratios: Mapping[str, float] = field(default_factory=dict)
    encode_bps: float = DEFAULT_ENCODE_BPS
    decode_bps: float = DEFAULT_DECODE_BPS
    encode_call_s: float = 0.0
    decode_call_s: float = 0.0
    default_ratio: float = DEFAULT_CODEC_RATIO

    def of(self, info: TensorInfo) -> tuple[float, float, float]:
        """(wire bytes, encode seconds, decode seconds) of one sample of ``info``."""
        if np.dtype(info.dtype).kind != "f":
            return float(info.bytes_per_sample), 0.0, 0.0
        raw = fp32_bytes(info)
        bits = raw * 8
        return (
            raw / self.ratios.get(info.name, self.default_ratio),
            bits / self.encode_bps + self.encode_call_s,
            bits / self.decode_bps + self.decode_call_s,
        )


class CodecEstimate(NamedTuple):
    """A codec measured on real activations.

    ``ratio``: fp32 bytes / encoded bytes. ``encode_bps``/``decode_bps``: fp32 bits
    per second, marginal (the fixed cost per call removed). ``*_call_s``: the
    fixed seconds per tensor encoded or decoded.
    """

    ratio: float
    encode_bps: float
    decode_bps: float
    encode_call_s: float = 0.0
    decode_call_s: float = 0.0


def cut_costs(
    space_or_plans: CutSpace | Sequence[CutPlan],
    analysis: GraphAnalysis,
    edge_times: Mapping[str, float],
    cloud_times: Mapping[str, float],
    codec_ratio: float | Mapping[str, float] = DEFAULT_CODEC_RATIO,
    encode_bps: float = DEFAULT_ENCODE_BPS,
    decode_bps: float = DEFAULT_DECODE_BPS,
    *,
    encode_call_s: float = 0.0,
    decode_call_s: float = 0.0,
    run_overhead_s: float = 0.0,
    cloud_times_by_batch: Mapping[int, Mapping[str, float]] | None = None,
    accuracy_drop: Mapping[str, float | None] | None = None,
) -> list[CutCost]:
    """The cost of every plan, in the order given.

    ``codec_ratio`` is one ratio for every float cut tensor, or a mapping from
    tensor name to its measured ratio (tensors not in it use
    :data:`DEFAULT_CODEC_RATIO`): cuts share their tensors, so a graph with
    thousands of cuts has only as many ratios to measure as tensors.
    ``accuracy_drop`` maps cut ids to their measured drop (absent: unknown).
    """
    plans = list(space_or_plans.plans() if isinstance(space_or_plans, CutSpace) else space_or_plans)
    flops = space_or_plans.flops if isinstance(space_or_plans, CutSpace) else all_flops(analysis)
    for name, value in (("encode_bps", encode_bps), ("decode_bps", decode_bps)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name}={value!r} must be a throughput > 0 bits/s")
    for name, value in (
        ("encode_call_s", encode_call_s),
        ("decode_call_s", decode_call_s),
        ("run_overhead_s", run_overhead_s),
    ):
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{name}={value!r} must be seconds >= 0")
    names = [node.name for node in analysis.nodes]
    n = len(names)
    edge_t = times_vector(edge_times, names, flops, "edge")
    cloud_t = times_vector(cloud_times, names, flops, "cloud")
    batch_t = [
        (int(batch), times_vector(times, names, flops, f"cloud batch {batch}"))
        for batch, times in sorted((cloud_times_by_batch or {}).items())
    ]
    memory_of = _EdgeMemory(analysis)
    edge_parts, cloud_parts, memory_parts = [], [], []
    batch_parts: list[list[F64]] = [[] for _ in batch_t]
    for start in range(0, len(plans), CHUNK_CUTS):  # bounded memory for many cuts
        part = plans[start : start + CHUNK_CUTS]
        edge_m = _membership([p.edge_nodes for p in part], n)
        cloud_m = _membership([p.cloud_nodes for p in part], n)
        cloud_runs = run_overhead_s * cloud_m.any(axis=1)
        edge_parts.append(edge_m @ edge_t + run_overhead_s * edge_m.any(axis=1))
        cloud_parts.append(cloud_m @ cloud_t + cloud_runs)
        for k, (_, vec) in enumerate(batch_t):
            batch_parts[k].append(cloud_m @ vec + cloud_runs)
        memory_parts.append(memory_of(part, edge_m))
    edge_s, cloud_s, memory = (_joined(x) for x in (edge_parts, cloud_parts, memory_parts))
    batch_s = [(b, _joined(batch_parts[k])) for k, (b, _) in enumerate(batch_t)]
    ratios = codec_ratio if isinstance(codec_ratio, Mapping) else {}
    default_ratio = DEFAULT_CODEC_RATIO if isinstance(codec_ratio, Mapping) else codec_ratio
    for r in [default_ratio, *ratios.values()]:
        if not (math.isfinite(r) and r > 0):
            raise ConfigError(f"codec ratio {r!r} must be > 0 (fp32 bytes / wire bytes)")
    wire_cache: dict[str, tuple[float, int, int]] = {}

    def wire(name: str) -> tuple[float, int, int]:
        """(wire bytes, fp32 bytes through the codec, codec calls) of one tensor."""
        if name not in wire_cache:
            info = analysis.tensors[name]
            if np.dtype(info.dtype).kind == "f":
                raw = fp32_bytes(info)
                wire_cache[name] = (raw / ratios.get(name, default_ratio), raw, 1)
            else:
                wire_cache[name] = (float(info.bytes_per_sample), 0, 0)
        return wire_cache[name]

    down_bytes = sum(analysis.tensors[o].bytes_per_sample for o in analysis.outputs)
    drops = accuracy_drop or {}
    out: list[CutCost] = []
    for i, plan in enumerate(plans):
        kind = plan.kind
        if kind == "all":
            up, coded, calls, down = 0, 0, 0, 0
        else:
            parts = [wire(t) for t in plan.crossing]
            up = math.ceil(sum(p[0] for p in parts))
            coded = sum(p[1] for p in parts)
            calls = sum(p[2] for p in parts)
            down = down_bytes
        out.append(
            CutCost(
                cut_id=plan.id,
                kind=kind,
                edge_s=float(edge_s[i]),
                encode_s=coded * 8 / encode_bps + calls * encode_call_s,
                up_bytes=up,
                cloud_s=float(cloud_s[i]),
                decode_s=coded * 8 / decode_bps + calls * decode_call_s,
                down_bytes=down,
                edge_memory_bytes=int(memory[i]),
                edge_flops=plan.edge_flops,
                cloud_flops=plan.cloud_flops,
                accuracy_drop=drops.get(plan.id),
                cloud_batch_s=tuple((b, float(v[i])) for b, v in batch_s),
            )
        )
    return out


def times_vector(
    times: Mapping[str, float], names: list[str], flops: Sequence[int], side: str
) -> F64:
    """Seconds per node in analysis order. A node with FLOPs must have a time; shape
    arithmetic (zero FLOPs) that the runtime folded away may be missing (0 s)."""
    vec = np.zeros(len(names))
    if names and not any(name in times for name in names):
        raise ConfigError(f"{side} times name none of the graph's {len(names)} nodes")
    for i, name in enumerate(names):
        t = times.get(name)
        if t is None:
            if flops[i] > 0:
                raise ConfigError(
                    f"{side} times have no entry for node {name!r}; per-node times must "
                    "come from the same optimized graph"
                )
            continue
        if not (math.isfinite(t) and t >= 0):
            raise ConfigError(f"{side} time of node {name!r} is {t!r}; expected seconds >= 0")
        vec[i] = t
    return vec


def _membership(rows: Sequence[tuple[int, ...]], n: int) -> F64:
    """A cuts x nodes 0/1 matrix from per-cut node index lists."""
    m = np.zeros((len(rows), n))
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    total = int(lengths.sum())
    if total:
        cols = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)
        m[np.repeat(np.arange(len(rows)), lengths), cols] = 1.0
    return m


def _joined(parts: list[F64]) -> F64:
    return np.concatenate(parts) if parts else np.zeros(0)


class _EdgeMemory:
    """Weights read by the edge nodes plus the peak of live edge activations (bytes)."""

    def __init__(self, analysis: GraphAnalysis) -> None:
        n = len(analysis.nodes)
        tensors = analysis.tensors
        inits = [name for name, t in tensors.items() if t.is_initializer]
        init_col = {name: j for j, name in enumerate(inits)}
        self.init_bytes = np.array([_fp32_full_bytes(tensors[k]) for k in inits], dtype=np.float64)
        self.uses = np.zeros((n, len(inits)))
        for i, names in enumerate(analysis.node_inputs):
            for name in names:
                if name in init_col:
                    self.uses[i, init_col[name]] = 1.0
        outputs = set(analysis.outputs)
        acts = [
            t
            for t in tensors.values()
            if not t.is_initializer and (t.consumers or t.is_input or t.name in outputs)
        ]
        self.live = np.zeros((len(acts), n), dtype=np.float32)
        self.producers = np.array(
            [-1 if t.producer is None else t.producer for t in acts], dtype=np.int64
        )
        for k, t in enumerate(acts):
            start = -1 if t.producer is None else t.producer
            end = n - 1 if t.name in outputs else max(t.consumers, default=start)
            self.live[k, max(start, 0) : end + 1] = _act_bytes(t)
        self.act_bytes = {t.name: _act_bytes(t) for t in acts}
        self.n = n

    def __call__(self, plans: Sequence[CutPlan], edge_m: F64) -> F64:
        if self.init_bytes.size:
            weights = ((edge_m @ self.uses) > 0) @ self.init_bytes
        else:
            weights = np.zeros(len(plans))
        edge32 = edge_m.astype(np.float32)
        produced_on = np.where(
            self.producers[None, :] < 0, np.float32(1), edge32[:, self.producers]
        )
        at_step = (produced_on @ self.live) * edge32  # float32: an estimate, ~1e-7 relative
        peak = at_step.max(axis=1) if self.n else np.zeros(len(plans))
        crossing = np.array(
            [sum(self.act_bytes[c] for c in p.crossing) for p in plans], dtype=np.float64
        )
        out: F64 = weights + np.maximum(peak, crossing)
        return out


def _act_bytes(info: TensorInfo) -> float:
    return float(fp32_bytes(info))


def _fp32_full_bytes(info: TensorInfo) -> float:
    numel = math.prod(info.sample_shape)
    kind = np.dtype(info.dtype).kind
    return float(numel * (4 if kind == "f" else np.dtype(info.dtype).itemsize))


# -- codec measurement ----------------------------------------------------------------


def quant_axis(ndim: int) -> int | None:
    """The per-channel axis of a batched activation: channels of NCHW (axis 1), the
    last axis of [batch, features] and [batch, seq, hidden]; per tensor for rank 1."""
    if ndim <= 1:
        return None
    return 1 if ndim >= 4 else ndim - 1


def estimate_codec(
    samples_by_tensor: Mapping[str, Array],
    codec: Codec,
    *,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> CodecEstimate:
    """Measure ``codec`` on real activations, one sample per call as the edge sends.

    Each array holds several samples along axis 0. Float tensors are calibrated
    per channel on all their samples (if the codec needs parameters) and then
    encoded and decoded one sample at a time; other dtypes travel raw and are
    left out. The fixed cost per call is measured on a one-element tensor and
    removed from the throughput. Times are the median of ``repeats`` passes.
    """
    floats = {
        name: np.ascontiguousarray(a)
        for name, a in samples_by_tensor.items()
        if np.asarray(a).dtype.kind == "f" and str(np.asarray(a).dtype) in codec.dtypes
    }
    if not floats:
        raise ConfigError("estimate_codec needs at least one float activation tensor")
    if repeats < 1:
        raise ConfigError(f"repeats={repeats!r} must be >= 1")
    jobs: list[tuple[Array, Any]] = []
    for a in floats.values():
        if a.ndim < 1 or a.shape[0] < 1 or not np.isfinite(a).all():
            raise ConfigError("activation samples must be finite with a leading sample axis")
        params = calibrate_params(a, axis=quant_axis(a.ndim)) if codec.needs_params else None
        jobs.extend((a[i : i + 1], params) for i in range(a.shape[0]))
    raw = sum(x.size * 4 for x, _ in jobs)
    encoded = [codec.encode(x, p) for x, p in jobs]
    wire = sum(len(e) for e in encoded)
    limit = 8 * max(x.nbytes for x, _ in jobs) + 4096

    def encode_all() -> None:
        for x, p in jobs:
            codec.encode(x, p)

    def decode_all() -> None:
        for (x, p), e in zip(jobs, encoded, strict=True):
            codec.decode(e, str(x.dtype), tuple(x.shape), p, limit)

    tiny = np.ones((1, 1), dtype=np.float32)
    tiny_p = calibrate_params(tiny, axis=None) if codec.needs_params else None
    tiny_e = codec.encode(tiny, tiny_p)
    calls = 64

    def encode_tiny() -> None:
        for _ in range(calls):
            codec.encode(tiny, tiny_p)

    def decode_tiny() -> None:
        for _ in range(calls):
            codec.decode(tiny_e, "float32", (1, 1), tiny_p, 4096)

    enc_call = _median_seconds(encode_tiny, repeats, clock) / calls
    dec_call = _median_seconds(decode_tiny, repeats, clock) / calls
    enc = _median_seconds(encode_all, repeats, clock)
    dec = _median_seconds(decode_all, repeats, clock)
    enc_marginal = max(enc - len(jobs) * enc_call, enc * 0.05)
    dec_marginal = max(dec - len(jobs) * dec_call, dec * 0.05)
    return CodecEstimate(
        ratio=raw / max(wire, 1),
        encode_bps=raw * 8 / enc_marginal,
        decode_bps=raw * 8 / dec_marginal,
        encode_call_s=enc_call,
        decode_call_s=dec_call,
    )


def tensor_ratios(
    samples_by_tensor: Mapping[str, Array],
    codec: Codec,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """The codec's compression ratio per float tensor, for ``cut_costs(codec_ratio=...)``;
    ``progress(done, total)`` after each tensor."""
    out: dict[str, float] = {}
    total = len(samples_by_tensor)
    for done, (name, a) in enumerate(samples_by_tensor.items(), 1):
        if progress is not None:
            progress(done, total)
        arr = np.ascontiguousarray(a)
        if arr.dtype.kind != "f":
            continue
        params = calibrate_params(arr, axis=quant_axis(arr.ndim)) if codec.needs_params else None
        wire = sum(len(codec.encode(arr[i : i + 1], params)) for i in range(arr.shape[0]))
        out[name] = arr.size * 4 / max(wire, 1)
    return out


def _median_seconds(fn: Callable[[], None], repeats: int, clock: Callable[[], float]) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return max(statistics.median(times), 1e-12)


# -- the table for the manifest and the CLI -----------------------------------------


def candidate_table(
    costs: Sequence[CutCost], link: Link, chosen: str | None = None
) -> list[dict[str, Any]]:
    """One row per cut: milliseconds on each side, bytes, and which cut is chosen.

    ``edge_ms`` is edge compute + encode, ``cloud_ms`` decode + cloud compute,
    ``transfer_ms`` the expected network time (upload, round trip, download), so
    ``edge_ms + transfer_ms + cloud_ms == total_ms`` (expected over the link's
    distribution); ``p95_ms`` is the 95th percentile. ``chosen`` defaults to the
    latency-optimal cut.
    """
    if not costs:
        return []
    table = latency_table(costs, link)
    # the latency-optimal cut, as choose() breaks ties: lowest mean, then input order
    chosen_id = chosen if chosen is not None else costs[int(np.argmin(table[:, 0]))].cut_id
    rows: list[dict[str, Any]] = []
    for c, (mean, _p50, p95, _q) in zip(costs, table, strict=True):
        edge = (c.edge_s + c.encode_s) * 1e3
        cloud = (c.decode_s + c.cloud_s) * 1e3
        total = float(mean) * 1e3
        rows.append(
            {
                "cut": c.cut_id,
                "kind": c.kind,
                "edge_ms": edge,
                "encode_ms": c.encode_s * 1e3,
                "transfer_ms": max(total - edge - cloud, 0.0),
                "decode_ms": c.decode_s * 1e3,
                "cloud_ms": cloud,
                "total_ms": total,
                "p95_ms": float(p95) * 1e3,
                "up_bytes": c.up_bytes,
                "down_bytes": c.down_bytes,
                "edge_memory_bytes": c.edge_memory_bytes,
                "chosen": c.cut_id == chosen_id,
            }
        )
    return rows
