"""Closed-loop load on the cloud service: throughput, latency and batch size vs concurrency.

    python bench/bench_cloud.py [--quick] [--seconds 3] [--levels 1,2,4,8,16,32,64]
                                [--size 48] [--spinning] [--no-peer] [--json out.json]
                                [--client auto|wrk|aiohttp]

The model is a VGG-style CNN built with onnx.helper (conv-relu pairs of
widths 32, 64, 128 on a 3x48x48 input, max pools between them); the package
is cut after the first pool and the service serves the cloud segment (a
32x24x24 float activation in, 10 logits out). Every system below serves that
same ONNX segment with ONNX Runtime on the CPU and the same session options
(the service's: default intra-op threads, idle threads not spinning unless
``--spinning``).

- ``bare``: one ONNX Runtime session in this process, batch sizes 1..64; its
  best samples/s is the **ceiling**, its batch-1 p50 the latency floor. The
  machine may be shared, so both are re-measured (batch 1, 32 and the sweep's
  best) just before and just after every level and averaged; each row is
  compared with its own ceiling.
- ``batching``: ``cloud-service`` (a subprocess, --no-auth) with dynamic
  batching (max_batch_size 32, max_queue_delay 2 ms, one batch at a time).
- ``no-batch``: the same service with ``--no-batching``.
- ``overhead`` (c=32 only): the batching service on a near-zero segment (the same
  CNN with 2 channels on 8x8): what the service itself costs per request through
  HTTP, the figure to watch when working on its overhead.
- ``http-echo`` (c=1 only): an aiohttp server that reads the frame and answers
  a canned one: the transport's own share of the c=1 latency.
- ``litserve``: LitServe (``LitAPI(max_batch_size=32, batch_timeout=0.002)``,
  one CPU worker) serving the segment; requests carry the activation as
  base64 in JSON (LitServe takes JSON or forms), answers are JSON.

The load generator is a closed loop: each of ``c`` clients (one connection
each) sends a request, waits for its answer and sends the next. It is wrk
(``bench/wrk_closed_loop.lua``, one thread) when wrk is on PATH (``apt install
wrk``), else aiohttp's client in this process (``--client`` chooses). Either
shares the CPUs with the servers; wrk takes about 0.05 ms of CPU per request,
the aiohttp client about 0.25 ms, which on 2 CPUs is CPU the servers lose.
Columns: req/s over the measured window; p50 and p99 of the client-side
latency; ``batch``: mean samples per executed batch (from the service's
/metrics, from LitServe's predict calls); ``ceiling`` and ``%ceil``: the ceiling
around that level, and req/s over it; ``load``: the machine's 1-minute load
average after the level (2 CPUs: above 2 means other work competed for them,
and every figure of that row is suspect); ``srv cpu`` and ``gen cpu``: CPU ms
per request of the server's processes (all threads, ONNX Runtime's included)
and of the load generator. The verdicts add a CPU budget line: at 80% of the
ceiling, what the CPUs leave per request beside ONNX Runtime's own share, and
what the service and the load generator took; and under the p99 verdict, the
mean latency Little's law gives 32 closed-loop clients (32 / req/s) at the
measured rate, at 80% of the ceiling and at the ceiling: no p99 is below it.

Targets (issue 5): at concurrency 32 the batching service reaches >= 80% of the
ceiling, with p99 <= max_queue_delay + 2 x its mean batch compute time; it is at
least as fast as the peer at equal or lower p99; its p50 at concurrency 1 is
less than 1 ms above a bare session's batch-1 p50.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.shared.frame import FRAME_TYPE

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

MODEL = "vgg"
MAX_BATCH = 32
DELAY_MS = 2.0
TARGET_CEILING = 0.80
TARGET_OVERHEAD_MS = 1.0


@dataclass
class Row:
    system: str
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    batch: float
    requests: int
    errors: int
    compute_ms: float = 0.0  # mean batch compute (service only)
    ceiling: float = 0.0  # the bare session's best samples/s, measured around this level
    bare_p50_ms: float = 0.0  # the bare session's batch-1 p50, measured around this level
    loadavg: float = 0.0  # the machine's 1-minute load average after this level
    server_cpu_ms: float = float("nan")  # CPU per request of the server's processes
    client_cpu_ms: float = float("nan")  # CPU per request of the load generator
    ceiling_cpu_ms: float = float("nan")  # the bare session's CPU per sample at the ceiling


# -- the model ------------------------------------------------------------------------


def vgg(size: int, widths: tuple[int, ...]) -> Any:
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
    """Write the package to ``root/repo/vgg/1``; return the cloud segment and the cut."""
    import onnx

    from splitinfer.partitioner.pipeline import prepare, write_package

    src = root / f"{MODEL}.onnx"
    onnx.save(vgg(size, widths), str(src))
    prepared = prepare(src)
    plan = next(p for p in prepared.space.plans() if p.crossing == ("p0",))
    manifest = write_package(prepared, plan, root / "repo" / MODEL / "1")
    cut = manifest.cut
    return root / "repo" / MODEL / "1" / cut.cloud.file, manifest


SPINNING = [False]  # --spinning: ONNX Runtime threads spin while idle (everywhere alike)
SERVICE_ARGS: list[str] = []  # --service-arg: more cloud-service flags (tuning experiments)


def session(path: Path) -> Any:
    """A CPU session with the service's own session options, for the ceiling and the peer."""

    from splitinfer.cloud.config import RuntimeConfig
    from splitinfer.cloud.runtime import session_options
    from splitinfer.shared.ortsession import open_session

    opts = session_options(RuntimeConfig(spinning=SPINNING[0]))
    return open_session(path, options=opts)


