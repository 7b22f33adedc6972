"""``cloud-service``: the cloud daemon.

    cloud-service --repository DIR [--listen HOST:PORT] [--config FILE]
                  [--credentials FILE | --no-auth] [--tls-cert F --tls-key F] ...

Every option of the TOML config file is also a flag (generated from the
config dataclasses); per-model policies are set with
``--set models.NAME.KEY=VALUE``. Flags override the file. On start it prints
``cloud-service: listening on URL`` to stdout; SIGINT/SIGTERM drain and stop.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from splitinfer import __version__
from splitinfer.cloud.config import ServiceConfig, build_config
from splitinfer.cloud.server import serve
from splitinfer.serving.loop import loop_factory, loop_name
from splitinfer.shared.cli import (
    ArgumentParser,
    add_debug_flag,
    add_version_flag,
    examples,
    run_cli,
)
from splitinfer.shared.options import add_flags, load_toml, merge_flags, set_key

PROG = "cloud-service"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Serve the cloud segments of split packages: batching, versions, metrics.",
        epilog=examples(
            "cloud-service --repository repo --credentials credentials.toml --listen 0.0.0.0:8080",
            "cloud-service --repository repo --no-auth --max-batch-size 16 "
            "--max-queue-delay 5ms --providers cuda,cpu",
            "cloud-service --config cloud.toml --set models.ocr.canary_percent=10 --print-config",
        ),
    )
    p.add_argument("--config", type=Path, metavar="FILE", help="TOML config file")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="set any config key, TOML value syntax (repeatable), "
        'e.g. models.resnet.versions=\'["1","2"]\' or models.resnet.canary_percent=10 '
        "(default: none)",
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the effective config as JSON and exit"
    )
    add_debug_flag(p)
    add_version_flag(p, __version__)
    add_flags(p, ServiceConfig, "service")
    return p


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    """Defaults, then the config file, then ``--set``, then the flags."""
    data: dict[str, Any] = load_toml(args.config) if args.config else {}
    for assignment in args.set:
        set_key(data, assignment)
    merge_flags(data, args, ServiceConfig)
    where = str(args.config) if args.config else "options"
    return build_config(data, where=where, warn=_warn)


def _warn(message: str) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def _jsonable(config: ServiceConfig) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))  # type: ignore[no-any-return]


def _body(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    if args.print_config:
        print(json.dumps(_jsonable(config), indent=2))
        return 0
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s cloud-service %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    with asyncio.Runner(loop_factory=loop_factory()) as runner:  # uvloop when installed
        runner.run(_run(config))
    return 0


async def _run(config: ServiceConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    logging.getLogger("splitinfer.cloud").info("event loop: %s", loop_name(loop))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await serve(config, stop, started=lambda url: print(f"{PROG}: listening on {url}", flush=True))


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, _body, argv)


if __name__ == "__main__":
    sys.exit(main())
