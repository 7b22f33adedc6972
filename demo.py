"""``splitinfer-demo``: the main job, end to end, on a real trained network.

1. Gets the model: by default ddddocr's captcha recogniser (trained weights
   shipped in the ``ddddocr`` wheel, :mod:`splitinfer.demo_ocr`) with an argmax
   head, and draws captchas with known text; with ``--quick`` it trains the
   small digits classifier on scikit-learn's bundled digits instead.
2. Partitions it with ``--split auto`` (INT8 edge, calibrated, run-time
   candidates, planned for the emulated device and the uplink trace), and also
   as cloud-only (``--split none``), edge-only (``--split all``) and once with
   differential privacy on.
3. Starts a real ``cloud-service`` and one real ``edge-agent`` per strategy on
   loopback, every agent behind an emulated cellular uplink (a Mahimahi trace
   bundled in ``sim/traces/``) and, for the OCR job, emulating a Raspberry Pi 5,
   all signed with a fresh device credential.
4. Sends the held-out inputs through each agent and prints one table:
   accuracy against the ground truth, exact match, agreement with the fp32
   model, p50/p99 latency, bytes per request on the wire; says why the chosen
   cut is where it is; draws ``cuts.png`` (the per-cut edge/transfer/cloud bars,
   chosen cut marked) and ``latency-cdf.png`` (one curve per strategy).

Everything it starts is stopped on the way out, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer import __version__
from splitinfer.demo_console import PROGRESS, format_ms, prepare_out
from splitinfer.shared.cli import (
    ArgumentParser,
    add_debug_flag,
    add_version_flag,
    examples,
    run_cli,
)
from splitinfer.shared.contract import (
    HEADER_CUT,
    HEADER_DOWN_BYTES,
    HEADER_LOCAL,
    HEADER_UP_BYTES,
)
from splitinfer.shared.errors import ConfigError, SplitInferError
from splitinfer.shared.options import Deprecated
from splitinfer.sim.daemon import Daemon, command

#: The OCR job's uplink: the slowest LTE trace (1.9 Mbit/s mean, outages while driving).
DEFAULT_TRACE = "ATT-LTE-driving-2016.up"
QUICK_TRACE = "Verizon-LTE-short.up"
START_TIMEOUT_S = 60.0


def _say(message: str) -> None:
    PROGRESS.say(message)


def _step(doing: str, status: Callable[[], str] | None = None) -> None:
    PROGRESS.step(doing, status)


@dataclass
class Strategy:
    name: str
    package: Path
    version: str | None  # model version in the cloud repository; None: never calls it
    note: str = ""
    force_cut: str | None = None  # sent as X-Splitinfer-Cut: pin a candidate cut
    latencies: list[float] = field(default_factory=list)
    predictions: list[Any] = field(default_factory=list)  # None: no answer
    cuts: set[str] = field(default_factory=set)
    local: int = 0
    errors: int = 0
    up_bytes: int = 0  # the requests' frames, as the agent reports them (0 when local)
    down_bytes: int = 0

    def answered(self) -> str:
        return f"{len(self.latencies) + self.errors} answered"


@dataclass
class Job:
    """What the agents are sent and how their answers are scored."""

    name: str  # the model's name in the cloud repository
    what: str  # "digits", "captchas"
    x: np.ndarray
    truth: list[Any]
    fp32: list[Any]  # the source model's answers
    decode: Callable[[Any], Any]  # the agent's npz answer -> one answer
    score: Callable[[list[Any], list[Any]], float]  # accuracy of answers vs truth
    metric: str
    emulate: str | None  # edge profile every agent emulates
    auto_package: Path


# -- processes ----------------------------------------------------------------------


class Daemons:
    """The daemons the demo started (:class:`splitinfer.sim.daemon.Daemon`, each logging
    to ``log_dir/NAME.log``), stopped (TERM, then KILL) on exit, last started first."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Daemon] = []

    def start(self, name: str, program: str, args: list[str]) -> str:
        """Start ``program`` (``cloud-service``, ``edge-agent``) with ``args``; its URL."""
        daemon = Daemon(
            [*command(program), *args],
            name=name,
            log=self.log_dir / f"{name}.log",
            timeout_s=START_TIMEOUT_S,
        )
        self.procs.append(daemon)
        try:
            return daemon.wait()
        except ConfigError as exc:
            raise ConfigError(f"{exc} (log: {self.log_dir / name}.log)") from None

    def stop(self) -> None:
        for daemon in reversed(self.procs):
            daemon.stop(timeout_s=10)
        self.procs.clear()


