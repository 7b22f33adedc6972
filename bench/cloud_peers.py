"""bench_cloud's other servers, each a process of its own:

    python bench/cloud_peers.py echo PORT
    python bench/cloud_peers.py litserve SEGMENT PORT BATCH_LOG MAX_BATCH DELAY_MS [--spinning]

- ``echo``: an aiohttp server that reads the frame and answers a canned one (the
  transport's own share of the latency); ``GET /readyz`` answers once it serves.
- ``litserve``: the peer, LitServe (``LitAPI(max_batch_size=MAX_BATCH,
  batch_timeout=DELAY_MS / 1000)``, one CPU worker) serving the same segment with the same
  session options; requests carry the activation as base64 in JSON, answers are
  JSON; every predict call appends its batch size to ``BATCH_LOG``.
"""

from __future__ import annotations

import base64
import sys
from pathlib import Path
from typing import Any

import numpy as np
from cloud_setup import Settings, session

from splitinfer.shared.frame import FRAME_TYPE

try:  # the peer; LitServe starts its worker with spawn, so its API class lives at top level
    import litserve as _ls
except ImportError:  # pragma: no cover - the peer is optional
    _ls = None

HAVE_LITSERVE = _ls is not None

if _ls is not None:

    class OrtAPI(_ls.LitAPI):  # type: ignore[misc]
        """The same ONNX segment behind LitServe's own batching."""

        def __init__(self, segment: str, batch_log: str, spinning: bool, **kw: Any) -> None:
            super().__init__(**kw)
            self.segment, self.batch_log, self.spinning = segment, batch_log, spinning

        def setup(self, device: str) -> None:
            self.sess = session(Path(self.segment), self.spinning)
            self.input = self.sess.get_inputs()[0]
            self.shape = tuple(self.input.shape[1:])
            self.log = open(self.batch_log, "a", buffering=1)  # noqa: SIM115

        def decode_request(self, request: dict[str, str]) -> np.ndarray:
            raw = base64.b64decode(request["x"])
            return np.frombuffer(raw, np.float32).reshape(self.shape)

        def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
            return np.stack(inputs)

        def predict(self, x: np.ndarray) -> np.ndarray:
            self.log.write(f"{len(x)}\n")
            return self.sess.run(None, {self.input.name: x})[0]  # type: ignore[no-any-return]

        def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
            return list(output)

        def encode_response(self, output: np.ndarray) -> dict[str, list[float]]:
            return {"y": output.tolist()}


def echo_argv(port: int) -> list[str]:
    return [sys.executable, __file__, "echo", str(port)]


def litserve_argv(segment: Path, port: int, batch_log: Path, settings: Settings) -> list[str]:
    argv = [sys.executable, __file__, "litserve", str(segment), str(port), str(batch_log)]
    argv += [str(settings.max_batch), str(settings.delay_ms)]
    return argv + (["--spinning"] if settings.spinning else [])


def serve_echo(port: int) -> None:
    """The transport floor: aiohttp reading the body and answering a canned frame."""
    from aiohttp import web

    from splitinfer.shared.frame import Response, WireTensor, encode_response

    answer = encode_response(Response("r", tensors=(WireTensor("y", np.zeros((1, 10), "f4")),)))

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type=FRAME_TYPE)

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=2**26)
    app.router.add_post("/echo", handler)
    app.router.add_get("/readyz", ready)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def serve_litserve(
    segment: Path, port: int, batch_log: Path, max_batch: int, delay_ms: float, spinning: bool
) -> None:
    """The peer: LitServe, one CPU worker, bench_cloud's batch size and queue delay."""
    assert _ls is not None
    api = OrtAPI(
        str(segment),
        str(batch_log),
        spinning,
        max_batch_size=max_batch,
        batch_timeout=delay_ms / 1000,
    )
    server = _ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=60)
    server.run(
        host="127.0.0.1",
        port=port,
        generate_client_file=False,
        log_level="warning",
        num_api_servers=1,
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["echo"] and len(argv) == 2:
        serve_echo(int(argv[1]))
        return 0
    if argv[:1] == ["litserve"] and len(argv) in (6, 7):
        segment, port, log, batch, delay = argv[1:6]
        spinning = argv[6:] == ["--spinning"]
        serve_litserve(Path(segment), int(port), Path(log), int(batch), float(delay), spinning)
        return 0
    print(__doc__.split("\n\n")[0], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
