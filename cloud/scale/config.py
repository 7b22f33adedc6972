"""Options of the Ray Serve deployment: a frozen dataclass, and ``serve run`` arguments.

``serve run splitinfer.cloud.scale.ray_serve:app_builder repository=DIR max_replicas=4``
passes ``key=value`` strings. Keys of :class:`ScaleConfig` set the deployment;
every other key is a cloud-service option in the TOML key syntax of
``cloud-service --set`` (``no_auth=true``, ``batching.max_batch_size=16``,
``models.resnet.canary_percent=10``); ``config=FILE`` reads a cloud-service TOML
file first. The cloud options are validated by the same code as the daemon's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitinfer.cloud.config import (
    ServiceConfig,
    _number,
    _opt,
    _positive_int,
    apply_override,
    build_config,
    load_toml,
)
from splitinfer.shared.errors import ConfigError


@dataclass(frozen=True)
class ScaleConfig:
    """The Ray Serve application: the cloud service's config plus replicas and routing."""

    service: ServiceConfig  # the cloud service config each replica runs
    min_replicas: int = _opt(1, "fewest engine replicas (autoscaling floor)")
    max_replicas: int = _opt(2, "most engine replicas (autoscaling ceiling)")
    initial_replicas: int = _opt(0, "replicas at start (0: min_replicas)")
    target_ongoing_requests: float = _opt(
        16.0, "queue depth per replica autoscaling aims at (requests queued or running)"
    )
    max_ongoing_requests: int = _opt(
        128, "most requests one replica takes at once (Serve queues the rest at the caller)"
    )
    upscale_delay_s: float = _opt(5.0, "seconds over target before adding a replica")
    downscale_delay_s: float = _opt(60.0, "seconds under target before removing one")
    num_gpus: float = _opt(0.0, "GPUs each engine replica holds (ray_actor_options)")
    num_cpus: float = _opt(1.0, "CPUs each engine replica holds")
    ingress_replicas: int = _opt(1, "HTTP ingress replicas (auth, routing, retries)")
    ingress_num_cpus: float = _opt(0.5, "CPUs each ingress replica holds")
    max_versions_per_replica: int = _opt(
        4, "model versions one replica keeps loaded (least recently used unloaded)"
    )
    retries: int = _opt(4, "times a request is retried on another replica when one dies")
    retry_backoff_s: float = _opt(0.05, "first retry wait, doubled each time")
    moe_cache_bytes: int = _opt(0, "expert cache budget for MoE packages (0: no MoE runtime)")
    moe_cache_policy: str = _opt("lfru", "expert cache policy: lru, lfru or none")

    def __post_init__(self) -> None:
        if not isinstance(self.service, ServiceConfig):
            raise ConfigError("service: missing; give repository=DIR (or config=FILE)")
        for name in ("min_replicas", "ingress_replicas", "max_versions_per_replica"):
            _positive_int(self, name, 1)
        for name in ("max_ongoing_requests",):
            _positive_int(self, name, 1)
        _positive_int(self, "initial_replicas", 0)
        _positive_int(self, "retries", 0)
        _positive_int(self, "moe_cache_bytes", 0)
        _positive_int(self, "max_replicas", self.min_replicas)
        if self.initial_replicas and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ConfigError(
                f"initial_replicas={self.initial_replicas}: must lie within "
                f"min_replicas..max_replicas ({self.min_replicas}..{self.max_replicas})"
            )
        for name in ("target_ongoing_requests", "ingress_num_cpus"):
            _number(self, name, 0.001)
        for name in ("num_gpus", "num_cpus", "retry_backoff_s", "upscale_delay_s"):
            _number(self, name, 0.0)
        _number(self, "downscale_delay_s", 0.0)
        if self.moe_cache_policy not in ("lru", "lfru", "none"):
            raise ConfigError(f"moe_cache_policy={self.moe_cache_policy!r}: one of lru, lfru, none")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas > self.min_replicas

    def autoscaling_config(self) -> dict[str, Any]:
        """Serve's ``autoscaling_config``: scale on requests queued or running per replica."""
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": self.initial_replicas or self.min_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
        }

    def replica_options(self) -> dict[str, Any]:
        """``Deployment.options(...)`` of the engine replicas."""
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
        }
        if self.autoscaling:
            options["autoscaling_config"] = self.autoscaling_config()
        else:
            options["num_replicas"] = self.min_replicas
        return options


_FIELDS = {f.name: f for f in dataclasses.fields(ScaleConfig) if f.name != "service"}


def scale_config_from_args(args: Mapping[str, Any]) -> ScaleConfig:
    """A :class:`ScaleConfig` from ``serve run`` ``key=value`` arguments (or a dict)."""
    data: dict[str, Any] = {}
    if "config" in args:
        data = load_toml(Path(str(args["config"])))
    scale: dict[str, Any] = {}
    for key, value in args.items():
        if key == "config":
            continue
        if key in _FIELDS:
            scale[key] = _coerce(key, value, _FIELDS[key].default)
        elif isinstance(value, str):
            apply_override(data, f"{key}={value}")
        else:
            apply_override(data, f"{key}={_toml(value)}")
    service = build_config(data, where="args")
    return ScaleConfig(service=service, **scale)


def _coerce(key: str, value: Any, default: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r}: not a number") from None
    return value


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)
