"""The edge agent's configuration: frozen dataclasses, a TOML file, and flags.

Every option is defined once, here or (the settings the cloud service shares) in
:mod:`splitinfer.shared.settings`, as an :func:`~splitinfer.shared.options.option`
field with its help. The ``edge-agent`` command line is generated from these
classes (``--uplink-timeout`` for ``uplink.timeout``, ``--providers`` for
``runtime.providers``), a TOML ``--config`` file sets the same names (``[runtime]
providers = ["cuda"]``), flags override the file, and docs/edge-agent.md's reference
table is rendered from them (:mod:`splitinfer.shared.options`). Each class checks its
values in ``__post_init__`` and names the value and the fix.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from splitinfer.shared import options
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.options import build, load_toml, option, section
from splitinfer.shared.settings import PrivacyBudget, RuntimeOptions

__all__ = ["EdgeConfig", "add_flags", "config_from_args", "config_from_mapping", "load_toml"]

ON_EXHAUSTED = ("local", "refuse")
DEFAULT_LISTEN = "127.0.0.1:8480"


def _positive(where: str, value: float, fix: str) -> None:
    """``where`` is the field's path (``uplink.timeout_s``); the message names its key
    and shows the value in units (``uplink.timeout=0``)."""
    if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        key, unit = options.unit_of(where)
        shown = options.unit_text(value, unit) if unit and isinstance(value, float) else repr(value)
        raise ConfigError(f"{key}={shown} must be > 0; {fix}")


def _at_least(where: str, value: int, low: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        key, unit = options.unit_of(where)
        if unit and isinstance(value, int):
            low_text = options.unit_text(low, unit)
            raise ConfigError(
                f"{key}={options.unit_text(value, unit)} must be >= {low_text}; {fix}"
            )
        raise ConfigError(f"{where}={value!r} must be an integer >= {low}; {fix}")


@dataclass(frozen=True)
class RuntimeConfig(RuntimeOptions):
    """Which ONNX Runtime execution providers run the segments, and how (the settings
    shared with the cloud service, :class:`~splitinfer.shared.settings.RuntimeOptions`,
    and the edge's own)."""

    trt_int8: bool = option(True, "Let TensorRT run the int8 (Q/DQ) segments in int8.")
    verify: bool = option(True, "Check every package file against its sha256 at start.")
    emulate_device: str | None = option(
        None,
        "Emulate a slower device (tests, netsim): a built-in edge profile name or a measured "
        "profile JSON, as partition --edge-profile reads; each edge segment run is stretched to "
        "the profile's time for its nodes. Unset: off.",
        metavar="PROFILE",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.emulate_device is not None and not self.emulate_device.strip():
            raise ConfigError(
                "runtime.emulate_device='' is empty; give a built-in edge profile name "
                "(e.g. jetson-orin-nano) or a profile JSON, or leave it unset"
            )


@dataclass(frozen=True)
class UplinkConfig:
    """How frames travel to the cloud: timeouts, retries, failover, health checks."""

    timeout_s: float = option(
        5.0, "How long one attempt may take (capped by the request's deadline)."
    )
    connect_timeout_s: float = option(2.0, "How long opening a connection may take.")
    max_connections: int = option(
        8, "Connections open at once, over all endpoints (requests beyond wait for one)."
    )
    max_attempts: int = option(3, "Attempts per request over all endpoints, the first included.")
    backoff_s: float = option(0.05, "Base of the jittered exponential backoff between attempts.")
    backoff_max_s: float = option(1.0, "Largest backoff.")
    breaker_failures: int = option(
        3, "Consecutive failures that open an endpoint's circuit breaker."
    )
    breaker_reset_s: float = option(
        5.0, "How long an open breaker waits before a health check may close it."
    )
    health_interval_s: float = option(
        2.0, "Interval between health checks (GET /healthz) of the endpoints."
    )
    max_response_bytes: int = option(64 * 2**20, "Largest response body accepted from the cloud.")
    priority: int | None = option(
        None, "X-Splitinfer-Priority sent with every request (0..9; unset: the cloud's default, 5)."
    )
    sign_audience: bool = option(
        True,
        "Bind each signature to its endpoint's URL (auth v2, X-Splitinfer-Audience); turn off "
        "only to talk to a cloud-service older than auth v2 (docs/auth.md).",
    )

    def __post_init__(self) -> None:
        for name in ("timeout_s", "connect_timeout_s", "backoff_max_s", "breaker_reset_s"):
            _positive(f"uplink.{name}", getattr(self, name), "e.g. 2s")
        _positive("uplink.health_interval_s", self.health_interval_s, "e.g. 2s")
        if isinstance(self.backoff_s, bool) or not (
            math.isfinite(self.backoff_s) and self.backoff_s >= 0
        ):
            raise ConfigError(f"uplink.backoff={self.backoff_s!r}s must be >= 0")
        _at_least("uplink.max_connections", self.max_connections, 1, "e.g. 8")
        _at_least("uplink.max_attempts", self.max_attempts, 1, "e.g. 3")
        _at_least("uplink.breaker_failures", self.breaker_failures, 1, "e.g. 3")
        _at_least("uplink.max_response_bytes", self.max_response_bytes, 1024, "e.g. 64MiB")
        if self.priority is not None and (
            isinstance(self.priority, bool)
            or not isinstance(self.priority, int)
            or not 0 <= self.priority <= 9
        ):
            raise ConfigError(f"uplink.priority={self.priority!r} must be an integer 0..9")


@dataclass(frozen=True)
class AdaptConfig:
    """Link estimation and run-time cut switching."""

    enabled: bool = option(True, "Switch among the package's candidate cuts at run time.")
    cut: str | None = option(
        None,
        "Pin one cut id (switching off); unset: the chooser decides, starting at the default.",
        metavar="CUT",
    )
    hysteresis: float = option(
        0.15, "A cut must be predicted this fraction faster than the current one to switch to it."
    )
    min_dwell: int = option(
        10, "Requests to stay on a cut before switching again (a change of cloud load excepted)."
    )
    load_high: float = option(
        0.8, "Cloud load (0..1, EWMA) at which the agent counts the cloud as overloaded."
    )
    load_low: float = option(0.5, "Load at which an overloaded cloud counts as clear again.")
    load_factor: float = option(
        4.0, "While overloaded, the cloud part of each prediction is multiplied by this."
    )
    load_half_life_s: float = option(
        30.0,
        "Without a new answer from the cloud, the load estimate halves every this long.",
    )
    measured_edge: bool = option(
        True, "Predict with this device's measured edge-segment times instead of the package's."
    )
    alpha: float = option(
        0.2, "Weight of a new sample in the load and edge-time estimates (EWMA), 0..1."
    )
    link_half_life_s: float = option(
        10.0, "Half-life of a transfer's or health check's weight in the link estimate."
    )
    min_rate_bytes: int = option(
        8192,
        "The uplink rate is measured only from uploads at least this big.",
        name="min_rate_sample",
    )
    prior_uplink: str | None = option(
        None,
        "Uplink rate before any transfer is measured (default: the package's planning link, else "
        "10mbit), e.g. 5mbit.",
        metavar="RATE",
    )
    prior_downlink: str | None = option(
        None,
        "Downlink rate; never measured (answers are small), e.g. 50mbit (default: the planning "
        "link's, else 50mbit).",
        metavar="RATE",
    )
    prior_rtt: str | None = option(
        None,
        "Round trip time before any is measured (default: the planning link's, else 50ms).",
        metavar="DURATION",
    )

    def __post_init__(self) -> None:
        for name in ("hysteresis", "load_high", "load_low"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (math.isfinite(value) and 0 <= value <= 1):
                raise ConfigError(f"adapt.{name}={value!r} must be a number in [0, 1]")
        if self.load_low > self.load_high:
            raise ConfigError(
                f"adapt.load_low={self.load_low} is above adapt.load_high={self.load_high}; "
                "the load must clear below the level that marks it high"
            )
        _at_least("adapt.min_dwell", self.min_dwell, 0, "e.g. 10 requests")
        _positive("adapt.load_half_life_s", self.load_half_life_s, "e.g. 30s")
        _positive("adapt.link_half_life_s", self.link_half_life_s, "e.g. 10s")
        _at_least("adapt.min_rate_sample", self.min_rate_bytes, 1, "e.g. 8KiB")
        if isinstance(self.load_factor, bool) or not (
            math.isfinite(self.load_factor) and self.load_factor >= 1
        ):
            raise ConfigError(f"adapt.load_factor={self.load_factor!r} must be a number >= 1")
        if isinstance(self.alpha, bool) or not (math.isfinite(self.alpha) and 0 < self.alpha <= 1):
            raise ConfigError(f"adapt.alpha={self.alpha!r} must be a number in (0, 1]")
        from splitinfer.shared.links import parse_duration, parse_rate

        for key, rate in (
            ("prior_uplink", self.prior_uplink),
            ("prior_downlink", self.prior_downlink),
        ):
            if rate is not None:
                parse_rate(rate, f"adapt.{key}")
        if self.prior_rtt is not None:
            parse_duration(self.prior_rtt, "adapt.prior_rtt")


@dataclass(frozen=True)
class QueueConfig:
    """The local API's admission: bounded work, never an unbounded queue."""

    max_concurrency: int = option(4, "Requests processed at once (segments, encoding, uplink).")
    max_queue: int = option(64, "Requests waiting beyond those; more are refused with 503 at once.")
    max_body_bytes: int = option(
        64 * 2**20, "Largest request body from an application (413 beyond)."
    )
    request_timeout_s: float = option(
        10.0, "How long a request may take end to end unless it sends X-Splitinfer-Timeout-Ms."
    )
    inline_below_ms: float = option(
        1.0,
        "A request whose own CPU work (edge segment, noise, encode; measured per cut) is under "
        "this runs it on the event loop when no other request is computing: the hop to a "
        "worker thread and back costs more than that here. 0: always the pool.",
    )
    header_timeout_s: float = option(
        10.0,
        "How long a new connection to the local API may take to send its first request's headers; "
        "then it is closed.",
    )
    body_timeout_s: float = option(30.0, "How long a request body may take to arrive (then 408).")
    keepalive_timeout_s: float = option(
        15.0, "How long an idle keep-alive connection (or one sending its next headers) is kept."
    )
    max_connections: int = option(
        256, "Connections to the local API open at once; more get 503 and are closed."
    )
    max_inflight_bytes: int = option(
        128 * 2**20, "Request body bytes read at once over all applications; beyond: 503."
    )

    def __post_init__(self) -> None:
        _at_least("queue.max_concurrency", self.max_concurrency, 1, "e.g. 4")
        _at_least("queue.max_connections", self.max_connections, 1, "e.g. 256")
        if isinstance(self.max_inflight_bytes, bool) or not (
            isinstance(self.max_inflight_bytes, int)
            and self.max_inflight_bytes >= self.max_body_bytes
        ):
            raise ConfigError(
                f"queue.max_inflight={self.max_inflight_bytes!r} must be >= "
                f"queue.max_body={self.max_body_bytes} (bytes), or a largest body could never "
                "be read"
            )
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            _positive(f"queue.{name}", getattr(self, name), "e.g. 10s")
        if isinstance(self.inline_below_ms, bool) or not (
            isinstance(self.inline_below_ms, (int, float))
            and math.isfinite(self.inline_below_ms)
            and self.inline_below_ms >= 0
        ):
            raise ConfigError(
                f"queue.inline_below={self.inline_below_ms!r}ms must be >= 0; "
                "0 runs every request's work in the worker pool"
            )
        _at_least("queue.max_queue", self.max_queue, 0, "e.g. 64")
        _at_least("queue.max_body_bytes", self.max_body_bytes, 1024, "e.g. 64MiB")
        _positive("queue.request_timeout_s", self.request_timeout_s, "e.g. 10s")


@dataclass(frozen=True)
class PrivacyConfig(PrivacyBudget):
    """The per-device privacy budget, for packages that add noise (``manifest.privacy``):
    the budget shared with the cloud service
    (:class:`~splitinfer.shared.settings.PrivacyBudget`), and what the edge does past it."""

    on_exhausted: str = option(
        "local",
        "Beyond the budget: local (answer from the device's own model) or refuse (429).",
        metavar="refuse|local",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.on_exhausted not in ON_EXHAUSTED:
            raise ConfigError(
                f"privacy.on_exhausted={self.on_exhausted!r}; use one of {ON_EXHAUSTED}"
            )


@dataclass(frozen=True)
class EdgeConfig:
    """Everything ``edge-agent`` runs with."""

    package: Path = option(help="The split package folder.", metavar="DIR")
    cloud: tuple[str, ...] = option(
        (),
        "Cloud service base URLs, tried in this order (http://host:port or https://...).",
        metavar="URL[,URL...]",
    )
    listen: str = option(DEFAULT_LISTEN, "HOST:PORT of the local API.", metavar="HOST:PORT")
    credentials: Path | None = option(
        None, "TOML credential file holding this device's key (see docs/auth.md).", metavar="FILE"
    )
    device_id: str | None = option(
        None, "Device id in the credential file (default: the only device in it).", metavar="ID"
    )
    model: str | None = option(
        None,
        "NAME[:VERSION] to ask the cloud for (default: the package's model, any version).",
        metavar="NAME[:VERSION]",
    )
    ca_file: Path | None = option(
        None,
        "PEM file of the CA that signed the cloud's certificate (default: system CAs).",
        metavar="F",
    )
    runtime: RuntimeConfig = section(
        RuntimeConfig, prefix="", old_prefix="runtime", old={"providers": ["provider"]}
    )
    uplink: UplinkConfig = section(UplinkConfig)
    adapt: AdaptConfig = section(AdaptConfig)
    queue: QueueConfig = section(QueueConfig)
    privacy: PrivacyConfig = section(PrivacyConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "package", Path(self.package))
        object.__setattr__(self, "cloud", tuple(self.cloud))
        for url in self.cloud:
            check_url(url)
        if len(set(self.cloud)) != len(self.cloud):
            raise ConfigError(f"cloud: {list(self.cloud)} lists an endpoint twice")
        parse_listen(self.listen)
        if self.model is not None:
            parse_model(self.model)

    @property
    def host_port(self) -> tuple[str, int]:
        return parse_listen(self.listen)


def check_url(url: str) -> str:
    """A cloud base URL, checked: http(s), a host, no query or fragment."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"cloud URL {url!r} is not http(s)://HOST[:PORT]; e.g. https://cloud.example:8443"
        )
    if parts.query or parts.fragment:
        raise ConfigError(f"cloud URL {url!r}: remove the query or fragment")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ConfigError(f"cloud URL {url!r}: the port is not a number 1..65535") from None
    return url


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8480`` for IPv6) as (host, port); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"listen={text!r} is not HOST:PORT, e.g. 127.0.0.1:8480")
    return host, int(port)


def parse_model(text: str) -> tuple[str, str]:
    """``NAME[:VERSION]`` as (name, version); an empty version lets the cloud choose."""
    name, _, version = text.partition(":")
    if not name or any(c in name for c in "/?#% "):
        raise ConfigError(f"model={text!r} is not NAME[:VERSION], e.g. demo_cnn:3")
    if any(c in version for c in "/?#% :"):
        raise ConfigError(f"model={text!r}: the version {version!r} has a bad character")
    return name, version


def config_from_mapping(
    data: Mapping[str, Any], src: str = "config", warn: Callable[[str], None] | None = None
) -> EdgeConfig:
    """An EdgeConfig from a TOML-shaped mapping (top-level keys plus [section] tables);
    ``warn`` gets one line per former (deprecated) key."""
    return build(EdgeConfig, data, src, warn)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option of EdgeConfig and its sections (``--uplink-timeout``)."""
    options.add_flags(parser, EdgeConfig, "agent")


def config_from_args(
    args: argparse.Namespace,
    base: Mapping[str, Any] | None = None,
    src: str = "options",
    warn: Callable[[str], None] | None = None,
) -> EdgeConfig:
    """Flags over the file's values (``base``, TOML-shaped) over the defaults; an error
    names ``src`` (the file, or "options")."""
    data: dict[str, Any] = {
        k: (dict(v) if isinstance(v, Mapping) else v) for k, v in (base or {}).items()
    }
    return config_from_mapping(options.merge_flags(data, args, EdgeConfig), src, warn)


def sections() -> Sequence[str]:
    return tuple(options.sections(EdgeConfig))
