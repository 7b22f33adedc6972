"""The batch axis of a model that declares a fixed one.

Most exported models declare their inputs as ``[1, 3, H, W]``: batch 1, fixed.
The cloud batches requests from many devices along the batch axis, and
``--split auto`` measures on stacked samples, so a fixed batch is freed where
the model really runs batched: the inputs' leading dimension becomes a symbol,
and the model is *run* to check it (two samples at batch 1, then both at batch
2: each output must grow along exactly one axis and hold the two batch-1
answers there). Where it does not (a Reshape to a literal 1, a batch-1 RNN
state, an output that mixes samples), the batch stays fixed, the note says why,
and the package is served one request per run.

Declared output and intermediate shapes are dropped before the optimization
passes (:func:`forget_declared_shapes`): an exporter's declared shape can be
wrong (ddddocr's recogniser declares ``[1, seqlen]`` for a ``(T, N, C)``
output), and a pass that trusts it folds the graph to the wrong answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from splitinfer.partitioner.loader import WeightShell, analysis_input_shapes, dims_of, graph_inputs
from splitinfer.shared.errors import ModelError
from splitinfer.shared.ortsession import open_session

#: The symbol a freed batch axis gets (another is chosen if the model uses it).
SYMBOL = "batch"
#: Batched and per-sample answers agree within this, relative to max(1, |ref|).
RTOL = 1e-4

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class BatchAxis:
    """How the model's batch axis was found.

    ``mode``: ``"symbolic"`` (declared free, or the model has no batched input),
    ``"freed"`` (declared fixed at 1, runs batched: now symbolic) or ``"fixed"``
    (runs at ``size`` only). ``note`` says what was done and why, for the user.
    """

    mode: str
    size: int | None = None
    note: str | None = None

    @property
    def fixed(self) -> bool:
        return self.mode == "fixed"

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "size": self.size, "note": self.note}


def forget_declared_shapes(model: onnx.ModelProto) -> None:
    """Drop the declared shapes of outputs and intermediates (keep their types), in place."""
    for vi in model.graph.output:
        if vi.type.HasField("tensor_type"):
            vi.type.tensor_type.ClearField("shape")
    del model.graph.value_info[:]


def free_batch(model: onnx.ModelProto, overrides: dict[str, list[int]]) -> BatchAxis:
    """Free a fixed batch-1 axis of ``model``'s inputs in place where the model runs
    batched (checked by running it); else leave it fixed and say why."""
    inputs = [vi for vi in graph_inputs(model) if dims_of(vi)]
    if not inputs or any(not isinstance(dims_of(vi)[0], int) for vi in inputs):
        return BatchAxis("symbolic")
    leads = {int(dims_of(vi)[0]) for vi in inputs}  # type: ignore[arg-type]
    if leads != {1}:
        size = min(leads)
        return BatchAxis(
            "fixed", size, f"the inputs declare leading dimensions {sorted(leads)}, not a batch "
            f"of 1: partitioned at the declared sizes, served one request per run",
        )  # fmt: skip
    if any(len(dims_of(vi)) < 2 for vi in inputs):
        return BatchAxis(
            "fixed", 1, "an input of rank 1 declares size 1: no batch axis to free; "
            "partitioned at batch 1, served one request per run",
        )  # fmt: skip
    taken = {d for vi in graph_inputs(model) for d in dims_of(vi) if isinstance(d, str)}
    symbol = SYMBOL if SYMBOL not in taken else next(
        f"{SYMBOL}{i}" for i in range(1, 100) if f"{SYMBOL}{i}" not in taken
    )  # fmt: skip
    for vi in inputs:
        dim = vi.type.tensor_type.shape.dim[0]
        dim.Clear()
        dim.dim_param = symbol
    why = _runs_batched(model, inputs, overrides)
    if why is None:
        return BatchAxis(
            "freed", 1, "the model declares batch 1; it runs batched (checked at batch 2 "
            "against two batch-1 runs), so the batch axis is free: the cloud batches requests",
        )  # fmt: skip
    for vi in inputs:
        dim = vi.type.tensor_type.shape.dim[0]
        dim.Clear()
        dim.dim_value = 1
    return BatchAxis(
        "fixed", 1, f"the model declares batch 1 and does not run batched ({why}): "
        "partitioned at batch 1; the cloud serves it one request per run",
    )  # fmt: skip


def _runs_batched(
    model: onnx.ModelProto, inputs: list[onnx.ValueInfoProto], overrides: dict[str, list[int]]
) -> str | None:
    """None if ``model`` (inputs' batch now symbolic) answers two samples at batch 2 as it
    does each at batch 1; else why not."""
    import onnxruntime as ort

    shapes = analysis_input_shapes(model, overrides)
    rng = np.random.default_rng(0)
    one = [{vi.name: _random(vi, [1, *shapes[vi.name]], rng) for vi in inputs} for _ in (0, 1)]
    both = {k: np.concatenate([one[0][k], one[1][k]]) for k in one[0]}
    shell = WeightShell(model)
    del shell.model.graph.value_info[:]
    for vi in shell.model.graph.output:
        vi.type.tensor_type.ClearField("shape")
    opts = shell.options(optimize="basic", log_severity=4, arena=False)
    try:
        sess = open_session(shell.model.SerializeToString(), options=opts)
    except ModelError as exc:
        return f"ONNX Runtime cannot load it with a free batch: {exc}"
    del shell
    run_opts = ort.RunOptions()
    run_opts.log_severity_level = 4
    names = [o.name for o in sess.get_outputs()]
    try:
        singles = [sess.run(names, feed, run_opts) for feed in one]
        batched = sess.run(names, both, run_opts)
    except Exception as exc:  # ORT's own exception types
        text = str(exc).strip().splitlines()
        return f"ONNX Runtime at batch 2: {text[0] if text else type(exc).__name__}"
    for i, name in enumerate(names):
        a, b, ab = (np.asarray(x) for x in (singles[0][i], singles[1][i], batched[i]))
        axis = batch_axis_of(a.shape, ab.shape)
        if axis is None or b.shape != a.shape:
            return (
                f"output {name!r} is {'x'.join(map(str, ab.shape)) or '()'} at batch 2 and "
                f"{'x'.join(map(str, a.shape)) or '()'} at batch 1"
            )
        got = np.concatenate([a, b], axis=axis)
        if not _close(got, ab):
            return f"output {name!r} at batch 2 differs from the two batch-1 answers"
    return None


def batch_axis_of(one: tuple[int, ...], two: tuple[int, ...]) -> int | None:
    """The one axis that is 1 at batch 1 and 2 at batch 2, all others equal; else None."""
    if len(one) != len(two):
        return None
    grown = [k for k, (x, y) in enumerate(zip(one, two, strict=True)) if x != y]
    if len(grown) != 1 or one[grown[0]] != 1 or two[grown[0]] != 2:
        return None
    return grown[0]


def _close(got: Array, ref: Array) -> bool:
    if got.shape != ref.shape:
        return False
    if got.dtype.kind not in "fc":
        return bool(np.array_equal(got, ref))
    r = ref.astype(np.float64)
    err = np.abs(got.astype(np.float64) - r)
    ok = (err <= RTOL * np.maximum(1.0, np.abs(r))) | (np.isnan(got) & np.isnan(ref))
    return bool(ok.all())


def _random(vi: onnx.ValueInfoProto, shape: list[int], rng: np.random.Generator) -> Array:
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    values = rng.integers(0, 2, shape).astype(dtype)  # ids, masks: 0 and 1 are valid for all
    if values.ndim >= 2:
        values[:, 0] = 1
    return values


# -- running a fixed batch on stacked samples ------------------------------------------


class RowSession:
    """An ONNX Runtime session whose ``run`` takes stacked samples even where the model's
    inputs declare a fixed batch of 1 (:func:`run_rows`); all else is the session's."""

    def __init__(self, sess: Any) -> None:
        self._sess = sess

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sess, name)

    def run(self, names: Sequence[str] | None, feeds: Mapping[str, Any], *_: Any) -> list[Any]:
        wanted = [o.name for o in self._sess.get_outputs()] if names is None else names
        return run_rows(self._sess, wanted, feeds)


