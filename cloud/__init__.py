"""splitinfer.cloud: the cloud service.

An in-process :class:`~splitinfer.cloud.engine.Engine` (model repository and
versions, dynamic batching, ONNX Runtime sessions, metrics, overload control)
under a thin aiohttp server (:mod:`splitinfer.cloud.server`); the
``cloud-service`` command (:mod:`splitinfer.cloud.cli`) runs both. See
``docs/cloud-service.md``.

Modules, pure logic first: ``config`` (options), ``batcher`` and ``estimate``
(when batches run), ``overload`` (refusals, rate limits, breakers),
``traffic`` (which version), ``repository`` (what is on disk), ``tensors``
(padding, stacking), ``runtime`` (sessions), ``registry`` (loaded versions,
hot reload), ``metrics``, ``engine``, ``handler``, ``status`` (the page at ``/``),
``server``, ``cli``.
"""
