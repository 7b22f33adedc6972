"""The one way to start a daemon (``cloud-service``, ``edge-agent``) as a process.

Both daemons print ``PROG: listening on URL`` once they serve (the cloud on
stdout, the edge agent on stderr) and stop cleanly on SIGTERM. :class:`Daemon`
starts one, copies everything it writes on either stream (one pipe, so in the
order written) to an optional log file and keeps the last lines, waits for that
line (or for a known URL to answer a readiness path), and stops it: SIGTERM, then
SIGKILL when it does not go.

    with Daemon(command("cloud-service") + ["--repository", repo, "--no-auth",
                "--listen", "127.0.0.1:0"], ready="/readyz") as cloud:
        ... cloud.url, cloud.port ...

    async with Daemon(argv, log=path) as agent:   # the same, from a coroutine
        ...

A daemon that exits or stays silent past ``timeout_s`` is a :class:`DaemonError`
(a ``ConfigError``: the CLIs print it on one line) naming the daemon, why, and the
last lines it wrote. The tests, ``sim/``, the demo and the benchmarks all start
their daemons here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

from splitinfer.shared.errors import ConfigError

#: the module each daemon's command runs (``python -m MODULE``)
PROGRAMS: dict[str, str] = {
    "cloud-service": "splitinfer.cloud.cli",
    "edge-agent": "splitinfer.edge.cli",
}
#: what each daemon prints once it serves, followed by its URL
MARKER = "listening on "
#: seconds a daemon may take to load its models and listen
START_S = 60.0
#: seconds a stopping daemon gets before it is killed
STOP_S = 30.0
#: lines of its output a daemon's :attr:`Daemon.lines` keeps
KEEP_LINES = 2000
#: loopback readiness probes never go through an HTTP proxy of the environment
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class DaemonError(ConfigError):
    """A daemon did not start: its name, why, and the last lines it wrote."""


def command(program: str) -> list[str]:
    """``[python, -m, MODULE]`` of ``program`` (``cloud-service``, ``edge-agent``),
    with this interpreter, so the daemon runs the same code as its caller."""
    if program not in PROGRAMS:
        raise ConfigError(f"no daemon named {program!r} (known: {', '.join(PROGRAMS)})")
    return [sys.executable, "-m", PROGRAMS[program]]


class Daemon:
    """One daemon process. It starts at construction; :meth:`wait` (or entering the
    context) waits until it serves and gives its URL; :meth:`stop` ends it.

    ``log``: a file that gets everything the daemon writes (both streams, appended).
    ``env``: variables added to this process's environment. ``url``: the daemon's
    URL when it is known beforehand (a port chosen by the caller); then no
    ``listening on`` line is awaited. ``ready``: a path (``/readyz``) that must
    answer 200 before :meth:`wait` returns. ``new_session``: the daemon leads its
    own process group (:attr:`pid` is its id), signalled whole on stop.
    """

    def __init__(
        self,
        argv: Sequence[str | Path],
        *,
        name: str | None = None,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        url: str | None = None,
        ready: str | None = None,
        timeout_s: float = START_S,
        new_session: bool = False,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.name = name or _name(self.argv)
        self.log_path = log
        self.ready = ready
        self.timeout_s = timeout_s
        self.new_session = new_session
        self.url = url.rstrip("/") if url else ""
        self._lines: collections.deque[str] = collections.deque(maxlen=KEEP_LINES)
        self._listening = threading.Event()
        if self.url:
            self._listening.set()
        self._lock = threading.Lock()
        self._code = 0
        self._log: IO[str] | None = None
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            self._log = log.open("a", encoding="utf-8")
        try:
            self.proc: subprocess.Popen[str] | None = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                # one pipe for both streams: its lines keep the order they were written
                # in (two pipes read by two threads interleave by chance)
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                start_new_session=new_session,
            )
        except OSError as exc:
            if self._log is not None:
                self._log.close()
            raise DaemonError(f"{self.name} did not start: {self.argv[0]}: {exc.strerror}") from exc
        self._pumps = [
            threading.Thread(
                target=self._pump, args=(self.proc.stdout,), daemon=True, name=f"{self.name}-pump"
            )
        ]
        for t in self._pumps:
            t.start()

    # -- what it wrote ----------------------------------------------------------------

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            with self._lock:
                self._lines.append(line)
                if self._log is not None:
                    self._log.write(line)
                    self._log.flush()
            if not self._listening.is_set() and MARKER in line:
                self.url = line.split(MARKER, 1)[1].split()[0].rstrip("/")
                self._listening.set()

    @property
    def lines(self) -> list[str]:
        """The last lines it wrote (both streams, newlines kept)."""
        with self._lock:
            return list(self._lines)

    def tail(self, n: int = 5) -> str:
        """Its last ``n`` non-blank lines, on one line."""
        last = [ln.strip() for ln in self.lines if ln.strip()][-n:]
        return " | ".join(last) or "nothing"

    @property
    def pid(self) -> int | None:
        """Its process id while it runs (also its process group with ``new_session``)."""
        return self.proc.pid if self.proc is not None else None

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    # -- starting ---------------------------------------------------------------------

    def wait(self, timeout_s: float | None = None) -> str:
        """Block until it serves; its URL. A :class:`DaemonError` (and the daemon
        stopped) when it exits first or takes longer than ``timeout_s``."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        try:
            while not self._listening.wait(0.05):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise self._failed(f"no {MARKER.strip()!r} line in {limit:g} s")
            if self.ready is not None:
                self._wait_ready(deadline, limit)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _check_alive(self) -> None:
        assert self.proc is not None, f"{self.name} was stopped"
        code = self.proc.poll()
        if code is not None:
            for t in self._pumps:  # its last words
                t.join(2)
            raise self._failed(f"exit code {code}")

    def _wait_ready(self, deadline: float, limit: float) -> None:
        url = self.url + str(self.ready)
        while True:
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                _DIRECT.open(url, timeout=1) as resp,
            ):
                if resp.status == 200:
                    return
            self._check_alive()
            if time.monotonic() > deadline:
                raise self._failed(f"{url} did not answer 200 in {limit:g} s")
            time.sleep(0.05)

    def _failed(self, why: str) -> DaemonError:
        where = f" (log: {self.log_path})" if self.log_path is not None else ""
        return DaemonError(f"{self.name} did not start{where}: {why}; it wrote: {self.tail()}")

    # -- stopping ---------------------------------------------------------------------

    def stop(self, timeout_s: float = STOP_S) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; its exit code. Idempotent."""
        proc = self.proc
        if proc is None:
            return self._code
        if proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
        return self._reap()

    def kill(self) -> int:
        """SIGKILL at once (a daemon that dies mid-run); its exit code."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal(signal.SIGKILL)
        return self._reap()

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            if self.new_session:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)

    def _reap(self) -> int:
        proc = self.proc
        if proc is None:
            return self._code
        self._code = proc.wait()
        for t in self._pumps:
            t.join(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None
        self.proc = None
        return self._code

    # -- as a context, sync or async ----------------------------------------------------

    def __enter__(self) -> Daemon:
        self.wait()
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def wait_async(self, timeout_s: float | None = None) -> str:
        """:meth:`wait` from a coroutine (in a worker thread)."""
        return await asyncio.to_thread(self.wait, timeout_s)

    async def stop_async(self, timeout_s: float = STOP_S) -> int:
        """:meth:`stop` from a coroutine (in a worker thread)."""
        return await asyncio.to_thread(self.stop, timeout_s)

    async def __aenter__(self) -> Daemon:
        await self.wait_async()
        return self

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.shield(self.stop_async())


def start(
    program: str,
    args: Sequence[str | Path],
    *,
    log: Path | None = None,
    env: Mapping[str, str] | None = None,
    ready: str | None = None,
    timeout_s: float = START_S,
) -> Daemon:
    """``program`` (``cloud-service``, ``edge-agent``) with ``args``, started and
    serving; the caller stops it (or uses it as a context)."""
    argv = [*command(program), *map(str, args)]
    daemon = Daemon(argv, name=program, log=log, env=env, ready=ready, timeout_s=timeout_s)
    daemon.wait()
    return daemon


def _name(argv: Sequence[str]) -> str:
    """``edge-agent`` for ``python -m splitinfer.edge.cli ...`` or ``.../edge-agent ...``."""
    if len(argv) > 2 and argv[1] == "-m":
        for program, module in PROGRAMS.items():
            if argv[2] == module:
                return program
        return argv[2]
    return Path(argv[0]).name
