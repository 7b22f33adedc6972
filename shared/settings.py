"""The settings both daemons have, defined once (docs/options.md).

``edge-agent`` and ``cloud-service`` both run ONNX Runtime sessions and both hold a
device to a privacy budget. Each takes :class:`RuntimeOptions` as its ``[runtime]``
table (flags without a prefix: ``--providers``, ``--threads``, ``--gpu``,
``--trt-fp16``) and :class:`PrivacyBudget` as its ``[privacy]`` table
(``--privacy-budget-epsilon``), subclassing them to add its own options, so one
setting has one TOML key, one flag and one meaning in both. A subclass may give a
setting another default (the cloud builds fp32 TensorRT kernels unless told), never
another meaning; the names a daemon used before are its sections' ``old=``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitinfer.shared.errors import ConfigError
from splitinfer.shared.options import check, option

#: the execution providers a ``providers`` list may name (``auto`` stands alone)
PROVIDERS = ("tensorrt", "cuda", "cpu")
AUTO = "auto"
ACCOUNTANTS = ("rdp", "prv")


@dataclass(frozen=True)
class RuntimeOptions:
    """ONNX Runtime sessions: which execution providers, and how."""

    providers: tuple[str, ...] = option(
        (AUTO,),
        "ONNX Runtime execution providers, best first (tensorrt, cuda, cpu): the first this "
        "ONNX Runtime has runs the segment, the later ones and CPU take the nodes it refuses, "
        "and none present is an error; auto: the best this machine has (edge: TensorRT on a "
        "Jetson, else CUDA where present, else CPU; cloud: TensorRT, CUDA, CPU)",
        metavar="auto|P[,P...]",
    )
    threads: int = option(
        0,
        "intra-op threads of each ONNX Runtime session (0: ONNX Runtime decides)",
        minimum=0,
    )
    spin: bool = option(
        False,
        "let ONNX Runtime's idle intra-op threads spin (a faster hand-off, but they burn the "
        "cores the daemon encodes and serves on)",
    )
    gpu: int = option(0, "GPU index (CUDA device) for the cuda and tensorrt providers", minimum=0)
    trt_cache_dir: Path | None = option(
        None,
        "folder of the TensorRT engine cache (default: edge: $STATE_DIRECTORY/trt-cache, else "
        "~/.cache/splitinfer/trt; cloud: no cache, engines are rebuilt at each start)",
        metavar="DIR",
    )
    trt_fp16: bool = option(True, "let TensorRT build fp16 kernels")
    trt_workspace_mb: int = option(1024, "TensorRT builder workspace", minimum=16)

    def __post_init__(self) -> None:
        check(self, "runtime.")
        given = list(self.providers)
        if given != [AUTO] and (not given or any(p not in PROVIDERS for p in given)):
            raise ConfigError(
                f"runtime.providers={given!r}: give auto, or one or more of "
                f"{', '.join(PROVIDERS)} in order of preference"
            )


@dataclass(frozen=True)
class PrivacyBudget:
    """Per-device privacy budget over noised frames (``manifest.privacy``)."""

    budget_epsilon: float | None = option(
        None,
        "largest epsilon one device may spend per window on noised frames, composed by the "
        "accountant (unset or 0: no budget); beyond it the edge agent answers per "
        "privacy.on_exhausted and the cloud service refuses with 429",
        minimum=0.0,
    )
    budget_window_s: float = option(3600.0, "the budget's window (tumbling)", minimum=1e-3)
    budget_delta: float | None = option(
        None,
        "delta at which a window's epsilon is measured (default: the package's delta)",
    )
    accountant: str = option(
        "rdp",
        "opacus accountant composing the releases: rdp (about 0.3 ms a charge here) or prv "
        "(tighter, but about 0.4 s a charge on this CPU: every request would pay it)",
        choices=ACCOUNTANTS,
    )

    def __post_init__(self) -> None:
        check(self, "privacy.")
        if self.budget_epsilon == 0:
            object.__setattr__(self, "budget_epsilon", None)  # 0: no budget, as unset
        if self.budget_delta is not None and not 0 < self.budget_delta < 1:
            raise ConfigError(
                f"privacy.budget_delta={self.budget_delta!r}: must be in (0, 1), e.g. 1e-5"
            )

    @property
    def enforced(self) -> bool:
        return self.budget_epsilon is not None