# -- building -----------------------------------------------------------------------


def _partition(argv: list[str]) -> None:
    """Run ``partition ARGV`` in this process. Its progress goes to stderr as ``demo:
    partition NAME: ...`` (NAME: the package folder's), and so does what it would print,
    under a heading: the predicted cost per cut of a ``--split auto`` run."""
    from splitinfer.partitioner.cli import Written, run
    from splitinfer.partitioner.request import PartitionRequest

    req = PartitionRequest.from_argv(argv)
    tag = f"partition {req.output.name if req.output is not None else ''}".rstrip()

    def progress(message: str) -> None:
        _step(f"{tag}: {message}")
        _say(f"{tag}: {message}")

    _step(f"{tag}: starting")
    try:
        done = run(req, progress)
    except SplitInferError as exc:
        raise ConfigError(f"partition {' '.join(argv)}: {exc}") from exc
    assert isinstance(done, Written)  # the demo always writes a package
    if done.auto is None:
        for line in done.summary.splitlines():
            _say(f"{tag}: {line}")
        return
    _say(f"{tag}: predicted cost per cut, ms (total: the mean over the uplink trace)")
    for line in done.summary.splitlines():
        _say(f"    {line}")


def split_candidate(package: Path) -> str | None:
    """The package's best-predicted cut that really splits (None if it has none)."""
    from splitinfer.shared.manifest import load_manifest

    m = load_manifest(package)
    splits = [c for c in m.cuts if c.kind == "split"]
    if not splits:
        return None
    return min(splits, key=lambda c: c.predicted.get("latency_mean_s", 0.0)).id


# -- running ------------------------------------------------------------------------


async def _send(url: str, strategy: Strategy, job: Job, x: np.ndarray, streams: int) -> None:
    import aiohttp

    order = asyncio.Queue[int]()
    for i in range(len(x)):
        order.put_nowait(i)
    preds: dict[int, Any] = {}

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
                strategy.up_bytes += int(resp.headers.get(HEADER_UP_BYTES, 0))
                strategy.down_bytes += int(resp.headers.get(HEADER_DOWN_BYTES, 0))
                preds[i] = job.decode(np.load(io.BytesIO(body)))

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(streams)))
    strategy.predictions = [preds.get(i) for i in range(len(x))]


async def _run_all(
    strategies: list[Strategy],
    job: Job,
    cloud_url: str,
    daemons: Daemons,
    args: argparse.Namespace,
    trace: Path,
    credentials: Path,
) -> None:
    from splitinfer.sim.config import Direction, LinkConfig
    from splitinfer.sim.link import EmulatedLink

    host, port = cloud_url.removeprefix("http://").rsplit(":", 1)
    x = job.x[: args.samples]
    for s in strategies:
        if s.force_cut is None and s.name.startswith("split at"):
            _say(f"{s.name}: the package has no split candidate; skipped")
            continue
        up = Direction.from_trace(trace)
        config = LinkConfig(uplink=up, downlink=Direction.rate("20mbit"), delay_ms=20.0)
        async with EmulatedLink(config, target=(host, int(port))) as link:
            argv = ["--package", str(s.package), "--listen", "127.0.0.1:0",
                    "--credentials", str(credentials),
                    "--cloud", f"http://127.0.0.1:{link.port}"]  # fmt: skip
            if s.version is not None:
                argv += ["--model", f"{job.name}:{s.version}"]
            if job.emulate is not None:
                argv += ["--emulate-device", job.emulate]
            _say(f"{s.name}: starting an edge agent behind {config.describe()}")
            _step(f"{s.name}: starting an edge agent")
            tag = "".join(ch if ch.isalnum() else "-" for ch in s.name)
            url = await asyncio.to_thread(daemons.start, f"edge-agent-{tag}", "edge-agent", argv)
            t0 = time.perf_counter()
            _step(f"{s.name}: sending {len(x)} {job.what}", s.answered)
            await _send(url, s, job, x, args.streams)
            _say(
                f"{s.name}: {len(x)} {job.what} in {time.perf_counter() - t0:.1f} s; the link "
                f"carried {link.uplink_stats.delivered_bytes:,} B up, "
                f"{link.downlink_stats.delivered_bytes:,} B down (HTTP and health checks "
                f"included)"
            )


