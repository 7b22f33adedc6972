"""A cloud half in process, for tests and simulations: no sockets, real parts.

:class:`LocalCloud` answers the HTTP contract of docs/http-api.md as a plain
function ``(method, path, body, headers) -> Reply``, to plug into
:class:`~splitinfer.edge.transport.FunctionTransport`: it verifies the
signature (when given a verifier), decodes and validates the request frame
against the package, runs the cut's cloud segment with ONNX Runtime and
encodes the response frame with the ``load`` it is told to report. It is not
the cloud service (no batching, no versions): it is the smallest real peer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from splitinfer.edge.transport import Reply
from splitinfer.shared.auth import Verifier
from splitinfer.shared.errors import ModelNotFoundError, SplitInferError
from splitinfer.shared.frame import (
    Limits,
    Response,
    WireTensor,
    decode_request,
    encode_response,
    peek_request,
)
from splitinfer.shared.package import open_package


class LocalCloud:
    """The cloud segments of one package behind the HTTP contract, as a function."""

    def __init__(
        self,
        package: Path | str,
        *,
        load: float = 0.0,
        verifier: Verifier | None = None,
        wall: Callable[[], float] = time.time,
        limits: Limits | None = None,
    ) -> None:
        import onnxruntime as ort

        self.package = open_package(package)
        self.manifest = self.package.manifest
        self.load = load
        self.verifier = verifier
        self.wall = wall
        self.limits = limits or Limits()
        self.requests = 0
        self.sessions: dict[str, Any] = {}
        self.codecs: dict[str, Any] = {}
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        for cut in self.manifest.cuts:
            if cut.cloud is None:
                continue
            self.sessions[cut.id] = ort.InferenceSession(
                str(self.package.file(cut.cloud)), opts, providers=["CPUExecutionProvider"]
            )
            self.codecs[cut.id] = self.package.codec(cut)[1]
        self.path = f"/v1/models/{self.manifest.model_name}/infer"

    def __call__(self, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        if method == "GET" and path == "/healthz":
            return Reply(200, {"Content-Type": "text/plain"}, b"ok")
        try:
            if method != "POST" or path != self.path:
                raise ModelNotFoundError(f"no route {method} {path}")
            if self.verifier is not None:
                self.verifier.verify(method, path, headers, body, self.wall())
            return self.infer(body)
        except SplitInferError as exc:
            return _error(exc.http_status, str(exc))

    def infer(self, body: bytes) -> Reply:
        """Decode, run the cut's cloud segment, encode: the 200 reply."""
        self.requests += 1
        cut_id = _peek_cut(body)
        codecs = self.codecs.get(cut_id)
        request = decode_request(body, self.manifest, self.limits, codecs)
        session = self.sessions[request.cut_id]
        feeds = {t.name: t.array for t in request.tensors}
        names = [o.name for o in session.get_outputs()]
        wanted = {i.name: feeds[i.name] for i in session.get_inputs()}
        outs = dict(zip(names, session.run(names, wanted), strict=True))
        response = Response(
            request_id=request.request_id,
            tensors=tuple(WireTensor(o.name, outs[o.name]) for o in self.manifest.outputs),
            model_version="1",
            load=self.load,
        )
        frame = encode_response(response)
        return Reply(200, {"Content-Type": "application/vnd.splitinfer.frame"}, frame)


def _peek_cut(body: bytes) -> str:
    """The frame's cut id without validating (to pick the cut's codec registry)."""
    ids = peek_request(body, Limits())
    return ids[2] if ids is not None else ""


def _error(status: int, message: str) -> Reply:
    body = json.dumps({"error": " ".join(message.split()), "status": status}).encode()
    headers = {"Content-Type": "application/json"}
    if status in (429, 503):
        headers["Retry-After"] = "1"
    return Reply(status, headers, body)
