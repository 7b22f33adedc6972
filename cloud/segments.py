"""Which runtime opens a cloud segment: the engine's default runtime factory.

An ONNX segment opens as :class:`~splitinfer.cloud.runtime.Runtime` (ONNX Runtime);
an MoE program (``moe.json``, see docs/moe.md) as
:class:`~splitinfer.cloud.moe.runtime.MoERuntime`. This module sits above both, so
neither imports the other's module back; the MoE code (and its metrics) is imported
only when an MoE package is loaded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from splitinfer.cloud.config import RuntimeConfig
from splitinfer.cloud.runtime import Runtime


def segment_factory(registry: Any = None) -> Callable[[Path, RuntimeConfig], Any]:
    """The engine's default runtime factory: ONNX segments by :class:`Runtime`, MoE
    programs (``moe.json``, see docs/moe.md) by the MoE runtime with the expert cache
    that ``RuntimeConfig.expert_cache_bytes`` asks for, its metrics in ``registry``.

    The MoE code (and its metrics) is loaded only when an MoE package is.
    """
    lock = threading.Lock()
    moe: list[Callable[[Path, RuntimeConfig], Any]] = []

    def make(path: Path, config: RuntimeConfig) -> Any:
        if path.suffix != ".json":
            return Runtime(path, config)
        with lock:
            if not moe:
                from splitinfer.cloud.moe.runtime import moe_service_factory

                moe.append(moe_service_factory(registry))
        return moe[0](path, config)

    return make
