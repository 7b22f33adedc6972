"""Shell completion for splitinfer's six commands, generated from their own argparse
parsers by shtab (the ``completion`` extra: ``pip install 'splitinfer[completion]'``).

    python -m splitinfer.completion bash > ~/.local/share/bash-completion/completions/splitinfer
    python -m splitinfer.completion zsh edge-agent > ~/.zfunc/_edge-agent

With no tool named it prints one script that completes all of them. Options whose
value is a file or a folder complete paths; ``edge-agent profile`` completes too.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from splitinfer.shared.cli import ArgumentParser, run_cli
from splitinfer.shared.errors import ConfigError

PROG = "splitinfer-completion"

#: each command (``[project.scripts]``) and the ``module:function`` that builds its parser
TOOLS: dict[str, str] = {
    "partition": "splitinfer.partitioner.request:build_parser",
    "edge-agent": "splitinfer.edge.cli:build_parser",
    "cloud-service": "splitinfer.cloud.cli:build_parser",
    "netsim": "splitinfer.sim.cli:build_parser",
    "splitinfer-demo": "splitinfer.demo:build_parser",
    "splitinfer-triton": "splitinfer.cloud.triton:build_parser",
}
SHELLS = ("bash", "zsh", "tcsh")


def parser_of(tool: str) -> argparse.ArgumentParser:
    """The parser ``tool`` runs with, its path options marked for path completion."""
    if tool not in TOOLS:
        raise ConfigError(f"no command named {tool!r} (known: {', '.join(TOOLS)})")
    module, function = TOOLS[tool].split(":")
    build: Callable[[], argparse.ArgumentParser] = getattr(
        importlib.import_module(module), function
    )
    parser = build()
    _mark_paths(parser)
    return parser


def script(shell: str, tools: Sequence[str] = ()) -> str:
    """The completion script of ``tools`` (all six when empty) for ``shell``."""
    try:
        import shtab
    except ImportError as exc:
        raise ConfigError(
            "shell completion needs shtab: pip install 'splitinfer[completion]'"
        ) from exc
    if shell not in SHELLS:
        raise ConfigError(f"shell {shell!r}: give one of {', '.join(SHELLS)}")
    return "\n".join(shtab.complete(parser_of(t), shell=shell) for t in tools or TOOLS)


def _mark_paths(parser: argparse.ArgumentParser) -> None:
    """Tell shtab which options take a file or a folder (``type=Path``, or a FILE or
    DIR metavar), in the parser and its subcommands."""
    import shtab

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _mark_paths(sub)
            continue
        if not action.option_strings and action.nargs == 0:
            continue
        metavar = str(action.metavar or "")
        if metavar.startswith("DIR"):
            action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
        elif action.type is Path or metavar.startswith("FILE"):
            action.complete = shtab.FILE  # type: ignore[attr-defined]


def _main(argv: Sequence[str] | None) -> int:
    p = ArgumentParser(
        prog="python -m splitinfer.completion",
        description="Print a shell completion script for splitinfer's commands.",
    )
    p.add_argument("shell", choices=SHELLS, help="the shell the script is for")
    p.add_argument(
        "tools",
        nargs="*",
        metavar="TOOL",
        help=f"commands to complete (default all: {', '.join(TOOLS)})",
    )
    args = p.parse_args(argv)
    sys.stdout.write(script(args.shell, args.tools))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
