"""``netsim fleet SCENARIO.toml``: a fleet of devices and a cloud of replicas, simulated.

    netsim fleet sim/scenarios/fleet_demo.toml [-o DIR] [--replicas N] [--devices N]
                 [--duration 10min] [--capacity --p99 300ms] [--no-plots] [-q]

Prints the table (percentiles end to end and per component, replicas, cuts, cost) and
writes ``report.json``, ``latency-cdf.png`` and ``p99-over-time.png`` to DIR; with
``--capacity`` it searches for the fewest replicas that meet the p99 target, prints the
answer with its margin and adds ``p99-vs-replicas.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

PROG = "netsim fleet"


def add_fleet_command(commands: Any) -> None:
    """Add ``fleet`` to ``netsim``'s subcommands (``sim/cli.py``)."""
    from splitinfer.shared.cli import add_debug_flag

    p = commands.add_parser(
        "fleet",
        help="simulate a fleet of devices and a cloud of replicas on virtual time",
        description="Simulate N devices (each with its package, link and requests) and R "
        "cloud replicas running the real batcher; percentiles, utilisation, cut switches, "
        "cost; --capacity finds the fewest replicas that meet a p99 target. "
        "docs/netsim.md (Fleet) has the scenario format.",
    )
    p.add_argument("scenario", type=Path, help="the fleet scenario TOML file")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        metavar="DIR",
        help="output folder (default: netsim-fleet-NAME)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="cloud replicas (default: the scenario's)",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="devices in all, the groups in proportion (default: the scenario's)",
    )
    p.add_argument(
        "--duration",
        default=None,
        metavar="DURATION",
        help="simulated time, e.g. 10min (default: the scenario's)",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed (default: the scenario's)")
    p.add_argument(
        "--capacity", action="store_true", help="search for the fewest replicas that meet --p99"
    )
    p.add_argument(
        "--p99",
        default="300ms",
        metavar="DURATION",
        help="the p99 target of --capacity (default: 300ms)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="ask every chooser and the batcher after every event (slow; a check)",
    )
    p.add_argument("--no-plots", action="store_true", help="write report.json only")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    add_debug_flag(p)
    p.set_defaults(run=run_fleet_command)


def run_fleet_command(args: argparse.Namespace) -> int:
    import dataclasses

    from splitinfer.shared.errors import ConfigError
    from splitinfer.sim.fleet.capacity import search
    from splitinfer.sim.fleet.engine import run_fleet
    from splitinfer.sim.fleet.reading import load_fleet
    from splitinfer.sim.fleet.report import (
        plot_cdf,
        plot_replicas,
        plot_timeline,
        summary,
        table,
        write_json,
    )
    from splitinfer.sim.fleet.scenario import parse_span

    def say(message: str) -> None:
        if not args.quiet:
            print(f"netsim: {message}", file=sys.stderr, flush=True)

    def warn(message: str) -> None:
        print(f"netsim: warning: {message}", file=sys.stderr)

    sc = load_fleet(args.scenario, warn=warn)
    duration = parse_span(args.duration, "--duration") if args.duration else None
    sc = sc.scaled(args.devices, duration)
    if args.seed is not None:
        sc = dataclasses.replace(sc, seed=args.seed)
    if args.replicas is not None:
        if args.replicas < 1:
            raise ConfigError(f"--replicas {args.replicas}: give at least 1")
        sc = sc.with_replicas(args.replicas)
    out = args.output or Path(f"netsim-fleet-{sc.name}")
    say(f"{sc.name}: {sc.devices:,} devices, {sc.duration_s:g} s, {sc.cloud.replicas} replica(s)")

    def simulate(s: Any) -> Any:
        say(f"simulating with {s.cloud.replicas} replica(s)")
        return run_fleet(s, exact=args.exact, progress=say)

    found = None
    if args.capacity:
        target = parse_span(args.p99, "--p99")
        found = search(sc, target, simulate=simulate, progress=say)
        run = found.run
        assert run is not None
    else:
        run = simulate(sc)
    doc = summary(run)
    if found is not None:
        doc["capacity"] = {
            "replicas": found.replicas,
            "p99_ms": found.p99_s * 1e3,
            "target_ms": found.target_s * 1e3,
            "margin": found.margin,
            "tried": {str(k): v * 1e3 for k, v in sorted(found.tried.items())},
        }
    write_json(doc, out / "report.json")
    print(table(doc))
    if found is not None:
        print(found.describe())
    if not args.no_plots:
        plot_cdf(run, out / "latency-cdf.png")
        plot_timeline(run, out / "p99-over-time.png")
        if found is not None:
            plot_replicas(found.tried, found.target_s, out / "p99-vs-replicas.png", sc.name)
    print(f"netsim: report -> {out / 'report.json'} ({run.wall_s:.1f} s to simulate)", flush=True)
    return 0
