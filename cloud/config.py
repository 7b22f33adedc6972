"""The cloud service's configuration: frozen dataclasses, a TOML file, command-line flags.

Each option is defined once, as a dataclass field with a ``help`` in its
metadata; ``__post_init__`` rejects a bad value naming it and the fix. The TOML
file mirrors the dataclasses (``[batching]``, ``[runtime]``, ``[overload]``, ``[privacy]``,
``[models.<name>]``); :mod:`splitinfer.cloud.cli` generates one flag per scalar
option from the same fields and takes ``--set models.NAME.KEY=VALUE`` for the
per-model ones, so every option is also a command-line option.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitinfer.shared.errors import ConfigError
from splitinfer.shared.frame import Limits

PROVIDER_NAMES = ("tensorrt", "cuda", "cpu")
VERSION_MODES = ("latest", "all", "list")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _opt(default: Any, help: str, flag: str = "") -> Any:
    """A field with its help (and command-line flag name if not the field's own)."""
    return field(default=default, metadata={"help": help, "flag": flag})


def _positive_int(obj: object, name: str, minimum: int = 1) -> None:
    value = getattr(obj, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}={value!r}: must be an integer >= {minimum}")


def _number(obj: object, name: str, minimum: float = 0.0) -> None:
    value = getattr(obj, name)
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < minimum
    ):
        raise ConfigError(f"{name}={value!r}: must be a finite number >= {minimum:g}")


@dataclass(frozen=True)
class BatchingConfig:
    """How requests for one model are grouped into batches (see ``batcher.py``)."""

    enabled: bool = _opt(
        True, "batch requests together (off: every request runs alone)", flag="batching"
    )
    max_batch_size: int = _opt(32, "most samples (rows) in one batch")
    max_queue_delay_ms: float = _opt(
        2.0, "longest a request waits for a batch to fill while another batch runs"
    )
    max_queue_size: int = _opt(
        1024, "most samples queued per model; more are refused with 503 and Retry-After"
    )
    max_concurrent_batches: int = _opt(1, "most batches of one model executing at once")
    adaptive_delay: bool = _opt(
        False, "learn batch latency vs size and wait only while a request is due sooner"
    )
    aimd: bool = _opt(
        False, "adapt the batch size AIMD-style: +1 under aimd_target_ms, x0.9 over it"
    )
    aimd_target_ms: float = _opt(50.0, "batch compute time AIMD keeps batches under")

    def __post_init__(self) -> None:
        _positive_int(self, "max_batch_size")
        _positive_int(self, "max_queue_size")
        _positive_int(self, "max_concurrent_batches")
        _number(self, "max_queue_delay_ms")
        _number(self, "aimd_target_ms", 0.001)
        if self.max_queue_size < self.max_batch_size:
            raise ConfigError(
                f"max_queue_size={self.max_queue_size} is below max_batch_size="
                f"{self.max_batch_size}; raise it so a full batch can queue"
            )


@dataclass(frozen=True)
class PrivacyConfig:
    """Per-device privacy budgets the cloud enforces on noised frames.

    Defence in depth: the edge agent keeps its own budget (docs/privacy.md), but a
    device that skips it (a bug, or a modified agent) is still held to this one.
    """

    max_epsilon: float = _opt(
        0.0,
        "largest epsilon one device may spend per window on noised frames, composed by "
        "the accountant (0: not enforced); beyond it 429 with Retry-After",
        flag="privacy_max_epsilon",
    )
    window_s: float = _opt(3600.0, "the budget window, seconds (tumbling)", "privacy_window_s")
    delta: float = _opt(1e-5, "delta at which a window's epsilon is measured", "privacy_delta")
    accountant: str = _opt(
        "rdp",
        "opacus accountant composing the releases: rdp (0.3 ms a charge here) or prv "
        "(tighter, but about 0.4 s a charge: not for a busy service)",
        "privacy_accountant",
    )

    def __post_init__(self) -> None:
        _number(self, "max_epsilon")
        _number(self, "window_s", 1e-3)
        if not 0 < self.delta < 1:
            raise ConfigError(f"privacy.delta={self.delta!r}: must be in (0, 1), e.g. 1e-5")
        if self.accountant not in ("rdp", "prv"):
            raise ConfigError(f"privacy.accountant={self.accountant!r}: use rdp or prv")

    @property
    def enforced(self) -> bool:
        return self.max_epsilon > 0


