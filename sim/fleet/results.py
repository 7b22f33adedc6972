"""What a fleet run produced: every request's outcome and latencies, the batches."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from splitinfer.sim.fleet.scenario import FleetScenario

F64 = npt.NDArray[np.float64]

#: outcomes of a request
CLOUD, LOCAL, FALLBACK_REFUSED, FALLBACK_LATE, REFUSED, LATE = range(6)
OUTCOMES = (
    "cloud",
    "device (its cut)",
    "fallback (refused)",
    "fallback (late)",
    "error (refused)",
    "error (late)",
)
COMPONENTS = ("device", "uplink", "queue", "batch", "downlink")


@dataclass
class Requests:
    """Every request: its arrival, device, cut and outcome, end to end and per component
    (seconds, float32; per component only meaningful for cloud answers)."""

    arrival: F64
    submit: F64  # when the cloud took it (NaN: never reached the cloud)
    device: npt.NDArray[np.int32]
    cut: npt.NDArray[np.int8]
    outcome: npt.NDArray[np.int8]
    e2e: npt.NDArray[np.float32]
    parts: npt.NDArray[np.float32]  # shape (5, n): COMPONENTS
    n: int = 0

    @classmethod
    def empty(cls, capacity: int) -> Requests:
        return cls(
            np.zeros(capacity),
            np.full(capacity, np.nan),
            np.zeros(capacity, np.int32),
            np.zeros(capacity, np.int8),
            np.zeros(capacity, np.int8),
            np.full(capacity, np.nan, np.float32),
            np.zeros((5, capacity), np.float32),
        )

    def reserve(self, more: int) -> None:
        need = self.n + more
        if need <= self.arrival.size:
            return
        size = max(need, int(self.arrival.size * 1.5))
        for name in ("arrival", "submit", "device", "cut", "outcome", "e2e"):
            old = getattr(self, name)
            new = np.full(size, np.nan if old.dtype.kind == "f" else 0, old.dtype)
            new[: self.n] = old[: self.n]
            setattr(self, name, new)
        parts = np.zeros((5, size), np.float32)
        parts[:, : self.n] = self.parts[:, : self.n]
        self.parts = parts

    def trim(self) -> None:
        for name in ("arrival", "submit", "device", "cut", "outcome", "e2e"):
            setattr(self, name, getattr(self, name)[: self.n])
        self.parts = self.parts[:, : self.n]


@dataclass
class FleetRun:
    """What a run produced: the requests, the batches, the choosers' switches."""

    scenario: FleetScenario
    requests: Requests
    #: per batch: replica, start, end, rows, cut index
    batches: dict[str, np.ndarray]
    switches: int
    switch_times: F64
    busy_s: list[float]
    chooser_calls: int
    degraded: list[tuple[float, float, float, int]] = field(default_factory=list)
    wall_s: float = 0.0
