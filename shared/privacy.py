"""Differential privacy for the cut activation: clip, add Gaussian noise, account.

The edge clips each sample's activation (axis 0 is the batch) to L2 norm ``C``
and adds ``N(0, sigma^2)`` noise before the tensor leaves the device. Any two
inputs, each clipped to norm ``C``, give activations at most ``2C`` apart
(replace-one adjacency), so the L2 sensitivity is ``2C`` and

    sigma = noise_multiplier * 2C.

This differs from opacus's DP-SGD convention (sensitivity ``C`` under add/remove
adjacency); the noise multiplier itself means the same thing, which is why
opacus's accountants apply unchanged. Quantizing and compressing the noised
tensor afterwards is post-processing and costs no privacy.

One release is one full (``sample_rate=1``) Gaussian mechanism. Per device, an
:class:`Accountant` composes the releases of a window with opacus's PRV or RDP
accountant, and a :class:`Budget` refuses a release, or sends the request down
the edge-only path, once the window's epsilon would exceed its limit.

opacus (and so torch) is imported only inside the functions that need it.
"""

from __future__ import annotations

import math
import secrets
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from splitinfer.shared.errors import ConfigError, ModelError, SplitInferError

Mechanism = Literal["prv", "rdp"]
OnExhausted = Literal["refuse", "local"]
MECHANISMS: tuple[str, ...] = ("prv", "rdp")
ON_EXHAUSTED: tuple[str, ...] = ("refuse", "local")

#: One history entry as opacus keeps it: (noise_multiplier, sample_rate, steps).
Step = tuple[float, float, int]
_CACHE_MAX = 4096
_CLIP_MARGIN = 1.0 - 1e-6


class PrivacyBudgetExhausted(SplitInferError):
    """A device has spent its privacy budget for the current window."""

    http_status = 429


def _positive(name: str, value: float, fix: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name}={value!r} must be a finite number > 0; {fix}")


def _check_delta(delta: float) -> None:
    if not (math.isfinite(delta) and 0 < delta < 1):
        raise ConfigError(
            f"delta={delta!r} must lie strictly between 0 and 1; "
            "use a value well below 1/n such as 1e-5"
        )


def _check_mechanism(accountant: str) -> None:
    if accountant not in MECHANISMS:
        raise ConfigError(f"accountant={accountant!r} is unknown; use one of {MECHANISMS}")


@contextmanager
def _quiet_opacus() -> Iterator[None]:
    """Silence two known, harmless opacus warnings for the full-release case.

    * RDP: "Optimal order is the largest alpha" -- for a large noise multiplier
      the best Renyi order lies beyond opacus's default alphas. The bound is
      still a valid upper bound, only looser; ``get_noise_multiplier`` probes
      such multipliers in every search.
    * PRV: at ``sample_rate=1`` the Poisson-subsampled PRV evaluates
      ``log(1 - q) = log(0)``; numpy warns, and ``-inf`` is the correct limit.

    Not thread-safe (``warnings.catch_warnings`` is process-wide): call from one
    thread, e.g. the event loop.
    """
    with warnings.catch_warnings(), np.errstate(divide="ignore"):
        warnings.filterwarnings(
            "ignore", message="Optimal order is the largest alpha", category=UserWarning
        )
        yield


def noise_multiplier_for(epsilon: float, delta: float, accountant: Mechanism = "prv") -> float:
    """The noise multiplier that makes one Gaussian release (epsilon, delta)-DP.

    Computed by opacus's ``get_noise_multiplier`` with ``sample_rate=1, steps=1``
    (one full release), the binary search it does to within 0.01 in epsilon.
    Multiply by the sensitivity ``2C`` to get the noise std.
    """
    _positive("epsilon", epsilon, "pass the per-request privacy budget, e.g. --epsilon 2")
    _check_delta(delta)
    _check_mechanism(accountant)
    from opacus.accountants.utils import get_noise_multiplier

    try:
        with _quiet_opacus():
            sigma = get_noise_multiplier(
                target_epsilon=epsilon,
                target_delta=delta,
                sample_rate=1.0,
                steps=1,
                accountant=accountant,
            )
    except ValueError as exc:  # opacus: "The privacy budget is too low."
        raise ConfigError(
            f"epsilon={epsilon!r} at delta={delta!r} needs a noise multiplier above 1e6; "
            "raise epsilon or delta"
        ) from exc
    return float(sigma)


