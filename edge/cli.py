"""``edge-agent``: the daemon, and ``edge-agent profile`` for per-node times.

    edge-agent --package DIR --cloud URL[,URL...] [--listen 127.0.0.1:PORT]
               [--credentials FILE] [--device-id ID] [--config FILE]
               [--model NAME[:VERSION]] [--ca-file F] [--<section>-<option> VALUE ...]
    edge-agent profile --package DIR -o profile.json [--batch 1,4] [--runs 10]
               [--providers cpu]

Every option of :class:`~splitinfer.edge.config.EdgeConfig` is a flag; a TOML
``--config`` file sets the same names and flags override it. The daemon prints
``edge-agent: listening on http://HOST:PORT`` once it serves (the real port
when ``--listen`` gives port 0) and stops cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from splitinfer import __version__
from splitinfer.edge.config import EdgeConfig, add_flags, config_from_args
from splitinfer.serving.sockets import ConnectionGate, bound_url, listen
from splitinfer.shared.cli import (
    DEBUG_FLAG,
    ArgumentParser,
    add_debug_flag,
    add_version_flag,
    examples,
    run_cli,
)
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.options import Deprecated, load_toml

PROG = "edge-agent"
LOG_LEVELS = ("debug", "info", "warning", "error")


PROFILE_HELP = "measure per-node latency on this device (for partition --edge-profile)"


def build_parser() -> argparse.ArgumentParser:
    """The daemon's flags, and ``profile`` as a command (parsed by :func:`profile_parser`:
    ``edge-agent profile ...`` never reaches the daemon's parser)."""
    p = _DaemonParser(
        prog=PROG,
        description="Run the device half of split models: a local HTTP API that answers "
        "with the package's edge segment and a cloud service. Without a command: the daemon.",
        epilog=examples(
            "edge-agent --package pkg --cloud http://127.0.0.1:8080 --no-verify "
            "--listen 127.0.0.1:8480",
            "edge-agent --config /etc/splitinfer/edge.toml --uplink-timeout 2s --providers cuda",
            "edge-agent profile --package pkg -o profile.json --batch 1,4",
        ),
    )
    p.add_argument("--config", type=Path, metavar="FILE", help="TOML file with these options")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="(default: info)")
    add_debug_flag(p)
    add_version_flag(p, __version__)
    add_flags(p)
    commands = p.add_subparsers(
        dest="command",
        metavar="COMMAND",
        title="commands",
        parser_class=ArgumentParser,
        action=_Commands,
    )
    commands.add_parser(
        "profile",
        parents=[profile_parser()],
        add_help=False,
        help=PROFILE_HELP,
        description=PROFILE_DESCRIPTION,
    )
    return p


class _Commands(argparse._SubParsersAction):  # type: ignore[type-arg]
    """The daemon's commands; a word that is none of them is an unrecognized argument
    (as it was before the daemon had commands), not an invalid choice."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if values and values[0] not in self.choices:
            extras = vars(namespace).setdefault(argparse._UNRECOGNIZED_ARGS_ATTR, [])
            extras.extend(values)
            return
        super().__call__(parser, namespace, values, option_string)


class _DaemonParser(ArgumentParser):
    """The daemon's parser: a word that is no command reaches :class:`_Commands`."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if not isinstance(action, _Commands):
            super()._check_value(action, value)


PROFILE_DESCRIPTION = (
    "Measure per-node latency of the package's model on this device, in the format "
    "partition --edge-profile reads."
)


def profile_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog=f"{PROG} profile",
        description=PROFILE_DESCRIPTION,
        epilog=examples(
            "edge-agent profile --package pkg -o profile.json",
            "edge-agent profile --package pkg -o profile.json --batch 1,4 --providers cuda",
        ),
    )
    p.add_argument("--package", type=Path, required=True, metavar="DIR", help="split package")
    p.add_argument(
        "-o", "--output", type=Path, required=True, metavar="FILE", help="profile JSON to write"
    )
    p.add_argument(
        "--batch", default="1", metavar="B[,B...]", help="batch sizes to measure (default: 1)"
    )
    p.add_argument("--runs", type=int, default=10, help="measured runs per batch (default: 10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up runs per batch (default: 3)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads of each session (default: ONNX Runtime decides)",
    )
    p.add_argument(
        "--providers",
        default="cpu",
        metavar="auto|P[,P...]",
        help="the execution providers to measure on, best first: tensorrt, cuda, cpu, or auto "
        "(default: cpu)",
    )
    p.add_argument(
        "--runtime-provider", action=Deprecated, dest="providers", new="--providers", type=str
    )
    add_debug_flag(p)
    return p


def _warn(message: str) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def resolve(argv: Sequence[str] | None) -> tuple[EdgeConfig, argparse.Namespace]:
    """The daemon's config from the command line (and its --config file)."""
    args = build_parser().parse_args(argv)
    base = load_toml(args.config) if args.config is not None else {}
    src = str(args.config) if args.config else "options"
    config = config_from_args(args, base, src, warn=_warn)
    if not config.cloud:
        raise ConfigError(
            "no cloud endpoint: give --cloud URL[,URL...] (or cloud = [...] in --config)"
        )
    return config, args


async def serve(
    config: EdgeConfig,
    stop: asyncio.Event | None = None,
    started: Callable[[str], None] | None = None,
    app: Any = None,
) -> None:
    """Run the agent until ``stop`` is set (by default on SIGTERM/SIGINT).

    ``started`` gets the URL it listens on (by default it is printed); ``app``
    replaces the one built from ``config`` (tests).
    """
    from aiohttp import web

    from splitinfer.edge.agent import create_app

    app = app if app is not None else create_app(config)
    q = config.queue
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        keepalive_timeout=q.keepalive_timeout_s,
        lingering_time=min(2.0, q.body_timeout_s),
    )
    await runner.setup()
    host, port = config.host_port
    gate = ConnectionGate(q.max_connections, q.header_timeout_s)
    try:
        server = await listen(runner, host, port, gate)
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"listen={config.listen}: cannot listen: {exc.strerror}") from exc
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
    url = bound_url(server)
    if started is not None:
        started(url)
    else:
        print(f"{PROG}: listening on {url}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        if started is None:
            print(f"{PROG}: stopping", file=sys.stderr, flush=True)
        server.close()
        await runner.cleanup()


def _main(argv: Sequence[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    lead = 1 if args[:1] == [DEBUG_FLAG] else 0  # `edge-agent --debug profile ...`
    if args[lead : lead + 1] == ["profile"]:
        return profile(args[:lead] + args[lead + 1 :])
    config, ns = resolve(args)
    logging.basicConfig(
        level=ns.log_level.upper(), format=f"{PROG}: %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve(config))
    return 0


def profile(argv: Sequence[str]) -> int:
    """``edge-agent profile``: measure, merge and write a node profile."""
    from splitinfer.edge.profile import profile_package

    args = profile_parser().parse_args(argv)
    try:
        batches = tuple(int(b) for b in args.batch.split(",") if b.strip())
    except ValueError:
        raise ConfigError(f"--batch {args.batch!r}: give batch sizes like 1,4") from None
    result: Any = profile_package(
        args.package,
        batch_sizes=batches,
        runs=args.runs,
        warmup=args.warmup,
        threads=args.threads,
        provider=args.providers,
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    result.profile.save(args.output)
    total = sum(result.profile.times[batches[0]].values())
    print(
        f"{PROG} profile: {len(result.profile.nodes)} nodes of {result.measured} on "
        f"{result.profile.device}: {total * 1e3:.3f} ms at batch {batches[0]} -> {args.output}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