#: eviction policies of the MoE expert cache (``cloud/moe/cache.py`` POLICIES)
EXPERT_POLICIES = ("lfru", "lru", "none")


@dataclass(frozen=True)
class RuntimeConfig:
    """ONNX Runtime sessions for the cloud segments (see ``runtime.py``)."""

    providers: tuple[str, ...] = _opt(
        PROVIDER_NAMES,
        "execution providers in order of preference, those present are used (tensorrt, cuda, cpu)",
    )
    intra_op_threads: int = _opt(0, "threads inside one operator (0: ONNX Runtime's default)")
    inter_op_threads: int = _opt(1, "threads across operators (1: sequential execution)")
    spinning: bool = _opt(
        False,
        "let idle ONNX Runtime threads spin (faster hand-off, but they eat the CPU "
        "the event loop needs)",
    )
    io_binding: bool = _opt(True, "bind inputs/outputs on GPU providers to save copies")
    trt_fp16: bool = _opt(False, "let TensorRT build fp16 kernels")
    trt_cache_dir: str = _opt("", "folder for TensorRT engine caches ('' = none)")
    device_id: int = _opt(0, "the GPU ordinal for CUDA and TensorRT")
    expert_cache_bytes: int = _opt(
        0,
        "device bytes for the experts of each loaded MoE model (0: no bound, every expert "
        "stays resident once used); see docs/moe.md",
    )
    expert_cache_policy: str = _opt("lfru", "MoE expert eviction: lfru, lru or none")
    expert_prefetch: bool = _opt(
        False,
        "prefetch the next MoE layer's experts on a background worker (pays where the "
        "page-in overlaps compute, e.g. a GPU copy engine)",
    )

    def __post_init__(self) -> None:
        if self.expert_cache_policy not in EXPERT_POLICIES:
            raise ConfigError(
                f"expert_cache_policy={self.expert_cache_policy!r}: "
                f"give one of {', '.join(EXPERT_POLICIES)}"
            )
        _positive_int(self, "expert_cache_bytes", 0)
        if not self.providers or any(p not in PROVIDER_NAMES for p in self.providers):
            raise ConfigError(
                f"providers={list(self.providers)!r}: "
                f"give one or more of {', '.join(PROVIDER_NAMES)}"
            )
        _positive_int(self, "intra_op_threads", 0)
        _positive_int(self, "inter_op_threads", 0)
        _positive_int(self, "device_id", 0)


@dataclass(frozen=True)
class OverloadConfig:
    """Rate limits and the circuit breaker (see ``overload.py``)."""

    device_rate: float = _opt(0.0, "requests per second per device (0: unlimited)")
    device_burst: int = _opt(0, "token bucket size per device (0: max(1, device_rate))")
    max_devices: int = _opt(100_000, "devices tracked by the rate limiter (least recent dropped)")
    breaker_failures: int = _opt(5, "consecutive failed batches that open a version's breaker")
    breaker_cooldown_s: float = _opt(10.0, "seconds an open breaker waits before one trial batch")

    def __post_init__(self) -> None:
        _number(self, "device_rate")
        _positive_int(self, "device_burst", 0)
        _positive_int(self, "max_devices")
        _positive_int(self, "breaker_failures")
        _number(self, "breaker_cooldown_s")

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
        _positive_int(self, "latest")
        if self.versions == "list" and not self.version_list:
            raise ConfigError("versions='list' needs version_list = [...] naming the versions")
        for v in (*self.version_list, *self.weights):
            if not isinstance(v, str) or not _NAME.fullmatch(v):
                raise ConfigError(f"version {v!r}: must match {_NAME.pattern}")
        for v, w in self.weights.items():
            if not isinstance(w, (int, float)) or isinstance(w, bool) or not (0 <= w < math.inf):
                raise ConfigError(f"weights.{v}={w!r}: must be a finite number >= 0")
        _number(self, "canary_percent")
        if self.canary_percent > 100:
            raise ConfigError(f"canary_percent={self.canary_percent}: must be within 0..100")


