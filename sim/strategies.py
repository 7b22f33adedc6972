"""The strategies a scenario compares, each a split package built by ``partition``.

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

import contextlib
import io
import json
import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from splitinfer.shared.errors import ConfigError, SplitInferError
from splitinfer.shared.manifest import load_manifest
from splitinfer.sim.config import LinkConfig
from splitinfer.sim.scenario import Scenario, check_strategy


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


def partition(argv: Sequence[str]) -> str:
    """Run ``partition`` in process; its stdout, or a ConfigError with its message."""
    from splitinfer.partitioner.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*argv, "-q"])
    if code != 0:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        raise ConfigError(lines[-1] if lines else f"partition {' '.join(argv)} failed ({code})")
    return out.getvalue()


def split_cuts(model: Path, input_shape: Sequence[str] = ()) -> list[str]:
    """The ids of every valid cut of ``model`` that splits it (neither none nor all)."""
    shapes = [a for s in input_shape for a in ("--input-shape", s)]
    table = json.loads(partition([str(model), "--list-cuts", "--json", *shapes]))
    return [str(c["id"]) for c in table if c["kind"] == "split"]


def expand(strategies: Sequence[str], model: Path, input_shape: Sequence[str] = ()) -> list[str]:
    """``cuts`` replaced by one ``cut:ID`` per split cut."""
    out: list[str] = []
    for s in strategies:
        if s == "cuts":
            out.extend(f"cut:{c}" for c in split_cuts(model, input_shape) if f"cut:{c}" not in out)
        elif s not in out:
            out.append(s)
    return out


def planning_flags(link: LinkConfig) -> list[str]:
    """``--uplink/--downlink/--rtt`` for the link's mean rates (a trace: its mean)."""
    flags = ["--rtt", f"{2 * link.delay_ms:g}ms"]
    up = link.uplink.mean_bps
    flags += ["--uplink", f"{up:.6g}bit" if math.isfinite(up) else "10gbit"]
    down = link.downlink.mean_bps
    flags += ["--downlink", f"{down:.6g}bit" if math.isfinite(down) else "10gbit"]
    return flags


def client_codec(model: Path) -> list[str]:
    """How a real client uploads the raw input: pictures as PNG (8 bits a pixel, as a
    camera gives them), anything else with the package's usual codec."""
    import onnx

    from splitinfer.shared.images import layout

    graph = onnx.load(str(model), load_external_data=False).graph
    initializers = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    shapes = [
        [d.dim_value if d.HasField("dim_value") else d.dim_param or "?" for d in dims]
        for dims in (i.type.tensor_type.shape.dim for i in inputs)
    ]
    if shapes and all(layout(shape) is not None for shape in shapes):
        return ["--input-codec", "png"]
    return []


def build(
    scenario: Scenario, repo: Path, work: Path, profile: Path | str | None = None
) -> list[Strategy]:
    """Partition ``scenario.model`` once per strategy into ``repo/<model>/<version>``;
    ``auto`` and ``adaptive`` plan with the device's node ``profile`` (None: measure
    on this machine)."""
    model = scenario.model
    shapes = [a for s in scenario.input_shape for a in ("--input-shape", s)]
    fallback = ["--edge-fallback"] if scenario.edge.fallback else []
    work.mkdir(parents=True, exist_ok=True)
    names = expand(scenario.strategies, model, scenario.input_shape)
    built: list[Strategy] = []
    tmp = work / "packages"
    for name in names:
        version = version_name(name)
        out = tmp / version
        if out.exists():
            shutil.rmtree(out)
        if name in ("auto", "adaptive"):
            extra = ["--split", "auto"]
            extra += ["--edge-profile", str(profile)] if profile is not None else []
            extra += planning_flags(scenario.link)
            if name == "adaptive":
                extra += ["--candidates", str(scenario.candidates)]
        elif name == "edge-only":
            extra = ["--split", "all"]
        elif name == "cloud-only":
            extra = ["--split", "none", *client_codec(model)]
        else:
            extra = ["--split", name.split(":", 1)[1]]
        try:
            partition([str(model), *extra, *shapes, *fallback, "-o", str(out)])
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


def device_profile(scenario: Scenario, work: Path) -> str | None:
    """The scenario's device as a profile ``partition --edge-profile`` and ``edge-agent
    --runtime-emulate-device`` read: ``edge.device``, else the whole model measured here
    times ``edge.slowdown`` (a JSON in ``work``); None for this machine."""
    from splitinfer.sim.device import slowed_profile

    if scenario.edge.device is not None:
        return scenario.edge.device
    if scenario.edge.slowdown <= 1:
        return None
    shapes = [a for s in scenario.input_shape for a in ("--input-shape", s)]
    whole = work / "profile-package"
    if whole.exists():
        shutil.rmtree(whole)
    partition([str(scenario.model), "--split", "none", *shapes, "-o", str(whole)])
    return str(slowed_profile(whole, scenario.edge.slowdown, work / "edge-profile.json"))
