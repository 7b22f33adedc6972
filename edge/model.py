"""The package as the agent runs it: one session per edge segment, codecs, costs.

:func:`load_model` opens the package verified (every file against its sha256),
opens a session for the edge segment of every candidate cut and for the full
local model when the package has one, and reads each cut's codec, calibrated
quantization and predicted cost. Every cut is loaded up front, so switching cut
at run time costs nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.edge.config import RuntimeConfig
from splitinfer.edge.runtime import (
    CUDA,
    TENSORRT,
    DeviceInfo,
    SegmentRunner,
    available_providers,
    detect_device,
    open_segment,
)
from splitinfer.shared.codecs import FLOAT_DTYPES, Codec, QuantParams, default_codecs
from splitinfer.shared.costs import CutCost
from splitinfer.shared.errors import ConfigError, PackageError
from splitinfer.shared.manifest import Cut, Manifest, TensorSpec
from splitinfer.shared.package import Package, open_package, quant_params

log = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class CutRuntime:
    """One candidate cut, ready to run."""

    cut: Cut
    #: The edge segment's session; None for a "none" cut (the inputs cross as they are).
    edge: SegmentRunner | None
    #: Wire id of the cut's codec, and a registry holding it with the cut's settings.
    codec_id: int
    codecs: Mapping[int, Codec]
    #: Calibrated int8 parameters per cut tensor; None: computed per batch.
    quant: Mapping[str, QuantParams | None]
    #: The cost model's prediction for this cut (None if the package has none).
    cost: CutCost | None

    @property
    def id(self) -> str:
        return self.cut.id

    @property
    def local(self) -> bool:
        """An "all" cut: the edge segment gives the model's outputs, nothing is sent."""
        return self.cut.kind == "all"

    @property
    def float_only(self) -> bool:
        """Every cut tensor is a float (the privacy mechanism can noise them all)."""
        return all(t.dtype in FLOAT_DTYPES for t in self.cut.tensors)


@dataclass(frozen=True)
class EdgeModel:
    """The verified package with a session for every part the device runs."""

    package: Package
    cuts: Mapping[str, CutRuntime]
    #: The full model (``full.onnx``) for answering locally; None if the package has none.
    fallback: SegmentRunner | None
    #: Codecs that decode response frames (the cloud answers with any registered one).
    response_codecs: Mapping[int, Codec]
    device: DeviceInfo
    #: The slower device this model emulates (``runtime.emulate_device``); None: this one.
    emulated: str | None = None

    @property
    def manifest(self) -> Manifest:
        return self.package.manifest

    @property
    def path(self) -> Path:
        return self.package.path

    def local_runner(self) -> SegmentRunner | None:
        """What answers without the cloud: ``full.onnx``, else an "all" cut's segment."""
        if self.fallback is not None:
            return self.fallback
        for rt in self.cuts.values():
            if rt.local:
                return rt.edge
        return None

    def sample_inputs(self, batch: int = 1, seed: int = 0) -> dict[str, Array]:
        """Inputs of the analysed shapes (``manifest.analysis_shapes``) for warm-up."""
        return sample_inputs(self.manifest, batch, seed)


def sample_inputs(manifest: Manifest, batch: int = 1, seed: int = 0) -> dict[str, Array]:
    """Random inputs of the model's per-sample shapes, batch ``batch``.

    Floats are standard normal, integers small and non-negative, booleans true.
    A free dimension the analysis did not fix is taken as 1.
    """
    rng = np.random.default_rng(seed)
    feeds: dict[str, Array] = {}
    for spec in manifest.inputs:
        shape = _sample_shape(manifest, spec, batch)
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "f":
            feeds[spec.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            feeds[spec.name] = rng.integers(0, 8, size=shape).astype(dtype)
        else:
            feeds[spec.name] = np.ones(shape, dtype=dtype)
    return feeds


def _sample_shape(manifest: Manifest, spec: TensorSpec, batch: int) -> tuple[int, ...]:
    known = manifest.analysis_shapes.get(spec.name)
    if known is not None and len(known) == len(spec.shape) - 1:
        return (batch, *(int(d) for d in known))
    dims = [d if isinstance(d, int) else 1 for d in spec.shape]
    if spec.shape and spec.shape[0] == manifest.batch_dim:
        dims[0] = batch
    return tuple(dims)


def cut_cost(cut: Cut) -> CutCost | None:
    """The cut's predicted cost from ``cut.predicted`` (CutCost.to_dict), or None.

    Unknown keys are ignored, so a manifest with extra figures still reads.
    """
    if not cut.predicted:
        return None
    names = {f.name for f in dataclasses.fields(CutCost)}
    data = {k: v for k, v in cut.predicted.items() if k in names}
    data["cut_id"] = cut.id
    data["kind"] = cut.kind
    try:
        return CutCost.from_dict(data, f"cut {cut.id}: predicted")
    except PackageError as exc:
        log.warning("%s; this cut takes no part in switching", exc)
        return None


def load_model(
    path: Path | str,
    config: RuntimeConfig | None = None,
    *,
    device: DeviceInfo | None = None,
    available: Sequence[str] | None = None,
    cuts: Sequence[str] | None = None,
) -> EdgeModel:
    """Open the package and a session for every edge segment (and ``full.onnx``).

    ``cuts`` limits which candidate cuts are loaded (default: all of them).
    """
    config = config or RuntimeConfig()
    package = open_package(path, verify=config.verify)
    manifest = package.manifest
    providers = list(available) if available is not None else available_providers()
    if device is None:
        # only a GPU provider makes nvidia-smi worth a process (a CPU build lists Azure too)
        device = detect_device(want_gpu=any(p in (CUDA, TENSORRT) for p in providers))
    wanted = list(manifest.cut_ids) if cuts is None else list(cuts)
    unknown = [c for c in wanted if manifest.find_cut(c) is None]
    if unknown:
        raise ConfigError(
            f"cut {unknown[0]!r} is not in the package; it has {', '.join(manifest.cut_ids)}"
        )
    runtimes: dict[str, CutRuntime] = {}
    for cut in manifest.cuts:
        if cut.id not in wanted:
            continue
        edge = None
        if cut.edge is not None:
            edge = open_segment(package.file(cut.edge), cut.edge, config, device, providers)
        codec_id, codecs = package.codec(cut)
        runtimes[cut.id] = CutRuntime(
            cut=cut,
            edge=edge,
            codec_id=codec_id,
            codecs=codecs,
            quant={t.name: quant_params(cut, t.name) for t in cut.tensors},
            cost=cut_cost(cut),
        )
    fallback = None
    if manifest.fallback is not None:
        seg = manifest.fallback
        fallback = open_segment(package.file(seg), seg, config, device, providers)
    model = EdgeModel(package, runtimes, fallback, default_codecs(), device)
    if config.emulate_device is not None:
        from splitinfer.edge.emulate import describe, emulate

        model = emulate(model, config.emulate_device)
        log.info(
            "emulating device %s: edge segments at batch 1: %s", model.emulated, describe(model)
        )
    return model
