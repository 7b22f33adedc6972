"""The edge agent's configuration: frozen dataclasses, a TOML file, and flags.

Every option is defined once, here, as an :func:`~splitinfer.shared.options.option`
field with its help. The ``edge-agent`` command line is generated from these
classes (``--runtime-provider`` for ``runtime.provider``), a TOML ``--config``
file sets the same names (``[runtime] provider = "cuda"``), flags override the
file, and docs/edge-agent.md's reference table is rendered from them
(:mod:`splitinfer.shared.options`). Each class checks its values in
``__post_init__`` and names the value and the fix.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from splitinfer.shared import options
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.options import build, load_toml, option, section

__all__ = ["EdgeConfig", "add_flags", "config_from_args", "config_from_mapping", "load_toml"]

PROVIDERS = ("auto", "cpu", "cuda", "tensorrt")
ON_EXHAUSTED = ("local", "refuse")
DEFAULT_LISTEN = "127.0.0.1:8480"


def _positive(where: str, value: float, fix: str) -> None:
    if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{where}={value!r} must be a number > 0; {fix}")


def _at_least(where: str, value: int, low: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{where}={value!r} must be an integer >= {low}; {fix}")


@dataclass(frozen=True)
class RuntimeConfig:
    """Which ONNX Runtime execution provider runs the segments, and how."""

    provider: str = option(
        "auto",
        "auto (TensorRT on Jetson, CUDA where present, else CPU), cpu, cuda or tensorrt.",
        metavar="auto|cpu|cuda|tensorrt",
    )
    threads: int = option(0, "Intra-op threads of each session; 0 lets ONNX Runtime decide.")
    spin: bool = option(
        False,
        "Let ONNX Runtime's idle intra-op threads spin (lower latency for the segment, but they "
        "burn the cores the agent encodes on right after each run).",
    )
    gpu: int = option(0, "CUDA device index for the cuda and tensorrt providers.")
    trt_cache_dir: Path | None = option(
        None,
        "Folder of the TensorRT engine cache (default: $STATE_DIRECTORY/trt-cache, else "
        "~/.cache/splitinfer/trt).",
        metavar="DIR",
    )
    trt_fp16: bool = option(True, "Let TensorRT use fp16 kernels.")
    trt_int8: bool = option(True, "Let TensorRT run the int8 (Q/DQ) segments in int8.")
    trt_workspace_mb: int = option(1024, "TensorRT builder workspace, MiB.")
    verify: bool = option(True, "Check every package file against its sha256 at start.")
    emulate_device: str | None = option(
        None,
        "Emulate a slower device (tests, netsim): a built-in edge profile name or a measured "
        "profile JSON, as partition --edge-profile reads; each edge segment run is stretched to "
        "the profile's time for its nodes. Unset: off.",
        metavar="PROFILE",
    )

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise ConfigError(
                f"runtime.provider={self.provider!r} is unknown; use one of {', '.join(PROVIDERS)}"
            )
        _at_least("runtime.threads", self.threads, 0, "0 lets ONNX Runtime choose")
        _at_least("runtime.gpu", self.gpu, 0, "give the CUDA device index, e.g. 0")
        _at_least("runtime.trt_workspace_mb", self.trt_workspace_mb, 16, "e.g. 1024")
        if self.emulate_device is not None and not self.emulate_device.strip():
            raise ConfigError(
                "runtime.emulate_device='' is empty; give a built-in edge profile name "
                "(e.g. jetson-orin-nano) or a profile JSON, or leave it unset"
            )


@dataclass(frozen=True)
class UplinkConfig:
    """How frames travel to the cloud: timeouts, retries, failover, health checks."""

    timeout_s: float = option(
        5.0, "Seconds one attempt may take (capped by the request's deadline)."
    )
    connect_timeout_s: float = option(2.0, "Seconds to open a connection.")
    max_connections: int = option(
        8, "Connections open at once, over all endpoints (requests beyond wait for one)."
    )
    max_attempts: int = option(3, "Attempts per request over all endpoints, the first included.")
    backoff_s: float = option(
        0.05, "Base of the jittered exponential backoff between attempts, seconds."
    )
    backoff_max_s: float = option(1.0, "Largest backoff, seconds.")
    breaker_failures: int = option(
        3, "Consecutive failures that open an endpoint's circuit breaker."
    )
    breaker_reset_s: float = option(
        5.0, "Seconds an open breaker waits before a health check may close it."
    )
    health_interval_s: float = option(
        2.0, "Seconds between health checks (GET /healthz) of the endpoints."
    )
    max_response_bytes: int = option(
        64 * 2**20, "Largest response body accepted from the cloud, bytes."
    )
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
            _positive(f"uplink.{name}", getattr(self, name), "give seconds, e.g. 2")
        _positive("uplink.health_interval_s", self.health_interval_s, "give seconds, e.g. 2")
        if isinstance(self.backoff_s, bool) or not (
            math.isfinite(self.backoff_s) and self.backoff_s >= 0
        ):
            raise ConfigError(f"uplink.backoff_s={self.backoff_s!r} must be seconds >= 0")
        _at_least("uplink.max_connections", self.max_connections, 1, "e.g. 8")
        _at_least("uplink.max_attempts", self.max_attempts, 1, "e.g. 3")
        _at_least("uplink.breaker_failures", self.breaker_failures, 1, "e.g. 3")
        _at_least("uplink.max_response_bytes", self.max_response_bytes, 1024, "e.g. 67108864")
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
        "Without a new answer from the cloud, the load estimate halves every this many seconds.",
    )
    measured_edge: bool = option(
        True, "Predict with this device's measured edge-segment times instead of the package's."
    )
    alpha: float = option(
        0.2, "Weight of a new sample in the load and edge-time estimates (EWMA), 0..1."
    )
    link_half_life_s: float = option(
        10.0, "Half-life of a transfer's or health check's weight in the link estimate, seconds."
    )
    min_rate_bytes: int = option(
        8192, "The uplink rate is measured only once an upload of at least this many bytes is seen."
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
        _positive("adapt.load_half_life_s", self.load_half_life_s, "give seconds, e.g. 30")
        _positive("adapt.link_half_life_s", self.link_half_life_s, "give seconds, e.g. 10")
        _at_least("adapt.min_rate_bytes", self.min_rate_bytes, 1, "e.g. 8192")
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
        64 * 2**20, "Largest request body from an application, bytes (413 beyond)."
    )
    request_timeout_s: float = option(
        10.0, "Seconds a request may take end to end unless it sends X-Splitinfer-Timeout-Ms."
    )
    inline_below_ms: float = option(
        1.0,
        "A request whose own CPU work (edge segment, noise, encode; measured per cut) is under "
        "this many ms runs it on the event loop when no other request is computing: the hop to a "
        "worker thread and back costs more than that here. 0: always the pool.",
    )
    header_timeout_s: float = option(
        10.0,
        "Seconds a new connection to the local API may take to send its first request's headers; "
        "then it is closed.",
    )
    body_timeout_s: float = option(30.0, "Seconds a request body may take to arrive (then 408).")
    keepalive_timeout_s: float = option(
        15.0, "Seconds an idle keep-alive connection (or one sending its next headers) is kept."
    )
    max_connections: int = option(
        256, "Connections to the local API open at once; more get 503 and are closed."
    )
    max_inflight_bytes: int = option(
        128 * 2**20, "Request body bytes being read at once over all applications; beyond: 503."
    )

    def __post_init__(self) -> None:
        _at_least("queue.max_concurrency", self.max_concurrency, 1, "e.g. 4")
        _at_least("queue.max_connections", self.max_connections, 1, "e.g. 256")
        if isinstance(self.max_inflight_bytes, bool) or not (
            isinstance(self.max_inflight_bytes, int)
            and self.max_inflight_bytes >= self.max_body_bytes
        ):
            raise ConfigError(
                f"queue.max_inflight_bytes={self.max_inflight_bytes!r} must be an integer >= "
                f"queue.max_body_bytes={self.max_body_bytes}, or a largest body could never be read"
            )
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            _positive(f"queue.{name}", getattr(self, name), "give seconds, e.g. 10")
        if isinstance(self.inline_below_ms, bool) or not (
            isinstance(self.inline_below_ms, (int, float))
            and math.isfinite(self.inline_below_ms)
            and self.inline_below_ms >= 0
        ):
            raise ConfigError(
                f"queue.inline_below_ms={self.inline_below_ms!r} must be a number >= 0; "
                "0 runs every request's work in the worker pool"
            )
        _at_least("queue.max_queue", self.max_queue, 0, "e.g. 64")
        _at_least("queue.max_body_bytes", self.max_body_bytes, 1024, "e.g. 67108864")
        _positive("queue.request_timeout_s", self.request_timeout_s, "give seconds, e.g. 10")


@dataclass(frozen=True)
class PrivacyConfig:
    """The per-device privacy budget, for packages that add noise (``manifest.privacy``)."""

    budget_epsilon: float | None = option(
        None, "Largest epsilon this device may spend per window; unset: no budget is enforced."
    )
    budget_window_s: float = option(3600.0, "Window length of the budget, seconds (tumbling).")
    budget_delta: float | None = option(
        None, "Delta at which the window's epsilon is measured (default: the package's delta)."
    )
    on_exhausted: str = option(
        "local",
        "Beyond the budget: local (answer from the device's own model) or refuse (429).",
        metavar="refuse|local",
    )
    accountant: str = option(
        "rdp",
        "opacus accountant that composes the releases: rdp (about 0.3 ms a charge here) or prv "
        "(tighter, but about 0.4 s a charge on this CPU: every request would pay it).",
        metavar="prv|rdp",
    )

    def __post_init__(self) -> None:
        if self.budget_epsilon is not None:
            _positive("privacy.budget_epsilon", self.budget_epsilon, "e.g. 8")
        _positive("privacy.budget_window_s", self.budget_window_s, "e.g. 3600")
        if self.budget_delta is not None and not 0 < self.budget_delta < 1:
            raise ConfigError(f"privacy.budget_delta={self.budget_delta!r} must be in (0, 1)")
        if self.on_exhausted not in ON_EXHAUSTED:
            raise ConfigError(
                f"privacy.on_exhausted={self.on_exhausted!r}; use one of {ON_EXHAUSTED}"
            )
        if self.accountant not in ("prv", "rdp"):
            raise ConfigError(f"privacy.accountant={self.accountant!r}; use prv or rdp")


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
    runtime: RuntimeConfig = section(RuntimeConfig)
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


def config_from_mapping(data: Mapping[str, Any], src: str = "config") -> EdgeConfig:
    """An EdgeConfig from a TOML-shaped mapping (top-level keys plus [section] tables)."""
    return build(EdgeConfig, data, src)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option of EdgeConfig and its sections (``--uplink-timeout-s``)."""
    options.add_flags(parser, EdgeConfig, "agent")


def config_from_args(
    args: argparse.Namespace, base: Mapping[str, Any] | None = None, src: str = "options"
) -> EdgeConfig:
    """Flags over the file's values (``base``, TOML-shaped) over the defaults; an error
    names ``src`` (the file, or "options")."""
    data: dict[str, Any] = {
        k: (dict(v) if isinstance(v, Mapping) else v) for k, v in (base or {}).items()
    }
    return config_from_mapping(options.merge_flags(data, args, EdgeConfig), src)


def sections() -> Sequence[str]:
    return tuple(options.sections(EdgeConfig))
