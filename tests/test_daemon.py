"""The one daemon launcher (``sim/daemon.py``), on tiny stand-in daemons: a Python
one-liner that prints a ``listening on`` line (on stdout like the cloud service, or
on stderr like the edge agent), one that dies, one that never says it listens, one
that ignores SIGTERM. The real daemons go through it in the integration tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from splitinfer.shared.errors import ConfigError
from splitinfer.sim.daemon import Daemon, DaemonError, command

pytestmark = pytest.mark.integration


def fake(body: str) -> list[str]:
    """``python -c`` with ``sys``, ``time`` and ``signal`` imported."""
    return [sys.executable, "-c", f"import signal, sys, time\n{body}"]


SERVES = "print('{}: listening on http://127.0.0.1:4321/', file={}, flush=True)\ntime.sleep(60)"


@pytest.mark.parametrize("stream", ["sys.stdout", "sys.stderr"])
def test_the_url_comes_from_its_listening_line_on_either_stream(
    stream: str, tmp_path: Path
) -> None:
    log = tmp_path / "logs" / "d.log"
    with Daemon(fake(SERVES.format("fake", stream)), name="fake", log=log) as d:
        assert d.url == "http://127.0.0.1:4321"
        assert d.port == 4321
        assert d.pid is not None
    assert d.pid is None  # stopped on the way out
    assert "fake: listening on http://127.0.0.1:4321/" in log.read_text()


def test_a_daemon_that_exits_is_an_error_with_its_last_words(tmp_path: Path) -> None:
    argv = fake("print('loading', flush=True)\nsys.exit('fake: error: no such package /nope')")
    with pytest.raises(DaemonError) as info, Daemon(argv, name="fake", log=tmp_path / "f.log"):
        pass
    text = str(info.value)
    assert isinstance(info.value, ConfigError)  # the CLIs print it on one line
    assert "\n" not in text
    assert text.startswith(f"fake did not start (log: {tmp_path / 'f.log'}): exit code 1")
    assert "loading | fake: error: no such package /nope" in text


def test_its_lines_keep_the_order_they_were_written_in_across_both_streams(
    tmp_path: Path,
) -> None:
    """stdout and stderr lines interleaved by the daemon come back (and go to the log)
    in that order: the last words of a daemon that fails are read as it wrote them."""
    body = (
        "for i in range(200):\n"
        "    print(f'line {i}', file=sys.stdout if i % 2 else sys.stderr, flush=True)\n"
        "sys.exit(3)"
    )
    log = tmp_path / "d.log"
    d = Daemon(fake(body), name="fake", log=log)
    with pytest.raises(DaemonError, match=r"exit code 3; it wrote: line 195 \| line 196"):
        d.wait(30)
    want = [f"line {i}\n" for i in range(200)]
    assert log.read_text().splitlines(keepends=True) == want


def test_a_silent_daemon_times_out_and_is_stopped() -> None:
    d = Daemon(fake("print('warming up', flush=True)\ntime.sleep(60)"), name="fake")
    with pytest.raises(DaemonError, match=r"no 'listening on' line in 0.5 s; it wrote: warming"):
        d.wait(0.5)
    assert d.pid is None


def test_stop_kills_a_daemon_that_ignores_sigterm() -> None:
    ignores = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + SERVES.format("x", "sys.stdout")
    d = Daemon(fake(ignores))
    d.wait()
    assert d.stop(timeout_s=0.3) == -9  # SIGKILL after the grace time
    assert d.stop() == -9  # again: nothing left to stop


async def test_from_a_coroutine_and_with_a_known_url() -> None:
    # a server that prints no banner: its URL is known beforehand
    async with Daemon(fake("time.sleep(60)"), url="http://127.0.0.1:9/") as d:
        assert d.url == "http://127.0.0.1:9"
    assert d.pid is None


def test_commands_run_this_interpreter() -> None:
    assert command("edge-agent") == [sys.executable, "-m", "splitinfer.edge.cli"]
    with pytest.raises(ConfigError, match="no daemon named 'edge'"):
        command("edge")