@dataclass(frozen=True)
class PrivacyParams:
    """Per-request DP parameters of the cut activation."""

    #: Target epsilon of one release.
    epsilon: float
    #: Target delta of one release.
    delta: float
    #: L2 bound each sample's activation is clipped to.
    clip: float
    #: Noise std divided by the sensitivity 2 * clip; 0 means no noise (no privacy).
    noise_multiplier: float

    def __post_init__(self) -> None:
        _positive("epsilon", self.epsilon, "pass the per-request privacy budget, e.g. --epsilon 2")
        _check_delta(self.delta)
        _positive(
            "clip", self.clip, "pick an L2 bound near typical activation norms, e.g. --clip 10"
        )
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ConfigError(
                f"noise_multiplier={self.noise_multiplier!r} must be a finite number >= 0; "
                "derive it with noise_multiplier_for(epsilon, delta)"
            )

    @classmethod
    def for_target(
        cls, epsilon: float, delta: float, clip: float, accountant: Mechanism = "prv"
    ) -> PrivacyParams:
        """Parameters whose noise multiplier opacus derives from (epsilon, delta)."""
        return cls(epsilon, delta, clip, noise_multiplier_for(epsilon, delta, accountant))

    @property
    def sensitivity(self) -> float:
        """L2 distance between any two clipped activations: 2 * clip."""
        return 2.0 * self.clip

    @property
    def noise_std(self) -> float:
        """Standard deviation of the Gaussian noise added to each element."""
        return self.noise_multiplier * self.sensitivity


def secure_rng() -> np.random.Generator:
    """A numpy generator seeded with 128 bits from the OS CSPRNG (``secrets``).

    The seed is unpredictable, but numpy's PCG64 is not itself a CSPRNG: an
    observer who could see enough raw outputs could in principle recover its
    state and predict, hence subtract, later noise. Raw noise is never sent (it
    is added to the activation), but under a strict threat model take a fresh
    generator per request; seeding costs microseconds. Floating-point sampling
    is also not the idealised continuous Gaussian (Mironov 2012); the guarantee
    is the textbook one for real-valued noise.
    """
    return np.random.Generator(np.random.PCG64(secrets.randbits(128)))


def _row_norms(x64: np.ndarray) -> np.ndarray:
    """L2 norm of each sample (axis 0) over all its other elements."""
    flat = x64.reshape(x64.shape[0], math.prod(x64.shape[1:]))
    norms: np.ndarray = np.sqrt(np.einsum("ij,ij->i", flat, flat))
    return norms


def clip_and_noise(
    x: np.ndarray, clip: float, noise_multiplier: float, rng: np.random.Generator
) -> np.ndarray:
    """Clip each sample to L2 norm ``clip``, then add ``N(0, (noise_multiplier*2*clip)^2)``.

    Samples already within the bound are left unchanged. Returns float32 of
    ``x``'s shape. Clipping is done in float64 to ``clip * (1 - 1e-6)``, so that
    rounding back to float32 (relative error under 1e-7) cannot exceed ``clip``.
    """
    _positive("clip", clip, "pick an L2 bound near typical activation norms")
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ConfigError(f"noise_multiplier={noise_multiplier!r} must be a finite number >= 0")
    if x.ndim == 0:
        raise ValueError("clip_and_noise needs a batch axis (axis 0); got a scalar")
    x64 = np.asarray(x, dtype=np.float64)
    if not np.isfinite(x64).all():
        raise ModelError(
            "the cut activation holds NaN or inf; it cannot be clipped or released, "
            "check the front model's inputs and numerics"
        )
    norms = _row_norms(x64)
    with np.errstate(divide="ignore"):
        scale = np.minimum(1.0, clip * _CLIP_MARGIN / norms)  # a zero norm gives inf -> 1
    clipped = (x64 * scale.reshape((-1,) + (1,) * (x.ndim - 1))).astype(np.float32)
    std = np.float32(noise_multiplier * 2.0 * clip)
    noise = rng.standard_normal(clipped.shape, dtype=np.float32) * std
    out: np.ndarray = clipped + noise
    return out


