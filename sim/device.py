"""A device slower than this machine, from a device profile.

The device is a profile ``partition --edge-profile`` reads: ``edge.device`` names
one (a built-in profile or a measured JSON), or ``edge.slowdown = k`` makes one:
the model's node profile measured here, times k (:func:`slowed_profile`). The
edge agent emulates it itself (``edge-agent --emulate-device PROFILE``,
``edge/emulate.py``): every edge segment run takes the profile's time for its
nodes. In-process agents get the same wrapping through :func:`emulated`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from splitinfer.edge.model import EdgeModel


def slowed_profile(package: Path, slowdown: float, out: Path) -> Path:
    """A node profile of ``package``'s whole model measured here, times x ``slowdown``:
    what ``partition --edge-profile`` plans with for a device that much slower."""
    from splitinfer.edge.profile import profile_package

    measured = profile_package(package, runs=5, warmup=2, whole=True).profile
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


def emulated(model: EdgeModel, profile: str | None) -> EdgeModel:
    """``model`` on the device ``profile`` (None: this machine, unchanged)."""
    if profile is None:
        return model
    from splitinfer.edge.emulate import emulate

    return emulate(model, profile)
