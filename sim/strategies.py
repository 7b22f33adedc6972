"""The strategies a scenario compares, each a split package built as ``partition``
builds it, through the partitioner's library (``prepare``, ``artifacts_for``,
``auto_split``, ``write_package``): the model is loaded and analysed once.

Every strategy's package is one *version* of the model in one cloud repository
(``<repo>/<model>/<version>/``), so one cloud service serves them all side by
side and an agent asks for its strategy's version:

* ``edge-only``: ``--split all``;
* ``cloud-only``: ``--split none``: an image input travels as PNG (``--input-codec png``),
  as a real client uploads a picture; any other input with the package's codec
  (int8 + zstd, what a device that compresses its input would send);
* ``cut:ID``: ``--split ID``; ``cuts``: every valid split cut;
* ``auto``: ``--split auto`` planned for this device (``edge.device``, or a node
  profile measured here and stretched by the device's slowdown) and the link's
  mean rates;
* ``adaptive``: the same with ``--candidates K``: the agent switches at run time.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from splitinfer.shared.errors import ConfigError, SplitInferError
from splitinfer.shared.links import Link
from splitinfer.shared.manifest import load_manifest
from splitinfer.sim.config import LinkConfig
from splitinfer.sim.scenario import Scenario, check_strategy

if TYPE_CHECKING:
    from splitinfer.partitioner.pipeline import CutArtifacts, Prepared

#: Calibration samples for a cloud-only cut's picture codec (``partition`` draws as
#: many synthetic ones when no calibration folder is given).
CODEC_SAMPLES = 64


@dataclass(frozen=True)
class Strategy:
    """One strategy and the package that plays it."""

    name: str
    #: the package's version folder in the cloud repository
    version: str
    package: Path
    #: the agent switches among the package's candidate cuts
    adaptive: bool = False


def version_name(strategy: str) -> str:
    """A repository version name for a strategy (``cut:c3`` -> ``cut-c3``)."""
    return check_strategy(strategy).replace(":", "-")


def prepare(model: Path, input_shape: Sequence[str] = ()) -> Prepared:
    """The partitioner's view of ``model``: loaded, optimized, analysed, its cuts."""
    from splitinfer.partitioner.loader import parse_input_shapes
    from splitinfer.partitioner.pipeline import prepare as prepare_model

    return prepare_model(model, parse_input_shapes(list(input_shape)))


def split_cuts(prepared: Prepared) -> list[str]:
    """The ids of every valid cut that splits the model (neither none nor all)."""
    return [plan.id for plan in prepared.space.plans() if plan.kind == "split"]


def expand(strategies: Sequence[str], prepared: Prepared) -> list[str]:
    """``cuts`` replaced by one ``cut:ID`` per split cut."""
    out: list[str] = []
    for s in strategies:
        if s == "cuts":
            out.extend(f"cut:{c}" for c in split_cuts(prepared) if f"cut:{c}" not in out)
        elif s not in out:
            out.append(s)
    return out


def planning_link(link: LinkConfig) -> Link:
    """The link ``--split auto`` plans for: the mean rates (a trace: its mean), the
    round trip of the delays; an unlimited direction as 10 Gbit/s."""
    up, down = link.uplink.mean_bps, link.downlink.mean_bps
    return Link.fixed(
        up if math.isfinite(up) else 10e9,
        down if math.isfinite(down) else 10e9,
        2 * link.delay_ms / 1000.0,
    )


def input_codec(prepared: Prepared) -> str | None:
    """How a real client uploads the raw input: pictures as ``png`` (8 bits a pixel,
    as a camera gives them); None: the package's usual codec."""
    from splitinfer.partitioner.pipeline import tensor_spec
    from splitinfer.shared.images import layout

    specs = [tensor_spec(prepared.analysis, t) for t in prepared.space.find("none").crossing]
    if specs and all(layout(spec.shape) is not None for spec in specs):
        return "png"
    return None


