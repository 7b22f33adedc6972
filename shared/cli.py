"""The one place where command-line entry points turn errors into exit codes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from splitinfer.shared.errors import ConfigError, SplitInferError

#: Exit code for any error caused by input (bad model, flag, file, ...).
EXIT_USAGE = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors raise :class:`ConfigError`, so that :func:`run_cli`
    prints them as one line and exits 2 like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def run_cli(
    prog: str, body: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None
) -> int:
    """Run ``body(argv)``; print a :class:`SplitInferError` as one line and return 2.

    ``KeyboardInterrupt`` returns 130 quietly. Any other exception is a bug and
    propagates with its traceback.
    """
    try:
        return body(argv)
    except SplitInferError as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"{prog}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # the reader went away (`partition ... | head`); not an error of ours
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
