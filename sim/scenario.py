"""What a scenario is: a model, the strategies to compare, the edge devices, the link,
the workload and the cloud's batching, as frozen dataclasses read from TOML.

    name = "att-lte"
    model = "digits.onnx"                  # relative to the scenario file
    strategies = ["edge-only", "cloud-only", "cuts", "auto", "adaptive"]
    candidates = 3                         # K of the adaptive strategy

    [edge]
    agents = 1                             # edge devices, each behind its own link
    mode = "process"                       # edge-agent processes, or "inprocess" pipelines
    slowdown = 50                          # the device computes this many times slower
    # device = "jetson-orin-nano"          # or a device profile (built-in name or JSON)
    shared_link = false                    # true: every agent behind one link
    fallback = false                       # package the full model for local answers
    timeout = "2s"                         # one uplink attempt

    [workload]
    kind = "poisson"                       # or "closed" (with concurrency)
    rate = 5                               # requests/s per agent (poisson)
    concurrency = 1                        # requests in flight per agent (closed)
    duration = "20s"

    [link]                                 # sim.config.LinkConfig.from_dict
    uplink = { trace = "ATT-LTE-driving-2016.up", offset = "30s" }  # bundled, or a path
    [backup_link]                          # optional: a second cloud endpoint

    [cloud]
    max_batch_size = 32
    max_queue_delay = "2ms"

Quantities carry their units in the value, as the tools' flags do (``timeout = "2s"``,
``[link] delay = "25ms"``, ``queue = "64KiB"``); the former keys with the unit in the
name (``timeout_s = 2``, ``delay_ms = 25``) still read, deprecated, with one warning.

Strategies: ``edge-only`` (the whole model on the device), ``cloud-only`` (the
input uploaded with the package's codec), ``cut:ID`` (one fixed cut), ``cuts``
(every valid split cut), ``auto`` (``partition --split auto`` for this device and
the link's mean rate) and ``adaptive`` (auto with ``--candidates K``: the agent
switches at run time). A bad value is a one-line :class:`ConfigError`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitinfer.shared.errors import ConfigError
from splitinfer.shared.links import parse_duration
from splitinfer.shared.options import load_toml
from splitinfer.sim.config import LinkConfig, with_units

STRATEGY_WORDS = ("edge-only", "cloud-only", "cuts", "auto", "adaptive")
WORKLOAD_KINDS = ("poisson", "closed")
AGENT_MODES = ("process", "inprocess")
_CUT_ID = re.compile(r"^cut:[A-Za-z0-9._-]+$")
_TOP_KEYS = ("name", "model", "strategies", "candidates", "seed", "input_shape")
_TABLES = ("edge", "workload", "link", "backup_link", "cloud")
#: per table, the keys whose value carries its unit -> the field (its unit in its name)
_UNIT_KEYS = {
    "edge": {
        "timeout": "timeout_s",
        "request_timeout": "request_timeout_s",
        "link_half_life": "link_half_life_s",
        "min_rate_sample": "min_rate_bytes",
    },
    "cloud": {"max_queue_delay": "max_queue_delay_ms"},
}


def _number(value: object, name: str, *, low: float, integer: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and integer and not isinstance(value, int):
        ok = False
    if not ok or not math.isfinite(float(value)) or float(value) < low:  # type: ignore[arg-type]
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{name}={value!r} must be {kind} >= {low:g}")
    return float(value)  # type: ignore[arg-type]


def check_strategy(name: str) -> str:
    """``name`` if it is a strategy word or ``cut:ID``, else a ConfigError."""
    if name in STRATEGY_WORDS or (isinstance(name, str) and _CUT_ID.match(name)):
        return name
    raise ConfigError(
        f"strategy {name!r} not understood: use {', '.join(STRATEGY_WORDS)} or cut:ID (e.g. cut:c3)"
    )


@dataclass(frozen=True)
class EdgeSpec:
    """The edge devices."""

    #: edge agents, each behind its own link (or all behind one, shared_link)
    agents: int = 1
    #: "process": each agent is an ``edge-agent`` subprocess, the workload calls its local
    #: API; "inprocess": the agent's pipeline in this process (faster to start)
    mode: str = "process"
    #: the device computes this many times slower than this machine (1: as fast)
    slowdown: float = 1.0
    #: the device as a profile ``partition --edge-profile`` reads (a built-in name or a
    #: profile JSON); None: this machine, slowed by ``slowdown``
    device: str | None = None
    #: every agent behind one link: they share its capacity
    shared_link: bool = False
    #: package the whole model too (partition --edge-fallback): answer locally when
    #: no cloud endpoint answers
    fallback: bool = False
    #: seconds one uplink attempt may take before the agent tries the next endpoint
    timeout_s: float = 2.0
    #: seconds a request may take in all (the agent's request deadline)
    request_timeout_s: float = 10.0
    #: the agent's adapt.min_dwell: requests on a cut before it may switch again
    min_dwell: int = 5
    #: the agent's adapt.min_rate_bytes: uploads this big measure the uplink
    min_rate_bytes: int = 1024
    #: the agent's adapt.link_half_life_s: how fast old link samples fade
    link_half_life_s: float = 3.0

    def __post_init__(self) -> None:
        _number(self.agents, "edge.agents", low=1, integer=True)
        if self.mode not in AGENT_MODES:
            raise ConfigError(f"edge.mode={self.mode!r} must be one of {', '.join(AGENT_MODES)}")
        _number(self.slowdown, "edge.slowdown", low=1)
        if self.device is not None:
            if not isinstance(self.device, str) or not self.device.strip():
                raise ConfigError(
                    f"edge.device={self.device!r} must be a built-in profile name or a JSON path"
                )
            if self.slowdown != 1:
                raise ConfigError(
                    f"edge.device={self.device!r} and edge.slowdown={self.slowdown:g} both "
                    "describe the device: keep one"
                )
        _number(self.timeout_s, "edge.timeout_s", low=0.01)
        _number(self.request_timeout_s, "edge.request_timeout_s", low=0.01)
        _number(self.min_dwell, "edge.min_dwell", low=1, integer=True)
        _number(self.min_rate_bytes, "edge.min_rate_bytes", low=1, integer=True)
        _number(self.link_half_life_s, "edge.link_half_life_s", low=0.01)
        for name in ("shared_link", "fallback"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"edge.{name}={getattr(self, name)!r} must be true or false")


@dataclass(frozen=True)
class WorkloadSpec:
    """The requests each agent gets."""

    #: "poisson": arrivals at ``rate``/s; "closed": ``concurrency`` requests in flight
    kind: str = "poisson"
    rate: float = 5.0
    concurrency: int = 1
    duration_s: float = 10.0
    #: samples per request
    batch: int = 1

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ConfigError(
                f"workload.kind={self.kind!r} must be one of {', '.join(WORKLOAD_KINDS)}"
            )
        if _number(self.rate, "workload.rate", low=0) <= 0:
            raise ConfigError(f"workload.rate={self.rate!r} must be > 0 requests/s, e.g. 5")
        _number(self.concurrency, "workload.concurrency", low=1, integer=True)
        if _number(self.duration_s, "workload.duration", low=0) <= 0:
            raise ConfigError(f"workload.duration={self.duration_s!r} must be > 0 s, e.g. 20s")
        _number(self.batch, "workload.batch", low=1, integer=True)


@dataclass(frozen=True)
class CloudSpec:
    """The cloud service's batching (``cloud-service --set batching.*``)."""

    max_batch_size: int = 32
    max_queue_delay_ms: float = 2.0
    batching: bool = True

    def __post_init__(self) -> None:
        _number(self.max_batch_size, "cloud.max_batch_size", low=1, integer=True)
        _number(self.max_queue_delay_ms, "cloud.max_queue_delay_ms", low=0)
        if not isinstance(self.batching, bool):
            raise ConfigError(f"cloud.batching={self.batching!r} must be true or false")


