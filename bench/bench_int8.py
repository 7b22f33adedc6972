"""INT8 edge segments: fp32 vs u8s8 / s8s8 QDQ latency on this CPU, and digits agreement.

    python bench/bench_int8.py [--quick] [--threads 1] [--repeats 15] [--widths 1,4]
                               [--explore] [--conv] [--profile resnet] [--json out.json]

Latency: the CNN architectures of the small model zoo (``models/zoo_small.py``:
chain, resnet, mobilenet, inception; random weights, BatchNorm folded by the
partitioner's passes) at 1x3x224x224, each at the zoo's channel widths (x1, the
zoo's own networks) and with every channel count multiplied (x4, ``widen``: widths
of real 224x224 CNNs, e.g. 64..128 channels for the resnet). Each is quantized as the
partitioner would for an ONNX Runtime CPU edge (``config_for("cpu")``: u8s8,
7-bit weights) under each recipe below, calibrated on 8 synthetic samples. All
variants run in ONNX Runtime CPU with the same session options (ORT_ENABLE_ALL,
so QDQ groups fuse into integer kernels; ``--threads`` intra-op threads), warmed
up, then timed round-robin (one run of each variant per round) so that load on a
shared machine hits all alike; the figure is the median. Target: fp32 / shipped
int8 (``cpu``) >= 2.0 per model.

The recipes, each adding one change (see ``variants``): ``all`` (every op quantized,
the recipe before), ``+ops`` (only CPU_INT8_OPS), ``+pool`` (spatial ReduceMean as
GlobalAveragePool), ``+dw`` (depthwise convs fp32), ``cpu`` (the RGB stem fp32 too:
``config_for("cpu")``, shipped). ``--explore`` adds the shipped recipe with full 8-bit
weights and with per-tensor weights, and s8s8 (``config_for("tensorrt")``).
``--conv`` times single Conv+Relu layers at the zoo's shapes, fp32 vs int8: the
kernel-level ceiling of any recipe.
``--profile NAME`` prints ONNX Runtime's per-op time of NAME (x1) fp32 vs u8s8.

Agreement: the digits CNN (splitinfer.models.digits, trained here with seed 0),
calibrated on 300 training samples; fp32 and int8 accuracy on the 450 test
samples and the top-1 agreement between them. Target >= 0.99.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from splitinfer.partitioner.calibration import synthetic_calibration
from splitinfer.partitioner.passes import DEFAULT_PIPELINE, optimize
from splitinfer.partitioner.quantize import (
    CPU_INT8_OPS,
    QuantConfig,
    agreement,
    config_for,
    quantize_model,
)
from splitinfer.shared.manifest import TensorSpec
from splitinfer.shared.ortsession import open_session

MODELS = ("chain", "resnet", "mobilenet", "inception")
INPUT = TensorSpec("x", "float32", ("batch", 3, 224, 224))
TARGET_SPEEDUP = 2.0
TARGET_AGREEMENT = 0.99
CALIB_SAMPLES = 8
DIGITS_CALIB = 300


# --- the zoo's CNN architectures with a channel multiplier ---------------------------------


def widen(net: Any, w: int) -> Any:
    """A small-zoo CNN (:mod:`splitinfer.models.zoo_small`) with every channel count
    multiplied by ``w``: each Conv2d, BatchNorm2d and Linear rebuilt wider, the RGB input
    (3 channels) and the classes kept, depthwise convs still depthwise."""
    if w == 1:
        return net
    from torch import nn

    for parent in list(net.modules()):
        for key, m in parent.named_children():
            if isinstance(m, nn.Conv2d):
                c_in = m.in_channels if m.in_channels == 3 else m.in_channels * w
                groups = m.groups * w if m.groups > 1 else 1
                wide: Any = nn.Conv2d(
                    c_in, m.out_channels * w, m.kernel_size, m.stride, m.padding, m.dilation,
                    groups, m.bias is not None,
                )  # fmt: skip
            elif isinstance(m, nn.BatchNorm2d):
                wide = nn.BatchNorm2d(m.num_features * w)
            elif isinstance(m, nn.Linear):
                wide = nn.Linear(m.in_features * w, m.out_features, m.bias is not None)
            else:
                continue
            setattr(parent, key, wide)
    return net


def export_cnn(name: str, w: int, out: Path) -> onnx.ModelProto:
    """The zoo's ``name`` at 224x224, widened ``w`` times (random weights, seed 0,
    non-trivial BatchNorm statistics: the zoo's export), optimized."""
    from splitinfer.models.zoo import SMALL, InputSpec, export

    small = SMALL[name]
    model = replace(
        small, build=lambda: widen(small.build(), w), inputs={"x": InputSpec((3, 224, 224))}
    )
    path = export(model, out / f"{name}_x{w}.onnx")
    optimized: onnx.ModelProto = optimize(onnx.load(str(path)), DEFAULT_PIPELINE)[0]
    return optimized


