"""The fewest replicas whose fleet meets a p99 target.

More replicas never make the cloud slower for the same requests, so the p99 falls (or
stays) as replicas are added; the search doubles the count from ``start`` until the
target holds, then bisects between the last count that failed and the first that held.
Each try is a whole run of the scenario with the same seed. A request that got no answer
counts as infinitely late (:func:`~splitinfer.sim.fleet.report.latency_quantile`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from splitinfer.shared.errors import ConfigError
from splitinfer.sim.fleet.engine import run_fleet
from splitinfer.sim.fleet.report import latency_quantile
from splitinfer.sim.fleet.results import FleetRun
from splitinfer.sim.fleet.scenario import FleetScenario

#: the most replicas the search tries before it gives up
MAX_REPLICAS = 4096


@dataclass
class Capacity:
    replicas: int
    p99_s: float
    target_s: float
    #: p99 seconds of every count tried
    tried: dict[int, float] = field(default_factory=dict)
    run: FleetRun | None = None

    @property
    def margin(self) -> float:
        """How far under the target the answer's p99 is, as a fraction of the target."""
        return (self.target_s - self.p99_s) / self.target_s

    def describe(self) -> str:
        below = self.tried.get(self.replicas - 1)
        fewer = (
            f"; {self.replicas - 1} replica(s) give p99 {below * 1e3:.1f} ms"
            if below is not None
            else ""
        )
        return (
            f"capacity: {self.replicas} replica(s) meet p99 <= {self.target_s * 1e3:g} ms: "
            f"p99 {self.p99_s * 1e3:.1f} ms, margin {self.margin:.1%} "
            f"({(self.target_s - self.p99_s) * 1e3:.1f} ms){fewer}"
        )


def search(
    sc: FleetScenario,
    target_s: float,
    *,
    quantile: float = 0.99,
    start: int = 1,
    simulate: Callable[[FleetScenario], FleetRun] = run_fleet,
    progress: Callable[[str], None] | None = None,
) -> Capacity:
    """The fewest replicas (>= ``start``) whose run's ``quantile`` is within ``target_s``."""
    if not target_s > 0:
        raise ConfigError(f"p99 target {target_s!r} must be > 0 seconds")
    say = progress or (lambda _m: None)
    tried: dict[int, float] = {}
    runs: dict[int, FleetRun] = {}

    def p99(r: int) -> float:
        if r not in tried:
            run = simulate(sc.with_replicas(r))
            tried[r] = latency_quantile(run, quantile)
            if tried[r] <= target_s and (not runs or r < min(runs)):
                runs.clear()  # keep one run in memory: the fewest replicas that met it
                runs[r] = run
            say(
                f"{r} replica(s): p{quantile * 100:g} {tried[r] * 1e3:.1f} ms "
                f"({'meets' if tried[r] <= target_s else 'misses'} {target_s * 1e3:g} ms)"
            )
        return tried[r]

    bad, r = start - 1, max(1, start)
    while p99(r) > target_s:
        bad = r
        r *= 2
        if r > MAX_REPLICAS:
            raise ConfigError(
                f"no count of replicas up to {MAX_REPLICAS} meets p99 {target_s * 1e3:g} ms "
                f"(at {bad}: {tried[bad] * 1e3:.1f} ms); the devices' own part may exceed it"
            )
    good = r
    while good - bad > 1:
        mid = (good + bad) // 2
        if p99(mid) <= target_s:
            good = mid
        else:
            bad = mid
    if good > 1 and good - 1 not in tried:
        p99(good - 1)  # for the margin line: what one fewer gives
    return Capacity(good, tried[good], target_s, tried, runs.get(good))