@dataclass(frozen=True)
class ServiceConfig:
    """The whole service. ``repository`` is the only option without a default."""

    repository: str = _opt("", "model repository folder: <repo>/<model>/<version>/")
    listen: str = _opt("127.0.0.1:8080", "HOST:PORT to listen on (port 0: any free port)")
    credentials: str = _opt("", "device credential file (TOML, see docs/auth.md)")
    no_auth: bool = _opt(False, "accept unsigned requests (development on loopback only)")
    tls_cert: str = _opt("", "PEM certificate chain for HTTPS")
    tls_key: str = _opt("", "PEM private key for HTTPS")
    max_body_bytes: int = _opt(64 * 2**20, "largest request body; bigger ones get 413")
    max_tensor_bytes: int = _opt(256 * 2**20, "largest decoded tensor of one request")
    max_request_batch: int = _opt(256, "most samples one request frame may carry")
    auth_window_s: float = _opt(30.0, "accepted clock skew / replay window of signed requests")
    audience: tuple[str, ...] = _opt(
        (),
        "this replica's audience(s), e.g. its public URL: only requests signed for one of "
        "them are accepted (auth v2; empty: any audience, and unbound v1 signatures)",
    )
    nonce_store: str = _opt(
        "",
        "where accepted nonces are remembered: '' (this process; the default) or "
        "redis://HOST:PORT/DB, shared by replicas with the same audience",
    )
    max_inflight_bytes: int = _opt(
        128 * 2**20,
        "request body bytes being read at once over all clients; beyond: 503 + Retry-After",
    )
    max_device_inflight_bytes: int = _opt(
        64 * 2**20, "request body bytes being read at once for one device; beyond: 503"
    )
    accept_raw: bool = _opt(
        False,
        "accept raw tensors where the cut's manifest names another codec (tests and "
        "debugging; off: such a frame is 400, as the HTTP contract says)",
    )
    max_json_bytes: int = _opt(8 * 2**20, "largest infer.json body (parsed off the event loop)")
    header_timeout_s: float = _opt(
        10.0, "seconds a new connection may take to send its first request's headers"
    )
    body_timeout_s: float = _opt(30.0, "seconds a request body may take to arrive (then 408)")
    keepalive_timeout_s: float = _opt(
        15.0, "seconds an idle keep-alive connection (or one sending its next headers) is kept"
    )
    max_connections: int = _opt(1000, "connections open at once; more get 503 and are closed")
    watch_interval_s: float = _opt(0.0, "rescan the repository every N seconds (0: off)")
    drain_timeout_s: float = _opt(30.0, "on shutdown, how long queued requests may finish")
    warmup: bool = _opt(True, "run each new version at batch 1 and max batch before serving")
    workers: int = _opt(0, "threads running batches (0: 2 x max_concurrent_batches, at least 2)")
    log_level: str = _opt("info", "debug, info, warning or error")
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    overload: OverloadConfig = field(default_factory=OverloadConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    models: Mapping[str, ModelPolicy] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.repository:
            raise ConfigError("repository: missing; give --repository DIR (or repository = ...)")
        self.host_port()  # validates listen
        _positive_int(self, "max_body_bytes")
        _positive_int(self, "max_tensor_bytes")
        _positive_int(self, "max_request_batch")
        _positive_int(self, "workers", 0)
        _number(self, "auth_window_s", 1.0)
        _positive_int(self, "max_inflight_bytes")
        _positive_int(self, "max_device_inflight_bytes")
        _positive_int(self, "max_json_bytes")
        _positive_int(self, "max_connections")
        _number(self, "header_timeout_s", 0.001)
        _number(self, "body_timeout_s", 0.001)
        _number(self, "keepalive_timeout_s", 0.001)
        if not self.max_body_bytes <= self.max_device_inflight_bytes <= self.max_inflight_bytes:
            raise ConfigError(
                f"max_body_bytes={self.max_body_bytes} <= max_device_inflight_bytes="
                f"{self.max_device_inflight_bytes} <= max_inflight_bytes="
                f"{self.max_inflight_bytes} must hold, or a largest body could never be read; "
                "raise the in-flight bounds or lower max_body_bytes"
            )
        if self.nonce_store and not self.nonce_store.startswith(("redis://", "rediss://")):
            raise ConfigError(
                f"nonce_store={self.nonce_store!r}: give '' (this process) or redis://HOST:PORT/DB"
            )
        for aud in self.audience:
            if not aud or any(c.isspace() for c in aud) or len(aud) > 256:
                raise ConfigError(f"audience {aud!r}: a URL or name, no spaces, <= 256 chars")
        _number(self, "watch_interval_s")
        _number(self, "drain_timeout_s")
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


#: The sections whose scalar fields become command-line flags, by TOML table.
SECTIONS: dict[str, type] = {
    "batching": BatchingConfig,
    "runtime": RuntimeConfig,
    "overload": OverloadConfig,
    "privacy": PrivacyConfig,
}


def scalar_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The options of ``cls`` that take one value (the ones with a ``help``)."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def load_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read: {exc.strerror}") from exc
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--config {path}: not valid TOML: {exc}") from exc