# --- timing --------------------------------------------------------------------------------


def session(model: onnx.ModelProto, threads: int, profile: bool = False) -> ort.InferenceSession:
    return open_session(
        model, optimize="all", sequential=True, threads=threads, inter_threads=1, profile=profile
    )


def time_round_robin(
    sessions: dict[str, ort.InferenceSession], feed: dict[str, Any], repeats: int, warmup: int
) -> dict[str, float]:
    """Median milliseconds per variant; one run of each variant per round."""
    for sess in sessions.values():
        for _ in range(warmup):
            sess.run(None, feed)
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(repeats):
        for key, sess in sessions.items():
            t0 = time.perf_counter()
            sess.run(None, feed)
            times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def variants(explore: bool) -> dict[str, QuantConfig]:
    """The recipes timed against fp32; ``cpu`` (= ``config_for("cpu")``) is the shipped one.

    Each ``+`` step adds one change to the previous recipe (``all`` quantizes every op,
    the recipe before issue 3's work), so the table shows what each change buys.
    """
    base = QuantConfig("u8s8", reduce_range=True)
    ops = replace(base, op_types=CPU_INT8_OPS)
    pool = replace(ops, global_pool=True)
    dw = replace(pool, fp32_depthwise=True)
    out = {"all": base, "+ops": ops, "+pool": pool, "+dw": dw, "cpu": config_for("cpu")}
    if explore:
        out["cpu-8bit"] = replace(config_for("cpu"), reduce_range=False)
        out["cpu-tensor"] = replace(config_for("cpu"), per_channel=False)
        out["s8s8"] = config_for("tensorrt")
    return out


SHIPPED = "cpu"


