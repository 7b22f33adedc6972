"""Daemons (``cloud-service``, ``edge-agent``) started as subprocesses for tests."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

BIN = Path(sys.executable).parent
STARTUP_S = 60.0


class Proc:
    """A daemon started as a subprocess; its URL from its 'listening on' line."""

    def __init__(self, argv: list[str], marker: str) -> None:
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
        )
        self.lines: list[str] = []
        found = threading.Event()
        self.url = ""

        def pump(stream: io.TextIOBase) -> None:
            for line in stream:
                self.lines.append(line)
                if marker in line and not self.url:
                    self.url = line.split(marker, 1)[1].strip()
                    found.set()

        self.pumps = [
            threading.Thread(target=pump, args=(stream,), daemon=True)
            for stream in (self.proc.stdout, self.proc.stderr)
        ]
        for t in self.pumps:
            t.start()
        if not found.wait(STARTUP_S):
            self.stop()
            raise AssertionError(f"{argv[0]} did not start:\n{''.join(self.lines)}")

    def kill(self) -> None:
        self.proc.kill()
        self._reap(10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self._reap(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self._reap(10)

    def _reap(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        for t in self.pumps:
            t.join(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        return code


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env
