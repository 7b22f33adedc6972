"""Kinds of test, and Hypothesis in CI; conftest.py imports these hooks.

Every test has exactly one kind: ``unit``, ``integration``, ``sim`` or ``gpu``
(``slow`` is a separate tag). A file names its kind with ``pytestmark``; a test that
names a kind of its own has that one instead of its file's. A test with no kind is
a collection error, so ``-m unit`` is the whole set of unit tests.

A unit test may open no socket and start no process: the ``_unit_tests_stay_in``
fixture turns a bind, a connect or a subprocess in one into a failure naming it.

With ``CI`` set (``CI=true``, as CI services set it) Hypothesis runs the
``ci`` profile: derandomized (the same examples every run, so a red run is a real
regression and reruns the same way) and without deadlines (a loaded runner is slow).
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from typing import Any, NoReturn

import pytest
from hypothesis import settings

KINDS = ("unit", "integration", "sim", "gpu")

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
    settings.load_profile("ci")


def _kind_marks(node: pytest.Item | pytest.Collector) -> list[pytest.Mark]:
    return [m for m in node.own_markers if m.name in KINDS]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give each test one kind: its own if it names one, else its file's."""
    missing, modules = [], set()
    for item in items:
        chain = item.listchain()
        own = next((m for node in reversed(chain) for m in _kind_marks(node)), None)
        if own is None:
            missing.append(item.nodeid)
            continue
        for node in chain:
            if node is not item and _kind_marks(node):
                modules.add(node)
        item.own_markers = [m for m in item.own_markers if m.name not in KINDS] + [own]
    for node in modules:  # the file's kind now sits on each of its tests
        node.own_markers = [m for m in node.own_markers if m.name not in KINDS]
    if missing:
        files = sorted({m.split("::")[0] for m in missing})
        raise pytest.UsageError(
            f"{len(missing)} test(s) without a kind ({', '.join(KINDS)}) in {', '.join(files)}, "
            f"e.g. {missing[0]}: give the file a pytestmark"
        )


def _refuse(what: str) -> Any:
    def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise AssertionError(f"a unit test may not {what}: mark it integration or sim")

    return refuse


@pytest.fixture(autouse=True)
def _unit_tests_stay_in(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        for name in ("bind", "connect", "connect_ex"):
            mp.setattr(socket.socket, name, _refuse(f"{name} a socket"))
        mp.setattr(subprocess.Popen, "__init__", _refuse("start a process"))
        yield
