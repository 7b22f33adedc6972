"""Which ready version serves a request: A/B weights, canary, newest; sticky per device.

Pure: the random draw (or the device's stable hash) is passed in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from splitinfer.cloud.config import ModelPolicy
from splitinfer.cloud.repository import version_key


def stable_draw(model: str, device: str) -> float:
    """A number in [0, 1) fixed for this device and model (sticky routing)."""
    digest = hashlib.sha256(f"{model}\0{device}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def choose_version(policy: ModelPolicy, ready: Sequence[str], draw: float) -> str:
    """The version for a request among ``ready`` (non-empty), given ``draw`` in [0, 1).

    1. ``weights``: each ready version with a positive weight gets its share of
       the traffic; the shares of versions not ready go to the others.
    2. ``canary_percent``: the newest ready version gets that share, the
       second newest the rest.
    3. Otherwise the newest ready version.
    """
    if not ready:
        raise ValueError("no ready version to choose from")
    if len(ready) == 1:  # the common case, on every request: nothing to weigh
        return ready[0]
    ordered = sorted(ready, key=version_key)
    weighted = [(v, float(policy.weights.get(v, 0.0))) for v in ordered]
    weighted = [(v, w) for v, w in weighted if w > 0]
    total = sum(w for _, w in weighted)
    if weighted and total > 0:
        point = draw * total
        for version, weight in weighted:
            if point < weight:
                return version
            point -= weight
        return weighted[-1][0]
    if policy.canary_percent > 0 and len(ordered) >= 2:
        return ordered[-1] if draw * 100.0 < policy.canary_percent else ordered[-2]
    return ordered[-1]
