"""Privacy on the device: clip and noise the cut tensors, and keep the budget.

When the package carries a :class:`~splitinfer.shared.manifest.PrivacySpec`,
every cut tensor leaves the device clipped and noised. Several tensors crossing
one cut are one release: they are flattened and concatenated per sample,
clipped to ``clip`` together and noised (``shared.privacy.clip_and_noise``), as
the partitioner assumed when it measured the utility. Only float tensors can be
noised; a cut that ships integer tensors (ids, masks) is never used with a
privacy package.

:class:`PrivacyGate` enforces the per-device budget of
``shared.privacy.Budget``: each request is one release of the cut activation
(the whole batch at once); past the window's epsilon the gate answers "local"
(the device's own model answers, nothing leaves) or refuses with 429.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from splitinfer.edge.config import PrivacyConfig
from splitinfer.shared.manifest import PrivacySpec
from splitinfer.shared.privacy import Budget, BudgetPolicy, Decision, clip_and_noise

Array = np.ndarray[Any, Any]
T = TypeVar("T")
Compute = Callable[[Callable[[], T]], Awaitable[T]]


def noise_tensors(
    arrays: Sequence[Array], spec: PrivacySpec, rng: np.random.Generator
) -> list[Array]:
    """Clip every sample's tensors, as one vector, to ``spec.clip`` and add noise."""
    if not arrays:
        return []
    batch = arrays[0].shape[0]
    flat = np.concatenate([np.asarray(a, np.float32).reshape(batch, -1) for a in arrays], axis=1)
    noised = clip_and_noise(flat, spec.clip, spec.noise_multiplier, rng)
    out: list[Array] = []
    start = 0
    for a in arrays:
        size = math.prod(a.shape[1:])
        out.append(noised[:, start : start + size].reshape(a.shape).astype(a.dtype, copy=False))
        start += size
    return out


async def _inline(fn: Callable[[], T]) -> T:
    return fn()


class PrivacyGate:
    """The device's privacy budget over tumbling windows (see ``shared.privacy.Budget``).

    The opacus accounting runs through ``compute`` (a thread in the agent), one
    charge at a time.
    """

    def __init__(
        self,
        spec: PrivacySpec,
        config: PrivacyConfig,
        device_id: str,
        clock: Callable[[], float],
    ) -> None:
        self.spec = spec
        self.device_id = device_id
        self._clock = clock
        self.policy: BudgetPolicy | None = None
        self._budget: Budget | None = None
        if config.budget_epsilon is not None:
            self.policy = BudgetPolicy(
                window_s=config.budget_window_s,
                max_epsilon=config.budget_epsilon,
                delta=config.budget_delta if config.budget_delta is not None else spec.delta,
                on_exhausted=config.on_exhausted,  # type: ignore[arg-type]
                accountant=config.accountant,  # type: ignore[arg-type]
            )
            self._budget = Budget(self.policy)
        self._lock = asyncio.Lock()
        self.spent = 0.0

    @property
    def enforced(self) -> bool:
        return self._budget is not None

    async def charge(self, compute: Compute[Decision] | None = None) -> Decision | None:
        """Charge one release; None when no budget is configured.

        Raises ``PrivacyBudgetExhausted`` (429) past the budget under "refuse".
        """
        budget = self._budget
        if budget is None:
            return None
        run: Compute[Decision] = compute or _inline
        async with self._lock:
            now = self._clock()
            decision = await run(
                lambda: budget.charge(self.device_id, self.spec.noise_multiplier, now)
            )
        self.spent = decision.spent
        return decision