def _table(strategies: list[Strategy], job: Job, n: int) -> str:
    truth, ref = job.truth[:n], job.fp32[:n]

    def exact(pred: list[Any], want: list[Any]) -> float:
        return float(np.mean([p == w for p, w in zip(pred, want, strict=True)]))

    head = (
        f"{'strategy':<22} {'cut':<10} {job.metric:>8} {'exact':>6} {'= fp32':>7} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'B up/req':>9} {'B down/req':>10} {'errors':>6}  note"
    )
    lines = [
        head,
        f"{'fp32 model (reference)':<22} {'-':<10} {job.score(ref, truth):>8.4f} "
        f"{exact(ref, truth):>6.3f} {1:>7.4f}",
    ]
    for s in strategies:
        if not s.predictions:
            continue
        pred = s.predictions[:n]
        lat = np.array(s.latencies) * 1e3 if s.latencies else np.array([np.nan])
        done = max(1, sum(p is not None for p in pred))
        lines.append(
            f"{s.name:<22} {','.join(sorted(s.cuts)):<10} {job.score(pred, truth):>8.4f} "
            f"{exact(pred, truth):>6.3f} {exact(pred, ref):>7.4f} "
            f"{np.percentile(lat, 50):>8.1f} {np.percentile(lat, 99):>8.1f} "
            f"{s.up_bytes / done:>9.0f} {s.down_bytes / done:>10.0f} {s.errors:>6}  {s.note}"
        )
    return "\n".join(lines)


def explain_choice(package: Path) -> str:
    """One paragraph: the cut ``--split auto`` chose and, when it is not interior, why not
    (from the package's predicted costs: the mean latency over the uplink trace, the
    statistic of the partitioner's cost table; device time is its ``edge ms``, compute
    and encoding)."""
    from splitinfer.shared.manifest import load_manifest

    m = load_manifest(package)
    by_id = {c.id: c for c in m.cuts}
    chosen = by_id[m.default_cut]

    def mean(p: dict[str, Any]) -> str:
        return format_ms(float(p.get("latency_mean_s", 0.0)))

    def device_s(p: dict[str, Any]) -> float:
        return float(p.get("edge_s", 0.0)) + float(p.get("encode_s", 0.0))

    p = chosen.predicted
    text = (
        f"--split auto chose {chosen.id} ({chosen.kind}): predicted mean latency {mean(p)}, "
        f"{format_ms(device_s(p))} on the device, {int(p.get('up_bytes', 0)):,} B up."
    )
    if chosen.kind == "split":
        return text + " The cut is interior: the device runs the front, the cloud the rest."
    splits = [c for c in m.cuts if c.kind == "split"]
    cloud = next((c for c in m.cuts if c.kind == "none"), None)
    if not splits or cloud is None:
        return text + " No interior cut was packaged (none predicted within reach)."
    best = min(splits, key=lambda c: c.predicted.get("latency_mean_s", 0.0))
    q, r = best.predicted, cloud.predicted
    sent, raw = int(q.get("up_bytes", 0)), int(r.get("up_bytes", 0))
    front = device_s(q)
    all_edge = next((c.predicted for c in m.cuts if c.kind == "all"), {})
    whole = device_s(all_edge) if all_edge else None
    if sent >= raw:
        why = f"it sends more than the input itself ({sent:,} B against {raw:,} B)"
    else:
        why = f"it sends {sent:,} B against the input's {raw:,} B"
    share = ""
    if whole is not None and whole >= 1e-3:  # a share of next to no time says nothing
        compute = float(q.get("edge_s", 0.0)) / max(float(all_edge.get("edge_s", 0.0)), 1e-12)
        share = f" ({min(compute, 1.0):.0%} of the whole network's {format_ms(whole)})"
    return (
        f"{text} Not interior: the best interior cut, {best.id}, runs {format_ms(front)} on "
        f"the device{share} and {why}, so it is predicted slower than both ends (mean "
        f"{mean(q)}; cloud-only {mean(r)}). No cut of this network shrinks the data "
        f"far below its compressed input while leaving most of the work to the cloud."
    )


@contextlib.contextmanager
def _daemons(log_dir: Path) -> Iterator[Daemons]:
    daemons = Daemons(log_dir)
    try:
        yield daemons
    finally:
        daemons.stop()


