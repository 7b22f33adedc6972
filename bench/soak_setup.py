"""The soak run's packages, inputs and reference outputs (``bench/bench_soak.py``).

Four models, built on the spot as the tests build theirs:

- ``chain``: the test zoo's small CNN (``models/zoo.py``), cloud-only over a raw
  wire (``--split none --input-codec raw --edge-fallback``). Two weight sets
  (seeds 0 and 1): version 1 is seed 0, and every hot swap writes the next version
  with the other seed, so an answer from a stale version cannot pass as a new one.
  Judged exactly (fp32 segments, lossless wire).
- ``digits``: the digits CNN (``models/digits.py``, trained in seconds),
  ``--split auto --candidates 4 --edge-fallback`` with an INT8 edge, the agents
  pinned to its interior cut. Judged by the top-1 agreement the package states.
- ``digits_dp``: the same with privacy (``--epsilon 64 --clip 10``): noised cut
  activations. Judged by the private top-1 agreement the package states.
- ``moe``: the MoE transformer (``models/moe.py``) as an MoE split package (experts
  as safetensors shards, run by the cloud's MoE runtime). No local model: its
  device answers only from the cloud. Judged exactly against the dense torch
  reference (the model has no ONNX form as a whole: its MoE layers never enter ONNX).

The reference of every other model is ONNX Runtime on the source model. Inputs:
the held-out digits for the digits models (so top-1 agreement means something),
seeded normal draws for the others.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.sim.soak import Rule, rule_of

Arrays = dict[str, np.ndarray]
#: Inputs of the chain and the MoE model (the digits models take the 450 held-out
#: digits); requests cycle through them.
POOL = 64
CHAIN_SEEDS = (0, 1)
EPSILON, CLIP = 64.0, 10.0


@dataclass
class Model:
    """One model of the mix: the package its agents run, the cut they are pinned to,
    the rule its answers are judged by, its inputs and the references of each weight
    set (``variants``: the chain's seeds; one for the others)."""

    name: str
    package: Path
    cut: str | None
    rule: Rule
    inputs: list[Arrays]
    refs: list[list[Arrays]]
    #: weight set of each version folder the repository holds
    variants: dict[str, int] = field(default_factory=dict)
    #: where each weight set's package was built (the chain's hot swaps copy them)
    sources: list[Path] = field(default_factory=list)

    def reference(self, sample: int, version: str | None) -> Arrays | None:
        """The reference of ``sample`` for a cloud answer from ``version``, or for the
        device's own answer (``None``: the agent's package, weight set 0); None for
        a version the repository never held."""
        if version is None:
            return self.refs[0][sample]
        variant = self.variants.get(version)
        return None if variant is None else self.refs[variant][sample]


def _say(text: str) -> None:
    print(f"bench_soak: {text}", file=sys.stderr, flush=True)


def _partition(argv: list[str]) -> None:
    """``partition ARGV -q``; what it prints (its cut table) goes to stderr, so that
    stdout holds only the soak's report."""
    import contextlib

    from splitinfer.partitioner.cli import main as partition

    with contextlib.redirect_stdout(sys.stderr):
        code = partition([*argv, "-q"])
    if code != 0:
        raise SystemExit(f"bench_soak: partition {' '.join(argv)} failed (exit {code})")


def _ort(model: Path, inputs: list[Arrays]) -> list[Arrays]:
    """The source model's outputs for each input: ONNX Runtime, one session."""
    from splitinfer.shared.ortsession import open_session

    sess = open_session(model)
    names = [o.name for o in sess.get_outputs()]
    feeds = [i.name for i in sess.get_inputs()]
    return [
        dict(zip(names, sess.run(names, {n: x[n] for n in feeds}), strict=True)) for x in inputs
    ]


def _best_split(pkg: Path) -> tuple[str, dict[str, Any]]:
    """The interior cut with a cloud segment whose stated top-1 agreement is highest."""
    manifest = json.loads((pkg / "manifest.json").read_text())
    private = bool(manifest.get("privacy"))
    best, score = None, -1.0
    for cut in manifest["cuts"]:
        if cut.get("kind") != "split" or not cut.get("cloud"):
            continue
        quality = cut.get("quality") or {}
        stated = (quality.get("private") or {}) if private else quality
        value = float(stated.get("value", 0.0))
        if value > score:
            best, score = cut["id"], value
    if best is None:
        raise SystemExit(f"bench_soak: {pkg} has no split cut with a cloud segment")
    return best, manifest


def build(out: Path) -> list[Model]:
    """Build every package under ``out`` (once: a finished build is reused), in a
    child process: torch and the training stay out of the harness, whose own RSS the
    run reports."""
    stamp = out / "built.json"
    t0 = time.perf_counter()
    if not stamp.is_file():
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        done = subprocess.run([sys.executable, __file__, str(out)], check=False)
        if done.returncode != 0:
            raise SystemExit(f"bench_soak: building the packages failed (exit {done.returncode})")
        stamp.write_text(json.dumps({"built": time.time()}))
        _say(f"built the four packages in {time.perf_counter() - t0:.1f} s -> {out}")
    models = _load(out)
    _say(f"references of {sum(len(m.inputs) for m in models)} inputs ready")
    return models


def _build_packages(out: Path) -> None:
    from splitinfer.models.digits import export_digits, load_digits_split, train_digits_cnn
    from splitinfer.models.moe import INPUT_SHAPES, moe_transformer
    from splitinfer.models.zoo import SMALL, export
    from splitinfer.partitioner.moe_export import export_moe_package

    for seed in CHAIN_SEEDS:
        src = export(SMALL["chain"], out / f"chain-seed{seed}" / "chain.onnx", seed=seed)
        _partition([str(src), "--split", "none", "--input-codec", "raw", "--edge-fallback",
                    "-o", str(out / f"pkg-chain-seed{seed}")])  # fmt: skip
    _say("chain: two weight sets, cloud-only over a raw wire")
    x_train, _, x_test, _ = load_digits_split(0)
    digits = export_digits(out / "digits" / "digits.onnx", seed=0, net=train_digits_cnn(seed=0))
    shutil.copy(digits, out / "digits" / "digits_dp.onnx")
    calib = out / "calibration"
    calib.mkdir()
    np.save(calib / "train.npy", x_train[:1024])
    np.save(out / "digits" / "test.npy", x_test)  # all 450: top-1 agreement over many inputs
    plan = ["--split", "auto", "--calibration", str(calib), "--edge-profile", "raspberry-pi-5",
            "--cloud-profile", "l4", "--uplink", "20mbit", "--rtt", "40ms", "--candidates", "4",
            "--edge-fallback"]  # fmt: skip
    _partition([str(digits), *plan, "-o", str(out / "pkg-digits")])
    _say("digits: INT8 edge, run-time candidates")
    _partition([str(out / "digits" / "digits_dp.onnx"), *plan, "--epsilon", str(EPSILON),
                "--clip", str(CLIP), "-o", str(out / "pkg-digits_dp")])  # fmt: skip
    _say(f"digits_dp: private, epsilon {EPSILON:g}, clip {CLIP:g}")
    moe = moe_transformer()
    export_moe_package(moe, out / "pkg-moe", name="moe", sample_shape=INPUT_SHAPES["transformer"])
    rng = np.random.default_rng(29)
    x = rng.standard_normal((POOL, 1, *INPUT_SHAPES["transformer"])).astype(np.float32)
    np.save(out / "moe-inputs.npy", x)
    from splitinfer.models.moe import reference

    np.save(out / "moe-refs.npy", np.stack([reference(moe, xi) for xi in x]))
    _say("moe: MoE split package (experts in the cloud), dense torch reference")


def _load(out: Path) -> list[Model]:
    rng = np.random.default_rng(7)
    chain_x = [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(POOL)]
    chain_pkgs = [out / f"pkg-chain-seed{s}" for s in CHAIN_SEEDS]
    chain_refs = [_ort(out / f"chain-seed{s}" / "chain.onnx", chain_x) for s in CHAIN_SEEDS]
    chain_manifest = json.loads((chain_pkgs[0] / "manifest.json").read_text())
    models = [
        Model(
            "chain",
            chain_pkgs[0],
            None,
            rule_of(chain_manifest, chain_manifest["default_cut"]),
            chain_x,
            chain_refs,
            sources=chain_pkgs,
        )
    ]
    test = np.load(out / "digits" / "test.npy")
    digits_x = [{"x": test[i : i + 1]} for i in range(len(test))]
    for name in ("digits", "digits_dp"):
        pkg = out / f"pkg-{name}"
        cut, manifest = _best_split(pkg)
        refs = _ort(out / "digits" / f"{name}.onnx", digits_x)
        models.append(Model(name, pkg, cut, rule_of(manifest, cut), digits_x, [refs]))
    moe_x = np.load(out / "moe-inputs.npy")
    moe_refs = np.load(out / "moe-refs.npy")
    manifest = json.loads((out / "pkg-moe" / "manifest.json").read_text())
    models.append(
        Model(
            "moe",
            out / "pkg-moe",
            None,
            rule_of(manifest, manifest["default_cut"]),
            [{"x": x} for x in moe_x],
            [[{"logits": r} for r in moe_refs]],
        )
    )
    for m in models:
        m.variants = {"1": 0}
    return models


if __name__ == "__main__":  # the child process of build()
    _build_packages(Path(sys.argv[1]))
