"""``splitinfer-demo``: the main job, end to end, on the built-in default.

1. Trains the digits classifier on scikit-learn's bundled digits (seconds) and
   exports it to ONNX.
2. Partitions it with ``--split auto`` (INT8 edge, calibrated on training
   digits, run-time candidates), and also as cloud-only (``--split none``),
   edge-only (``--split all``) and once with differential privacy on, its
   cloud segment and a learned 10-dimensional code fine-tuned for the noise
   (``--adapt-cloud``, issue 19).
3. Starts a real ``cloud-service`` and one real ``edge-agent`` per strategy on
   loopback, every agent behind an emulated cellular uplink (a Mahimahi trace
   bundled in ``sim/traces/``), all signed with
   a fresh device credential.
4. Sends the held-out digits through each agent and prints one table:
   accuracy against the labels and agreement with the fp32 model, p50/p99
   latency, bytes per request on the wire.

Everything it starts is stopped on the way out, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from splitinfer.shared.cli import run_cli
from splitinfer.shared.contract import HEADER_CUT, HEADER_LOCAL
from splitinfer.shared.errors import ConfigError

DEFAULT_TRACE = "Verizon-LTE-short.up"
#: --adapt-seconds of the private run: the fine-tune that keeps its answers usable.
ADAPT_SECONDS = 20
START_TIMEOUT_S = 60.0


def _say(message: str) -> None:
    print(f"demo: {message}", file=sys.stderr, flush=True)


@dataclass
class Strategy:
    name: str
    package: Path
    version: str | None  # model version in the cloud repository; None: never calls it
    note: str = ""
    force_cut: str | None = None  # sent as X-Splitinfer-Cut: pin a candidate cut
    latencies: list[float] = field(default_factory=list)
    predictions: list[int] = field(default_factory=list)
    cuts: set[str] = field(default_factory=set)
    local: int = 0
    errors: int = 0
    up_bytes: int = 0
    down_bytes: int = 0


# -- processes ----------------------------------------------------------------------


class Daemons:
    """Subprocesses started by the demo, stopped (TERM, then KILL) on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], banner_stream: str) -> str:
        """Start ``argv``; return the URL from its ``listening on URL`` line."""
        log = (self.log_dir / f"{name}.log").open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        watched = subprocess.PIPE
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=watched if banner_stream == "stdout" else log,
            stderr=watched if banner_stream == "stderr" else log,
            env=env,
        )
        self.procs.append((name, proc))
        stream = proc.stdout if banner_stream == "stdout" else proc.stderr
        assert stream is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        seen: list[str] = []
        while time.monotonic() < deadline:
            line = stream.readline().decode(errors="replace")
            if not line:
                break
            seen.append(line.rstrip())
            if "listening on " in line:
                url = line.split("listening on ", 1)[1].split()[0]
                _drain(stream, log)
                return url
        tail = "; ".join(seen[-3:]) or "no output"
        raise ConfigError(f"{name} did not start (see {self.log_dir / name}.log): {tail}")

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def _drain(stream: IO[bytes], log: IO[bytes]) -> None:
    """Keep copying a daemon's watched stream into its log, so it never blocks."""
    import threading

    def pump() -> None:
        for chunk in iter(lambda: stream.read1(65536), b""):  # type: ignore[attr-defined]
            log.write(chunk)
            log.flush()

    threading.Thread(target=pump, daemon=True).start()


