"""splitinfer.edge: the edge agent daemon.

Modules, from the bottom up:

* ``config``: the options (frozen dataclasses, TOML, generated flags);
* ``runtime``: ONNX Runtime sessions and the provider choice (CPU, CUDA, TensorRT
  with its engine cache); ``model``: the package with a session per edge segment;
* ``payload``: the local API's bodies and the input checks;
* ``transport``: the one network seam (aiohttp, or a function in tests);
* ``failover``: retries, failover, circuit breakers, health checks;
* ``link`` and ``chooser``: the link estimate and the run-time cut choice;
* ``noise``: clip and noise, and the privacy budget; ``wire``: codecs and int8
  parameters per cut tensor;
* ``pipeline``: one request, in process, with no sockets;
* ``agent``: the aiohttp local API; ``status``: ``/v1/status`` and the status
  page at ``/``; ``metrics``: Prometheus;
* ``cli``: ``edge-agent`` and ``edge-agent profile`` (``profile``);
* ``testing``: a cloud half in process for tests and simulations.

See docs/edge-agent.md.
"""
