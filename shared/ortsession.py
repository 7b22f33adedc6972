"""The one place an ONNX Runtime session is made.

Every room opens sessions (the partitioner to analyse, profile and verify; the
edge and the cloud to serve; the benchmarks to time), and each used to set its
own options. :func:`session_options` builds the :class:`SessionOptions` from a
few named choices and :func:`open_session` loads a model from a path, bytes or
an :class:`onnx.ModelProto` with those options and the providers given, turning
ONNX Runtime's untyped load errors into one :class:`~splitinfer.shared.errors.ModelError`
line that names the model.

Quiet by default (log severity 3: errors only): ONNX Runtime's warnings about
declared shapes that the graph does not honour are expected for real models and
:mod:`splitinfer.partitioner.verify` reports those itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from os import PathLike
from typing import Any, Literal

from splitinfer.shared.errors import ModelError

Optimize = Literal["none", "basic", "extended", "all"]
Provider = str | tuple[str, Mapping[str, Any]]

CPU: tuple[str, ...] = ("CPUExecutionProvider",)


def session_options(
    *,
    threads: int | None = None,
    inter_threads: int | None = None,
    optimize: Optimize = "all",
    log_severity: int = 3,
    spinning: bool = True,
    sequential: bool = False,
    parallel: bool = False,
    arena: bool = True,
    priority_order: bool = False,
    optimized_path: str | PathLike[str] | None = None,
    profile: bool = False,
    config: Mapping[str, str] | None = None,
) -> Any:
    """SessionOptions from named choices; ``threads=None`` leaves ONNX Runtime's default.

    ``sequential`` / ``parallel``: the execution mode (default: ONNX Runtime's, sequential).
    ``spinning=False``: idle worker threads block instead of spinning. ``arena=False``: no
    CPU memory arena (a session run a few times gives its memory back). ``priority_order``:
    each node runs as soon as its inputs exist (ONNX Runtime's priority-based order).
    ``optimized_path``: ONNX Runtime writes the graph it optimized there. ``profile``: its
    profiler on. ``config``: more session config entries, as ONNX Runtime names them.
    """
    import onnxruntime as ort

    levels = {
        "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    opts = ort.SessionOptions()
    opts.log_severity_level = log_severity
    opts.graph_optimization_level = levels[optimize]
    if threads is not None:
        opts.intra_op_num_threads = threads
    if inter_threads is not None:
        opts.inter_op_num_threads = inter_threads
    if sequential and parallel:
        raise TypeError("an ONNX Runtime session is sequential or parallel, not both")
    if sequential:
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if parallel:
        opts.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    if not arena:
        opts.enable_cpu_mem_arena = False
    if priority_order:
        opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    if optimized_path is not None:
        opts.optimized_model_filepath = str(optimized_path)
    if profile:
        opts.enable_profiling = True
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    for key, value in (config or {}).items():
        opts.add_session_config_entry(key, value)
    return opts


def open_session(
    model: str | PathLike[str] | bytes | Any,
    *,
    providers: Sequence[Provider] = CPU,
    options: Any = None,
    name: str | None = None,
    **choices: Any,
) -> Any:
    """An InferenceSession on ``model`` (path, serialized bytes or ModelProto).

    ``options`` is a ready SessionOptions; otherwise ``choices`` go to
    :func:`session_options`. A provider is a name or ``(name, options)``.
    Load failures raise one ModelError line, ``NAME: ONNX Runtime cannot load it:
    REASON`` with ``name`` (else the path), or ``ONNX Runtime cannot load the model:
    REASON`` for a model in memory or ``name="the model"``.
    """
    import onnxruntime as ort

    if options is None:
        options = session_options(**choices)
    elif choices:
        raise TypeError("pass either options or session_options choices, not both")
    if hasattr(model, "SerializeToString"):
        source: Any = model.SerializeToString()
    elif isinstance(model, bytes):
        source = model
    else:
        source = str(model)
    names = [p if isinstance(p, str) else p[0] for p in providers]
    provider_options = [{} if isinstance(p, str) else dict(p[1]) for p in providers]
    try:
        return ort.InferenceSession(
            source, options, providers=names, provider_options=provider_options
        )
    except Exception as exc:  # onnxruntime raises its own, untyped errors
        label = name or (source if isinstance(source, str) else "the model")
        message = " ".join(str(exc).split())[:400] or type(exc).__name__
        if label == "the model":
            raise ModelError(f"ONNX Runtime cannot load the model: {message}") from exc
        raise ModelError(f"{label}: ONNX Runtime cannot load it: {message}") from exc