def _bin(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    return str(exe) if exe.exists() else shutil.which(name) or name


# -- building -----------------------------------------------------------------------


def _partition(argv: list[str]) -> None:
    from splitinfer.partitioner.cli import main as partition

    code = partition([*argv, "-q"])
    if code != 0:
        raise ConfigError(f"partition {' '.join(argv)} failed (exit {code})")


def build(out: Path, trace: Path, epsilon: float) -> tuple[list[Strategy], dict[str, np.ndarray]]:
    from splitinfer.models.digits import export_digits, load_digits_split, train_digits_cnn

    t0 = time.perf_counter()
    x_train, _, x_test, y_test = load_digits_split(0)
    net = train_digits_cnn(seed=0)
    model = export_digits(out / "digits.onnx", seed=0, net=net)
    calib = out / "calibration"
    calib.mkdir(exist_ok=True)
    np.save(calib / "train.npy", x_train[:256])
    _say(f"trained and exported the digits CNN in {time.perf_counter() - t0:.1f} s -> {model}")
    link = ["--trace", str(trace)]
    common = [str(model), "--calibration", str(calib), *link, "--rtt", "40ms"]
    pk = out / "packages"
    t0 = time.perf_counter()
    _partition([*common, "--split", "auto", "--candidates", "3", "-o", str(pk / "auto")])
    _partition([str(model), "--split", "none", "-o", str(pk / "cloud-only")])
    _partition([*common[:3], "--split", "all", "--precision", "int8", "-o", str(pk / "edge")])
    clip = _median_norm(out, pk)
    _partition(
        [*common, "--split", "auto", "-o", str(pk / "private"), "--epsilon", str(epsilon),
         "--clip", f"{clip:.3g}", "--bottleneck", "10", "--adapt-cloud",
         "--adapt-seconds", str(ADAPT_SECONDS), "--candidates", "3"]
    )  # fmt: skip
    _say(f"partitioned four ways in {time.perf_counter() - t0:.1f} s")
    repo = out / "repository" / "digits"
    for version, name in (("1", "auto"), ("2", "cloud-only"), ("3", "private")):
        shutil.copytree(pk / name, repo / version)
    data: dict[str, np.ndarray] = {"x": x_test, "y": y_test, "fp32": _fp32(model, x_test)}
    split = _split_candidate(pk / "auto")
    private = _split_candidate(pk / "private")
    strategies = [
        Strategy("auto (its choice)", pk / "auto", "1", "INT8 edge"),
        Strategy(
            f"split at {split}", pk / "auto", "1", "run-time candidate, pinned", force_cut=split
        ),
        Strategy("cloud-only", pk / "cloud-only", "2", "raw input, int8+zstd"),
        Strategy("edge-only", pk / "edge", None, "INT8, no network"),
        Strategy(
            f"split at {private}, DP",
            pk / "private",
            "3",
            f"eps={epsilon:g} per request, adapted code-10, clip {clip:.3g}",
            force_cut=private,
        ),
    ]
    return strategies, data


def _split_candidate(package: Path) -> str | None:
    """The package's best-predicted cut that really splits (None if it has none)."""
    from splitinfer.shared.manifest import load_manifest

    m = load_manifest(package)
    splits = [c for c in m.cuts if c.kind == "split"]
    if not splits:
        return None
    return min(splits, key=lambda c: c.predicted.get("latency_mean_s", 0.0)).id


def _median_norm(out: Path, packages: Path) -> float:
    """A clip norm for the private run: the median L2 norm of the auto cut's activations."""
    import onnxruntime as ort

    from splitinfer.shared.manifest import load_manifest

    m = load_manifest(packages / "auto")
    cut = next((c for c in m.cuts if c.kind == "split" and c.edge is not None), None)
    if cut is None or cut.edge is None:
        return 10.0
    x = np.load(out / "calibration" / "train.npy")
    sess = ort.InferenceSession(str(packages / "auto" / cut.edge.file))
    acts = sess.run(None, {"x": x})
    flat = np.concatenate([a.reshape(len(x), -1) for a in acts], axis=1)
    return float(np.median(np.linalg.norm(flat, axis=1)))


def _fp32(model: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    preds: np.ndarray = sess.run(None, {"x": x})[0].argmax(axis=1)
    return preds


# -- running ------------------------------------------------------------------------


async def _send(url: str, strategy: Strategy, x: np.ndarray, streams: int) -> None:
    import aiohttp

    order = asyncio.Queue[int]()
    for i in range(len(x)):
        order.put_nowait(i)
    preds: dict[int, int] = {}

    async def worker(session: aiohttp.ClientSession) -> None:
        while not order.empty():
            i = order.get_nowait()
            buf = io.BytesIO()
            np.save(buf, x[i : i + 1])
            t0 = time.perf_counter()
            headers = {"Content-Type": "application/x-npy"}
            if strategy.force_cut:
                headers[HEADER_CUT] = strategy.force_cut
            async with session.post(
                f"{url}/v1/infer", data=buf.getvalue(), headers=headers
            ) as resp:
                body = await resp.read()
                elapsed = time.perf_counter() - t0
                if resp.status != 200:
                    strategy.errors += 1
                    continue
                strategy.latencies.append(elapsed)
                strategy.cuts.add(resp.headers.get(HEADER_CUT, "?"))
                strategy.local += resp.headers.get(HEADER_LOCAL) == "1"
                out = np.load(io.BytesIO(body))
                preds[i] = int(out["logits"].argmax())

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(streams)))
    strategy.predictions = [preds.get(i, -1) for i in range(len(x))]


