"""bench_cloud's set-up: its frozen settings, the model and its package, the request
frames, and the bare ONNX Runtime session that gives the ceiling and the floor."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from harness import LoadConfig

TESTS = Path(__file__).resolve().parent.parent / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

MODEL = "vgg"


@dataclass(frozen=True)
class Settings:
    """One run of bench_cloud, from its flags; every system is measured under it."""

    load: LoadConfig = field(default_factory=LoadConfig)
    spinning: bool = False  # ONNX Runtime threads spin while idle (every system alike)
    service_args: tuple[str, ...] = ()  # more cloud-service flags (tuning experiments)
    max_batch: int = 32
    delay_ms: float = 2.0

    def service_argv(self, repo: Path, batching: bool) -> list[str]:
        """``cloud-service`` serving ``repo`` on a free port, with dynamic batching or not."""
        from splitinfer.sim.daemon import command

        return [
            *command("cloud-service"),
            "--repository",
            str(repo),
            "--listen",
            "127.0.0.1:0",
            "--no-auth",
            "--accept-raw",  # frames_for() sends the cut tensor raw
            "--log-level",
            "warning",
            "--max-batch-size",
            str(self.max_batch),
            "--max-queue-delay",
            f"{self.delay_ms}ms",
            "--max-queue-size",
            "4096",
            "--batching" if batching else "--no-batching",
            *self.service_args,
            *(["--spin"] if self.spinning else []),
        ]


# -- the model ------------------------------------------------------------------------


def vgg(size: int, widths: tuple[int, ...]) -> Any:
    """A VGG-style CNN: conv-relu pairs of ``widths`` on 3 x size x size, pools between."""
    from graphs import f32, make, rand
    from onnx import helper

    nodes, inits, prev, cin = [], {}, "x", 3
    for stage, width in enumerate(widths):
        for k in range(2):
            i = 2 * stage + k
            inits[f"w{i}"] = rand(width, cin, 3, 3, seed=i) * float(1.0 / np.sqrt(cin * 9))
            inits[f"b{i}"] = rand(width, seed=100 + i) * 0.1
            nodes.append(
                helper.make_node("Conv", [prev, f"w{i}", f"b{i}"], [f"c{i}"], pads=[1, 1, 1, 1])
            )
            nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
            prev, cin = f"r{i}", width
        if stage < len(widths) - 1:
            nodes.append(
                helper.make_node(
                    "MaxPool", [prev], [f"p{stage}"], kernel_shape=[2, 2], strides=[2, 2]
                )
            )
            prev = f"p{stage}"
    nodes += [
        helper.make_node("GlobalAveragePool", [prev], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], transB=1),
    ]
    inits["wf"], inits["bf"] = rand(10, cin, seed=999), rand(10, seed=998)
    return make(nodes, [f32("x", ["N", 3, size, size])], [f32("y", ["N", 10])], inits)


def build_repo(root: Path, size: int, widths: tuple[int, ...]) -> tuple[Path, Any]:
    """Write the package to ``root/repo/vgg/1``; return the cloud segment and the manifest."""
    import onnx

    from splitinfer.partitioner.pipeline import prepare, write_package

    src = root / f"{MODEL}.onnx"
    onnx.save(vgg(size, widths), str(src))
    prepared = prepare(src)
    plan = next(p for p in prepared.space.plans() if p.crossing == ("p0",))
    manifest = write_package(prepared, plan, root / "repo" / MODEL / "1")
    cut = manifest.cut
    return root / "repo" / MODEL / "1" / cut.cloud.file, manifest


def sample_shape(manifest: Any) -> tuple[int, ...]:
    """The cut tensor's per-sample shape."""
    (spec,) = manifest.cut.tensors
    return tuple(int(d) for d in spec.shape[1:])


def sample_arrays(manifest: Any, n: int, seed: int = 0) -> list[Any]:
    """``n`` random float32 cut tensors of batch 1."""
    shape = (1, *sample_shape(manifest))
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


def frames_for(manifest: Any, arrays: Any) -> list[bytes]:
    """One raw request frame per array (each a batch of 1 of the cut tensor)."""
    from splitinfer.shared.codecs import RAW
    from splitinfer.shared.frame import Request, WireTensor, encode_request

    (spec,) = manifest.cut.tensors
    return [
        encode_request(
            Request(f"r{i}", MODEL, "", manifest.cut.id, (WireTensor(spec.name, a, RAW),))
        )
        for i, a in enumerate(arrays)
    ]


# -- the ceiling ------------------------------------------------------------------------


def session(path: Path, spinning: bool) -> Any:
    """A CPU session with the service's own session options, for the ceiling and the peer."""
    from splitinfer.cloud.config import RuntimeConfig
    from splitinfer.cloud.runtime import session_options
    from splitinfer.shared.ortsession import open_session

    return open_session(path, options=session_options(RuntimeConfig(spin=spinning)))


class Bare:
    """One ONNX Runtime session of the segment in this process: the ceiling and the floor."""

    def __init__(self, path: Path, sample: tuple[int, ...], spinning: bool) -> None:
        self.sess = session(path, spinning)
        self.name = self.sess.get_inputs()[0].name
        self.sample = sample
        self.best = 1
        #: CPU seconds (all threads) per sample at each batch size, last measured
        self.cpu_per_sample: dict[int, float] = {}
        #: CPU ms per sample at the ceiling's batch size, last measured (:meth:`now`)
        self.ceiling_cpu_ms = float("nan")

    def measure(self, batch: int, seconds: float) -> tuple[float, float]:
        """(samples/s, p50 seconds) of back-to-back runs at ``batch``."""
        x = np.random.default_rng(batch).standard_normal((batch, *self.sample))
        feeds = {self.name: x.astype(np.float32)}
        self.sess.run(None, feeds)
        times: list[float] = []
        end = time.perf_counter() + seconds
        cpu0 = time.process_time()
        while time.perf_counter() < end or len(times) < 3:
            t0 = time.perf_counter()
            self.sess.run(None, feeds)
            times.append(time.perf_counter() - t0)
        self.cpu_per_sample[batch] = (time.process_time() - cpu0) / (batch * len(times))
        return batch * len(times) / sum(times), statistics.median(times)

    def sweep(self, seconds: float) -> dict[int, tuple[float, float]]:
        table = {b: self.measure(b, seconds) for b in (1, 2, 4, 8, 16, 32, 64)}
        self.best = max(table, key=lambda b: table[b][0])
        return table

    def now(self, seconds: float = 0.4) -> tuple[float, float]:
        """The ceiling and the batch-1 p50 (ms) right now (the machine may be shared).

        The best of batch 1, the sweep's best and 32: a sweep on a busy machine
        can crown the wrong size.
        """
        rates = {b: self.measure(b, seconds) for b in sorted({1, self.best, 32})}
        top = max(rates, key=lambda b: rates[b][0])
        self.ceiling_cpu_ms = 1000 * self.cpu_per_sample[top]
        return rates[top][0], 1000 * rates[1][1]

    def around(self, before: tuple[float, float]) -> tuple[float, float]:
        """Mean of a measurement taken before a level and one taken now, after it."""
        after = self.now()
        return (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
