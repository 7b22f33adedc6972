"""Options of the Ray Serve deployment: a frozen dataclass, and ``serve run`` arguments.

``serve run splitinfer.cloud.scale.ray_serve:app_builder repository=DIR max_replicas=4``
passes ``key=value`` strings. Keys of :class:`ScaleConfig` set the deployment;
every other key is a cloud-service option in the TOML key syntax of
``cloud-service --set`` (``no_auth=true``, ``batching.max_batch_size=16``,
``models.resnet.canary_percent=10``); ``config=FILE`` reads a cloud-service TOML
file first. The cloud options are validated by the same code as the daemon's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitinfer.cloud.config import ServiceConfig, build_config
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.options import (
    at_least,
    check,
    coerce,
    from_text,
    load_toml,
    option,
    own_options,
    set_key,
)


@dataclass(frozen=True)
class ScaleConfig:
    """The Ray Serve application: the cloud service's config plus replicas and routing."""

    service: ServiceConfig  # the cloud service config each replica runs (not an option)
    min_replicas: int = option(1, "fewest engine replicas (autoscaling floor)", minimum=1)
    max_replicas: int = option(2, "most engine replicas (autoscaling ceiling)")
    initial_replicas: int = option(0, "replicas at start (0: min_replicas)", minimum=0)
    target_ongoing_requests: float = option(
        16.0,
        "queue depth per replica autoscaling aims at (requests queued or running)",
        minimum=0.001,
    )
    max_ongoing_requests: int = option(
        128,
        "most requests one replica takes at once (Serve queues the rest at the caller)",
        minimum=1,
    )
    upscale_delay_s: float = option(5.0, "seconds over target before adding a replica", minimum=0.0)
    downscale_delay_s: float = option(60.0, "seconds under target before removing one", minimum=0.0)
    num_gpus: float = option(0.0, "GPUs each engine replica holds (ray_actor_options)", minimum=0.0)
    num_cpus: float = option(1.0, "CPUs each engine replica holds", minimum=0.0)
    ingress_replicas: int = option(1, "HTTP ingress replicas (auth, routing, retries)", minimum=1)
    ingress_num_cpus: float = option(0.5, "CPUs each ingress replica holds", minimum=0.001)
    max_versions_per_replica: int = option(
        4,
        "model versions one replica keeps loaded (least recently used unloaded)",
        minimum=1,
    )
    retries: int = option(
        4, "times a request is retried on another replica when one dies", minimum=0
    )
    retry_backoff_s: float = option(0.05, "first retry wait, doubled each time", minimum=0.0)
    moe_cache_bytes: int = option(
        0, "expert cache budget for MoE packages (0: no MoE runtime)", minimum=0
    )
    moe_cache_policy: str = option(
        "lfru", "expert cache policy: lru, lfru or none", choices=("lru", "lfru", "none")
    )

    def __post_init__(self) -> None:
        if not isinstance(self.service, ServiceConfig):
            raise ConfigError("service: missing; give repository=DIR (or config=FILE)")
        check(self)
        at_least(self, "max_replicas", self.min_replicas)
        if self.initial_replicas and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ConfigError(
                f"initial_replicas={self.initial_replicas}: must lie within "
                f"min_replicas..max_replicas ({self.min_replicas}..{self.max_replicas})"
            )

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


_OPTIONS = {o.name: o for o in own_options(ScaleConfig)}


def scale_config_from_args(args: Mapping[str, Any]) -> ScaleConfig:
    """A :class:`ScaleConfig` from ``serve run`` ``key=value`` arguments (or a dict)."""
    data: dict[str, Any] = {}
    if "config" in args:
        data = load_toml(Path(str(args["config"])))
    scale: dict[str, Any] = {}
    for key, value in args.items():
        if key == "config":
            continue
        if key in _OPTIONS:
            opt = _OPTIONS[key]
            parsed = from_text(value, opt) if isinstance(value, str) else value
            scale[key] = coerce(parsed, opt, key)
        elif isinstance(value, str):
            set_key(data, f"{key}={value}")
        else:
            set_key(data, f"{key}={_toml(value)}")
    service = build_config(data, where="args")
    return ScaleConfig(service=service, **scale)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)