def write_strategy(
    prepared: Prepared,
    name: str,
    out: Path,
    *,
    profile: Path | str | None = None,
    link: LinkConfig | None = None,
    candidates: int = 1,
    fallback: bool = False,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Write the package of strategy ``name`` into ``out`` with the partitioner's
    library: what ``partition --split ...`` writes for it (see the module docstring).
    ``progress``: the partitioner's progress lines of ``auto``/``adaptive``."""
    from splitinfer.partitioner.pipeline import PackageExtras, artifacts_for, write_package

    if name in ("auto", "adaptive"):
        from splitinfer.partitioner.auto import AutoOptions, auto_split

        opts = AutoOptions(
            link=planning_link(link or LinkConfig()),
            edge_profile=None if profile is None else str(profile),
            candidates=candidates if name == "adaptive" else 1,
        )
        say = progress or (lambda _m: None)
        result = auto_split(prepared, opts, say, lambda _m: None)
        extras = result.extras
        if fallback:
            extras.fallback = prepared.optimized
        write_package(prepared, result.artifacts, out, extras=extras)
        return
    cut = {"edge-only": "all", "cloud-only": "none"}.get(name) or name.split(":", 1)[1]
    art = artifacts_for(prepared, prepared.space.find(cut))
    codec = input_codec(prepared) if name == "cloud-only" else None
    if codec is not None:
        _plan_input_codec(prepared, art, codec)
    extras = PackageExtras(fallback=prepared.optimized if fallback else None)
    write_package(prepared, [art], out, extras=extras)


def _plan_input_codec(prepared: Prepared, art: CutArtifacts, codec: str) -> None:
    """The cloud-only cut's inputs travel with ``codec`` (``partition --input-codec``),
    its pixel mapping calibrated on synthetic samples as ``partition`` does without a
    calibration folder. Unlike ``partition``, no agreement is measured: the
    partitioner has no public function for that part (``cli._plan_inputs``)."""
    from splitinfer.partitioner.calibration import synthetic_calibration
    from splitinfer.partitioner.pipeline import io_spec
    from splitinfer.partitioner.wirecodec import InputCodec, plan_wire, stack

    a = prepared.analysis
    inputs = [io_spec(vi) for vi in a.model.graph.input if vi.name in a.inputs]
    shapes = {k: (1, *v) for k, v in a.sample_input_shapes.items()}
    feeds = stack(synthetic_calibration(inputs, CODEC_SAMPLES, 0, shapes))
    acts = {t: feeds[t] for t in art.plan.crossing}
    wire = plan_wire(acts, dictionary_file="unused", input_codec=InputCodec(codec))
    art.codec, art.quant = wire.codec, wire.quant
    art.quality["wire"] = wire.summary()


def build(
    scenario: Scenario,
    repo: Path,
    work: Path,
    profile: Path | str | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Strategy]:
    """Partition ``scenario.model`` once per strategy into ``repo/<model>/<version>``;
    ``auto`` and ``adaptive`` plan with the device's node ``profile`` (None: measure
    on this machine). ``progress`` hears of each package and of auto's steps."""
    work.mkdir(parents=True, exist_ok=True)
    prepared = prepare(scenario.model, scenario.input_shape)
    built: list[Strategy] = []
    tmp = work / "packages"
    names = expand(scenario.strategies, prepared)
    for i, name in enumerate(names, 1):
        if progress is not None:
            progress(f"package {i}/{len(names)}: {name}")
        version = version_name(name)
        out = tmp / version
        if out.exists():
            shutil.rmtree(out)
        try:
            write_strategy(
                prepared,
                name,
                out,
                profile=profile,
                link=scenario.link,
                candidates=scenario.candidates,
                fallback=scenario.edge.fallback,
                progress=None if progress is None else _indented(progress, name),
            )
        except SplitInferError as exc:
            raise ConfigError(f"strategy {name}: {exc}") from None
        manifest = load_manifest(out)
        dest = repo / manifest.model_name / version
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(out, dest)
        built.append(Strategy(name, version, dest, adaptive=name == "adaptive"))
    return built


def _indented(progress: Callable[[str], None], name: str) -> Callable[[str], None]:
    return lambda message: progress(f"  {name}: {message}")


def device_profile(scenario: Scenario, work: Path) -> str | None:
    """The scenario's device as a profile ``partition --edge-profile`` and ``edge-agent
    --emulate-device`` read: ``edge.device``, else the whole model measured here
    times ``edge.slowdown`` (a JSON in ``work``); None for this machine."""
    from splitinfer.sim.device import slowed_profile

    if scenario.edge.device is not None:
        return scenario.edge.device
    if scenario.edge.slowdown <= 1:
        return None
    whole = work / "profile-package"
    if whole.exists():
        shutil.rmtree(whole)
    prepared = prepare(scenario.model, scenario.input_shape)
    write_strategy(prepared, "cut:none", whole)
    return str(slowed_profile(whole, scenario.edge.slowdown, work / "edge-profile.json"))