class Bare:
    """One ONNX Runtime session of the segment in this process: the ceiling and the floor."""

    def __init__(self, path: Path, sample: tuple[int, ...]) -> None:
        self.sess = session(path)
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


# -- servers ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def process(cmd: list[str], ready: str, timeout: float = 120) -> Iterator[subprocess.Popen[str]]:
    """Start ``cmd`` in its own process group; wait until ``ready`` answers 200; stop it."""
    import urllib.request

    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        end = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited: {proc.stderr.read() if proc.stderr else ''}")
            try:
                with urllib.request.urlopen(ready, timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"{cmd[0]} did not become ready")
            time.sleep(0.2)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def service_cmd(repo: Path, port: int, batching: bool) -> list[str]:
    exe = Path(sys.executable).with_name("cloud-service")
    return [
        str(exe),
        "--repository",
        str(repo),
        "--listen",
        f"127.0.0.1:{port}",
        "--no-auth",
        "--accept-raw",  # frames_for() sends the cut tensor raw
        "--log-level",
        "warning",
        "--max-batch-size",
        str(MAX_BATCH),
        "--max-queue-delay-ms",
        str(DELAY_MS),
        "--max-queue-size",
        "4096",
        "--batching" if batching else "--no-batching",
        *SERVICE_ARGS,
    ] + (["--spinning"] if SPINNING[0] else [])


try:  # the peer; LitServe starts its worker with spawn, so its API class lives at top level
    import litserve as _ls
except ImportError:  # pragma: no cover - the peer is optional
    _ls = None

if _ls is not None:

    class OrtAPI(_ls.LitAPI):  # type: ignore[misc]
        """The same ONNX segment behind LitServe's own batching."""

        def __init__(self, segment: str, batch_log: str, **kw: Any) -> None:
            super().__init__(**kw)
            self.segment, self.batch_log = segment, batch_log

        def setup(self, device: str) -> None:
            self.sess = session(Path(self.segment))
            self.input = self.sess.get_inputs()[0]
            self.shape = tuple(self.input.shape[1:])
            self.log = open(self.batch_log, "a", buffering=1)  # noqa: SIM115

        def decode_request(self, request: dict[str, str]) -> np.ndarray:
            raw = base64.b64decode(request["x"])
            return np.frombuffer(raw, np.float32).reshape(self.shape)

        def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
            return np.stack(inputs)

        def predict(self, x: np.ndarray) -> np.ndarray:
            self.log.write(f"{len(x)}\n")
            return self.sess.run(None, {self.input.name: x})[0]  # type: ignore[no-any-return]

        def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
            return list(output)

        def encode_response(self, output: np.ndarray) -> dict[str, list[float]]:
            return {"y": output.tolist()}


