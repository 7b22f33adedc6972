"""ONNX Runtime sessions for cloud segments.

:func:`choose_providers` is the pure choice of execution providers: the
configured preference (TensorRT, CUDA, CPU by default) filtered by what this
ONNX Runtime build offers, CPU always last as the fallback for operators the
GPU providers do not take. :class:`Runtime` wraps one session; on a GPU
provider it runs through I/O binding (inputs bound from host memory once,
outputs copied back in one step, ONNX Runtime's documented pattern), on CPU it
calls ``run`` directly, which copies nothing extra.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from splitinfer.cloud.config import RuntimeConfig
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.ortsession import open_session
from splitinfer.shared.ortsession import session_options as shared_session_options
from splitinfer.shared.settings import AUTO, PROVIDERS

log = logging.getLogger("splitinfer.cloud")

Array = npt.NDArray[Any]

ORT_NAMES = {
    "tensorrt": "TensorrtExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
}
GPU_PROVIDERS = frozenset({ORT_NAMES["tensorrt"], ORT_NAMES["cuda"]})


def choose_providers(preference: Sequence[str], available: Sequence[str]) -> list[str]:
    """ORT provider names to use, best first: preferred ones that are available, then CPU
    (``auto``: TensorRT, CUDA, CPU); a preference none of which is available is refused.

    >>> choose_providers(["tensorrt", "cuda", "cpu"], ["CUDAExecutionProvider",
    ...                  "CPUExecutionProvider"])
    ['CUDAExecutionProvider', 'CPUExecutionProvider']
    """
    if list(preference) == [AUTO]:
        preference = PROVIDERS
    chosen = [ORT_NAMES[p] for p in preference if ORT_NAMES[p] in available]
    if not chosen:
        raise ConfigError(
            f"runtime.providers={','.join(preference)}, but this onnxruntime has none of them "
            f"(it has {', '.join(sorted(available))}); install onnxruntime-gpu or add cpu"
        )
    cpu = ORT_NAMES["cpu"]
    if cpu not in chosen:
        chosen.append(cpu)  # ORT needs a CPU fallback for nodes GPU providers refuse
    return chosen


def provider_options(name: str, config: RuntimeConfig) -> dict[str, str]:
    """The options ONNX Runtime takes for provider ``name``."""
    if name == ORT_NAMES["cuda"]:
        return {"device_id": str(config.gpu)}
    if name == ORT_NAMES["tensorrt"]:
        opts = {
            "device_id": str(config.gpu),
            "trt_fp16_enable": "True" if config.trt_fp16 else "False",
            "trt_max_workspace_size": str(config.trt_workspace_mb * 2**20),
        }
        if config.trt_cache_dir is not None:
            opts["trt_engine_cache_enable"] = "True"
            opts["trt_engine_cache_path"] = str(config.trt_cache_dir)
        return opts
    return {}


def session_options(config: RuntimeConfig) -> Any:
    """The service's SessionOptions: its threads, spinning, and parallel execution
    when it has more than one inter-op thread."""
    return shared_session_options(
        threads=config.threads,
        inter_threads=config.inter_op_threads,
        spinning=config.spin,
        parallel=config.inter_op_threads > 1,
        sequential=config.inter_op_threads <= 1,
    )


class Runtime:
    """One ONNX Runtime session of a cloud segment; :meth:`run` is thread-safe."""

    def __init__(
        self,
        path: Path,
        config: RuntimeConfig,
        available: Sequence[str] | None = None,
    ) -> None:
        import onnxruntime as ort

        have = ort.get_available_providers() if available is None else available
        providers = choose_providers(config.providers, have)
        self.session = open_session(
            path,
            providers=[(p, provider_options(p, config)) for p in providers],
            options=session_options(config),
            name=path.name,
        )
        self.path = path
        self.providers: list[str] = list(self.session.get_providers())
        self.inputs: tuple[str, ...] = tuple(i.name for i in self.session.get_inputs())
        self.outputs: tuple[str, ...] = tuple(o.name for o in self.session.get_outputs())
        self.io_binding = config.io_binding and self.providers[0] in GPU_PROVIDERS
        if self.providers[0] != providers[0]:
            log.warning("%s: wanted %s, runs on %s", path.name, providers[0], self.providers[0])

    def run(self, feeds: Mapping[str, Array]) -> dict[str, Array]:
        """Outputs by name; ``feeds`` must hold every session input."""
        wanted = {name: feeds[name] for name in self.inputs}
        if self.io_binding:
            return self._run_bound(wanted)
        values = self.session.run(list(self.outputs), wanted)
        return dict(zip(self.outputs, values, strict=True))

    def _run_bound(self, feeds: Mapping[str, Array]) -> dict[str, Array]:
        binding = self.session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name in self.outputs:
            binding.bind_output(name)
        self.session.run_with_iobinding(binding)
        values = binding.copy_outputs_to_cpu()
        return dict(zip(self.outputs, values, strict=True))
