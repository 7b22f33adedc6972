"""The front end's cost per request (issue 29): what ``cloud-service`` spends on a request
when the model costs almost nothing, against the baseline commit and LitServe, in one run.

    python bench/bench_frontend.py [--seconds 3] [--rounds 3] [--levels 1,32]
                                   [--base 66ce796] [--base-tree DIR | --no-base]
                                   [--no-peer] [--no-echo] [--no-unet]
                                   [--unet-size 32] [--unet-cut c29] [--json out.json]

**The null model** is Relu then Sigmoid on 16 floats, served whole by the cloud (cut
``c0``: the device sends its input). Whatever a request costs beyond the few microseconds
ONNX Runtime takes is the front end's: HTTP, the checks, frame decode and encode,
batching, the hop to the compute thread, metrics. The systems, each a process of its own,
serve it with the same batching (at most 32 samples, 2 ms queue delay, ``--no-auth``, raw
frames):

- ``new``: ``cloud-service`` of this tree.
- ``base``: ``cloud-service`` of the baseline commit (``--base``: main when the work
  started), checked out beside this tree with ``git worktree add`` and run with
  ``PYTHONPATH`` at a folder where ``splitinfer`` links to that checkout, so that the
  base's own code is imported (the run prints ``splitinfer.__file__`` as the base sees
  it). Same package, same frames, the flags in the base's own spelling.
  ``--base-tree DIR`` uses a checkout that is there already.
- ``litserve``: LitServe (``cloud_peers.py``: one worker, the same batch size and delay),
  the input as base64 in JSON, as in ``bench_cloud.py``.
- ``http-echo``: an aiohttp server that reads the frame and answers a canned one: what a
  request costs aiohttp alone.

The load generator is wrk (``wrk_closed_loop.lua``, one thread; ``apt install wrk``): at
each level, that many connections, each a closed loop, after a 1 s warm-up. Without
wrk it is aiohttp's client in this process, which takes much more of the same CPUs (the
rates drop; the CPU per request of the server stays meaningful). Columns: ``req/s``;
client-side ``p50`` and ``p99``; ``srv µs/req``: the CPU time (user + system, every
thread) of the server's process and its children, from their own counters (psutil
``cpu_times()``) before and after the measured window, over the requests answered in
it; ``loop µs``: the part of it spent by the main thread of the server's first process
(``cloud-service``'s event loop; LitServe serves from other processes, so ~0 there);
``gen µs/req``: the load generator's CPU (wrk's rusage) per request. ``base`` and
``new`` run side by side and every round measures each level on both, their order
alternating; the peers follow, one at a time (an idle peer's own loops would take CPU
from the others). The summary gives each figure's median over the rounds with its
range, and the ratio base CPU/request over new CPU/request taken round by round (the
same minute for both).

**The U-Net row** (``--no-unet`` skips it; needs torch): the depth-5 U-Net of
``models/zoo.py`` at ``--unet-size`` squared, cut at ``--unet-cut`` (by default its
last decoder block's second convolution and the 1x1 head run in the cloud: 64 x 32 x
32 floats in, 76 MFLOP a sample), served by ``new`` (and ``base``) at 32 connections,
against a bare ONNX Runtime session of the same segment with the same session options at
its best batch size (swept over 1..64, then measured just before and just after each
system's window, the two averaged).

Targets (issue 29): ``new`` needs at least 1.5x less CPU per request than ``base`` on
the null model; on the U-Net at 32 connections it reaches at least 75 % of the bare
session's best.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import cloud_peers
import numpy as np
from cloud_setup import Bare, Settings
from harness import WRK_SCRIPT, LoadConfig, free_port, load_client

from splitinfer.shared.frame import FRAME_TYPE
from splitinfer.sim.daemon import Daemon, command

ROOT = Path(__file__).resolve().parent.parent
BASE_COMMIT = "66ce796"
TARGET_CPU_RATIO = 1.5
TARGET_UNET = 0.75


# -- packages and frames ---------------------------------------------------------------


def null_package(root: Path) -> tuple[Path, Any]:
    """Relu -> Sigmoid on 16 floats, cut c0 (all in the cloud), at ``root/repo/null/1``."""
    import onnx
    from graphs import f32, make
    from onnx import helper

    from splitinfer.partitioner.pipeline import prepare, write_package

    root.mkdir(parents=True, exist_ok=True)
    src = root / "null.onnx"
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Sigmoid", ["r"], ["y"])]
    onnx.save(make(nodes, [f32("x", ["N", 16])], [f32("y", ["N", 16])]), str(src))
    prepared = prepare(src)
    plan = next(p for p in prepared.space.plans() if p.crossing == ("x",))
    return root / "repo", write_package(prepared, plan, root / "repo" / "null" / "1")


def unet_package(root: Path, size: int, cut: str) -> tuple[Path, Path, Any]:
    """The zoo's depth-5 U-Net at ``size`` squared, cut at ``cut``: the repository, the
    cloud segment, the manifest."""
    from splitinfer.models.zoo import ZOO, export
    from splitinfer.partitioner.pipeline import prepare, write_package

    root.mkdir(parents=True, exist_ok=True)
    src = root / "unet.onnx"
    export(ZOO["unet"], src)
    prepared = prepare(src, {"x": [1, 3, size, size]})
    plans = {p.id: p for p in prepared.space.plans()}
    if cut not in plans:
        raise SystemExit(f"--unet-cut {cut}: no such cut (the U-Net has {len(plans)})")
    manifest = write_package(prepared, plans[cut], root / "repo" / "unet" / "1")
    return root / "repo", root / "repo" / "unet" / "1" / manifest.cut.cloud.file, manifest


def sample_shape(manifest: Any) -> tuple[int, ...]:
    """The cut tensor's shape without the batch: its analysed size where a dim is free."""
    (spec,) = manifest.cut.tensors
    analysed = manifest.cut.sample_shapes.get(spec.name)
    return tuple(int(d) for d in (analysed or spec.shape[1:]))


