"""DP on the cut activation: clipping, noise scale, opacus accounting, budgets."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from splitinfer.shared.errors import ConfigError, ModelError, SplitInferError
from splitinfer.shared.privacy import (
    Accountant,
    Budget,
    BudgetPolicy,
    Mechanism,
    OnExhausted,
    PrivacyBudgetExhausted,
    PrivacyParams,
    clip_and_noise,
    noise_multiplier_for,
    secure_rng,
)

pytestmark = pytest.mark.unit

DELTA = 1e-5

# Calling opacus directly (as the reference) shows the two warnings that
# splitinfer.shared.privacy silences around its own calls: RDP's "optimal order
# is the largest alpha" for large noise multipliers, and numpy's log(1 - q) at
# sample_rate=1 inside the PRV accountant.
opacus_reference = pytest.mark.filterwarnings(
    "ignore:Optimal order is the largest alpha:UserWarning",
    "ignore:divide by zero encountered in log:RuntimeWarning",
)


def norms(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.linalg.norm(x.reshape(x.shape[0], -1).astype(np.float64), axis=1)
    return out


def test_clip_bounds_large_samples_and_keeps_small_ones() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 3, 4)).astype(np.float32)
    x[0] *= 100.0  # far above the bound
    x[1] *= 1e-3  # far below it
    x[2] = 0.0
    clip = 2.0
    before = norms(x)
    out = clip_and_noise(x, clip, 0.0, rng)
    assert out.dtype == np.float32
    assert out.shape == x.shape
    after = norms(out)
    assert np.all(after <= clip)  # strictly, after float32 rounding
    big = before > clip
    np.testing.assert_allclose(after[big], clip, rtol=2e-6)
    # clipping only rescales: direction is kept
    np.testing.assert_allclose(out[0] / after[0], x[0] / before[0], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(out[~big], x[~big])
    assert not np.shares_memory(out, x)
    assert clip_and_noise(np.zeros((0, 3), np.float32), clip, 1.0, rng).shape == (0, 3)


def test_noise_std_is_noise_multiplier_times_twice_the_clip() -> None:
    clip, z = 0.75, 1.3
    x = np.zeros((1000, 200), dtype=np.float32)  # 200k noise samples
    noise = clip_and_noise(x, clip, z, np.random.default_rng(20240601)).astype(np.float64)
    expected = z * 2 * clip
    # std of the sample std is expected/sqrt(2n) ~ 0.16%: 1% is about 6 of them
    assert noise.std() == pytest.approx(expected, rel=0.01)
    assert abs(noise.mean()) < 5 * expected / math.sqrt(noise.size)
    assert PrivacyParams(1.0, DELTA, clip, z).noise_std == pytest.approx(expected)


def test_secure_rng_is_fresh_each_time() -> None:
    a, b = secure_rng(), secure_rng()
    assert isinstance(a, np.random.Generator)
    assert not np.array_equal(a.standard_normal(8), b.standard_normal(8))


def test_non_finite_activation_is_refused() -> None:
    x = np.ones((2, 3), dtype=np.float32)
    x[1, 2] = np.inf
    with pytest.raises(ModelError, match="NaN or inf"):
        clip_and_noise(x, 1.0, 1.0, np.random.default_rng(0))


@pytest.mark.parametrize("mechanism", ["prv", "rdp"])
@opacus_reference
def test_noise_multiplier_matches_opacus(mechanism: Mechanism) -> None:
    from opacus.accountants.utils import get_noise_multiplier

    theirs = get_noise_multiplier(
        target_epsilon=2.0, target_delta=DELTA, sample_rate=1.0, steps=1, accountant=mechanism
    )
    assert noise_multiplier_for(2.0, DELTA, mechanism) == theirs
    params = PrivacyParams.for_target(2.0, DELTA, 0.5, mechanism)
    assert params.noise_multiplier == theirs
    assert params.noise_std == pytest.approx(theirs * 2 * 0.5)


def test_noise_multiplier_falls_as_epsilon_grows() -> None:
    sigmas = [noise_multiplier_for(e, DELTA, "rdp") for e in (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)]
    assert all(a > b for a, b in itertools.pairwise(sigmas))
    # PRV is tighter than RDP, so it needs no more noise for the same target
    assert noise_multiplier_for(1.0, DELTA, "prv") <= sigmas[2]


def test_noise_multiplier_for_an_unreachable_epsilon_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="raise epsilon or delta"):
        noise_multiplier_for(1e-8, DELTA, "rdp")


@pytest.mark.parametrize("mechanism", ["prv", "rdp"])
@opacus_reference
def test_accountant_matches_a_fresh_opacus_accountant(mechanism: Mechanism) -> None:
    from opacus.accountants import create_accountant

    ours = Accountant(mechanism)
    theirs = create_accountant(mechanism=mechanism)
    assert ours.epsilon(DELTA) == 0.0
    for z in (3.0, 3.0, 3.0, 5.0, 5.0, 3.0):
        ours.record(z)
        theirs.step(noise_multiplier=z, sample_rate=1.0)
    assert ours.history == theirs.history
    assert ours.releases == 6
    assert ours.epsilon(DELTA) == theirs.get_epsilon(delta=DELTA)
    ours.reset()
    assert ours.epsilon(DELTA) == 0.0


@opacus_reference
def test_accountant_after_k_identical_releases() -> None:
    from opacus.accountants import PRVAccountant

    z = 2.0
    ours = Accountant("prv")
    for _ in range(5):
        ours.record(z)
    theirs = PRVAccountant()
    for _ in range(5):
        theirs.step(noise_multiplier=z, sample_rate=1.0)
    assert ours.epsilon(DELTA) == theirs.get_epsilon(delta=DELTA)
    assert ours.epsilon_after(z, DELTA) > ours.epsilon(DELTA)


def test_a_noiseless_release_spends_infinite_epsilon() -> None:
    acc = Accountant("prv")
    acc.record(0.0)
    assert acc.epsilon(DELTA) == math.inf


def policy(on_exhausted: OnExhausted) -> BudgetPolicy:
    return BudgetPolicy(window_s=60.0, max_epsilon=3.0, delta=DELTA, on_exhausted=on_exhausted)


def releases_that_fit(p: BudgetPolicy, z: float) -> int:
    acc = Accountant(p.accountant)
    k = 0
    while acc.epsilon_after(z, p.delta) <= p.max_epsilon:
        acc.record(z)
        k += 1
    return k


def test_budget_refuses_past_the_limit_and_resets_per_window() -> None:
    p = policy("refuse")
    z = 4.0
    k = releases_that_fit(p, z)
    assert k >= 2
    budget = Budget(p)
    for i in range(k):
        d = budget.charge("cam-1", z, now=10.0 + i)
        assert d.allowed
        assert d.window_ends == 70.0
    spent = budget.spent("cam-1", now=20.0)
    assert 0 < spent <= p.max_epsilon
    with pytest.raises(PrivacyBudgetExhausted) as info:
        budget.charge("cam-1", z, now=30.0)
    msg = str(info.value)
    assert "\n" not in msg
    assert "'cam-1'" in msg
    assert f"{spent:.3g}" in msg
    assert "of 3 " in msg
    assert info.value.http_status == 429
    assert isinstance(info.value, SplitInferError)
    # a refusal records nothing, and other devices have their own budget
    assert budget.spent("cam-1", now=30.0) == spent
    assert budget.charge("cam-2", z, now=30.0).allowed
    # the first charge at or after the window's end opens a fresh window
    d = budget.charge("cam-1", z, now=70.0)
    assert d.allowed
    assert d.window_ends == 130.0
    assert budget.spent("cam-1", now=70.0) < spent


def test_budget_falls_back_to_local_when_exhausted() -> None:
    p = policy("local")
    z = 4.0
    k = releases_that_fit(p, z)
    budget = Budget(p)
    for i in range(k):
        assert budget.charge("cam-1", z, now=float(i)).action == "release"
    spent = budget.spent("cam-1", now=float(k))
    d = budget.charge("cam-1", z, now=float(k))
    assert d.action == "local"
    assert not d.allowed
    assert d.spent == spent
    assert d.limit == p.max_epsilon
    assert budget.spent("cam-1", now=float(k)) == spent
    assert budget.charge("cam-1", z, now=60.0).allowed


def test_budget_refuses_a_noiseless_release() -> None:
    budget = Budget(policy("local"))
    assert budget.charge("cam-1", 0.0, now=0.0).action == "local"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epsilon": 0.0}, "epsilon=0.0 must be a finite number > 0"),
        ({"epsilon": -1.0}, "epsilon=-1.0"),
        ({"epsilon": math.inf}, "epsilon=inf"),
        ({"delta": 1.0}, "delta=1.0 must lie strictly between 0 and 1"),
        ({"delta": 0.0}, "delta=0.0"),
        ({"clip": 0.0}, "clip=0.0 must be a finite number > 0"),
        ({"clip": -2.0}, "clip=-2.0"),
        ({"noise_multiplier": -0.1}, "noise_multiplier=-0.1 must be a finite number >= 0"),
    ],
)
def test_bad_privacy_params_are_config_errors(kwargs: dict[str, float], match: str) -> None:
    good = {"epsilon": 1.0, "delta": DELTA, "clip": 1.0, "noise_multiplier": 1.0}
    with pytest.raises(ConfigError, match=match):
        PrivacyParams(**(good | kwargs))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window_s": 0.0}, "window_s=0.0"),
        ({"max_epsilon": -1.0}, "max_epsilon=-1.0"),
        ({"delta": 2.0}, "delta=2.0"),
        ({"on_exhausted": "drop"}, "on_exhausted='drop' is unknown"),
        ({"accountant": "gdp"}, "accountant='gdp' is unknown"),
    ],
)
def test_bad_budget_policy_is_a_config_error(kwargs: dict[str, object], match: str) -> None:
    good: dict[str, object] = {"window_s": 60.0, "max_epsilon": 1.0, "delta": DELTA}
    with pytest.raises(ConfigError, match=match):
        BudgetPolicy(**(good | kwargs))  # type: ignore[arg-type]


def test_noise_multiplier_for_rejects_bad_targets() -> None:
    with pytest.raises(ConfigError, match="epsilon=0"):
        noise_multiplier_for(0, DELTA)
    with pytest.raises(ConfigError, match="delta=1"):
        noise_multiplier_for(1.0, 1)
    with pytest.raises(ConfigError, match="clip=0"):
        clip_and_noise(np.ones((1, 2), np.float32), 0.0, 1.0, np.random.default_rng(0))
