"""``--adapt-cloud`` inside ``--split auto``: adapted utility drives the cut choice.

``auto_split`` calls :func:`adapt_measured` once, after it has built its
shortlisted cuts; the fine-tune itself is :func:`partitioner.adapt.adapt_cut`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from splitinfer.partitioner.adapt import AdaptOptions, Feed, Progress, adapt_cut, run_model
from splitinfer.shared.codecs import QuantParams
from splitinfer.shared.manifest import PrivacySpec

#: Share of ``--adapt-time`` the short fine-tunes of the shortlisted cuts get (together).
SHORT_SHARE = 0.4


def adapt_measured(
    prepared: Any,
    measured: Mapping[str, Any],
    opts: Any,
    calib: Feed,
    held: Feed,
    reference: Mapping[str, np.ndarray],
    progress: Progress,
) -> None:
    """``--adapt-cloud`` inside ``--split auto`` (``auto_split`` calls this once).

    ``measured`` maps cut ids to auto's built cuts (``.art``, ``.cost``);
    ``opts`` is its ``AutoOptions``. When the choice can depend on the adapted
    utility (``--max-accuracy-drop``) or several cuts are packaged
    (``--candidates``), every split cut gets a short fine-tune and its measured
    accuracy drop and wire bytes replace the un-adapted ones; then the split
    cut that ranks first gets the rest of the budget. Otherwise only that cut
    is adapted, with the whole budget.
    """
    from splitinfer.shared.costs import rank

    adapt: AdaptOptions = opts.adapt
    spec: PrivacySpec = opts.privacy
    out_name = prepared.analysis.outputs[0]
    teacher = run_model(prepared.optimized, calib)[out_name]
    ref = reference[out_name]
    t0 = time.perf_counter()

    def one(m: Any, seconds: float) -> None:
        art = m.art
        crossing = [t.name for t in art.tensors] if art.tensors else list(art.plan.crossing)
        quant = {
            k: QuantParams(scale=q.scale, zero_point=q.zero_point, axis=q.axis or 0)
            for k, q in art.quant.items()
        }
        earlier = art.quality.get("adaptation")
        name = f"codec/{art.plan.id}.zdict"
        got = adapt_cut(
            art.edge, art.cloud, crossing, spec, quant, calib, teacher, held, ref, out_name,
            adapt, seconds, progress, art.plan.id, name, opts.bottleneck, fresh=earlier is None,
        )  # fmt: skip
        record = got.record
        if earlier is not None:  # continuing: "before" is the un-adapted cut
            record = {
                **record,
                "utility_before": earlier["utility_before"],
                "steps": record["steps"] + earlier["steps"],
                "seconds": round(record["seconds"] + earlier["seconds"], 2),
            }
            record["adapted"] = record["utility_after"] >= record["utility_before"]
        art.quality["adaptation"] = record
        if got.wire is None:
            return
        art.edge, art.cloud = got.edge, got.cloud
        art.codec, art.quant = got.wire.codec, got.wire.quant
        art.files.pop(name, None)
        if got.wire.dictionary is not None:
            art.files[name] = got.wire.dictionary
        art.quality["wire"] = got.wire.summary()
        art.quality["private"] = {"metric": "top1", "value": got.utility, "epsilon": spec.epsilon}
        m.cost = replace(m.cost, up_bytes=round(got.wire.wire_bytes), accuracy_drop=1 - got.utility)

    split = [m for m in measured.values() if m.art.edge is not None and m.art.cloud is not None]
    if not split:
        return
    if opts.constraints.max_accuracy_drop is not None or opts.candidates > 1:
        each = adapt.seconds * SHORT_SHARE / len(split)
        progress(f"adapting {len(split)} shortlisted cuts to the noise, {each:.1f} s each")
        for m in split:
            one(m, each)
    costs = [m.cost for m in measured.values()]
    ranked = rank(costs, opts.link, opts.objective, opts.constraints)
    # the best split cut: the winner, or the one the edge agent switches to first
    best = next((m for r in ranked if (m := measured[r.cost.cut_id]) in split), None)
    if best is not None:
        left = max(adapt.seconds - (time.perf_counter() - t0), 0.2 * adapt.seconds)
        progress(f"adapting the chosen cut {best.art.plan.id} for {left:.0f} s")
        one(best, left)