def frames(manifest: Any, n: int) -> tuple[list[bytes], list[np.ndarray]]:
    """``n`` raw request frames of one sample each, and their arrays."""
    from splitinfer.shared.codecs import RAW
    from splitinfer.shared.frame import Request, WireTensor, encode_request

    (spec,) = manifest.cut.tensors
    rng = np.random.default_rng(0)
    shape = (1, *sample_shape(manifest))
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]
    cut, name = manifest.cut.id, manifest.model_name
    bodies = [
        encode_request(Request(f"r{i}", name, "", cut, (WireTensor(spec.name, a, RAW),)))
        for i, a in enumerate(arrays)
    ]
    return bodies, arrays


# -- the two services ------------------------------------------------------------------


def new_argv(repo: Path, settings: Settings) -> list[str]:
    """This tree's ``cloud-service`` (``Settings``, shared with bench_cloud, keeps its
    flags in today's spelling)."""
    return settings.service_argv(repo, batching=True)


def base_argv(repo: Path, settings: Settings) -> list[str]:
    """The baseline's ``cloud-service`` with the same settings, in that commit's spelling."""
    return [
        *command("cloud-service"),
        "--repository", str(repo), "--listen", "127.0.0.1:0", "--no-auth", "--accept-raw",
        "--log-level", "warning", "--max-batch-size", str(settings.max_batch),
        "--max-queue-delay-ms", str(settings.delay_ms), "--max-queue-size", "4096",
        "--batching",
    ]  # fmt: skip


def base_path(commit: str, tree: Path | None) -> Path:
    """A folder for ``PYTHONPATH`` in which ``splitinfer`` is ``commit``'s checkout (made
    with ``git worktree add`` beside this one unless ``tree`` is given)."""

    def git(*args: str, cwd: Path = ROOT) -> str:
        done = subprocess.run(
            ["git", "-C", str(cwd), *args], capture_output=True, text=True, check=False
        )
        if done.returncode:
            raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout.strip()

    if tree is None:
        sha = git("rev-parse", "--short=7", commit)
        tree = Path(tempfile.gettempdir()) / f"splitinfer-base-{sha}"
        if not (tree / "__init__.py").exists():
            git("worktree", "add", "--detach", str(tree), sha)
    sha = git("rev-parse", "--short=7", "HEAD", cwd=tree)
    folder = tree.parent / f"{tree.name}.pythonpath"
    folder.mkdir(exist_ok=True)
    link = folder / "splitinfer"
    if not link.is_symlink() or link.resolve() != tree.resolve():
        link.unlink(missing_ok=True)
        link.symlink_to(tree.resolve())
    where = subprocess.run(
        [sys.executable, "-c", "import splitinfer; print(splitinfer.__file__)"],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(folder)},
    ).stdout.strip()  # fmt: skip
    if Path(where).resolve().parent != tree.resolve():
        raise SystemExit(f"PYTHONPATH={folder} imports {where}, not the base at {tree}")
    print(f"base: {sha} at {tree}; its splitinfer.__file__ is {where} (PYTHONPATH={folder})")
    return folder


