"""Compression ratio, encode+decode throughput and output agreement of every activation
codec on real cut activations of the zoo models.

    python bench/bench_codecs.py [--repeats 5] [--json out.json]

For each CNN model (chain, resnet, mobilenet) the cut is a mid-network single-tensor
split (the largest ``bytes_per_sample`` among cuts with edge FLOPs between 20% and 80%
of the total); for the transformer it is the cut nearest the FLOP middle whose crossing
holds exactly one float 3-D hidden state (other crossing tensors, e.g. the mask, pass
through exactly). Int8 parameters are calibrated per channel (axis 1 for NCHW features,
the hidden axis for [batch, seq, hidden]) on a 64-sample batch (seed 1) and everything is
measured on a held-out 256-sample batch (seed 2).

Columns: ``ratio`` is raw fp32 bytes / encoded bytes; ``MB/s`` is fp32 input megabytes
(1e6) per second of encode + decode, median of the repeats, one thread, in-process;
``top-1`` is the percentage of samples whose argmax of the first cloud output matches the
one computed from the exact activations; ``cosine`` is the mean cosine similarity of the
first cloud output per sample. The zoo models have random weights, so agreement with
the exact activations is the meaningful figure, not accuracy.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort

from splitinfer.partitioner.cuts import CutPlan
from splitinfer.partitioner.pipeline import Prepared, prepare
from splitinfer.partitioner.segments import cloud_model, edge_model
from splitinfer.partitioner.wirecodec import plan_wire
from splitinfer.shared.codecs import (
    Codec,
    Fp16Codec,
    Int4ZstdCodec,
    Int8Codec,
    Int8ZstdCodec,
    QuantParams,
    RawCodec,
    calibrate_params,
)
from splitinfer.shared.ortsession import open_session

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

CNN_MODELS = ("chain", "resnet", "mobilenet")
#: The row of what ``partition`` ships: the step its search chose, as int8 + zstd-1 or,
#: at 4 bits, packed (int4 + zstd-1).
SHIPPED = "shipped"
TRANSFORMER = "transformer"
CALIB_BATCH, CALIB_SEED = 64, 1
EVAL_BATCH, EVAL_SEED = 256, 2
TARGET_RATIO = 6.0
TARGET_LOSS_POINTS = 1.0
TARGET_MBPS = 500.0

Array = npt.NDArray[Any]
Row = dict[str, float | int | str | list[int]]


def export_zoo(out: Path, names: tuple[str, ...]) -> dict[str, Path]:
    import torch  # noqa: F401  (configures torch logging before we quieten it)
    from zoo import ZOO, export

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    paths: dict[str, Path] = {}
    for name in names:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            paths[name] = export(ZOO[name], out / f"{name}.onnx")
    return paths


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return open_session(model, threads=1, inter_threads=1, log_severity=2)


def is_hidden_state(prepared: Prepared, name: str) -> bool:
    info = prepared.analysis.tensors[name]
    return np.dtype(info.dtype).kind == "f" and len(info.sample_shape) == 2


def cnn_cut(prepared: Prepared) -> CutPlan:
    """The largest single-tensor split among cuts with 20%..80% of the FLOPs on the edge."""
    plans = [p for p in prepared.space.plans() if p.kind == "split" and len(p.crossing) == 1]
    total = max(p.edge_flops + p.cloud_flops for p in prepared.space.plans())
    middle = [p for p in plans if 0.2 * total <= p.edge_flops <= 0.8 * total]
    if not middle:
        raise RuntimeError("no single-tensor split with 20%..80% of the FLOPs on the edge")
    return max(middle, key=lambda p: (p.bytes_per_sample, -abs(p.edge_flops - total / 2)))


def transformer_cut(prepared: Prepared) -> CutPlan:
    """The split nearest the FLOP middle whose crossing holds one float 3-D hidden state."""
    total = max(p.edge_flops + p.cloud_flops for p in prepared.space.plans())
    plans = [
        p
        for p in prepared.space.plans()
        if p.kind == "split" and sum(is_hidden_state(prepared, n) for n in p.crossing) == 1
    ]
    if not plans:
        raise RuntimeError("no split whose crossing holds a 3-D hidden state")
    return min(plans, key=lambda p: (abs(p.edge_flops - total / 2), len(p.crossing)))


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cosine(a: Array, b: Array) -> float:
    a2 = a.reshape(len(a), -1).astype(np.float64)
    b2 = b.reshape(len(b), -1).astype(np.float64)
    num = (a2 * b2).sum(1)
    den = np.linalg.norm(a2, axis=1) * np.linalg.norm(b2, axis=1)
    cos = np.where(den > 0, num / np.maximum(den, 1e-300), 1.0)
    return float(cos.mean())


def codecs() -> list[tuple[str, Codec]]:
    return [
        ("raw", RawCodec()),
        ("fp16", Fp16Codec()),
        ("int8", Int8Codec()),
        ("int8+zstd-1", Int8ZstdCodec(level=1)),
        ("int8+zstd-3", Int8ZstdCodec(level=3)),
    ]


def bench_model(name: str, path: Path, repeats: int) -> list[Row]:
    from zoo import ZOO

    prepared = prepare(path)
    is_cnn = name != TRANSFORMER
    plan = cnn_cut(prepared) if is_cnn else transformer_cut(prepared)
    edge = session(edge_model(prepared.analysis, plan))
    cloud = session(cloud_model(prepared.analysis, plan))
    target = next(n for n in plan.crossing if is_cnn or is_hidden_state(prepared, n))
    crossing = list(plan.crossing)
    calib = dict(
        zip(crossing, edge.run(crossing, ZOO[name].sample(CALIB_BATCH, CALIB_SEED)), strict=True)
    )
    held = dict(
        zip(crossing, edge.run(crossing, ZOO[name].sample(EVAL_BATCH, EVAL_SEED)), strict=True)
    )
    x = np.ascontiguousarray(held[target], dtype=np.float32)
    axis = 1 if is_cnn else x.ndim - 1
    params: QuantParams = calibrate_params(calib[target], axis=axis)
    out_name = cloud.get_outputs()[0].name
    exact = cloud.run([out_name], held)[0]
    shape = tuple(x.shape)
    raw_bytes = x.nbytes
    limit = 4 * raw_bytes + 1024
    # what the partitioner ships: its step search, scored by the cloud segment's top-1 on
    # the calibration batch (partitioner/wirecodec.py), then int8 + zstd level 1
    calib_top1 = cloud.run([out_name], calib)[0].argmax(-1)

    def score(acts: dict[str, Array]) -> float:
        got = cloud.run([out_name], {**calib, **acts})[0].argmax(-1)
        return float((got == calib_top1).mean())

    shipped = plan_wire(
        {target: calib[target]}, dictionary_file="d", score=score, train_dictionary=False
    )
    spec = shipped.quant[target]
    chosen = QuantParams(spec.scale, spec.zero_point, spec.axis)
    rows: list[Row] = []
    ships: Codec = (Int4ZstdCodec if shipped.codec.name == "int4+zstd" else Int8ZstdCodec)(1)
    for label, codec in [*codecs(), (f"{SHIPPED} {ships.name[:4]}", ships)]:
        p = (chosen if label.startswith(SHIPPED) else params) if codec.needs_params else None
        data = codec.encode(x, p)
        decoded = codec.decode(data, "float32", shape, p, limit)

        def roundtrip(codec: Codec = codec, p: QuantParams | None = p) -> None:
            codec.decode(codec.encode(x, p), "float32", shape, p, limit)

        roundtrip()  # warm-up
        seconds = median_time(roundtrip, repeats)
        got = cloud.run([out_name], {**held, target: decoded})[0]
        agree = float((got.argmax(-1) == exact.argmax(-1)).mean() * 100.0)
        rows.append(
            {
                "model": name,
                "cut": plan.id,
                "tensor": target,
                "shape": list(shape),
                "codec": label,
                "raw_bytes": raw_bytes,
                "encoded_bytes": len(data),
                "ratio": raw_bytes / len(data),
                "mb_per_s": raw_bytes / 1e6 / seconds,
                "top1_agreement_pct": agree,
                "cosine": cosine(got, exact),
                "zero_fraction": float((x == 0).mean()),
                "quant_axis": axis,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="timed runs per figure (median)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    names = (*CNN_MODELS, TRANSFORMER)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-codecs-") as tmp:
        t0 = time.perf_counter()
        paths = export_zoo(Path(tmp), names)
        print(f"exported the zoo in {time.perf_counter() - t0:.1f} s", flush=True)
        for name in names:
            print(f"benchmarking {name} ...", flush=True)
            rows.extend(bench_model(name, paths[name], args.repeats))

    print(f"\nheld-out batch of {EVAL_BATCH}, int8 calibrated on {CALIB_BATCH}; MB/s median of")
    print(f"{args.repeats} encode+decode runs, MB of fp32 input, one thread")
    head = f"{'model':<12}{'cut':<6}{'tensor':<24}{'shape':<18}{'zeros':>6}  {'codec':<12}"
    print(head + f"{'ratio':>7}{'MB/s':>9}{'top-1 %':>9}{'cosine':>10}")
    for r in rows:
        shape = "x".join(str(d) for d in r["shape"])  # type: ignore[union-attr]
        line = f"{r['model']:<12}{r['cut']:<6}{str(r['tensor'])[:23]:<24}{shape:<18}"
        line += f"{float(r['zero_fraction']):>6.2f}  {r['codec']:<12}"
        line += f"{float(r['ratio']):>7.2f}{float(r['mb_per_s']):>9.0f}"
        line += f"{float(r['top1_agreement_pct']):>9.2f}{float(r['cosine']):>10.6f}"
        print(line)

    zstd = [r for r in rows if str(r["codec"]).startswith(("int8+zstd", SHIPPED))]
    ships = [r for r in rows if str(r["codec"]).startswith(SHIPPED) and r["model"] in CNN_MODELS]
    worst_ratio = min(ships, key=lambda r: float(r["ratio"]))
    worst_loss = max(ships, key=lambda r: 100.0 - float(r["top1_agreement_pct"]))
    worst_speed = min(ships, key=lambda r: float(r["mb_per_s"]))
    full = [r for r in rows if r["codec"] == "int8+zstd-1" and r["model"] in CNN_MODELS]
    checks = [
        (
            float(worst_ratio["ratio"]) >= TARGET_RATIO,
            f"int8+zstd as partition ships it >= {TARGET_RATIO:.0f}x smaller than fp32 on CNN "
            f"features: min {float(worst_ratio['ratio']):.2f}x "
            f"({worst_ratio['model']}, {worst_ratio['codec']})",
        ),
        (
            100.0 - float(worst_loss["top1_agreement_pct"]) <= TARGET_LOSS_POINTS,
            f"top-1 agreement loss <= {TARGET_LOSS_POINTS:.0f} point (held-out batch): max "
            f"{100.0 - float(worst_loss['top1_agreement_pct']):.2f} points "
            f"({worst_loss['model']}, {worst_loss['codec']})",
        ),
        (
            float(worst_speed["mb_per_s"]) >= TARGET_MBPS,
            f"encode+decode >= {TARGET_MBPS:.0f} MB/s of fp32 on one core: min "
            f"{float(worst_speed['mb_per_s']):.0f} MB/s "
            f"({worst_speed['model']}, {worst_speed['codec']})",
        ),
    ]
    info = [
        f"info: at the full int8 step (8 bits) int8+zstd-1 gives min "
        f"{min(float(r['ratio']) for r in full):.2f}x and min "
        f"{min(float(r['mb_per_s']) for r in full):.0f} MB/s on the CNN features"
    ]
    print()
    for ok, text in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {text}")
    for line in info:
        print(line)
    trans = [r for r in zstd if r["model"] == TRANSFORMER]
    if trans:
        cos = min(float(r["cosine"]) for r in trans)
        print(f"info: transformer hidden state, int8+zstd min output cosine {cos:.6f}")
    total = time.perf_counter() - t_start
    print(f"total {total:.1f} s")
    if args.json is not None:
        doc = {
            "repeats": args.repeats,
            "targets": {
                "ratio": TARGET_RATIO,
                "top1_loss_points": TARGET_LOSS_POINTS,
                "mb_per_s": TARGET_MBPS,
            },
            "checks": [{"pass": ok, "text": text} for ok, text in checks],
            "total_s": total,
            "rows": rows,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