def serve_echo(port: int) -> None:
    """The transport floor: aiohttp reading the body and answering a canned frame."""
    from aiohttp import web

    from splitinfer.shared.frame import Response, WireTensor, encode_response

    answer = encode_response(Response("r", tensors=(WireTensor("y", np.zeros((1, 10), "f4")),)))

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type=FRAME_TYPE)

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=2**26)
    app.router.add_post("/echo", handler)
    app.router.add_get("/readyz", ready)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def serve_litserve(segment: Path, port: int, batch_log: Path) -> None:
    """The peer: LitServe, one CPU worker, max_batch_size 32, batch_timeout 2 ms."""
    assert _ls is not None
    api = OrtAPI(
        str(segment), str(batch_log), max_batch_size=MAX_BATCH, batch_timeout=DELAY_MS / 1000
    )
    server = _ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=60)
    server.run(
        host="127.0.0.1",
        port=port,
        generate_client_file=False,
        log_level="warning",
        num_api_servers=1,
    )


# -- load -------------------------------------------------------------------------------


@dataclass
class Load:
    """What one closed-loop run measured."""

    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    client_cpu_s: float  # the load generator's CPU time over the measured window


CEILING_CPU_MS = [float("nan")]  # the last level's bare CPU per sample (for row())
CLIENT = ["aiohttp"]  # --client: the load generator (wrk when it is installed)
WRK_SCRIPT = Path(__file__).resolve().parent / "wrk_closed_loop.lua"


def closed_loop(
    url: str, bodies: list[bytes], content_type: str, concurrency: int, seconds: float
) -> Load:
    """``concurrency`` clients, each sending its next request when its answer is in."""
    if CLIENT[0] == "wrk":
        return wrk_loop(url, bodies, content_type, concurrency, seconds)
    return asyncio.run(aiohttp_loop(url, bodies, content_type, concurrency, seconds))