def build_config(data: Mapping[str, Any], where: str = "config") -> ServiceConfig:
    """A :class:`ServiceConfig` from a TOML-shaped mapping; unknown keys are errors."""
    data = dict(data)
    kwargs: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        if name in data:
            kwargs[name] = _section(cls, data.pop(name), f"{where}: [{name}]")
    models = data.pop("models", {})
    if not isinstance(models, dict):
        raise ConfigError(f"{where}: models: expected tables [models.<name>]")
    kwargs["models"] = {
        name: _policy(body, f"{where}: [models.{name}]") for name, body in models.items()
    }
    kwargs.update(_scalars(ServiceConfig, data, f"{where}"))
    try:
        return ServiceConfig(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _section(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table")
    kwargs = _scalars(cls, raw, where)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _scalars(cls: type, raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    known = {f.name: f for f in scalar_fields(cls)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"{where}: {key}: unknown option (known: {', '.join(known)})")
        out[key] = _coerce(known[key], value, f"{where}: {key}")
    return out


def _coerce(f: dataclasses.Field[Any], value: Any, where: str) -> Any:
    """TOML values into the field's type; a wrong type names the option."""
    default = f.default
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, tuple):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    else:
        ok = isinstance(value, str)
    if not ok:
        kind = type(default).__name__ if not isinstance(default, tuple) else "list of strings"
        raise ConfigError(f"{where}: {value!r} is not a {kind}")
    return value


_POLICY_KEYS = frozenset(
    {"versions", "latest", "weights", "canary_percent", "sticky", "pad_buckets", "batching"}
)


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
        kwargs["batching"] = _section(BatchingConfig, raw["batching"], f"{where}.batching")
    try:
        return ModelPolicy(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one ``--set KEY.PATH=VALUE`` (VALUE in TOML syntax, bare words as strings)."""
    path, sep, text = assignment.partition("=")
    keys = [k.strip() for k in path.split(".")]
    if not sep or not all(keys):
        raise ConfigError(
            f"--set {assignment!r}: expected KEY.PATH=VALUE, e.g. models.resnet.latest=2"
        )
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word: a string
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {assignment!r}: {key} is not a table")
        node = child
    node[keys[-1]] = value