@dataclass(frozen=True)
class Scenario:
    """One scenario; see the module docstring."""

    model: Path
    link: LinkConfig = field(default_factory=LinkConfig)
    name: str = "scenario"
    strategies: tuple[str, ...] = ("edge-only", "cloud-only", "auto", "adaptive")
    candidates: int = 3
    edge: EdgeSpec = field(default_factory=EdgeSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    cloud: CloudSpec = field(default_factory=CloudSpec)
    #: a second cloud endpoint behind its own link (None: one endpoint)
    backup_link: LinkConfig | None = None
    #: ``NAME=DxDx...`` for models with free dimensions besides the batch
    input_shape: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.strategies:
            raise ConfigError("strategies is empty: name at least one, e.g. ['auto']")
        for s in self.strategies:
            check_strategy(s)
        if len(set(self.strategies)) != len(self.strategies):
            raise ConfigError(f"strategies {list(self.strategies)} name one twice: drop it")
        _number(self.candidates, "candidates", low=2, integer=True)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"seed={self.seed!r} must be an integer")
        if not re.match(r"^[A-Za-z0-9._-]+$", self.name):
            raise ConfigError(f"name={self.name!r} must be letters, digits, '.', '_' or '-'")

    @property
    def endpoints(self) -> int:
        return 1 if self.backup_link is None else 2


