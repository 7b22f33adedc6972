"""The cloud service's configuration: frozen dataclasses, a TOML file, command-line flags.

Each option is defined once, as a dataclass field with a ``help`` in its
metadata (the settings the edge agent shares, ``[runtime]``'s providers, threads and
TensorRT and ``[privacy]``'s budget, in :mod:`splitinfer.shared.settings`);
``__post_init__`` rejects a bad value naming it and the fix. The TOML
file mirrors the dataclasses (``[batching]``, ``[runtime]``, ``[overload]``, ``[privacy]``,
``[models.<name>]``); :mod:`splitinfer.cloud.cli` generates one flag per scalar
option from the same fields and takes ``--set models.NAME.KEY=VALUE`` for the
per-model ones, so every option is also a command-line option.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitinfer.shared.errors import ConfigError
from splitinfer.shared.frame import Limits
from splitinfer.shared.options import at_least, build, check, load_toml, option, section, set_key
from splitinfer.shared.settings import PROVIDERS, PrivacyBudget, RuntimeOptions

PROVIDER_NAMES = PROVIDERS
VERSION_MODES = ("latest", "all", "list")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


__all__ = ["ServiceConfig", "build_config", "load_toml"]


@dataclass(frozen=True)
class BatchingConfig:
    """How requests for one model are grouped into batches (see ``batcher.py``)."""

    enabled: bool = option(
        True, "batch requests together (off: every request runs alone)", flag="batching"
    )
    max_batch_size: int = option(32, "most samples (rows) in one batch", minimum=1)
    max_queue_delay_ms: float = option(
        2.0, "longest a request waits for a batch to fill while another batch runs", minimum=0.0
    )
    max_queue_size: int = option(
        1024, "most samples queued per model; more are refused with 503 and Retry-After", minimum=1
    )
    max_concurrent_batches: int = option(
        1, "most batches of one model executing at once", minimum=1
    )
    adaptive_delay: bool = option(
        False, "learn batch latency vs size and wait only while a request is due sooner"
    )
    aimd: bool = option(
        False, "adapt the batch size AIMD-style: +1 under --aimd-target, x0.9 over it"
    )
    aimd_target_ms: float = option(
        50.0, "batch compute time AIMD keeps batches under", minimum=0.001
    )

    def __post_init__(self) -> None:
        check(self)
        if self.max_queue_size < self.max_batch_size:
            raise ConfigError(
                f"max_queue_size={self.max_queue_size} is below max_batch_size="
                f"{self.max_batch_size}; raise it so a full batch can queue"
            )


@dataclass(frozen=True)
class PrivacyConfig(PrivacyBudget):
    """Per-device privacy budgets the cloud enforces on noised frames (the budget the
    edge agent keeps too, :class:`~splitinfer.shared.settings.PrivacyBudget`).

    Defence in depth: the edge agent keeps its own budget (docs/privacy.md), but a
    device that skips it (a bug, or a modified agent) is still held to this one.
    """

    budget_delta: float | None = option(
        1e-5, "delta at which a window's epsilon is measured (the cloud sees no package's)"
    )


#: eviction policies of the MoE expert cache (``cloud/moe/cache.py`` POLICIES)
EXPERT_POLICIES = ("lfru", "lru", "none")


@dataclass(frozen=True)
class RuntimeConfig(RuntimeOptions):
    """ONNX Runtime sessions for the cloud segments (see ``runtime.py``): the settings
    shared with the edge agent (:class:`~splitinfer.shared.settings.RuntimeOptions`),
    and the cloud's own."""

    trt_fp16: bool = option(False, "let TensorRT build fp16 kernels")
    inter_op_threads: int = option(
        1, "threads across operators (1: sequential execution)", minimum=0
    )
    io_binding: bool = option(True, "bind inputs/outputs on GPU providers to save copies")
    expert_cache_bytes: int = option(
        0,
        "device memory for the experts of each loaded MoE model (0: no bound, every expert "
        "stays resident once used); see docs/moe.md",
        minimum=0,
    )
    expert_cache_policy: str = option(
        "lfru", "MoE expert eviction: lfru, lru or none", choices=EXPERT_POLICIES
    )
    expert_prefetch: bool = option(
        False,
        "prefetch the next MoE layer's experts on a background worker (pays where the "
        "page-in overlaps compute, e.g. a GPU copy engine)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()


@dataclass(frozen=True)
class OverloadConfig:
    """Rate limits and the circuit breaker (see ``overload.py``)."""

    device_rate: float = option(0.0, "requests per second per device (0: unlimited)", minimum=0.0)
    device_burst: int = option(
        0, "token bucket size per device (0: max(1, device_rate))", minimum=0
    )
    max_devices: int = option(
        100_000, "devices tracked by the rate limiter (least recent dropped)", minimum=1
    )
    breaker_failures: int = option(
        5, "consecutive failed batches that open a version's breaker", minimum=1
    )
    breaker_cooldown_s: float = option(
        10.0, "how long an open breaker waits before one trial batch", minimum=0.0
    )

    def __post_init__(self) -> None:
        check(self)

    @property
    def burst(self) -> float:
        return float(self.device_burst) if self.device_burst else max(1.0, self.device_rate)


@dataclass(frozen=True)
class ModelPolicy:
    """Which versions of one model serve and how traffic splits between them.

    ``versions``: "latest" (the ``latest`` newest complete versions), "all", or
    "list" (exactly ``version_list``). ``weights`` splits traffic A/B between
    ready versions by weight; otherwise ``canary_percent`` of the traffic goes
    to the newest ready version and the rest to the one before it; otherwise
    the newest ready version takes everything. ``sticky`` keeps each device on
    one version (a hash of its id instead of a random draw).
    """

    versions: str = "latest"
    latest: int = 1
    version_list: tuple[str, ...] = ()
    weights: Mapping[str, float] = field(default_factory=dict)
    canary_percent: float = 0.0
    sticky: bool = False
    pad_buckets: bool = True  # pad variable-length cut tensors when the cut has a mask
    batching: BatchingConfig | None = None  # overrides the service-wide [batching]

    def __post_init__(self) -> None:
        if self.versions not in VERSION_MODES:
            raise ConfigError(
                f"versions={self.versions!r}: must be one of {', '.join(VERSION_MODES)}"
            )
        if not isinstance(self.latest, int) or isinstance(self.latest, bool) or self.latest < 1:
            raise ConfigError(f"latest={self.latest!r}: must be an integer >= 1")
        if self.versions == "list" and not self.version_list:
            raise ConfigError("versions='list' needs version_list = [...] naming the versions")
        for v in (*self.version_list, *self.weights):
            if not isinstance(v, str) or not _NAME.fullmatch(v):
                raise ConfigError(f"version {v!r}: must match {_NAME.pattern}")
        for v, w in self.weights.items():
            if not isinstance(w, (int, float)) or isinstance(w, bool) or not (0 <= w < math.inf):
                raise ConfigError(f"weights.{v}={w!r}: must be a finite number >= 0")
        at_least(self, "canary_percent", 0)
        if self.canary_percent > 100:
            raise ConfigError(f"canary_percent={self.canary_percent}: must be within 0..100")


@dataclass(frozen=True)
class ServiceConfig:
    """The whole service. ``repository`` is the only option without a default."""

    repository: str = option(
        "", "model repository folder: <repo>/<model>/<version>/", metavar="DIR"
    )
    listen: str = option(
        "127.0.0.1:8080", "HOST:PORT to listen on (port 0: any free port)", metavar="HOST:PORT"
    )
    credentials: str = option("", "device credential file (TOML, see docs/auth.md)", metavar="FILE")
    no_auth: bool = option(False, "accept unsigned requests (development on loopback only)")
    tls_cert: str = option("", "PEM certificate chain for HTTPS", metavar="FILE")
    tls_key: str = option("", "PEM private key for HTTPS", metavar="FILE")
    max_body_bytes: int = option(64 * 2**20, "largest request body; bigger ones get 413", minimum=1)
    max_tensor_bytes: int = option(256 * 2**20, "largest decoded tensor of one request", minimum=1)
    max_request_batch: int = option(256, "most samples one request frame may carry", minimum=1)
    auth_window_s: float = option(
        30.0, "accepted clock skew / replay window of signed requests", minimum=1.0
    )
    audience: tuple[str, ...] = option(
        (),
        "this replica's audience(s), e.g. its public URL: only requests signed for one of "
        "them are accepted (auth v2; empty: any audience, and unbound v1 signatures)",
    )
    nonce_store: str = option(
        "",
        "where accepted nonces are remembered: redis://HOST:PORT/DB, shared by replicas with "
        "the same audience (default: '', this process)",
    )
    max_inflight_bytes: int = option(
        128 * 2**20,
        "request body bytes read at once over all clients; beyond: 503 + Retry-After",
        minimum=1,
    )
    max_device_inflight_bytes: int = option(
        64 * 2**20, "request body bytes read at once for one device; beyond: 503", minimum=1
    )
    accept_raw: bool = option(
        False,
        "accept raw tensors where the cut's manifest names another codec (tests and "
        "debugging; off: such a frame is 400, as the HTTP contract says)",
    )
    max_json_bytes: int = option(
        8 * 2**20, "largest infer.json body (parsed off the event loop)", minimum=1
    )
    header_timeout_s: float = option(
        10.0,
        "how long a new connection may take to send its first request's headers",
        minimum=0.001,
    )
    body_timeout_s: float = option(
        30.0, "how long a request body may take to arrive (then 408)", minimum=0.001
    )
    keepalive_timeout_s: float = option(
        15.0,
        "how long an idle keep-alive connection (or one sending its next headers) is kept",
        minimum=0.001,
    )
    max_connections: int = option(
        1000, "connections open at once; more get 503 and are closed", minimum=1
    )
    watch_interval_s: float = option(0.0, "rescan the repository this often (0: off)", minimum=0.0)
    drain_timeout_s: float = option(
        30.0, "on shutdown, how long queued requests may finish", minimum=0.0
    )
    warmup: bool = option(True, "run each new version at batch 1 and max batch before serving")
    workers: int = option(
        0, "threads running batches (0: 2 x max_concurrent_batches, at least 2)", minimum=0
    )
    log_level: str = option("info", "debug, info, warning or error", metavar="LEVEL")
    batching: BatchingConfig = section(BatchingConfig, prefix="")
    runtime: RuntimeConfig = section(
        RuntimeConfig,
        prefix="",
        old={"threads": ["intra_op_threads"], "spin": ["spinning"], "gpu": ["device_id"]},
    )
    overload: OverloadConfig = section(OverloadConfig, prefix="")
    privacy: PrivacyConfig = section(  # flags --privacy-*
        PrivacyConfig,
        old={
            "budget_epsilon": ["max_epsilon"],
            "budget_window_s": ["window_s"],
            "budget_delta": ["delta"],
        },
    )
    models: Mapping[str, ModelPolicy] = option(
        default_factory=dict,
        help="per-model policies, [models.<name>] tables (--set models.NAME.KEY=VALUE)",
        parse=lambda raw, where: _policies(raw, where),  # noqa: PLW0108 - defined below
    )

    def __post_init__(self) -> None:
        if not self.repository:
            raise ConfigError("repository: missing; give --repository DIR (or repository = ...)")
        self.host_port()  # validates listen
        check(self)
        if not self.max_body_bytes <= self.max_device_inflight_bytes <= self.max_inflight_bytes:
            raise ConfigError(
                f"max_body={self.max_body_bytes} <= max_device_inflight="
                f"{self.max_device_inflight_bytes} <= max_inflight="
                f"{self.max_inflight_bytes} (bytes) must hold, or a largest body could never be "
                "read; raise the in-flight bounds or lower max_body"
            )
        if self.nonce_store and not self.nonce_store.startswith(("redis://", "rediss://")):
            raise ConfigError(
                f"nonce_store={self.nonce_store!r}: give '' (this process) or redis://HOST:PORT/DB"
            )
        for aud in self.audience:
            if not aud or any(c.isspace() for c in aud) or len(aud) > 256:
                raise ConfigError(f"audience {aud!r}: a URL or name, no spaces, <= 256 chars")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level={self.log_level!r}: one of debug, info, warning, error")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key go together: give both or neither")
        for name in self.models:
            if not _NAME.fullmatch(name):
                raise ConfigError(f"models.{name}: a model name must match {_NAME.pattern}")

    def host_port(self) -> tuple[str, int]:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"listen={self.listen!r}: expected HOST:PORT, e.g. 127.0.0.1:8080")
        return host.strip("[]"), int(port)

    @property
    def repository_path(self) -> Path:
        return Path(self.repository)

    def policy(self, model: str) -> ModelPolicy:
        return self.models.get(model) or ModelPolicy()

    def batching_for(self, model: str) -> BatchingConfig:
        return self.policy(model).batching or self.batching

    def limits(self) -> Limits:
        return Limits(
            max_frame_bytes=self.max_body_bytes,
            max_tensor_bytes=self.max_tensor_bytes,
            max_batch=self.max_request_batch,
        )

    @property
    def auth_enabled(self) -> bool:
        return not self.no_auth


