"""The strategies a scenario compares, each a split package built by ``partition``.

Every strategy's package is one *version* of the model in one cloud repository
(``<repo>/<model>/<version>/``), so one cloud service serves them all side by
side and an agent asks for its strategy's version:

* ``edge-only``: ``--split all``;
* ``cloud-only``: ``--split none``: the input is encoded with the package's codec
  (int8 + zstd, what a device that compresses its input would send);
* ``cut:ID``: ``--split ID``; ``cuts``: every valid split cut;
* ``auto``: ``--split auto`` planned for this device (a node profile measured
  here and stretched by the device's slowdown) and the link's mean rates;
* ``adaptive``: the same with ``--candidates K``: the agent switches at run time.
"""

from __future__ import annotations

import contextlib
import dataclasses
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


def slowed_profile(package: Path, slowdown: float, out: Path) -> Path:
    """A node profile of ``package``'s whole model measured here, times x ``slowdown``:
    what ``partition --edge-profile`` plans with for a device that much slower."""
    from splitinfer.edge.profile import profile_package

    measured = profile_package(package, runs=5, warmup=2).profile
    k = float(slowdown)
    slowed = dataclasses.replace(
        measured,
        device=f"{measured.device} x{k:g} slower (emulated)",
        times={b: {n: t * k for n, t in nodes.items()} for b, nodes in measured.times.items()},
        wall={b: t * k for b, t in measured.wall.items()},
        unattributed_s={b: t * k for b, t in measured.unattributed_s.items()},
    )
    slowed.save(out)
    return out


def planning_flags(link: LinkConfig) -> list[str]:
    """``--uplink/--downlink/--rtt`` for the link's mean rates (a trace: its mean)."""
    flags = ["--rtt", f"{2 * link.delay_ms:g}ms"]
    up = link.uplink.mean_bps
    flags += ["--uplink", f"{up:.6g}bit" if math.isfinite(up) else "10gbit"]
    down = link.downlink.mean_bps
    flags += ["--downlink", f"{down:.6g}bit" if math.isfinite(down) else "10gbit"]
    return flags


def build(
    scenario: Scenario, repo: Path, work: Path, profile: Path | None = None
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
            extra = ["--split", "none"]
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


def device_profile(scenario: Scenario, work: Path) -> Path | None:
    """The node profile of the scenario's device: the whole model measured here, times
    ``edge.slowdown`` (None for slowdown 1: the device is this machine)."""
    if scenario.edge.slowdown <= 1:
        return None
    shapes = [a for s in scenario.input_shape for a in ("--input-shape", s)]
    whole = work / "profile-package"
    if whole.exists():
        shutil.rmtree(whole)
    partition([str(scenario.model), "--split", "none", *shapes, "-o", str(whole)])
    return slowed_profile(whole, scenario.edge.slowdown, work / "edge-profile.json")