def latency_rows(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    rows = []
    configs = variants(args.explore)
    feed = synthetic_calibration([INPUT], 1, seed=99)[0]
    calib = synthetic_calibration([INPUT], CALIB_SAMPLES, seed=1)
    for w in args.widths:
        for name in args.models:
            t0 = time.perf_counter()
            fp32 = export_cnn(name, w, work)
            models = {"fp32": fp32}
            models.update({k: quantize_model(fp32, calib, c) for k, c in configs.items()})
            sessions = {k: session(m, args.threads) for k, m in models.items()}
            ms = time_round_robin(sessions, feed, args.repeats, args.warmup)
            speedup = {k: ms["fp32"] / v for k, v in ms.items() if k != "fp32"}
            best = max(speedup, key=lambda k: speedup[k])
            row = {
                "model": name,
                "width": w,
                "ms": ms,
                "speedup": speedup,
                "best": best,
                "pass": speedup[SHIPPED] >= TARGET_SPEEDUP,
                "setup_s": time.perf_counter() - t0,
            }
            rows.append(row)
            cells = "  ".join(
                f"{k} {v:7.2f} ms ({speedup.get(k, 1.0):4.2f}x)" for k, v in ms.items()
            )
            print(f"  {name:<10} x{w}  {cells}", flush=True)
    return rows


def profile(name: str, threads: int, work: Path, top: int = 12) -> None:
    """ORT's per-op-type kernel time of the fp32 and u8s8 model (10 runs)."""
    fp32 = export_cnn(name, 1, work)
    calib = synthetic_calibration([INPUT], CALIB_SAMPLES, seed=1)
    feed = synthetic_calibration([INPUT], 1, seed=99)[0]
    for label, model in (("fp32", fp32), ("u8s8", quantize_model(fp32, calib, config_for("cpu")))):
        sess = session(model, threads, profile=True)
        for _ in range(12):
            sess.run(None, feed)
        events = json.loads(Path(sess.end_profiling()).read_text())
        per_op: collections.Counter[str] = collections.Counter()
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                per_op[e["args"]["op_name"]] += e["dur"]
        total = sum(per_op.values()) / 12 / 1e3
        print(f"\nprofile {name} x1 {label}: {total:.2f} ms per run in kernels")
        for op, us in per_op.most_common(top):
            print(f"  {op:<20}{us / 12 / 1e3:8.3f} ms")


# --- one Conv layer alone: the kernel-level ceiling --------------------------------------

#: (C_in, C_out, H=W, kernel, groups) of the zoo's biggest convolutions at 224x224 input:
#: the RGB stem, resnet x1's 16- and 32-channel 3x3 convs, mobilenet's depthwise, and
#: the x4 resnet's 64- and 128-channel convs.
CONV_SHAPES = (
    (3, 16, 224, 3, 1),
    (16, 16, 224, 3, 1),
    (32, 32, 112, 3, 1),
    (64, 64, 112, 3, 64),
    (64, 64, 224, 3, 1),
    (128, 128, 112, 3, 1),
)


def conv_layer(c_in: int, c_out: int, hw: int, k: int, groups: int) -> onnx.ModelProto:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((c_out, c_in // groups, k, k)) * 0.1).astype(np.float32)
    b = (rng.standard_normal(c_out) * 0.1).astype(np.float32)
    node = helper.make_node(
        "Conv", ["x", "w", "b"], ["c"], name="conv", pads=[k // 2] * 4, group=groups
    )
    relu = helper.make_node("Relu", ["c"], ["y"], name="relu")
    graph = helper.make_graph(
        [node, relu],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c_in, hw, hw])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c_out, hw, hw])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def conv_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """fp32 vs u8s8 (per-channel, 7-bit weights) QDQ of one Conv+Relu, nothing else quantized."""
    cfg = QuantConfig("u8s8", reduce_range=True)
    rows = []
    for c_in, c_out, hw, k, groups in CONV_SHAPES:
        fp32 = conv_layer(c_in, c_out, hw, k, groups)
        spec = TensorSpec("x", "float32", (1, c_in, hw, hw))
        calib = synthetic_calibration([spec], 4, seed=1)
        sessions = {
            "fp32": session(fp32, args.threads),
            "int8": session(quantize_model(fp32, calib, cfg), args.threads),
        }
        feed = synthetic_calibration([spec], 1, seed=99)[0]
        ms = time_round_robin(sessions, feed, args.repeats, args.warmup)
        macs = c_out * (c_in // groups) * k * k * hw * hw
        row = {"shape": [c_in, c_out, hw, k, groups], "ms": ms, "macs": macs}
        rows.append(row)
        print(
            f"  conv {c_in:>3}->{c_out:<3} {k}x{k} g{groups:<3} at {hw}x{hw}: "
            f"fp32 {ms['fp32']:7.2f} ms ({macs / ms['fp32'] / 1e6:6.1f} GMAC/s), "
            f"int8 {ms['int8']:7.2f} ms ({macs / ms['int8'] / 1e6:6.1f} GMAC/s), "
            f"{ms['fp32'] / ms['int8']:.2f}x",
            flush=True,
        )
    return rows


# --- digits --------------------------------------------------------------------------------


def digits_rows(work: Path) -> list[dict[str, Any]]:
    from splitinfer.models.digits import export_digits, load_digits_split, train_digits_cnn

    x_train, _, x_test, y_test = load_digits_split(seed=0)
    t0 = time.perf_counter()
    net = train_digits_cnn(seed=0)
    train_s = time.perf_counter() - t0
    fp32 = onnx.load(str(export_digits(work / "digits.onnx", net=net)))
    rng = np.random.default_rng(0)
    picks = rng.choice(len(x_train), DIGITS_CALIB, replace=False)
    calib = [{"x": x_train[i : i + 1]} for i in picks]
    held = [{"x": x_test[i : i + 1]} for i in range(len(x_test))]
    fp32_acc = accuracy(fp32, x_test, y_test, optimize=True)
    print(f"  digits CNN trained in {train_s:.1f} s; fp32 test accuracy {fp32_acc:.4f}")
    rows = []
    for runtime in ("cpu", "tensorrt"):
        cfg = config_for(runtime)
        q = quantize_model(fp32, calib, cfg)
        for kernels in ("int8", "reference"):
            a = agreement(fp32, q, held, kernels=kernels)
            row = {
                "runtime": runtime,
                "config": asdict(cfg),
                "kernels": kernels,
                "fp32_accuracy": fp32_acc,
                "int8_accuracy": accuracy(q, x_test, y_test, optimize=kernels == "int8"),
                "agreement": asdict(a),
                "pass": a.value >= TARGET_AGREEMENT,
            }
            rows.append(row)
    return rows


def accuracy(model: onnx.ModelProto, x: Any, y: Any, optimize: bool) -> float:
    sess = open_session(model, optimize="all" if optimize else "none")
    logits = sess.run(None, {"x": x})[0]
    return float(np.mean(logits.argmax(1) == y))


# --- report --------------------------------------------------------------------------------


def cpu_summary() -> str:
    flags: set[str] = set()
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name") and name in ("", platform.machine()):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return f"{name}, {os.cpu_count()} CPUs, {' '.join(isa) or 'no AVX2'}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats, zoo widths only")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    p.add_argument("--repeats", type=int, default=15, help="timed rounds (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per variant first")
    p.add_argument("--widths", default="1,4", help="channel multipliers, e.g. 1,4")
    p.add_argument("--models", default=",".join(MODELS), help="subset of " + ",".join(MODELS))
    p.add_argument("--explore", action="store_true", help="also time other u8s8 settings")
    p.add_argument("--profile", choices=MODELS, help="per-op times of one model, fp32 vs u8s8")
    p.add_argument("--no-digits", action="store_true", help="skip the digits agreement part")
    p.add_argument("--conv", action="store_true", help="also time single Conv layers")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.widths = min(args.repeats, 5), "1"
    args.widths = [int(w) for w in str(args.widths).split(",")]
    args.models = [m for m in str(args.models).split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        p.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    t_start = time.perf_counter()
    print(f"CPU: {cpu_summary()}; onnxruntime {ort.__version__}; {args.threads} thread(s)")
    print(
        f"latency at 1x3x224x224, ORT_ENABLE_ALL, median of {args.repeats} round-robin runs "
        f"after {args.warmup} warm-up runs; recipes: all = u8s8 QDQ of every op (before), "
        "+ops = only CPU_INT8_OPS, +pool = ReduceMean as GlobalAveragePool, +dw = depthwise "
        "fp32, cpu = +fp32 stem = config_for('cpu') (shipped)",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench-int8-") as tmp:
        work = Path(tmp)
        rows = latency_rows(args, work)
        convs = conv_rows(args) if args.conv else []
        if args.profile:
            profile(args.profile, args.threads, work)
        digits = [] if args.no_digits else digits_rows(work)

    print(f"\nspeedup fp32 ms / recipe ms ({SHIPPED} = config_for('cpu') is shipped)")
    print(f"{'model':<11}{'width':>5}{'fp32 ms':>10}", end="")
    keys = [k for k in rows[0]["ms"] if k != "fp32"]
    print("".join(f"{k:>12}" for k in keys) + "  verdict")
    for r in rows:
        line = f"{r['model']:<11}{'x' + str(r['width']):>5}{r['ms']['fp32']:>10.2f}"
        line += "".join(f"{r['speedup'][k]:>11.2f}x" for k in keys)
        verdict = "PASS" if r["pass"] else "FAIL"
        print(f"{line}  {verdict} ({SHIPPED} {r['speedup'][SHIPPED]:.2f}x, best {r['best']})")
    ok = True
    for w in args.widths:
        group = [r for r in rows if r["width"] == w]
        passed = sum(r["pass"] for r in group)
        verdict = "PASS" if passed == len(group) else "FAIL"
        ok &= w != 1 or passed == len(group)
        label = "the zoo's widths" if w == 1 else f"channels x{w}"
        print(
            f"{verdict}: int8 ({SHIPPED}) >= {TARGET_SPEEDUP:.1f}x fp32 at 224x224, {label}: "
            f"{passed}/{len(group)} models"
        )
    if digits:
        # the deployed combinations: the CPU edge on this CPU's kernels, TensorRT on exact
        # math (its engine accumulates in int32; this CPU's kernels without VNNI saturate)
        deployed = {("cpu", "int8"), ("tensorrt", "reference")}
        print(f"\ndigits CNN, {DIGITS_CALIB} calibration samples ('info': not how it deploys):")
        for d in digits:
            a = d["agreement"]
            verdict = "PASS" if d["pass"] else "FAIL"
            if (d["runtime"], d["kernels"]) not in deployed:
                verdict = "info"
            print(
                f"  {verdict}: {d['runtime']:<8} ({d['config']['activations']}, reduce_range="
                f"{d['config']['reduce_range']}) on {d['kernels']:<9} kernels: fp32 acc "
                f"{d['fp32_accuracy']:.4f}, int8 acc {d['int8_accuracy']:.4f}, top-1 agreement "
                f"{a['value']:.4f} (target {TARGET_AGREEMENT}) over {a['samples']} test samples"
            )
        ok &= all(d["pass"] for d in digits if (d["runtime"], d["kernels"]) in deployed)
    total = time.perf_counter() - t_start
    print(f"total {total:.1f} s")
    if args.json is not None:
        doc = {"cpu": cpu_summary(), "threads": args.threads, "repeats": args.repeats}
        doc |= {"latency": rows, "conv": convs, "digits": digits, "pass": ok, "total_s": total}
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
