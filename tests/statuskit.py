"""A small split package with predicted costs and a device credential, for the status
page tests (test_status_page.py, test_status_screenshot.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
from graphs import chain

from splitinfer.partitioner.pipeline import artifacts_for, prepare, write_package
from splitinfer.shared.auth import Credential, generate_credential, render_toml
from splitinfer.shared.costs import CutCost
from splitinfer.shared.manifest import CodecSpec

#: Predicted costs by cut kind: all-cloud sends most, the split less, all-edge nothing.
COSTS: dict[str, dict[str, Any]] = {
    "split": {"edge_s": 0.030, "up_bytes": 40_000, "cloud_s": 0.002},
    "none": {"edge_s": 0.0, "up_bytes": 400_000, "cloud_s": 0.004},
    "all": {"edge_s": 0.150},
}


def status_package(tmp: Path, name: str = "statusdemo") -> Path:
    """``tmp/<name>-pkg``: chain(6) cut at c2 (default), c0 (all cloud) and all edge,
    each with a predicted cost."""
    src = tmp / f"{name}.onnx"
    onnx.save(chain(6, width=16), str(src))
    prepared = prepare(src)
    plans = prepared.space.plans()
    arts = []
    for plan in (plans[2], plans[0], plans[-1]):
        art = artifacts_for(prepared, plan)
        art.codec = CodecSpec("raw")
        art.predicted = CutCost(plan.id, plan.kind, **COSTS[plan.kind]).to_dict()
        arts.append(art)
    out = tmp / f"{name}-pkg"
    write_package(prepared, arts, out)
    return out


def device_credential(tmp: Path) -> tuple[Credential, Path]:
    """A fresh device key and the credential file that holds it."""
    cred = generate_credential("cam-01", "k1")
    path = tmp / "credentials.toml"
    path.write_text(render_toml(cred))
    return cred, path
