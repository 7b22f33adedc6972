"""``netsim``: network emulation for splitinfer.

    netsim link --uplink RATE|TRACE --downlink RATE|TRACE --delay 25ms \\
                --listen HOST:PORT --target HOST:PORT [--duration 60s]

RATE is ``5mbit``, ``500kB/s``, ... or ``unlimited``; TRACE a Mahimahi trace file
(``TRACE@30s`` replays it from 30 s in). ``netsim link`` prints the port it listens
on, then a line of counters every ``--report`` interval, on stdout.

    netsim run SCENARIO.toml [-o DIR]
    netsim compare --model M.onnx --traces T1 T2 ... [--duration 10s] [--rate 5]

``run`` compares strategies on one scenario (report.json and PNG plots);
``compare`` prints, per trace, each strategy's latency and the speedup of
auto/adaptive over cloud-only and edge-only.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from splitinfer import __version__
from splitinfer.shared.cli import (
    ArgumentParser,
    add_debug_flag,
    add_version_flag,
    examples,
    run_cli,
)
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.links import parse_duration
from splitinfer.shared.options import Deprecated
from splitinfer.shared.units import parse_size
from splitinfer.sim.config import Direction, LinkConfig, parse_outage
from splitinfer.sim.link import EmulatedLink

PROG = "netsim"
LISTEN = "127.0.0.1:0"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Trace-driven network emulation for splitinfer.",
        epilog=examples(
            "netsim link --uplink sim/traces/ATT-LTE-driving-2016.up --downlink 20mbit "
            "--delay 25ms --listen 127.0.0.1:9000 --target 127.0.0.1:8080",
            "netsim run sim/scenarios/att-lte.toml -o out/att",
            "netsim compare --model sim/scenarios/digits.onnx --traces sim/traces/*.up",
        ),
    )
    add_debug_flag(p)
    add_version_flag(p, __version__)
    commands = p.add_subparsers(
        dest="command", metavar="COMMAND", title="commands", parser_class=ArgumentParser
    )
    commands.required = True
    link = commands.add_parser(
        "link",
        help="run an emulated link: a TCP proxy from --listen to --target",
        description="A TCP proxy on loopback whose uplink (client -> target) and downlink "
        "(target -> client) are shaped by a fixed rate or a Mahimahi trace, with delay, "
        "jitter, loss and outages.",
    )
    link.add_argument(
        "--uplink",
        default="unlimited",
        metavar="RATE|TRACE",
        help="client -> target: a rate (5mbit, 500kB/s), a Mahimahi trace file "
        "(PATH or PATH@30s to start 30 s in), or unlimited (default: unlimited)",
    )
    link.add_argument(
        "--downlink",
        default="unlimited",
        metavar="RATE|TRACE",
        help="target -> client, as --uplink (default: unlimited)",
    )
    link.add_argument(
        "--delay",
        default="0ms",
        metavar="DURATION",
        help="one-way propagation delay (default: 0ms)",
    )
    link.add_argument(
        "--jitter",
        default="0ms",
        metavar="DURATION",
        help="each segment's delay varies by up to ± this (default: 0ms)",
    )
    link.add_argument(
        "--loss", type=float, default=0.0, help="probability a segment is lost (default: 0)"
    )
    link.add_argument(
        "--outage",
        action="append",
        default=[],
        metavar="START,DURATION",
        help="no delivery in this window of link time, e.g. 10s,5s (repeatable)",
    )
    link.add_argument(
        "--queue",
        default=None,
        metavar="SIZE",
        help="droptail queue bound per direction, e.g. 64KiB (default: unbounded)",
    )
    link.add_argument("--seed", type=int, default=0, help="seed of jitter and loss (default: 0)")
    link.add_argument(
        "--listen",
        default=LISTEN,
        metavar="HOST:PORT",
        help=f"address to listen on; port 0: any free one (default: {LISTEN})",
    )
    link.add_argument("--host", action=Deprecated, dest="host", new="--listen HOST:PORT", type=str)
    link.add_argument("--target", required=True, metavar="HOST:PORT", help="where to connect")
    link.add_argument(
        "--duration",
        default=None,
        metavar="DURATION",
        help="stop after this long (default: run until interrupted)",
    )
    link.add_argument(
        "--report",
        default="0s",
        metavar="DURATION",
        help="print counters at this interval, e.g. 1s (default: 0s, never)",
    )
    add_debug_flag(link)
    link.set_defaults(run=_run_link)
    run = commands.add_parser(
        "run",
        help="run a scenario: cloud service, edge agents behind links, a workload",
        description="Compare strategies (edge-only, cloud-only, fixed cuts, auto, adaptive) "
        "on the same emulated link; writes report.json and PNG plots.",
    )
    run.add_argument("scenario", type=Path, help="the scenario TOML file (docs/netsim.md)")
    run.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        metavar="DIR",
        help="output folder (default: netsim-NAME, NAME the scenario's)",
    )
    run.add_argument("--no-plots", action="store_true", help="write report.json only")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    add_debug_flag(run)
    run.set_defaults(run=_run_scenario)
    cmp = commands.add_parser(
        "compare",
        help="per trace, the latency of each strategy and the speedup of auto/adaptive",
        description="Neurosurgeon-style comparison of edge-only, cloud-only, auto and "
        "adaptive over several uplink traces.",
    )
    cmp.add_argument("--model", type=Path, required=True, help="the ONNX model")
    cmp.add_argument(
        "--traces",
        nargs="+",
        required=True,
        metavar="TRACE|RATE",
        help="the uplinks to compare on: Mahimahi trace files or rates (5mbit), one run each",
    )
    cmp.add_argument(
        "--duration",
        default="10s",
        metavar="DURATION",
        help="per strategy and trace (default: 10s)",
    )
    cmp.add_argument("--rate", type=float, default=5.0, help="Poisson requests/s (default: 5)")
    cmp.add_argument(
        "--delay", default="25ms", metavar="DURATION", help="one-way delay (default: 25ms)"
    )
    cmp.add_argument(
        "--downlink", default="10mbit", metavar="RATE", help="downlink (default: 10mbit)"
    )
    cmp.add_argument(
        "--slowdown", type=float, default=1.0, help="edge device this much slower (default: 1)"
    )
    cmp.add_argument(
        "--candidates", type=int, default=3, metavar="K", help="K of adaptive (default: 3)"
    )
    cmp.add_argument(
        "-o",
        "--output",
        type=Path,
        default=Path("netsim-compare"),
        metavar="DIR",
        help="output folder, one trace<i>/ per trace (default: netsim-compare)",
    )
    cmp.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    add_debug_flag(cmp)
    cmp.set_defaults(run=_run_compare)
    from splitinfer.sim.fleet.cli import add_fleet_command  # argparse only: light

    add_fleet_command(commands)
    return p


def parse_listen(args: argparse.Namespace) -> tuple[str, int]:
    """``--listen HOST:PORT``; the former ``--listen PORT`` (with ``--host HOST``) still
    reads, with one warning."""
    text, host = str(args.listen), getattr(args, "host", None)
    if text.isdigit():
        print(
            f"{PROG}: warning: --listen PORT is deprecated; use --listen HOST:PORT", file=sys.stderr
        )
        text = f"{host or '127.0.0.1'}:{text}"
    elif host is not None:
        raise ConfigError(f"--host {host} and --listen {text}: give the host in --listen only")
    where, sep, port = text.rpartition(":")
    if not sep or not where or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--listen {text!r} must be HOST:PORT, e.g. 127.0.0.1:0")
    return where.strip("[]"), int(port)


def parse_target(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--target {text!r} must be HOST:PORT, e.g. 127.0.0.1:8080")
    return host.strip("[]"), int(port)


def parse_direction(text: str, flag: str) -> Direction:
    """``RATE``, ``unlimited``, ``TRACE`` or ``TRACE@OFFSET``."""
    path, at, offset = text.rpartition("@")
    if at and path:
        try:
            return Direction.parse({"trace": path, "offset": offset})
        except ConfigError as exc:
            raise ConfigError(f"{flag}: {exc}") from None
    try:
        return Direction.parse(text)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def link_config(args: argparse.Namespace) -> LinkConfig:
    return LinkConfig(
        uplink=parse_direction(args.uplink, "--uplink"),
        downlink=parse_direction(args.downlink, "--downlink"),
        delay_ms=parse_duration(args.delay, "--delay") * 1000.0,
        jitter_ms=parse_duration(args.jitter, "--jitter") * 1000.0,
        loss=args.loss,
        outages=tuple(parse_outage(o) for o in args.outage),
        queue_bytes=None if args.queue is None else parse_size(args.queue, "--queue"),
        seed=args.seed,
    )


def _run_link(args: argparse.Namespace) -> int:
    config = link_config(args)
    target = parse_target(args.target)
    duration = parse_duration(args.duration, "--duration") if args.duration is not None else None
    report = parse_duration(args.report, "--report")
    host, port = parse_listen(args)
    asyncio.run(_serve(config, target, host, port, duration, report))
    return 0


async def _serve(
    config: LinkConfig,
    target: tuple[str, int],
    host: str,
    port: int,
    duration: float | None,
    report: float,
) -> None:
    try:
        link = EmulatedLink(config, target, host=host, port=port)
        await link.start()
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        print(
            f"{PROG}: link listening on {host}:{link.port} -> {target[0]}:{target[1]} "
            f"({config.describe()})",
            flush=True,
        )
        loop = asyncio.get_running_loop()
        end = None if duration is None else loop.time() + duration
        while end is None or loop.time() < end:
            step = report if report > 0 else 3600.0
            if end is not None:
                step = min(step, end - loop.time())
            await asyncio.sleep(max(step, 0.0))
            if report > 0:
                print(_counters(link), flush=True)
    finally:
        await link.close()
    if report <= 0:
        print(_counters(link), flush=True)


def _counters(link: EmulatedLink) -> str:
    return (
        f"t={link.now():.1f}s connections={link.connections} "
        f"up={link.uplink_stats.delivered_bytes}B queued={link.queued_bytes('uplink'):.0f}B "
        f"down={link.downlink_stats.delivered_bytes}B queued={link.queued_bytes('downlink'):.0f}B"
    )


def _run_scenario(args: argparse.Namespace) -> int:
    from splitinfer.sim.scenario import load_scenario

    scenario = load_scenario(args.scenario, warn=_warn)
    out = args.output or Path(f"netsim-{scenario.name}")
    doc = _execute(scenario, out, plots=not args.no_plots, progress=_progress(args.quiet))
    from splitinfer.sim.report import table

    print(table([(scenario.name, doc)]))
    print(f"{PROG}: report -> {out / 'report.json'}", flush=True)
    return 0


def _warn(message: str) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def _progress(quiet: bool, prefix: str = "") -> Callable[[str], None]:
    """Progress lines on stderr (``netsim: ...``), or nothing under ``-q``."""
    if quiet:
        return lambda _message: None

    def say(message: str) -> None:
        print(f"{PROG}: {prefix}{message}", file=sys.stderr, flush=True)

    return say


def _execute(
    scenario: Any, out: Path, plots: bool, progress: Callable[[str], None]
) -> dict[str, Any]:
    from splitinfer.sim.report import plot, report, write_json
    from splitinfer.sim.runner import run_scenario

    runs = asyncio.run(run_scenario(scenario, out, progress))
    doc = report(runs, _describe(scenario))
    write_json(doc, out / "report.json")
    if plots:
        progress("plotting")
        plot(runs, scenario.link, out)
    return doc


def _describe(scenario: Any) -> dict[str, Any]:
    return {
        "name": scenario.name,
        "model": str(scenario.model),
        "link": scenario.link.describe(),
        "backup_link": scenario.backup_link.describe() if scenario.backup_link else None,
        "agents": scenario.edge.agents,
        "agent_mode": scenario.edge.mode,
        "slowdown": scenario.edge.slowdown,
        "device": scenario.edge.device,
        "workload": dataclasses.asdict(scenario.workload),
        "strategies": list(scenario.strategies),
    }


def _run_compare(args: argparse.Namespace) -> int:
    from splitinfer.sim.report import table
    from splitinfer.sim.scenario import EdgeSpec, Scenario, WorkloadSpec

    docs = []
    for i, trace in enumerate(args.traces):
        link = LinkConfig(
            uplink=parse_direction(trace, "--traces"),
            downlink=parse_direction(args.downlink, "--downlink"),
            delay_ms=parse_duration(args.delay, "--delay") * 1000.0,
        )
        scenario = Scenario(
            model=args.model,
            link=link,
            name=f"trace{i}",
            strategies=("edge-only", "cloud-only", "auto", "adaptive"),
            candidates=args.candidates,
            edge=EdgeSpec(slowdown=args.slowdown),
            workload=WorkloadSpec(
                rate=args.rate, duration_s=parse_duration(args.duration, "--duration")
            ),
        )
        label = Path(trace).name
        say = _progress(args.quiet, f"[trace {i + 1}/{len(args.traces)} {label}] ")
        say(f"starting ({len(scenario.strategies)} strategies, {args.duration} each)")
        docs.append((label, _execute(scenario, args.output / f"trace{i}", False, say)))
    print(table(docs))
    return 0


def _body(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    run = args.run
    result: int = run(args)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, _body, argv)


if __name__ == "__main__":
    sys.exit(main())