# -- measuring -------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One system at one level in one round."""

    system: str
    concurrency: int
    round: int
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    server_us: float  # the server's CPU µs per request answered in the window
    loop_us: float  # ... of which its main thread's (the event loop's, in cloud-service)
    client_us: float  # the load generator's CPU µs per request
    loadavg: float  # the machine's 1-minute load average after the window


def server_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) so far of process ``pid`` and its children, and of the
    process's main thread alone."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in (root, *root.children(recursive=True)):
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            t = proc.cpu_times()
            total += t.user + t.system
    main = next((t for t in root.threads() if t.id == pid), None)
    return total, 0.0 if main is None else main.user_time + main.system_time


def _since(before: tuple[float, float], pid: int) -> tuple[float, float]:
    now = server_cpu(pid)
    return now[0] - before[0], now[1] - before[1]


@dataclass(frozen=True)
class Loader:
    """The closed loop at one level: wrk when there is one, else aiohttp in this process."""

    client: str
    seconds: float

    def sample(
        self, system: str, pid: int, url: str, bodies: Sequence[bytes], ctype: str, c: int, rnd: int
    ) -> Sample:
        got, (used, loop), client = self.run(pid, url, bodies, ctype, c)
        n = max(1, int(got["requests"]))
        return Sample(
            system, c, rnd, got["rps"], got["p50_ms"], got["p99_ms"], int(got["requests"]),
            int(got["errors"]), 1e6 * used / n, 1e6 * loop / n, 1e6 * client / n,
            os.getloadavg()[0],
        )  # fmt: skip

    def run(
        self, pid: int, url: str, bodies: Sequence[bytes], ctype: str, c: int
    ) -> tuple[dict[str, float], tuple[float, float], float]:
        """(figures, server CPU seconds (all, main thread), load generator CPU seconds)
        of one window."""
        if self.client != "wrk":
            return self._aiohttp(pid, url, bodies, ctype, c)
        with tempfile.TemporaryDirectory(prefix="bench-frontend-") as tmp:
            files = []
            for i, body in enumerate(bodies):
                files.append(Path(tmp) / f"{i}.body")
                files[-1].write_bytes(body)
            cmd = ["wrk", "-t1", f"-c{c}", "-s", str(WRK_SCRIPT)]
            args = ["--timeout", "30s", url, "--", ctype, *map(str, files)]
            subprocess.run([*cmd, "-d1s", *args], capture_output=True, check=True)  # warm-up
            ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu0 = server_cpu(pid)
            out = subprocess.run(
                [*cmd, f"-d{max(1, round(self.seconds))}s", *args],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            used = _since(cpu0, pid)
            ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        line = next((ln for ln in out.splitlines() if ln.startswith("WRK-RESULT ")), None)
        if line is None:
            raise RuntimeError(f"wrk printed no result: {out[-500:]}")
        r = json.loads(line.split(" ", 1)[1])
        figures = {
            "requests": r["requests"],
            "rps": r["requests"] / (r["duration_us"] / 1e6),
            "p50_ms": r["p50_us"] / 1000,
            "p99_ms": r["p99_us"] / 1000,
            "errors": r["socket_errors"] + r["non_2xx"],
        }
        client = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
        return figures, used, client

    def _aiohttp(
        self, pid: int, url: str, bodies: Sequence[bytes], ctype: str, c: int
    ) -> tuple[dict[str, float], tuple[float, float], float]:
        load = LoadConfig("aiohttp", self.seconds)
        cpu0 = server_cpu(pid)
        got = load.run(url, bodies, ctype, c)
        # the harness's window follows its warm-up: share the server's CPU out over both
        share = self.seconds / (self.seconds + load.warmup_s)
        used = tuple(share * x for x in _since(cpu0, pid))
        figures = {"requests": got.requests, "rps": got.rps, "p50_ms": got.p50_ms,
                   "p99_ms": got.p99_ms, "errors": got.errors}  # fmt: skip
        return figures, (used[0], used[1]), got.client_cpu_s


HEADER = (
    f"{'system':<10} {'conc':>4} {'round':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
    f"{'errors':>6} {'srv µs/req':>10} {'loop µs':>8} {'gen µs/req':>10} {'load':>5}"
)


def show(s: Sample) -> None:
    print(
        f"{s.system:<10} {s.concurrency:>4} {s.round:>5} {s.rps:>9.1f} {s.p50_ms:>8.2f} "
        f"{s.p99_ms:>8.2f} {s.errors:>6} {s.server_us:>10.1f} {s.loop_us:>8.1f} "
        f"{s.client_us:>10.1f} {s.loadavg:>5.1f}",
        flush=True,
    )


@dataclass(frozen=True)
class Target:
    """A server to measure: its name, how it starts, where its requests go."""

    name: str
    argv: list[str]
    path: str  # the inference path
    ready: str  # a path that answers 200 once it serves
    bodies: list[bytes]
    ctype: str
    env: dict[str, str] = field(default_factory=dict)
    port: int | None = None  # chosen beforehand (the peers), else read from its output


@contextlib.contextmanager
def started(targets: Sequence[Target]) -> Iterator[dict[str, Daemon]]:
    """Every target's process, up and serving, in its own process group."""
    with contextlib.ExitStack() as stack:
        up = {}
        for t in targets:
            url = f"http://127.0.0.1:{t.port}" if t.port else None
            daemon = Daemon(t.argv, url=url, ready=t.ready, env=t.env, new_session=True)
            up[t.name] = stack.enter_context(daemon)
        yield up


def rounds(
    targets: Sequence[Target], loader: Loader, n: int, levels: Sequence[int]
) -> list[Sample]:
    """Every target at every level, ``n`` times, the targets' order alternating."""
    out = []
    with started(targets) as up:
        for rnd in range(n):
            for c in levels:
                for t in targets if rnd % 2 == 0 else list(reversed(targets)):
                    daemon = up[t.name]
                    assert daemon.pid is not None
                    url = daemon.url + t.path
                    out.append(loader.sample(t.name, daemon.pid, url, t.bodies, t.ctype, c, rnd))
                    show(out[-1])
    return out


# -- the summary ------------------------------------------------------------------------


def spread(values: Sequence[float]) -> str:
    """The median and, over several, the range."""
    med = statistics.median(values)
    return f"{med:.1f}" if len(values) == 1 else f"{med:.1f} ({min(values):.1f}-{max(values):.1f})"


def summary(samples: Sequence[Sample]) -> list[tuple[str, bool | None]]:
    """Medians (ranges) per system and level; the base/new CPU ratio round by round."""
    print(
        f"\n{'system':<10} {'conc':>4} {'req/s median (range)':>26} {'p50 ms':>7} "
        f"{'srv µs/req median (range)':>27} {'gen µs/req':>10}"
    )
    systems = list(dict.fromkeys(s.system for s in samples))
    levels = sorted({s.concurrency for s in samples})
    for c in levels:
        for name in systems:
            got = [s for s in samples if s.system == name and s.concurrency == c]
            if got:
                print(
                    f"{name:<10} {c:>4} {spread([s.rps for s in got]):>26} "
                    f"{statistics.median(s.p50_ms for s in got):>7.2f} "
                    f"{spread([s.server_us for s in got]):>27} "
                    f"{statistics.median(s.client_us for s in got):>10.1f}"
                )
    verdicts: list[tuple[str, bool | None]] = []
    for c in levels:
        at = {(s.system, s.round): s for s in samples if s.concurrency == c}

        def med(system: str, w: str, at: dict[tuple[str, int], Sample] = at) -> float:
            return float(
                statistics.median(getattr(s, w) for (n, _), s in at.items() if n == system)
            )

        pairs = sorted(r for (n, r) in at if n == "base" and ("new", r) in at)
        ratios = [at["base", r].server_us / at["new", r].server_us for r in pairs]
        if ratios:
            ratio = statistics.median(ratios)
            verdicts.append((
                f"c={c}: server CPU per request, base {med('base', 'server_us'):.0f} µs / new "
                f"{med('new', 'server_us'):.0f} µs = {ratio:.2f}x (round by round: "
                f"{', '.join(f'{x:.2f}' for x in ratios)}; target >= {TARGET_CPU_RATIO}x); "
                f"req/s {med('base', 'rps'):.0f} -> {med('new', 'rps'):.0f}",
                ratio >= TARGET_CPU_RATIO,
            ))  # fmt: skip
        if any(n == "litserve" for n, _ in at) and any(n == "new" for n, _ in at):
            verdicts.append((
                f"c={c}: new {med('new', 'rps'):.0f} req/s at {med('new', 'server_us'):.0f} µs "
                f"of CPU a request; LitServe {med('litserve', 'rps'):.0f} req/s at "
                f"{med('litserve', 'server_us'):.0f} µs "
                f"({med('new', 'rps') / med('litserve', 'rps'):.1f}x the rate)",
                None,
            ))  # fmt: skip
        if any(n == "http-echo" for n, _ in at) and any(n == "new" for n, _ in at):
            verdicts.append((
                f"c={c}: an aiohttp server answering a canned frame takes "
                f"{med('http-echo', 'server_us'):.0f} µs of CPU a request",
                None,
            ))  # fmt: skip
    return verdicts


# -- the U-Net --------------------------------------------------------------------------


def unet_rows(
    work: Path, args: argparse.Namespace, settings: Settings, base: Path | None, loader: Loader
) -> list[tuple[str, bool | None]]:
    """Each service at 32 connections on the U-Net's cloud segment vs a bare session."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return [("U-Net row skipped: torch is not installed (pip install -e '.[torch]')", None)]
    repo, segment, manifest = unet_package(work / "unet", args.unet_size, args.unet_cut)
    sample = sample_shape(manifest)
    print(
        f"\nU-Net {args.unet_size}x{args.unet_size}, cut {manifest.cut.id}: the cloud takes "
        f"{list(sample)} float32 ({4 * int(np.prod(sample)) // 1024} KiB), "
        f"{manifest.cut.cloud_flops / 1e6:.0f} MFLOP a sample"
    )
    bare = Bare(segment, sample, settings.spinning)
    table = bare.sweep(seconds=min(args.seconds, 1.5))
    print("bare ONNX Runtime, same session options: " + ", ".join(
        f"batch {b} {rate:.0f}/s" + (" (best)" if b == bare.best else "")
        for b, (rate, _) in table.items()
    ))  # fmt: skip
    bodies, _ = frames(manifest, 16)
    systems: list[tuple[str, list[str], dict[str, str]]] = [("new", new_argv(repo, settings), {})]
    if base is not None:
        systems.append(("base", base_argv(repo, settings), {"PYTHONPATH": str(base)}))
    print(
        f"{'system':<10} {'conc':>4} {'samples/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'bare best':>10} {'share':>6} {'errors':>6} {'srv µs':>7} {'loop µs':>7} "
        f"{'gen µs':>7} {'bare µs':>7}"
    )
    out: list[tuple[str, bool | None]] = []
    for name, argv, env in systems:
        with Daemon(argv, ready="/readyz", env=env, new_session=True) as srv:
            assert srv.pid is not None
            before = bare.now()
            url = f"{srv.url}/v1/models/{manifest.model_name}/infer"
            got, (used, loop), client = loader.run(srv.pid, url, bodies, FRAME_TYPE, 32)
            ceiling, _ = bare.around(before)
        share = got["rps"] / ceiling
        per = 1e6 / max(1, got["requests"])  # µs per sample
        model_us = 1000 * bare.ceiling_cpu_ms  # the bare session's CPU a sample, at its best
        print(
            f"{name:<10} {32:>4} {got['rps']:>10.1f} {got['p50_ms']:>8.2f} "
            f"{got['p99_ms']:>8.2f} {ceiling:>10.1f} {100 * share:>5.0f}% "
            f"{int(got['errors']):>6} {used * per:>7.0f} {loop * per:>7.0f} {client * per:>7.0f} "
            f"{model_us:>7.0f}",
            flush=True,
        )
        line = (
            f"U-Net c=32 ({name}): {got['rps']:.0f} samples/s = {100 * share:.0f}% of a bare "
            f"session's best ({ceiling:.0f}/s around it); CPU a sample: the event loop "
            f"{loop * per:.0f} µs and the load generator {client * per:.0f} µs beside the "
            f"model's {model_us:.0f} µs (bare), the service's threads {used * per:.0f} µs in all"
        )
        if name == "new":
            out.append((f"{line} (target >= {100 * TARGET_UNET:.0f}%)", share >= TARGET_UNET))
        else:
            out.append((line, None))
    return out


# -- the run ----------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per window")
    p.add_argument("--rounds", type=int, default=3, help="times every level is measured")
    p.add_argument("--levels", default="1,32", help="concurrency levels")
    p.add_argument("--base", default=BASE_COMMIT, help="the baseline commit")
    p.add_argument("--base-tree", type=Path, help="a checkout of the baseline, there already")
    p.add_argument("--no-base", action="store_true", help="leave the baseline out")
    p.add_argument("--no-peer", action="store_true", help="leave LitServe out")
    p.add_argument("--no-echo", action="store_true", help="leave the aiohttp echo server out")
    p.add_argument("--no-unet", action="store_true", help="leave the U-Net row out")
    p.add_argument("--unet-size", type=int, default=32, help="U-Net input H = W (a multiple of 16)")
    p.add_argument("--unet-cut", default="c29", help="the U-Net cut the cloud serves")
    p.add_argument("--client", choices=("auto", "wrk", "aiohttp"), default="auto")
    p.add_argument("--json", type=Path, help="write the samples and verdicts here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    client = load_client(args.client)
    loader = Loader(client, args.seconds)
    levels = [int(v) for v in args.levels.split(",")]
    settings = Settings(load=LoadConfig(client, args.seconds))
    print(
        f"cpus: {os.cpu_count()}; load average {os.getloadavg()[0]:.1f}; load generator: "
        f"{client}; {args.seconds:g} s windows, {args.rounds} rounds"
    )
    base = None if args.no_base else base_path(args.base, args.base_tree)
    work = Path(tempfile.mkdtemp(prefix="bench-frontend-"))
    try:
        repo, manifest = null_package(work / "null")
        bodies, arrays = frames(manifest, 64)
        infer = f"/v1/models/{manifest.model_name}/infer"
        targets = [Target("new", new_argv(repo, settings), infer, "/readyz", bodies, FRAME_TYPE)]
        if base is not None:
            env = {"PYTHONPATH": str(base)}
            argv_base = base_argv(repo, settings)
            targets.insert(0, Target("base", argv_base, infer, "/readyz", bodies, FRAME_TYPE, env))
        print("\nnull model: Relu -> Sigmoid on 16 floats, all in the cloud\n" + HEADER)
        samples = rounds(targets, loader, args.rounds, levels)
        peers = []
        if not args.no_echo:
            port = free_port()
            argv = cloud_peers.echo_argv(port)
            peers.append(
                Target("http-echo", argv, "/echo", "/readyz", bodies, FRAME_TYPE, port=port)
            )
        if not args.no_peer and cloud_peers.HAVE_LITSERVE:
            port = free_port()
            log = work / "litserve-batches.log"
            log.touch()
            segment = repo / "null" / "1" / manifest.cut.cloud.file
            argv = cloud_peers.litserve_argv(segment, port, log, settings)
            jbodies = [
                json.dumps({"x": base64.b64encode(a.tobytes()).decode()}).encode() for a in arrays
            ]
            json_type = "application/json"
            peers.append(
                Target("litserve", argv, "/predict", "/health", jbodies, json_type, port=port)
            )
        elif not args.no_peer:
            print("(LitServe is not installed: pip install -e '.[bench]')")
        for peer in peers:
            samples += rounds([peer], loader, args.rounds, levels)
        verdicts = summary(samples)
        if not args.no_unet:
            verdicts += unet_rows(work, args, settings, base, loader)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    for line, ok in verdicts:
        print(f"{'INFO' if ok is None else 'PASS' if ok else 'FAIL'}  {line}")
    if args.json:
        doc = {"samples": [asdict(s) for s in samples], "verdicts": verdicts}
        args.json.write_text(json.dumps(doc, indent=2))
    return 0 if all(ok is not False for _, ok in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
