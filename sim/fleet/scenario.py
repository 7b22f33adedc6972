"""A fleet scenario: devices, their package, links and requests, and the cloud's
replicas, as frozen dataclasses read from TOML (``netsim fleet SCENARIO.toml``).

    name = "fleet-demo"
    seed = 1
    duration = "1h"                      # simulated time requests arrive in (s, min, h)
    decide_every = "2s"                  # how often each device's CutChooser decides

    [package]
    manifest = "fleet_demo.manifest.json"  # a package folder or its manifest.json
    # or the cost model by hand, one table per cut:
    # [[package.cuts]]
    # id = "c0"; kind = "none"; edge = "0ms"; encode = "0ms"; up_bytes = 300
    # cloud = "1ms"; decode = "0ms"; down_bytes = 1536; batch = { 8 = "3ms" }
    # start = "c0"; local = "40ms"; fallback = true

    [[devices]]                          # one table per device group
    count = 10000
    profile = "raspberry-pi-5"           # the edge profile the package was planned for
    edge_scale = 1.0                     # device times = the package's x this
    jitter = 0.1                         # lognormal sigma of each request's device time
    fallback = true                      # answer locally when refused or too late
    request_timeout = "10s"
    arrivals = { kind = "poisson", rate = 0.5 }   # per device per second
    # arrivals = { kind = "trace", file = "times.txt" }  # one column: replayed from
    #   each device's own offset; two columns (device, time): each device its own
    uplink = { traces = ["ATT-LTE-driving-2016.up", "TMobile-LTE-short.up"] }
    downlink = "20mbit"                  # a rate, "unlimited", or { traces = [...] }
    delay = "20ms"                       # one way

    [[degrade]]                          # optional: links scaled down for a while
    share = 0.33                         # of every group's devices (seeded draw)
    start = "20min"
    end = "30min"
    factor = 0.1                         # capacity x this (0: an outage)

    [adapt]                              # edge.config.AdaptConfig, as edge-agent reads it

    [cloud]
    profile = "l4"                       # price per hour (shared/profiles.py)
    replicas = 4
    routing = "round-robin"              # or "random", "device" (sticky)
    deadlines = false                    # true: the agent's deadline reaches the batcher
    jitter = 0.0                         # lognormal sigma of each batch's time
    # batch_latency = { c0 = { 1 = "2ms", 8 = "5ms", 32 = "14ms" } }  # measured table
    [cloud.batching]                     # cloud.config.BatchingConfig
    [cloud.overload]                     # cloud.config.OverloadConfig (device_rate)

Cut costs come from the manifest's ``predicted`` fields through the edge agent's own
reader (:func:`splitinfer.edge.model.cut_cost`); the cloud's batch latency per cut from
the same figures (``cloud_s`` at batch 1 and ``cloud_batch_s``, which ``partition``
prices with the cloud profile's roofline) unless ``batch_latency`` gives a measured
table. :mod:`splitinfer.sim.fleet.reading` reads the file (:func:`load_fleet`); a bad
value is a one-line :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.cloud.config import BatchingConfig, OverloadConfig
from splitinfer.edge.config import AdaptConfig
from splitinfer.shared.costs import CutCost
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.links import parse_duration

ROUTINGS = ("round-robin", "random", "device")
ARRIVAL_KINDS = ("poisson", "trace")
_SPAN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(min|h)\s*$")


def parse_span(value: Any, name: str) -> float:
    """Seconds of ``"90s"``, ``"250ms"``, ``"20min"`` or ``"1h"``."""
    if not isinstance(value, str):
        raise ConfigError(f'{name}={value!r}: give a duration with units, e.g. "30s" or "20min"')
    m = _SPAN.match(value)
    if m:
        return float(m.group(1)) * (60.0 if m.group(2) == "min" else 3600.0)
    return parse_duration(value, name)


@dataclass(frozen=True)
class BatchLatency:
    """Seconds of one batch of a cut vs its rows: linear between the given points and
    beyond the last along the last segment (at least flat)."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        pts = tuple(sorted((int(b), float(s)) for b, s in self.points))
        if not pts or pts[0][0] < 1 or any(not (math.isfinite(s) and s >= 0) for _, s in pts):
            raise ConfigError(f"batch latency {self.points!r}: give (batch >= 1, seconds >= 0)")
        object.__setattr__(self, "points", pts)

    def table(self, max_rows: int) -> list[float]:
        """Seconds for 0..max_rows rows (index = rows)."""
        b = np.array([p[0] for p in self.points], dtype=np.float64)
        s = np.array([p[1] for p in self.points], dtype=np.float64)
        rows = np.arange(max_rows + 1, dtype=np.float64)
        out = np.interp(rows, b, s)
        if len(b) >= 2:
            slope = max(0.0, (s[-1] - s[-2]) / (b[-1] - b[-2]))
            out = np.where(rows > b[-1], s[-1] + slope * (rows - b[-1]), out)
        elif b[0] > 0:  # one point: proportional above it, as the batcher's own estimate
            out = np.where(rows > b[0], s[0] * rows / b[0], out)
        out[0] = 0.0
        return [float(x) for x in out]


