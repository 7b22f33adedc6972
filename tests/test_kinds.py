"""The kinds of test (tests/kinds.py): a unit test opens no socket and starts no process."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def test_a_unit_test_cannot_open_a_socket() -> None:
    with socket.socket() as s, pytest.raises(AssertionError, match="may not bind a socket"):
        s.bind(("127.0.0.1", 0))
    with socket.socket() as s, pytest.raises(AssertionError, match="may not connect a socket"):
        s.connect(("127.0.0.1", 9))


def test_a_unit_test_cannot_start_a_process() -> None:
    with pytest.raises(AssertionError, match="may not start a process"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_each_test_has_one_kind(request: pytest.FixtureRequest) -> None:
    kinds = [m.name for m in request.node.iter_markers() if m.name in ("unit", "integration")]
    assert kinds == ["unit"]


@pytest.mark.integration
def test_a_test_of_its_own_kind_is_not_its_files(request: pytest.FixtureRequest) -> None:
    kinds = [m.name for m in request.node.iter_markers() if m.name in ("unit", "integration")]
    assert kinds == ["integration"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # allowed here