@dataclass
class Accountant:
    """Composes the releases of one stream (device) with an opacus accountant.

    The history is kept here in opacus's format and handed to a fresh opacus
    accountant on each query, so this object holds no torch state. Results are
    memoised per (history, delta) in ``cache``, which a :class:`Budget` shares
    across devices and windows: with a fixed noise multiplier the histories
    repeat, so opacus runs once per release count, not once per request.
    """

    mechanism: Mechanism = "prv"
    history: list[Step] = field(default_factory=list)
    cache: dict[tuple[tuple[Step, ...], float], float] = field(
        default_factory=dict, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        _check_mechanism(self.mechanism)

    @property
    def releases(self) -> int:
        return sum(steps for _, _, steps in self.history)

    def record(self, noise_multiplier: float) -> None:
        """Record one full release (``sample_rate=1``), merged as opacus's ``step`` does."""
        self.history = _with_step(self.history, noise_multiplier)

    def reset(self) -> None:
        self.history = []

    def epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta``; 0 before any release, inf if any was noiseless."""
        return self._epsilon(tuple(self.history), delta)

    def epsilon_after(self, noise_multiplier: float, delta: float) -> float:
        """Epsilon that would be spent after one more release with this noise multiplier."""
        return self._epsilon(tuple(_with_step(self.history, noise_multiplier)), delta)

    def _epsilon(self, history: tuple[Step, ...], delta: float) -> float:
        _check_delta(delta)
        if not history:
            return 0.0
        if any(z == 0 for z, _, _ in history):
            return math.inf
        key = (history, delta)
        if key not in self.cache:
            from opacus.accountants import create_accountant

            acc = create_accountant(mechanism=self.mechanism)
            acc.history = list(history)
            with _quiet_opacus():
                eps = float(acc.get_epsilon(delta=delta))
            if len(self.cache) >= _CACHE_MAX:
                self.cache.clear()
            self.cache[key] = eps
        return self.cache[key]


def _with_step(history: list[Step], noise_multiplier: float) -> list[Step]:
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ConfigError(f"noise_multiplier={noise_multiplier!r} must be a finite number >= 0")
    if history and history[-1][:2] == (noise_multiplier, 1.0):
        z, q, steps = history[-1]
        return [*history[:-1], (z, q, steps + 1)]
    return [*history, (noise_multiplier, 1.0, 1)]


@dataclass(frozen=True)
class BudgetPolicy:
    """How much each device may release per window, and what happens beyond it."""

    #: Window length in seconds (tumbling; see :class:`Budget`).
    window_s: float
    #: Largest epsilon a device may spend, composed over one window.
    max_epsilon: float
    #: Delta at which the window's epsilon is measured.
    delta: float
    #: "refuse": raise PrivacyBudgetExhausted; "local": run the edge-only path.
    on_exhausted: OnExhausted = "refuse"
    #: opacus accountant that composes the releases.
    accountant: Mechanism = "prv"

    def __post_init__(self) -> None:
        _positive("window_s", self.window_s, "give the budget window in seconds, e.g. 3600")
        _positive("max_epsilon", self.max_epsilon, "give the epsilon a device may spend per window")
        _check_delta(self.delta)
        if self.on_exhausted not in ON_EXHAUSTED:
            raise ConfigError(f"on_exhausted={self.on_exhausted!r} is unknown; use {ON_EXHAUSTED}")
        _check_mechanism(self.accountant)


@dataclass(frozen=True)
class Decision:
    """What the edge does with one request."""

    #: "release": send the noised activation; "local": run the edge-only path.
    action: Literal["release", "local"]
    device_id: str
    #: Epsilon spent in the window, including this release if it was allowed.
    spent: float
    limit: float
    #: When the device's current window ends (same clock as ``now``).
    window_ends: float

    @property
    def allowed(self) -> bool:
        return self.action == "release"


@dataclass
class _Window:
    start: float
    accountant: Accountant


class Budget:
    """Per-device privacy budgets over tumbling windows, on an injected clock.

    A device's window opens at its first charge and lasts ``window_s``; the first
    charge at or after its end opens a new window with an empty accountant. Over
    an arbitrary interval of length ``window_s`` that straddles a boundary a
    device may therefore spend up to twice ``max_epsilon``; pick the window with
    that in mind. ``now`` should come from a monotonic clock. Not thread-safe.
    """

    def __init__(self, policy: BudgetPolicy) -> None:
        self.policy = policy
        self._windows: dict[str, _Window] = {}
        self._cache: dict[tuple[tuple[Step, ...], float], float] = {}

    def spent(self, device_id: str, now: float) -> float:
        """Epsilon the device has spent in the window that holds ``now``."""
        window = self._window(device_id, now)
        return window.accountant.epsilon(self.policy.delta)

    def charge(self, device_id: str, noise_multiplier: float, now: float) -> Decision:
        """Charge one release to ``device_id`` if the window's budget allows it.

        Beyond the budget, "refuse" raises :class:`PrivacyBudgetExhausted` and
        "local" returns a ``local`` decision; neither records a release.
        """
        p = self.policy
        window = self._window(device_id, now)
        ends = window.start + p.window_s
        after = window.accountant.epsilon_after(noise_multiplier, p.delta)
        if after <= p.max_epsilon:
            window.accountant.record(noise_multiplier)
            return Decision("release", device_id, after, p.max_epsilon, ends)
        spent = window.accountant.epsilon(p.delta)
        if p.on_exhausted == "refuse":
            raise PrivacyBudgetExhausted(
                f"privacy budget exhausted for device {device_id!r}: spent epsilon {spent:.3g} "
                f"of {p.max_epsilon:g} (delta {p.delta:g}) this window, another release "
                f"would reach {after:.3g}; retry after t={ends:g}"
            )
        return Decision("local", device_id, spent, p.max_epsilon, ends)

    def window_end(self, device_id: str) -> float:
        """When ``device_id``'s current window ends (-inf for a device never charged)."""
        window = self._windows.get(device_id)
        return -math.inf if window is None else window.start + self.policy.window_s

    def _window(self, device_id: str, now: float) -> _Window:
        if not math.isfinite(now):
            raise ConfigError(f"now={now!r} must be a finite clock reading")
        window = self._windows.get(device_id)
        if window is None or now >= window.start + self.policy.window_s:
            window = _Window(now, Accountant(self.policy.accountant, cache=self._cache))
            self._windows[device_id] = window
        return window