@dataclass(frozen=True)
class LinkSpec:
    """One direction of every device's link in a group."""

    kind: str  # "traces" | "rate" | "unlimited"
    traces: tuple[Path, ...] = ()
    rate_bps: float = 0.0
    #: seconds into the trace each device starts; None: drawn per device over the period
    offset_s: float | None = None

    def describe(self) -> str:
        if self.kind == "traces":
            names = ", ".join(p.name for p in self.traces)
            return f"traces {names} (" + (
                "random offset per device)"
                if self.offset_s is None
                else f"from {self.offset_s:g} s)"
            )
        return "unlimited" if self.kind == "unlimited" else f"{self.rate_bps / 1e6:g} Mbit/s"


@dataclass(frozen=True)
class Arrivals:
    kind: str = "poisson"
    rate: float = 0.5  # per device per second
    file: Path | None = None


@dataclass(frozen=True)
class DeviceGroup:
    count: int
    uplink: LinkSpec
    downlink: LinkSpec
    delay_s: float = 0.02
    arrivals: Arrivals = field(default_factory=Arrivals)
    profile: str = ""
    edge_scale: float = 1.0
    jitter: float = 0.0
    fallback: bool = True
    request_timeout_s: float = 10.0


@dataclass(frozen=True)
class Degradation:
    share: float
    start_s: float
    end_s: float
    factor: float
    direction: str = "uplink"


@dataclass(frozen=True)
class CloudSpec:
    profile: str
    price_per_hour: float
    replicas: int
    batching: BatchingConfig
    overload: OverloadConfig
    latency: Mapping[str, BatchLatency]
    routing: str = "round-robin"
    deadlines: bool = False
    jitter: float = 0.0


@dataclass(frozen=True)
class FleetScenario:
    name: str
    seed: int
    duration_s: float
    decide_every_s: float
    costs: Mapping[str, CutCost]  # in the package's order (the chooser's tie order)
    start_cut: str
    local_s: float | None  # the fallback model's seconds on the device (None: no fallback)
    groups: tuple[DeviceGroup, ...]
    degradations: tuple[Degradation, ...]
    cloud: CloudSpec
    adapt: AdaptConfig
    planning: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def devices(self) -> int:
        return sum(g.count for g in self.groups)

    def with_replicas(self, replicas: int) -> FleetScenario:
        return dataclasses.replace(self, cloud=dataclasses.replace(self.cloud, replicas=replicas))

    def scaled(self, devices: int | None = None, duration_s: float | None = None) -> FleetScenario:
        """The same fleet with ``devices`` in all (groups in proportion) or another length."""
        out = self
        if devices is not None:
            total = self.devices
            counts = [max(1, round(g.count * devices / total)) for g in self.groups]
            counts[-1] = max(1, devices - sum(counts[:-1]))
            pairs = zip(self.groups, counts, strict=True)
            groups = tuple(dataclasses.replace(g, count=c) for g, c in pairs)
            out = dataclasses.replace(out, groups=groups)
        if duration_s is not None:
            out = dataclasses.replace(out, duration_s=duration_s)
        return out