def build_parser() -> argparse.ArgumentParser:
    """``splitinfer-demo``'s flags (also read by ``splitinfer.completion``)."""
    parser = ArgumentParser(
        prog="splitinfer-demo",
        description=__doc__.split("\n\n")[0],
        epilog=examples(
            "splitinfer-demo",
            "splitinfer-demo --quick -o out/quick",
            "splitinfer-demo --samples 40 --streams 2 --no-private",
        ),
    )
    parser.add_argument(
        "-o",
        "--output",
        dest="out",
        type=Path,
        default=Path("out/demo"),
        metavar="DIR",
        help="working folder (default: out/demo)",
    )
    parser.add_argument("--out", action=Deprecated, dest="out", new="--output", type=Path)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the small digits classifier instead of the OCR network (seconds to build)",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help=f"uplink trace (default: {DEFAULT_TRACE}; with --quick {QUICK_TRACE})",
    )
    parser.add_argument(
        "--samples",
        type=int,
        metavar="N",
        help="held-out inputs to send (default: 120 captchas; with --quick 450 digits)",
    )
    parser.add_argument(
        "--streams",
        type=int,
        default=4,
        metavar="N",
        help="concurrent requests per agent (default: 4)",
    )
    parser.add_argument(
        "--no-private", action="store_true", help="leave out the differentially private run"
    )
    parser.add_argument(
        "--epsilon",
        type=float,
        default=64.0,
        metavar="E",
        help="per-request epsilon of the private run (default: 64, weak protection, but "
        "where the adapted digits model still answers; see docs/privacy.md)",
    )
    add_debug_flag(parser)
    add_version_flag(parser, __version__)
    return parser


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.samples is None:
        args.samples = 450 if args.quick else 120
    if args.samples < 1 or args.streams < 1:
        raise ConfigError("--samples and --streams must be at least 1")
    from splitinfer.sim import traces

    default = QUICK_TRACE if args.quick else DEFAULT_TRACE
    trace: Path = args.trace if args.trace is not None else traces.path(default)
    if not trace.is_file():
        raise ConfigError(f"--trace {trace}: no such file")
    prepare_out(args.out)
    with PROGRESS.ticking():
        return _demo(args, trace)


def _demo(args: argparse.Namespace, trace: Path) -> int:
    start = time.perf_counter()
    if args.quick:
        from splitinfer.demo_digits import build_digits

        strategies, job = build_digits(args.out, trace, args.epsilon, not args.no_private)
    else:
        from splitinfer.demo_ocr import build_ocr

        strategies, job = build_ocr(
            args.out, trace, args.epsilon, args.samples, not args.no_private
        )

    from splitinfer.shared.auth import generate_credential, render_toml

    credentials = args.out / "credentials.toml"
    credentials.write_text(render_toml(generate_credential("demo-device", "k1")))
    credentials.chmod(0o600)
    with _daemons(args.out / "logs") as daemons:
        _step("starting the cloud service")
        cloud = daemons.start(
            "cloud-service",
            "cloud-service",
            ["--repository", str(args.out / "repository"),
             "--listen", "127.0.0.1:0", "--credentials", str(credentials),
             "--set", f'models.{job.name}.versions="all"'],
        )  # fmt: skip
        _say(f"cloud-service up at {cloud}")
        asyncio.run(_run_all(strategies, job, cloud, daemons, args, trace, credentials))
    n = min(args.samples, len(job.x))
    device = f", every edge agent emulating {job.emulate}" if job.emulate else ""
    print(
        f"{n} held-out {job.what} through each edge agent; uplink {trace.name} (Mahimahi), "
        f"20 Mbit/s down, 40 ms RTT, {args.streams} concurrent requests{device}\n"
    )
    print(_table(strategies, job, n))
    print("\n" + explain_choice(job.auto_package))
    pictures = [args.out / "cuts.png"] if (args.out / "cuts.png").is_file() else []
    _step("drawing the latency CDF")
    from splitinfer.demo_plots import latency_cdf

    pictures.append(
        latency_cdf(strategies, args.out / "latency-cdf.png", f"{job.what}, {trace.name}")
    )
    for pic in pictures:
        print(f"picture: {pic}")
    took = time.perf_counter() - start
    print(f"\ndone in {took:.0f} s; packages, logs and credentials in {args.out}")
    return 0 if all(s.errors == 0 for s in strategies) else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("splitinfer-demo", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