def run_rows(sess: Any, names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list[Any]:
    """``sess.run``; on a model whose inputs declare a fixed leading size (a batch of 1
    that does not run batched, see :mod:`.batch`, or an RNN state ``[2, 1, 128]``),
    samples stacked along axis 0 (each with its own leading size) run one sample at a
    time and the answers are joined along axis 0."""
    counts: dict[str, int] = {}
    for i in sess.get_inputs():
        lead = i.shape[0] if i.shape else None
        value = feeds.get(i.name)
        if not isinstance(lead, int) or lead < 1 or value is None or np.ndim(value) == 0:
            continue
        if len(value) > lead and len(value) % lead == 0:
            counts[i.name] = len(value) // lead
    rows = set(counts.values())
    if not rows:
        return list(sess.run(list(names), dict(feeds)))
    if len(rows) > 1:
        raise ModelError(
            "stacked samples disagree on how many there are: "
            + ", ".join(f"{k} holds {v}" for k, v in counts.items())
        )
    (n,) = rows
    size = {k: len(feeds[k]) // n for k in counts}

    def sample(r: int) -> dict[str, Any]:
        return {**feeds, **{k: feeds[k][r * size[k] : (r + 1) * size[k]] for k in counts}}

    parts = [sess.run(list(names), sample(r)) for r in range(n)]
    return [np.concatenate([p[k] for p in parts]) for k in range(len(names))]