async def _run_all(
    strategies: list[Strategy],
    data: dict[str, np.ndarray],
    cloud_url: str,
    daemons: Daemons,
    args: argparse.Namespace,
    trace: Path,
    credentials: Path,
) -> None:
    from splitinfer.sim.config import Direction, LinkConfig
    from splitinfer.sim.link import EmulatedLink

    host, port = cloud_url.removeprefix("http://").rsplit(":", 1)
    x = data["x"][: args.samples]
    for s in strategies:
        if s.force_cut is None and s.name.startswith("split at"):
            _say(f"{s.name}: the package has no split candidate; skipped")
            continue
        up = Direction.from_trace(trace)
        config = LinkConfig(uplink=up, downlink=Direction.rate("20mbit"), delay_ms=20.0)
        async with EmulatedLink(config, target=(host, int(port))) as link:
            argv = [_bin("edge-agent"), "--package", str(s.package), "--listen", "127.0.0.1:0",
                    "--credentials", str(credentials),
                    "--cloud", f"http://127.0.0.1:{link.port}"]  # fmt: skip
            if s.version is not None:
                argv += ["--model", f"digits:{s.version}"]
            _say(f"{s.name}: starting an edge agent behind {config.describe()}")
            tag = "".join(ch if ch.isalnum() else "-" for ch in s.name)
            url = await asyncio.to_thread(daemons.start, f"edge-agent-{tag}", argv, "stderr")
            t0 = time.perf_counter()
            await _send(url, s, x, args.streams)
            s.up_bytes = link.uplink_stats.delivered_bytes
            s.down_bytes = link.downlink_stats.delivered_bytes
            _say(f"{s.name}: {len(x)} digits in {time.perf_counter() - t0:.1f} s")


def _table(strategies: list[Strategy], data: dict[str, np.ndarray], n: int) -> str:
    y, ref = data["y"][:n], data["fp32"][:n]
    fp32_acc = float(np.mean(ref == y))
    head = (
        f"{'strategy':<22} {'cut':<10} {'accuracy':>8} {'= fp32':>7} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'B up/req':>9} {'B down/req':>10} {'errors':>6}  note"
    )
    lines = [head, f"{'fp32 model (reference)':<22} {'-':<10} {fp32_acc:>8.4f} {1:>7.4f}"]
    for s in strategies:
        pred = np.array(s.predictions)
        ok = pred >= 0
        lat = np.array(s.latencies) * 1e3 if s.latencies else np.array([np.nan])
        done = max(1, int(ok.sum()))
        lines.append(
            f"{s.name:<22} {','.join(sorted(s.cuts)):<10} {np.mean(pred == y):>8.4f} "
            f"{np.mean(pred[ok] == ref[ok]) if ok.any() else 0:>7.4f} "
            f"{np.percentile(lat, 50):>8.1f} {np.percentile(lat, 99):>8.1f} "
            f"{s.up_bytes / done:>9.0f} {s.down_bytes / done:>10.0f} {s.errors:>6}  {s.note}"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def _daemons(log_dir: Path) -> Iterator[Daemons]:
    daemons = Daemons(log_dir)
    try:
        yield daemons
    finally:
        daemons.stop()


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="splitinfer-demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="working folder")
    parser.add_argument("--trace", type=Path, help=f"uplink trace (default {DEFAULT_TRACE})")
    parser.add_argument("--samples", type=int, default=450, help="held-out digits to send")
    parser.add_argument("--streams", type=int, default=4, help="concurrent requests per agent")
    parser.add_argument(
        "--epsilon",
        type=float,
        default=64.0,
        help="per-request epsilon of the private run (default 64: weak protection, but "
        "where the adapted model still answers; see docs/privacy.md)",
    )
    args = parser.parse_args(argv)
    if args.samples < 1 or args.streams < 1:
        raise ConfigError("--samples and --streams must be at least 1")
    from splitinfer.sim import traces

    trace: Path = args.trace if args.trace is not None else traces.path(DEFAULT_TRACE)
    if not trace.is_file():
        raise ConfigError(f"--trace {trace}: no such file")
    start = time.perf_counter()
    if args.out.exists():
        shutil.rmtree(args.out)
    (args.out / "logs").mkdir(parents=True)
    strategies, data = build(args.out, trace, args.epsilon)

    from splitinfer.shared.auth import generate_credential, render_toml

    credentials = args.out / "credentials.toml"
    credentials.write_text(render_toml(generate_credential("demo-device", "k1")))
    credentials.chmod(0o600)
    with _daemons(args.out / "logs") as daemons:
        cloud = daemons.start(
            "cloud-service",
            [_bin("cloud-service"), "--repository", str(args.out / "repository"),
             "--listen", "127.0.0.1:0", "--credentials", str(credentials),
             "--set", 'models.digits.versions="all"'],
            "stdout",
        )  # fmt: skip
        _say(f"cloud-service up at {cloud}")
        asyncio.run(_run_all(strategies, data, cloud, daemons, args, trace, credentials))
    n = min(args.samples, len(data["x"]))
    link = f"{trace.name} (Mahimahi)"
    print(
        f"\n{n} held-out digits through each edge agent; uplink {link}, 20 Mbit/s down, "
        f"40 ms RTT, {args.streams} concurrent requests\n"
    )
    print(_table(strategies, data, n))
    took = time.perf_counter() - start
    print(f"\ndone in {took:.0f} s; packages, logs and credentials in {args.out}")
    return 0 if all(s.errors == 0 for s in strategies) else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("splitinfer-demo", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