def build_config(
    data: Mapping[str, Any], where: str = "config", warn: Callable[[str], None] | None = None
) -> ServiceConfig:
    """A :class:`ServiceConfig` from a TOML-shaped mapping; unknown keys are errors, and
    ``warn`` gets one line per former (deprecated) key."""
    return build(ServiceConfig, data, where, warn)


#: ``--set KEY.PATH=VALUE`` (and the Ray ingress's ``key=value`` arguments) on a TOML mapping.
apply_override = set_key


_POLICY_KEYS = frozenset(
    {"versions", "latest", "weights", "canary_percent", "sticky", "pad_buckets", "batching"}
)


def _policies(raw: Any, where: str) -> dict[str, ModelPolicy]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected tables [models.<name>]")
    return {name: _policy(body, f"{where}.{name}") for name, body in raw.items()}


def _policy(raw: Any, where: str) -> ModelPolicy:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table")
    extra = sorted(set(raw) - _POLICY_KEYS)
    if extra:
        raise ConfigError(f"{where}: {extra[0]}: unknown option (known: {sorted(_POLICY_KEYS)})")
    kwargs: dict[str, Any] = {}
    versions = raw.get("versions", "latest")
    if isinstance(versions, list):
        if not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in versions):
            raise ConfigError(f"{where}: versions: a list holds version names")
        kwargs["versions"] = "list"
        kwargs["version_list"] = tuple(str(v) for v in versions)
    elif isinstance(versions, str):
        kwargs["versions"] = versions
    else:
        raise ConfigError(f'{where}: versions: "latest", "all" or a list of versions')
    for key, kind in (("latest", int), ("canary_percent", float)):
        if key in raw:
            value = raw[key]
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(f"{where}: {key}: {value!r} is not a number")
            kwargs[key] = kind(value) if kind is float else value
    for key in ("sticky", "pad_buckets"):
        if key in raw:
            if not isinstance(raw[key], bool):
                raise ConfigError(f"{where}: {key}: {raw[key]!r} is not true or false")
            kwargs[key] = raw[key]
    if "weights" in raw:
        weights = raw["weights"]
        if not isinstance(weights, dict):
            raise ConfigError(f'{where}: weights: a table {{ "1" = 90, "2" = 10 }}')
        kwargs["weights"] = {str(k): v for k, v in weights.items()}
    if "batching" in raw:
        kwargs["batching"] = build(BatchingConfig, raw["batching"], f"{where}.batching")
    try:
        return ModelPolicy(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
