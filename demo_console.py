"""What ``splitinfer-demo`` says and where it writes: progress on stderr (whole lines
from any thread, and a line naming the running step whenever it has been quiet for
5 s), times formatted to be read, and the ``--out`` folder it owns."""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from splitinfer.shared.errors import ConfigError

#: The file that marks an output folder (-o DIR) as the demo's own (emptied on the next run).
MARKER = ".splitinfer-demo"
#: Longest silence on stderr while a step runs, in seconds.
QUIET_S = 5.0


class Progress:
    """The demo's stderr: whole lines from any thread, and, while :meth:`ticking`, a line
    naming the current step (:meth:`step`) whenever nothing was said for ``quiet_s``."""

    def __init__(self, quiet_s: float = QUIET_S) -> None:
        self.quiet_s = quiet_s
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._doing = ""
        self._since = self._last
        self._status: Callable[[], str] | None = None

    def say(self, message: str) -> None:
        with self._lock:
            sys.stderr.write(f"demo: {message}\n")
            sys.stderr.flush()
            self._last = time.monotonic()

    def step(self, doing: str, status: Callable[[], str] | None = None) -> None:
        """What runs now; ``status`` (called from the ticker's thread) adds how far it got."""
        with self._lock:
            self._doing, self._status, self._since = doing, status, time.monotonic()

    def _tick(self, stop: threading.Event) -> None:
        while not stop.wait(self.quiet_s / 10):
            now = time.monotonic()
            if now - self._last < self.quiet_s or not self._doing:
                continue
            status = self._status
            done = f": {status()}" if status is not None else ""
            running = now - self._since
            more = f" (still running, {running:.0f} s)" if running >= 1 else ""
            self.say(f"{self._doing}{done}{more}")

    @contextlib.contextmanager
    def ticking(self) -> Iterator[None]:
        stop = threading.Event()
        thread = threading.Thread(target=self._tick, args=(stop,), name="demo-progress")
        thread.daemon = True
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.step("")


PROGRESS = Progress()


def format_ms(seconds: float) -> str:
    """A time in milliseconds with enough digits to read: ``"0.06 ms"``, ``"3.4 ms"``,
    ``"286 ms"`` (``"<0.01 ms"`` below that, ``"0 ms"`` for nothing at all)."""
    ms = seconds * 1e3
    if ms == 0:
        return "0 ms"
    if ms < 0.01:
        return "<0.01 ms"
    digits = 2 if ms < 1 else 1 if ms < 10 else 0
    return f"{ms:,.{digits}f} ms"


def prepare_out(out: Path) -> None:
    """Make ``out`` (``-o DIR``) the demo's empty working folder, marked with :data:`MARKER`.

    A new or empty folder is used; one that holds the marker (an earlier run's) is
    emptied; any other folder is refused, so that nothing a user put there is deleted.
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out}: not a folder; give the demo a new or empty folder (-o DIR)")
    if out.is_dir() and any(out.iterdir()):
        if not (out / MARKER).is_file():
            raise ConfigError(
                f"{out}: the folder holds files the demo did not write (no {MARKER} in "
                f"it); give the demo a new or empty folder (-o DIR), or remove this one"
            )
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(
        "written by splitinfer-demo, which empties this folder when run with it again\n"
    )
