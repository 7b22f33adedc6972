"""splitinfer.sim: trace-driven network emulation.

* :mod:`~splitinfer.sim.config`: :class:`LinkConfig` and :class:`Direction` (a fixed
  rate, a Mahimahi trace, or unlimited), from Python or a TOML table;
* :mod:`~splitinfer.sim.shaper`: one direction of a link as pure logic with an
  injected clock (bottleneck, delay, jitter, loss, outages, droptail queue);
* :mod:`~splitinfer.sim.link`: :class:`EmulatedLink`, an asyncio TCP proxy on
  loopback through two shapers;
* :mod:`~splitinfer.sim.cli`: the ``netsim`` command (``netsim link``).

The scenario runner (``netsim run``, ``netsim compare``) is not built yet. See
docs/netsim.md for the model and its limits.
"""
