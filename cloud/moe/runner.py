"""Run the cloud half of an MoE package: dense ONNX -> MoE -> dense ONNX ...

:class:`MoEProgram` reads ``moe.json`` (checking every file's sha256),
:class:`MoERunner` opens the ONNX segments in ONNX Runtime, memory-maps the
expert shards and runs the steps in order over a dict of named tensors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.cloud.moe.cache import CacheConfig, ExpertCache, MoEMetrics
from splitinfer.cloud.moe.device import Device
from splitinfer.cloud.moe.executor import MoEExecutor, MoELayerParams
from splitinfer.cloud.moe.store import ExpertStore
from splitinfer.shared.errors import PackageError
from splitinfer.shared.manifest import resolve_file
from splitinfer.shared.moe import MOE_DOMAIN, MOE_OP, PROGRAM_FORMAT, MoESpec
from splitinfer.shared.ortsession import open_session
from splitinfer.shared.package import sha256_of


@dataclass(frozen=True)
class Step:
    op: str  # "onnx" or "MoE"
    file: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    layer: int = -1
    spec: MoESpec | None = None


@dataclass(frozen=True)
class MoEProgram:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    steps: tuple[Step, ...]

    @classmethod
    def load(cls, package: Path, file: str = "moe.json", *, verify: bool = True) -> MoEProgram:
        path = resolve_file(package, file)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise PackageError(f"{path}: cannot read the MoE program ({e})") from None
        if not isinstance(data, dict) or data.get("format") != PROGRAM_FORMAT:
            raise PackageError(f"{path}: format is not {PROGRAM_FORMAT!r}")
        if data.get("format_version") != 1:
            raise PackageError(f"{path}: format_version {data.get('format_version')!r} is not 1")
        steps = []
        for i, s in enumerate(data.get("steps", [])):
            where = f"{path.name}.steps[{i}]"
            resolved = resolve_file(package, str(s.get("file", "")))
            if not resolved.is_file():
                raise PackageError(f"{where}: file {s.get('file')!r} is missing")
            if verify and sha256_of(resolved) != s.get("sha256"):
                raise PackageError(f"{where}: {s['file']} does not match its sha256")
            if s.get("op") == MOE_OP and s.get("domain") == MOE_DOMAIN:
                spec = MoESpec.from_dict(s.get("spec"), f"{where}.spec")
                steps.append(
                    Step(
                        MOE_OP,
                        s["file"],
                        tuple(s["inputs"]),
                        tuple(s["outputs"]),
                        int(s["layer"]),
                        spec,
                    )
                )
            elif s.get("op") == "onnx":
                steps.append(Step("onnx", s["file"], tuple(s["inputs"]), tuple(s["outputs"])))
            else:
                raise PackageError(f"{where}: unknown op {s.get('domain', '')}/{s.get('op')!r}")
        layers = [s.layer for s in steps if s.op == MOE_OP]
        if layers != list(range(len(layers))):
            raise PackageError(f"{path}: MoE layers {layers} are not numbered 0..n-1 in order")
        return cls(tuple(data["inputs"]), tuple(data["outputs"]), tuple(steps))


class MoERunner:
    """The cloud half of an MoE package, with an expert cache of ``cache.budget_bytes``."""

    def __init__(
        self,
        package: Path,
        cache: CacheConfig,
        *,
        program_file: str = "moe.json",
        device: Device | None = None,
        metrics: MoEMetrics | None = None,
        prefetcher: Executor | None = None,
        prefetch: bool = True,
        providers: tuple[str, ...] = ("CPUExecutionProvider",),
    ) -> None:

        self.program = MoEProgram.load(package, program_file)
        moe_steps = [s for s in self.program.steps if s.op == MOE_OP]
        self.store = ExpertStore(
            {s.layer: resolve_file(package, s.file) for s in moe_steps},
            {s.layer: s.spec.expert_tensors for s in moe_steps if s.spec is not None},
        )
        self.cache = ExpertCache(
            self.store, cache, device=device, metrics=metrics, prefetcher=prefetcher
        )
        layers = []
        for s in moe_steps:
            assert s.spec is not None
            router = self.store.routers[s.layer]
            if router.shape != (s.spec.n_experts, s.spec.d_model):
                raise PackageError(f"{s.file}: router shape {router.shape} does not match its spec")
            layers.append(MoELayerParams(s.spec, router))
        self.executor = MoEExecutor(layers, self.cache, prefetch=prefetch)
        self.sessions: dict[str, Any] = {
            s.file: open_session(
                resolve_file(package, s.file), providers=list(providers), name=s.file
            )
            for s in self.program.steps
            if s.op == "onnx"
        }

    @property
    def metrics(self) -> MoEMetrics:
        return self.cache.metrics

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in self.program.inputs if n not in feeds]
        if missing:
            raise PackageError(f"MoE program inputs {missing} missing from the feeds")
        env: dict[str, np.ndarray] = {n: np.asarray(feeds[n]) for n in self.program.inputs}
        for step in self.program.steps:
            if step.op == MOE_OP:
                env[step.outputs[0]] = self.executor.forward(step.layer, env[step.inputs[0]])
            else:
                sess = self.sessions[step.file]
                values = sess.run(list(step.outputs), {n: env[n] for n in step.inputs})
                env.update(zip(step.outputs, values, strict=True))
        return {n: env[n] for n in self.program.outputs}