def _table(doc: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"[{key}] must be a table, got {value!r}")
    return dict(value)


def _take(table: dict[str, Any], where: str, known: tuple[str, ...]) -> None:
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(
            f"[{where}]: unknown option(s) {', '.join(unknown)}; the options are {', '.join(known)}"
        )


def _seconds(value: object, name: str) -> float:
    if isinstance(value, str):
        return parse_duration(value, name)
    return _number(value, name, low=0)


def scenario_from_dict(
    doc: Mapping[str, Any], base: Path, warn: Callable[[str], None] | None = None
) -> Scenario:
    """A scenario from a parsed TOML document; paths relative to ``base``; ``warn`` gets
    one line per former (deprecated) key."""
    unknown = sorted(set(doc) - set(_TOP_KEYS) - set(_TABLES))
    if unknown:
        raise ConfigError(
            f"unknown scenario key(s) {', '.join(unknown)}; the keys are "
            f"{', '.join(_TOP_KEYS)} and the tables [{'], ['.join(_TABLES)}]"
        )
    if "model" not in doc or not isinstance(doc["model"], str):
        raise ConfigError("the scenario needs model = PATH.onnx (relative to the scenario file)")
    model = Path(doc["model"]).expanduser()
    model = model if model.is_absolute() else base / model
    if not model.is_file():
        raise ConfigError(f"model {str(model)!r} does not exist: give the path of an .onnx file")
    kwargs: dict[str, Any] = {"model": model}
    for key in ("name", "candidates", "seed"):
        if key in doc:
            kwargs[key] = doc[key]
    for key in ("strategies", "input_shape"):
        if key in doc:
            value = doc[key]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{key} must be a list of strings, got {value!r}")
            kwargs[key] = tuple(value)
    edge = with_units(_table(doc, "edge"), "edge", _UNIT_KEYS["edge"], warn)
    _take(edge, "edge", tuple(EdgeSpec.__dataclass_fields__))
    device = edge.get("device")
    if isinstance(device, str) and (device.endswith(".json") or "/" in device):
        path = Path(device).expanduser()
        edge["device"] = str(path if path.is_absolute() else base / path)
    kwargs["edge"] = EdgeSpec(**edge)
    work = _table(doc, "workload")
    _take(work, "workload", ("kind", "rate", "concurrency", "duration", "batch"))
    if "duration" in work:
        work["duration_s"] = _seconds(work.pop("duration"), "workload.duration")
    kwargs["workload"] = WorkloadSpec(**work)
    cloud = with_units(_table(doc, "cloud"), "cloud", _UNIT_KEYS["cloud"], warn)
    _take(cloud, "cloud", tuple(CloudSpec.__dataclass_fields__))
    kwargs["cloud"] = CloudSpec(**cloud)
    kwargs["link"] = LinkConfig.from_dict(_table(doc, "link"), base, warn)
    if "backup_link" in doc:
        backup = _table(doc, "backup_link")
        kwargs["backup_link"] = LinkConfig.from_dict(backup, base, warn, "backup_link")
    return Scenario(**kwargs)


def load_scenario(path: Path | str, warn: Callable[[str], None] | None = None) -> Scenario:
    """Read and check a scenario TOML file (``warn``: one line per deprecated key)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"scenario {str(path)!r} does not exist")
    doc = load_toml(path, "scenario file")
    try:
        return scenario_from_dict(doc, path.resolve().parent, warn)
    except TypeError as exc:  # a wrong key reached a constructor
        raise ConfigError(f"scenario {str(path)!r}: {exc}") from None
