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
from splitinfer.cloud.config import (
    SECTIONS,
    ServiceConfig,
    apply_override,
    build_config,
    load_toml,
    scalar_fields,
)
from splitinfer.cloud.server import serve
from splitinfer.shared.cli import ArgumentParser, run_cli
from splitinfer.shared.errors import ConfigError

PROG = "cloud-service"
_METAVARS = {
    "repository": "DIR",
    "listen": "HOST:PORT",
    "credentials": "FILE",
    "tls_cert": "FILE",
    "tls_key": "FILE",
    "trt_cache_dir": "DIR",
    "log_level": "LEVEL",
}


def _flag(f: dataclasses.Field[Any]) -> str:
    return "--" + (f.metadata.get("flag") or f.name).replace("_", "-")


def _add(group: argparse._ArgumentGroup, f: dataclasses.Field[Any], dest: str) -> None:
    default = f.default
    help_text = f"{f.metadata['help']} (default: {_shown(default)})"
    if isinstance(default, bool):
        action: Any = "store_true" if default is False else argparse.BooleanOptionalAction
        group.add_argument(
            _flag(f), dest=dest, action=action, default=argparse.SUPPRESS, help=help_text
        )
        return
    kind: Any = str
    metavar = _METAVARS.get(f.name, "VALUE")
    if isinstance(default, int):
        kind, metavar = int, "N"
    elif isinstance(default, float):
        kind, metavar = float, "X"
    elif isinstance(default, tuple):
        metavar = "A,B,..."
    group.add_argument(
        _flag(f), dest=dest, type=kind, metavar=metavar, default=argparse.SUPPRESS, help=help_text
    )


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value)
    return repr(value) if value == "" else str(value)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Serve the cloud segments of split packages: batching, versions, metrics.",
    )
    p.add_argument("--config", type=Path, metavar="FILE", help="TOML config file")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="set any config key, TOML value syntax (repeatable), "
        'e.g. models.resnet.versions=\'["1","2"]\' or models.resnet.canary_percent=10',
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the effective config as JSON and exit"
    )
    p.add_argument("--version", action="version", version=f"splitinfer {__version__}")
    service = p.add_argument_group("service")
    for f in scalar_fields(ServiceConfig):
        _add(service, f, f.name)
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(section)
        for f in scalar_fields(cls):
            _add(group, f, f"{section}.{f.name}")
    return p


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    """Defaults, then the config file, then ``--set``, then the flags."""
    data: dict[str, Any] = load_toml(args.config) if args.config else {}
    for assignment in args.set:
        apply_override(data, assignment)
    for dest, value in vars(args).items():
        if dest in ("config", "set", "print_config"):
            continue
        section, _, name = dest.rpartition(".")
        target = data.setdefault(section, {}) if section else data
        if not isinstance(target, dict):
            raise ConfigError(f"[{section}] must be a table")
        target[name] = list(value.split(",")) if section and name == "providers" else value
    return build_config(data, where=str(args.config) if args.config else "options")


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
    asyncio.run(_run(config))
    return 0


async def _run(config: ServiceConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await serve(config, stop, started=lambda url: print(f"{PROG}: listening on {url}", flush=True))


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, _body, argv)


if __name__ == "__main__":
    sys.exit(main())