def wrk_loop(
    url: str, bodies: list[bytes], content_type: str, concurrency: int, seconds: float
) -> Load:
    """wrk (C, one thread): a load generator that costs its host a few µs per request."""
    with tempfile.TemporaryDirectory(prefix="bench-wrk-") as tmp:
        files = []
        for i, body in enumerate(bodies):
            files.append(Path(tmp) / f"{i}.body")
            files[-1].write_bytes(body)
        cmd = ["wrk", "-t1", f"-c{concurrency}", "-s", str(WRK_SCRIPT)]
        args = [url, "--", content_type, *map(str, files)]
        warm = max(1, round(min(1.0, seconds / 2)))
        subprocess.run([*cmd, f"-d{warm}s", *args], capture_output=True, check=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run(
            [*cmd, f"-d{max(1, round(seconds))}s", "--timeout", "30s", *args],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((ln for ln in out.splitlines() if ln.startswith("WRK-RESULT ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result: {out[-500:]}")
    r = json.loads(line.split(" ", 1)[1])
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return Load(
        r["requests"] / (r["duration_us"] / 1e6),
        r["p50_us"] / 1000,
        r["p99_us"] / 1000,
        r["requests"],
        r["socket_errors"] + r["non_2xx"],
        cpu,
    )


async def aiohttp_loop(
    url: str, bodies: list[bytes], content_type: str, concurrency: int, seconds: float
) -> Load:
    """The same closed loop in this process with aiohttp's client (when wrk is absent)."""
    import aiohttp

    latencies: list[float] = []
    errors = 0
    measuring = False
    stop = False
    headers = {"Content-Type": content_type}
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as http:

        async def client(i: int) -> None:
            nonlocal errors
            n = i
            while not stop:
                body = bodies[n % len(bodies)]
                n += concurrency
                t0 = time.perf_counter()
                async with http.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    ok = resp.status == 200
                if measuring:
                    if ok:
                        latencies.append(time.perf_counter() - t0)
                    else:
                        errors += 1

        tasks = [asyncio.create_task(client(i)) for i in range(concurrency)]
        await asyncio.sleep(min(1.0, seconds / 2))  # warm-up: fill the pipeline
        measuring = True
        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.sleep(seconds)
        measuring = False
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        stop = True
        await asyncio.gather(*tasks)
    return Load(
        len(latencies) / elapsed,
        pct(latencies, 50),
        pct(latencies, 99),
        len(latencies),
        errors,
        cpu,
    )


def group_cpu(pgid: int) -> float:
    """CPU seconds used so far by the live processes of process group ``pgid`` (Linux)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q)) * 1000.0


def scrape(base: str) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    wanted = {
        "splitinfer_inferences_total": "inferences",
        "splitinfer_executions_total": "executions",
        "splitinfer_compute_seconds_sum": "compute_sum",
        "splitinfer_compute_seconds_count": "compute_count",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted and s.labels.get("model") == MODEL:
                out[wanted[s.name]] += s.value
    return out


def run_service(
    system: str, repo: Path, frames: list[bytes], levels: list[int], seconds: float, bare: Bare
) -> list[Row]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    rows = []
    batching = system != "no-batch"
    with process(service_cmd(repo, port, batching), f"{base}/readyz") as proc:
        for c in levels:
            probe = bare.now()
            before, cpu0 = scrape(base), group_cpu(proc.pid)
            load = closed_loop(f"{base}/v1/models/{MODEL}/infer", frames, FRAME_TYPE, c, seconds)
            after, cpu = scrape(base), group_cpu(proc.pid) - cpu0
            ceiling, floor = bare.around(probe)
            CEILING_CPU_MS[0] = bare.ceiling_cpu_ms
            if system == "overhead":  # another segment: the CNN's ceiling does not apply
                ceiling = float("nan")
            d = {k: after[k] - before[k] for k in after}
            batch = d["inferences"] / d["executions"] if d["executions"] else float("nan")
            compute = 1000 * d["compute_sum"] / d["compute_count"] if d["compute_count"] else 0.0
            rows.append(row(system, c, load, batch, compute, ceiling, floor, cpu, d["inferences"]))
            print_row(rows[-1])
    return rows


def row(
    system: str,
    c: int,
    load: Load,
    batch: float,
    compute_ms: float,
    ceiling: float,
    floor: float,
    server_cpu_s: float,
    served: float,
) -> Row:
    """One table row; CPU per request over everything the server answered meanwhile
    (warm-up included: the load generator's own CPU is per measured request)."""
    return Row(
        system,
        c,
        load.rps,
        load.p50_ms,
        load.p99_ms,
        batch,
        load.requests,
        load.errors,
        compute_ms,
        ceiling,
        floor,
        os.getloadavg()[0],
        1000 * server_cpu_s / served if served else float("nan"),
        1000 * load.client_cpu_s / load.requests if load.requests else float("nan"),
        CEILING_CPU_MS[0],
    )


def engine_cpu(repo: Path, frames: list[bytes], concurrency: int, seconds: float) -> float:
    """CPU µs per request of the engine alone: in this process, no sockets, every
    segment replaced by a stub answering zeros at once (so only the engine is left:
    routing, frame decode and encode, batching, thread hand-offs, metrics)."""
    from splitinfer.cloud.config import BatchingConfig, RuntimeConfig, ServiceConfig
    from splitinfer.cloud.engine import Engine
    from splitinfer.cloud.runtime import Runtime

    class Stub:
        def __init__(self, path: Path, config: RuntimeConfig) -> None:
            real = Runtime(path, config)
            self.inputs, self.outputs, self.providers = real.inputs, real.outputs, real.providers
            probe = {n: np.zeros((1, *SAMPLE[0]), np.float32) for n in real.inputs}
            self.rows = {k: v.shape[1:] for k, v in real.run(probe).items()}

        def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
            n = len(next(iter(feeds.values())))
            return {k: np.zeros((n, *shape), np.float32) for k, shape in self.rows.items()}

    async def drive() -> float:
        cfg = ServiceConfig(
            repository=str(repo),
            no_auth=True,
            accept_raw=True,  # frames_for() sends the cut tensor raw
            log_level="warning",
            batching=BatchingConfig(max_batch_size=MAX_BATCH, max_queue_delay_ms=DELAY_MS),
        )
        done = 0
        stop = False
        async with Engine(cfg, runtime_factory=Stub) as engine:  # type: ignore[arg-type]

            async def client(i: int) -> None:
                nonlocal done
                while not stop:
                    await engine.infer(MODEL, frames[i % len(frames)])
                    done += 1
                    i += concurrency

            tasks = [asyncio.create_task(client(i)) for i in range(concurrency)]
            await asyncio.sleep(min(1.0, seconds / 2))
            done, cpu0 = 0, time.process_time()
            await asyncio.sleep(seconds)
            cpu, count = time.process_time() - cpu0, done
            stop = True
            await asyncio.gather(*tasks)
        return 1e6 * cpu / max(1, count)

    return asyncio.run(drive())


SAMPLE: list[tuple[int, ...]] = []  # the cut tensor's per-sample shape (set in main)


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


def sample_arrays(manifest: Any, n: int, seed: int = 0) -> list[Any]:
    """``n`` random float32 cut tensors of batch 1."""
    (spec,) = manifest.cut.tensors
    shape = (1, *(int(d) for d in spec.shape[1:]))
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


def run_overhead(root: Path, seconds: float, bare: Bare) -> list[Row]:
    """The batching service at c=32 on a near-zero segment (2 channels, 8x8): what the
    service costs per request through HTTP when the model costs almost nothing.
    Its ceiling columns are the CNN's (they do not apply to this row)."""
    root.mkdir(parents=True, exist_ok=True)
    _, manifest = build_repo(root, 8, (2, 2))
    frames = frames_for(manifest, sample_arrays(manifest, 16, seed=1))
    return run_service("overhead", root / "repo", frames, [32], seconds, bare)


def run_echo(frames: list[bytes], seconds: float, bare: Bare) -> list[Row]:
    """The HTTP round trip alone at concurrency 1: what no service on aiohttp can beat."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with process([sys.executable, __file__, "--serve-echo", str(port)], f"{base}/readyz") as proc:
        probe = bare.now()
        cpu0 = group_cpu(proc.pid)
        load = closed_loop(f"{base}/echo", frames, FRAME_TYPE, 1, seconds)
        cpu = group_cpu(proc.pid) - cpu0
        ceiling, floor = bare.around(probe)
        CEILING_CPU_MS[0] = bare.ceiling_cpu_ms
        served = load.requests * (1 + min(1.0, seconds / 2) / seconds)  # with the warm-up
        r = row("http-echo", 1, load, float("nan"), 0.0, ceiling, floor, cpu, served)
        print_row(r)
    return [r]


def run_peer(
    segment: Path, bodies: list[bytes], levels: list[int], seconds: float, bare: Bare
) -> list[Row]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp()) / "batches.log"
    log.touch()
    cmd = [sys.executable, __file__, "--serve-litserve", str(segment), str(port), str(log)]
    cmd += ["--spinning"] if SPINNING[0] else []
    rows = []
    with process(cmd, f"{base}/health") as proc:
        for c in levels:
            probe = bare.now()
            seen = len(log.read_text().split())
            cpu0 = group_cpu(proc.pid)
            load = closed_loop(f"{base}/predict", bodies, "application/json", c, seconds)
            cpu = group_cpu(proc.pid) - cpu0
            sizes = [int(v) for v in log.read_text().split()[seen:]]
            ceiling, floor = bare.around(probe)
            CEILING_CPU_MS[0] = bare.ceiling_cpu_ms
            batch = statistics.mean(sizes) if sizes else float("nan")
            rows.append(row("litserve", c, load, batch, 0.0, ceiling, floor, cpu, sum(sizes)))
            print_row(rows[-1])
    return rows


# -- report ------------------------------------------------------------------------------

HEADER = (
    f"{'system':<10} {'conc':>5} {'req/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'batch':>7} "
    f"{'ceiling':>8} {'%ceil':>6} {'errors':>6} {'load':>5} {'srv cpu':>8} {'gen cpu':>8}"
)


def print_row(r: Row) -> None:
    print(
        f"{r.system:<10} {r.concurrency:>5} {r.rps:>9.1f} {r.p50_ms:>9.2f} {r.p99_ms:>9.2f} "
        f"{r.batch:>7.1f} {r.ceiling:>8.1f} {100 * r.rps / r.ceiling:>5.0f}% {r.errors:>6} "
        f"{r.loadavg:>5.1f} {r.server_cpu_ms:>8.3f} {r.client_cpu_ms:>8.3f}",
        flush=True,
    )


def budget(r: Row) -> str:
    """Where the CPU goes at the ceiling target: what is left beside ONNX Runtime's share."""
    ncpu = os.cpu_count() or 1
    rate = TARGET_CEILING * r.ceiling
    per_request = 1000 * ncpu / rate
    left = per_request - r.ceiling_cpu_ms
    return (
        f"c={r.concurrency}: CPU per request at {rate:.0f} req/s ({100 * TARGET_CEILING:.0f}% "
        f"of the ceiling) on {ncpu} CPUs: {per_request:.3f} ms, of which ONNX Runtime needs "
        f"{r.ceiling_cpu_ms:.3f} (bare, best batch), leaving {left:.3f} ms for the service "
        f"beyond it, the load generator and the kernel; measured: service "
        f"{r.server_cpu_ms - r.ceiling_cpu_ms:.3f} beyond it (its {r.server_cpu_ms:.3f} "
        f"minus the bare compute), load generator {r.client_cpu_ms:.3f} ({CLIENT[0]})"
    )


def little(r: Row, bound: float) -> str:
    """The p99 bound against Little's law: a closed loop of N clients with no think time
    has a mean latency of exactly N / throughput, so no p99 is below that."""
    n = r.concurrency
    floor = {
        "at the measured rate": 1000 * n / r.rps,
        f"at {100 * TARGET_CEILING:.0f}% of the ceiling": 1000 * n / (TARGET_CEILING * r.ceiling),
        "at the ceiling": 1000 * n / r.ceiling,
    }
    return (
        f"c={n}: by Little's law the mean latency of {n} closed-loop clients is {n} / req/s: "
        + ", ".join(f"{v:.1f} ms {k}" for k, v in floor.items())
        + f" (the p99 bound above: {bound:.1f} ms)"
    )


def verdicts(rows: list[Row]) -> list[tuple[str, bool | None]]:
    """PASS/FAIL lines; each compares against the bare session measured just before."""

    def at(system: str, c: int) -> Row | None:
        return next((r for r in rows if r.system == system and r.concurrency == c), None)

    out: list[tuple[str, bool | None]] = []
    b32, b1, peer = at("batching", 32), at("batching", 1), at("litserve", 32)
    off = at("no-batch", 32)
    if b32 is not None:
        share = b32.rps / b32.ceiling
        line = (
            f"c=32: {b32.rps:.1f} req/s = {100 * share:.0f}% of the ceiling "
            f"{b32.ceiling:.1f} (target >= {100 * TARGET_CEILING:.0f}%)"
        )
        if off is not None:
            line += f"; batching off: {off.rps:.1f} req/s = {100 * off.rps / off.ceiling:.0f}%"
        out.append((line, share >= TARGET_CEILING))
        out.append((budget(b32), None))
        bound = DELAY_MS + 2 * b32.compute_ms
        out.append(
            (
                f"c=32: p99 {b32.p99_ms:.1f} ms <= max_queue_delay + 2 x mean batch "
                f"compute = {DELAY_MS:g} + 2 x {b32.compute_ms:.1f} = {bound:.1f} ms",
                b32.p99_ms <= bound,
            )
        )
        out.append((little(b32, bound), None))
        if peer is not None:
            out.append(
                (
                    f"c=32: {b32.rps:.1f} req/s at p99 {b32.p99_ms:.1f} ms vs LitServe "
                    f"{peer.rps:.1f} req/s at p99 {peer.p99_ms:.1f} ms "
                    f"({b32.rps / peer.rps:.2f}x the throughput)",
                    b32.rps >= peer.rps and b32.p99_ms <= peer.p99_ms,
                )
            )
    echo, tiny = at("http-echo", 1), at("overhead", 32)
    if tiny is not None:
        line = (
            f"c=32 on a near-zero segment (2 channels, 8x8): {tiny.rps:.0f} req/s, the "
            f"service's CPU {tiny.server_cpu_ms:.3f} ms per request"
        )
        if echo is not None:
            line += f" (an aiohttp server answering a canned frame: {echo.server_cpu_ms:.3f})"
        out.append((line, None))
    if b1 is not None:
        added = b1.p50_ms - b1.bare_p50_ms
        if echo is not None:
            out.append(
                (
                    f"c=1: the HTTP round trip alone (aiohttp, same client and frames) "
                    f"takes {echo.p50_ms:.2f} ms p50; the engine adds "
                    f"{added - echo.p50_ms:+.2f} ms beyond it",
                    None,
                )
            )
        out.append(
            (
                f"c=1: p50 {b1.p50_ms:.2f} ms vs a bare session's batch-1 p50 "
                f"{b1.bare_p50_ms:.2f} ms: {added:+.2f} ms (target < {TARGET_OVERHEAD_MS:g} ms)",
                added < TARGET_OVERHEAD_MS,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="levels 1,8,32 for 1.5 s each")
    p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per level")
    p.add_argument("--levels", default="1,2,4,8,16,32,64", help="concurrency levels")
    p.add_argument("--size", type=int, default=48, help="input height and width of the CNN")
    p.add_argument("--no-peer", action="store_true", help="skip LitServe")
    p.add_argument(
        "--spinning", action="store_true", help="let idle ONNX Runtime threads spin (all systems)"
    )
    p.add_argument("--json", type=Path, help="write the rows and verdicts here")
    p.add_argument(
        "--client",
        choices=("auto", "wrk", "aiohttp"),
        default="auto",
        help="the load generator: wrk (C; auto picks it when it is on PATH) or aiohttp "
        "(Python, in this process: it takes more of the shared CPUs)",
    )
    p.add_argument(
        "--service-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="pass a flag to cloud-service (repeatable), e.g. --service-arg=--intra-op-threads=1",
    )
    p.add_argument("--serve-echo", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument(
        "--serve-litserve", nargs=3, metavar=("SEGMENT", "PORT", "LOG"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    SPINNING[0] = args.spinning
    SERVICE_ARGS[:] = args.service_arg
    if args.client == "wrk" and shutil.which("wrk") is None:
        p.error("--client wrk: wrk is not on PATH (apt install wrk, brew install wrk)")
    CLIENT[0] = "wrk" if args.client != "aiohttp" and shutil.which("wrk") else "aiohttp"
    if args.serve_echo:
        serve_echo(args.serve_echo)
        return 0
    if args.serve_litserve:
        seg, port, log = args.serve_litserve
        serve_litserve(Path(seg), int(port), Path(log))
        return 0
    levels = [1, 8, 32] if args.quick else [int(v) for v in args.levels.split(",")]
    seconds = 1.5 if args.quick else args.seconds

    work = Path(tempfile.mkdtemp(prefix="bench-cloud-"))
    segment, manifest = build_repo(work, args.size, (32, 64, 128))
    (spec,) = manifest.cut.tensors
    sample = tuple(int(d) for d in spec.shape[1:])
    SAMPLE[:] = [sample]
    print(
        f"cloud segment: {manifest.cut.id} input {spec.name} {list(sample)} float32, "
        f"{manifest.cut.cloud_flops / 1e6:.0f} MFLOP/sample; cpus: {os.cpu_count()}; "
        f"load average {os.getloadavg()[0]:.1f}; load generator: {CLIENT[0]}"
    )

    bare = Bare(segment, sample)
    table = bare.sweep(seconds=min(seconds, 2.0))
    best = bare.best
    print(
        "\nbare ONNX Runtime session (the ceiling: its best batch, re-measured around each level)"
    )
    print(f"{'batch':>6} {'samples/s':>10} {'p50 ms':>9}")
    for b, (rate, p50) in table.items():
        print(f"{b:>6} {rate:>10.1f} {1000 * p50:>9.2f}{'  <- best' if b == best else ''}")

    arrays = sample_arrays(manifest, 64)
    frames = frames_for(manifest, arrays)
    bodies = [json.dumps({"x": base64.b64encode(a.tobytes()).decode()}).encode() for a in arrays]

    print("\n" + HEADER)
    rows = run_service("batching", work / "repo", frames, levels, seconds, bare)
    rows += run_service("no-batch", work / "repo", frames, levels, seconds, bare)
    rows += run_echo(frames, seconds, bare)
    rows += run_overhead(work / "tiny", seconds, bare)
    engine_us = {c: engine_cpu(work / "repo", frames, c, seconds) for c in (1, 32)}
    peer_note = ""
    if not args.no_peer:
        if _ls is not None:
            rows += run_peer(segment, bodies, levels, seconds, bare)
        else:
            peer_note = "LitServe is not installed (pip install litserve): no peer figures"
            print(peer_note)

    print()
    results = verdicts(rows)
    results.append(
        (
            "the engine alone (in-process, no sockets, segments stubbed to answer at once): "
            + ", ".join(f"{us:.0f} µs of CPU per request at c={c}" for c, us in engine_us.items()),
            None,
        )
    )
    for text, ok in results:
        print(f"{'INFO' if ok is None else 'PASS' if ok else 'FAIL'}  {text}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "best_batch": best,
                    "bare": {str(b): {"rps": r, "p50_ms": 1000 * t} for b, (r, t) in table.items()},
                    "rows": [asdict(r) for r in rows],
                    "verdicts": [{"text": t, "pass": ok} for t, ok in results],
                    "note": peer_note,
                },
                indent=2,
            )
        )
    return 0 if all(ok is not False for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
