"""The HTTP contract's names and its error body, for both halves (see docs/http-api.md).

Header names of the cloud service and of the edge agent's local API, the
content types, and the one error body both daemons answer with:
``{"error": "<one line>", "status": <code>}`` plus ``Retry-After`` on 429 and
503. :class:`Reply` is what an endpoint answers, whatever carried it (aiohttp,
Ray Serve, a function call in a test), and :data:`ServiceHandler` the shape of
the one request handler (``cloud/handler.py``) every front end adapts: method,
raw path, headers, a :class:`BodyStream` and the peer's address in, a
:class:`Reply` out. The signature headers are
:mod:`splitinfer.shared.auth`'s (``HEADER_DEVICE`` ...). No sockets here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import quote

from splitinfer.shared.frame import FRAME_TYPE as FRAME_TYPE  # noqa: PLC0414 (the contract's)

JSON_TYPE = "application/json"
NPY_TYPE = "application/x-npy"
NPZ_TYPE = "application/x-npz"

# -- the cloud service ----------------------------------------------------------------------
#: 0 (most urgent) .. 9; sent by the edge, read by the cloud's batcher
HEADER_PRIORITY = "X-Splitinfer-Priority"
#: on 200s: the model version that served the request
HEADER_VERSION = "X-Splitinfer-Model-Version"
#: ``cloud;dur=<ms>``: the cloud's own time, so the edge can tell the network's share
SERVER_TIMING = "Server-Timing"
RETRY_AFTER = "Retry-After"

# -- the edge agent's local API -------------------------------------------------------------
HEADER_TIMINGS = "X-Splitinfer-Timings"  # request "1": stage timings in the answer
HEADER_TIMEOUT = "X-Splitinfer-Timeout-Ms"
HEADER_CUT = "X-Splitinfer-Cut"  # request: pin a cut; answer: the cut that ran
HEADER_LOCAL = "X-Splitinfer-Local"  # answer: "1" when the device computed it all
HEADER_LOCAL_REASON = "X-Splitinfer-Local-Reason"
HEADER_TRACE = "X-Splitinfer-Trace"
HEADER_UP_BYTES = "X-Splitinfer-Up-Bytes"
HEADER_DOWN_BYTES = "X-Splitinfer-Down-Bytes"

# -- paths ----------------------------------------------------------------------------------
MODELS_PATH = "/v1/models"
RELOAD_PATH = "/v1/admin/reload"


def infer_path(model: str, json_body: bool = False) -> str:
    """``/v1/models/{model}/infer`` (frames) or ``.../infer.json`` (the debugging path)."""
    return f"{MODELS_PATH}/{quote(model, safe='')}/infer{'.json' if json_body else ''}"


@dataclass(frozen=True)
class Reply:
    """What an endpoint answered: status, headers, body."""

    status: int
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""

    def header(self, name: str, default: str = "") -> str:
        """A header, looked up case-insensitively."""
        exact = self.headers.get(name)
        if exact is not None:
            return exact
        low = name.lower()
        for key, value in self.headers.items():
            if key.lower() == low:
                return value
        return default


def one_line(message: str) -> str:
    """A message on one line (runs of whitespace, newlines included, become one space)."""
    return " ".join(message.split())


def retry_after_header(seconds: float) -> str:
    """``Retry-After`` in whole seconds (RFC 9110 delay-seconds), at least 1."""
    return str(max(1, math.ceil(seconds))) if math.isfinite(seconds) else "60"


def error_body(status: int, message: str) -> bytes:
    """The error body: ``{"error": "<one line>", "status": <code>}``."""
    return json.dumps({"error": one_line(message), "status": status}).encode()


def error_reply(status: int, message: str, retry_after: float | None = None) -> Reply:
    """An error :class:`Reply`; 429 and 503 always carry ``Retry-After`` (1 s unless given)."""
    headers = {"Content-Type": f"{JSON_TYPE}; charset=utf-8"}
    if retry_after is None and status in (429, 503):
        retry_after = 1.0
    if retry_after is not None:
        headers[RETRY_AFTER] = retry_after_header(retry_after)
    return Reply(status, headers, error_body(status, message))


def error_message(body: bytes) -> str:
    """The one-line ``error`` of an error body, or the body's start when it is not one."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return one_line(doc["error"])
    return one_line(body[:200].decode("utf-8", "replace")) or "no message"


class BodyStream(Protocol):
    """A request body as it arrives: ``readany()`` gives the next bytes, ``b""`` at the end.

    aiohttp's ``request.content`` is one; :class:`BytesBody` is one for a body in memory.
    """

    async def readany(self) -> bytes: ...


class BytesBody:
    """A body already in memory, as a :class:`BodyStream` (one chunk, then the end)."""

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data
        self.read = False  # whether anyone asked for the body

    async def readany(self) -> bytes:
        self.read = True
        data, self._data = self._data, None
        return data or b""


#: ``handler(method, raw_path, headers, body, remote) -> Reply``: a service's whole HTTP API.
ServiceHandler = Callable[[str, str, Mapping[str, str], BodyStream, str], Awaitable[Reply]]
