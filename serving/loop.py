"""A daemon's event loop: uvloop's when it is installed, else asyncio's own.

uvloop (libuv under asyncio's API) runs a daemon's sockets, transports and callbacks
in C; on the cloud service's front end it took about a tenth off the CPU per request
(docs/benchmarks.md, "Front end cost per request"). ``cloud-service`` runs on it. It is
in the default install; where it is missing (another platform, a trimmed install) the
daemon runs on asyncio's loop and behaves the same, only slower.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """For ``asyncio.Runner(loop_factory=...)``: uvloop's loop, or None (asyncio's)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``, for the start-up log."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
