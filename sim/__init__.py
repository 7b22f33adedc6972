"""splitinfer.sim: trace-driven network emulation.

* :mod:`~splitinfer.sim.config`: :class:`LinkConfig` and :class:`Direction` (a fixed
  rate, a Mahimahi trace, or unlimited), from Python or a TOML table;
* :mod:`~splitinfer.sim.shaper`: one direction of a link as pure logic with an
  injected clock (bottleneck, delay, jitter, loss, outages, droptail queue);
* :mod:`~splitinfer.sim.link`: :class:`EmulatedLink`, an asyncio TCP proxy on
  loopback through two shapers;
* :mod:`~splitinfer.sim.virtual`: the same proxy with no sockets on a virtual-time
  event loop (how the tests drive it);
* :mod:`~splitinfer.sim.traces`: the vendored Mahimahi traces;
* :mod:`~splitinfer.sim.scenario`: :class:`Scenario`, a scenario TOML file;
* :mod:`~splitinfer.sim.strategies`: one split package per strategy;
* :mod:`~splitinfer.sim.device`: a slower edge device as a profile;
* :mod:`~splitinfer.sim.daemon`: the one daemon launcher (``cloud-service`` and
  ``edge-agent`` as processes, for sim, the tests, the demo and the benchmarks);
* :mod:`~splitinfer.sim.cloud`: ``cloud-service`` as a subprocess;
* :mod:`~splitinfer.sim.agents`: ``edge-agent`` subprocesses and their local API;
* :mod:`~splitinfer.sim.runner`: edge devices behind links, the workload, one
  strategy and one scenario;
* :mod:`~splitinfer.sim.report`: the JSON report, plots and the comparison table;
* :mod:`~splitinfer.sim.cli`: the ``netsim`` command (``link``, ``run``, ``compare``).
* :mod:`~splitinfer.sim.soak`: the soak run's fault schedule, ledger, answer rules
  and verdicts, pure (``bench/bench_soak.py`` drives the processes).

See docs/netsim.md for the model and its limits.
"""
