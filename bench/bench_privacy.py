"""Accuracy vs epsilon for the digits classifier at every cut, with and without the
PCA bottleneck (issue 3's privacy figure).

For each cut whose crossing tensors are floats, the cut activations of the
held-out digits are clipped to L2 norm C (the median norm of the training
activations at that cut), noised with the Gaussian mechanism calibrated by
opacus (PRV accountant, one release, delta 1e-5), and the cloud segment
finishes the inference. The baseline in the same run is the clean split model
(no noise). With ``--bottleneck K`` the cut is first projected on the top K
principal components of the training activations (fitted here, no training of
the network), which spreads the same noise over K coordinates instead of the
tensor's full width.

    python bench/bench_privacy.py [--quick] [--bottleneck 16] [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from splitinfer.models.digits import export_digits, load_digits_split
from splitinfer.partitioner.dp import (
    apply_bottleneck,
    fit_bottleneck,
    noise_batch,
    privacy_spec,
)
from splitinfer.partitioner.pipeline import artifacts_for, prepare

EPSILONS = (1, 2, 4, 8, 16, 32, 64)
QUICK_EPSILONS = (1, 8, 64)
DELTA = 1e-5
REPEATS = 3  # noise draws per point


def _session(model):  # type: ignore[no-untyped-def]
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _run(model, feeds):  # type: ignore[no-untyped-def]
    sess = _session(model)
    names = [o.name for o in sess.get_outputs()]
    return dict(
        zip(names, sess.run(names, {i.name: feeds[i.name] for i in sess.get_inputs()}), strict=True)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--bottleneck", type=int, default=16)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    eps_list = QUICK_EPSILONS if args.quick else EPSILONS
    t0 = time.perf_counter()
    x_train, _, x_test, y_test = load_digits_split(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = export_digits(Path(tmp) / "digits.onnx", seed=0)
        prepared = prepare(path)
    z = {e: privacy_spec(float(e), DELTA, 1.0).noise_multiplier for e in eps_list}
    full = _run(prepared.optimized, {"x": x_test})["logits"]
    fp32_acc = float(np.mean(full.argmax(1) == y_test))
    print(f"digits CNN: fp32 test accuracy {fp32_acc:.4f} on {len(y_test)} held-out digits")
    print(
        f"noise multipliers (PRV, delta {DELTA:g}): "
        + ", ".join(f"eps {e}: z={z[e]:.3f}" for e in eps_list)
    )
    rows = []
    for plan in prepared.space.plans():
        if plan.kind != "split":
            continue
        art = artifacts_for(prepared, plan)
        assert art.edge is not None
        assert art.cloud is not None
        variants = [("full width", art.edge, art.cloud, list(plan.crossing))]
        if len(plan.crossing) == 1:
            (t,) = plan.crossing
            acts = _run(art.edge, {"x": x_train})[t]
            width = int(np.prod(acts.shape[1:]))
            if width > args.bottleneck:
                bn = fit_bottleneck(t, acts, args.bottleneck)
                e2, c2 = apply_bottleneck(art.edge, art.cloud, bn)
                variants.append((f"PCA {bn.dims} ({bn.explained:.0%} var)", e2, c2, [bn.projected]))
        for label, edge, cloud, crossing in variants:
            train_acts = _run(edge, {"x": x_train})
            flat = np.concatenate([train_acts[t].reshape(len(x_train), -1) for t in crossing], 1)
            clip = float(np.median(np.linalg.norm(flat, axis=1)))
            test_acts = _run(edge, {"x": x_test})
            cloud_sess = _session(cloud)
            names = [o.name for o in cloud_sess.get_outputs()]

            def accuracy(
                moved: list[np.ndarray], crossing=crossing, cloud_sess=cloud_sess, names=names
            ) -> float:
                feeds = dict(zip(crossing, moved, strict=True))
                out = cloud_sess.run(
                    names, {i.name: feeds[i.name] for i in cloud_sess.get_inputs()}
                )
                return float(np.mean(out[names.index("logits")].argmax(1) == y_test))

            clean = accuracy([test_acts[t] for t in crossing])
            row = {
                "cut": plan.id,
                "variant": label,
                "width": flat.shape[1],
                "clip": clip,
                "clean": clean,
                "by_epsilon": {},
            }
            rng = np.random.default_rng(0)
            for e in eps_list:
                spec = privacy_spec(float(e), DELTA, clip)
                accs = [
                    accuracy(noise_batch([test_acts[t] for t in crossing], spec, rng))
                    for _ in range(REPEATS)
                ]
                row["by_epsilon"][e] = float(np.mean(accs))
            rows.append(row)
    head = f"{'cut':>4} {'variant':<22} {'width':>6} {'clip C':>7} {'no noise':>9}" + "".join(
        f" {'eps ' + str(e):>8}" for e in eps_list
    )
    print(head)
    for r in rows:
        print(
            f"{r['cut']:>4} {r['variant']:<22} {r['width']:>6} {r['clip']:>7.2f} "
            f"{r['clean']:>9.3f}" + "".join(f" {r['by_epsilon'][e]:>8.3f}" for e in eps_list)
        )
    best = {e: max(rows, key=lambda r: r["by_epsilon"][e]) for e in eps_list}
    print(
        "best cut per epsilon: "
        + ", ".join(
            f"eps {e}: {b['cut']} {b['variant'].split(' (')[0]} {b['by_epsilon'][e]:.3f}"
            for e, b in best.items()
        )
    )
    gain = [
        (r2["by_epsilon"][e] - r1["by_epsilon"][e])
        for r1 in rows
        for r2 in rows
        if r1["cut"] == r2["cut"]
        and r1["variant"] == "full width"
        and r2["variant"] != "full width"
        for e in eps_list
    ]
    if gain:
        print(
            f"bottleneck vs full width at the same cut and epsilon: mean accuracy change "
            f"{np.mean(gain):+.3f} (max {np.max(gain):+.3f}) over {len(gain)} points"
        )
    print(f"chance level 0.100; fp32 baseline {fp32_acc:.3f}; {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"fp32_accuracy": fp32_acc, "delta": DELTA, "noise_multiplier": z, "rows": rows},
                indent=2,
            )
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        for r in rows:
            ax.plot(
                eps_list,
                [r["by_epsilon"][e] for e in eps_list],
                marker="o",
                linestyle="-" if r["variant"] == "full width" else "--",
                label=f"{r['cut']} {r['variant']}",
            )
        ax.axhline(fp32_acc, color="black", linewidth=0.8, label="fp32, no noise")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("epsilon per request (delta 1e-5)")
        ax.set_ylabel("test accuracy")
        ax.set_title("digits CNN: accuracy vs epsilon per cut")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
