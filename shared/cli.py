"""The one place where command-line entry points turn errors into exit codes."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from splitinfer.shared.errors import ConfigError, SplitInferError

#: Exit code for any error caused by input (bad model, flag, file, ...).
EXIT_USAGE = 2
#: Exit code for a bug: an exception that is not a :class:`SplitInferError`
#: (``EX_SOFTWARE`` of sysexits.h).
EXIT_INTERNAL = 70
#: Exit code after Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130
#: The flag every command accepts, and the environment variable that does the same.
DEBUG_FLAG = "--debug"
DEBUG_ENV = "SPLITINFER_DEBUG"


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors raise :class:`ConfigError`, so that :func:`run_cli`
    prints them as one line and exits 2 like every other bad input, and whose epilog
    (the examples, :func:`examples`) is printed as written, one command a line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)

    def format_help(self) -> str:
        epilog, self.epilog = self.epilog, None
        try:
            text = super().format_help()
        finally:
            self.epilog = epilog
        return f"{text}\n{epilog.rstrip()}\n" if epilog else text


def examples(*lines: str) -> str:
    """An ``--help`` epilog: ``examples:`` and one command a line (2 to 4 of them)."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def add_version_flag(parser: argparse.ArgumentParser, version: str) -> None:
    """``--version``: prints ``TOOL splitinfer X.Y.Z`` (the same in every command)."""
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s splitinfer {version}",
        help="print the command and splitinfer's version, and exit",
    )


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``--debug`` to ``parser`` (and so to its ``--help``).

    :func:`run_cli` reads the flag from argv itself, so it also works when the
    failure comes before or after parsing; the parsed value is not needed, and
    its default is suppressed so that a subcommand's parser does not reset it.
    """
    parser.add_argument(
        DEBUG_FLAG,
        action="store_true",
        default=argparse.SUPPRESS,
        help=f"print the traceback of an error (also: {DEBUG_ENV}=1)",
    )


def debug_requested(argv: Sequence[str] | None) -> bool:
    """Whether ``--debug`` is among the flags (before any ``--``) or ``SPLITINFER_DEBUG=1``."""
    if os.environ.get(DEBUG_ENV, "").strip().lower() in {"1", "true", "yes", "on"}:
        return True
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" in args:
        args = args[: args.index("--")]
    return DEBUG_FLAG in args


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def run_cli(
    prog: str, body: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None
) -> int:
    """Run ``body(argv)`` and turn whatever escapes it into one line on stderr.

    A :class:`SplitInferError` (bad input) returns 2, ``KeyboardInterrupt`` 130,
    and any other exception (a bug) 70 with ``PROG: internal error: TYPE:
    MESSAGE``. With ``--debug`` in argv or ``SPLITINFER_DEBUG=1`` the traceback
    is printed before that line; the exit code is the same.
    """
    try:
        return body(argv)
    except SplitInferError as exc:
        if debug_requested(argv):
            traceback.print_exc(file=sys.stderr)
        message = _one_line(exc) or type(exc).__name__
        print(f"{prog}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # the reader went away (`partition ... | head`); not an error of ours
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        what = type(exc).__name__ + (f": {_one_line(exc)}" if _one_line(exc) else "")
        if debug_requested(argv):
            traceback.print_exc(file=sys.stderr)
            print(f"{prog}: internal error: {what}", file=sys.stderr)
        else:
            print(
                f"{prog}: internal error: {what} (run with {DEBUG_FLAG} for the traceback)",
                file=sys.stderr,
            )
        return EXIT_INTERNAL
