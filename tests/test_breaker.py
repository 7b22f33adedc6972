"""The one circuit breaker (shared/breaker.py), on a fake clock; and that the cloud's
versions and the edge's endpoints both use it."""

from __future__ import annotations

import pytest

from splitinfer.shared.breaker import CircuitBreaker
from splitinfer.shared.errors import ConfigError

pytestmark = pytest.mark.unit


def opened(failures: int = 3, cooldown: float = 10.0, at: float = 1.0) -> CircuitBreaker:
    b = CircuitBreaker(failures, cooldown)
    for _ in range(failures):
        b.record(False, at)
    return b


def test_consecutive_failures_open_it_and_a_success_resets_the_count() -> None:
    b = CircuitBreaker(3, 10.0)
    b.record(False, 0.0)
    b.record(False, 0.0)
    b.record(True, 0.0)  # not consecutive any more
    b.record(False, 0.0)
    b.record(False, 0.0)
    assert b.state(0.0) == "closed"
    assert b.allows(0.0)
    b.record(False, 1.0)
    assert b.state(1.0) == "open"
    assert b.trips == 1
    assert not b.allows(10.9)
    assert not b.available(10.9)
    assert b.retry_after(5.0) == pytest.approx(6.0)


def test_half_open_lets_exactly_one_trial_through() -> None:
    b = opened()
    assert b.state(11.0) == "half-open"
    assert b.available(11.0)  # asking takes nothing
    assert b.available(11.0)
    assert b.allows(11.0)  # the trial
    assert not b.allows(11.0)  # everything else waits for it
    assert not b.available(12.0)
    assert b.retry_after(12.0) == pytest.approx(9.0)


def test_half_open_lets_as_many_trials_as_it_is_told() -> None:
    b = CircuitBreaker(1, 10.0, trials=2)
    b.record(False, 1.0)
    assert b.allows(11.0)
    assert b.allows(11.0)
    assert not b.allows(11.0)
    assert b.retry_after(12.0) == pytest.approx(9.0)
    b.release()
    assert b.allows(12.0)
    b.record(False, 12.5)  # the first verdict decides: open again
    assert not b.available(13.0)


def test_the_trials_success_closes_it() -> None:
    b = opened()
    assert b.allows(11.0)
    b.record(True, 11.5)
    assert b.state(11.5) == "closed"
    assert b.closed
    assert b.failures == 0
    assert all(b.allows(11.5) for _ in range(5))


def test_the_trials_failure_opens_it_for_a_new_cooldown() -> None:
    b = opened()
    assert b.allows(11.0)
    b.record(False, 12.0)
    assert b.state(12.0) == "open"
    assert not b.allows(21.9)
    assert b.allows(22.0)  # the next trial, a cooldown after the failed one
    assert b.trips == 1  # still the same outage


def test_a_trial_that_never_reports_is_replaced_after_a_cooldown() -> None:
    b = opened()
    assert b.allows(11.0)  # refused before it ran: no record
    assert not b.allows(20.9)
    assert b.allows(21.0)
    b.record(True, 21.5)
    assert b.closed


def test_a_late_failure_while_open_does_not_restart_the_cooldown() -> None:
    b = opened(at=1.0)
    b.record(False, 5.0)  # a request sent before it opened, timing out now
    assert b.state(11.0) == "half-open"
    assert b.retry_after(5.0) == pytest.approx(6.0)


def test_reopening_after_a_close_counts_a_new_trip() -> None:
    b = opened()
    assert b.allows(11.0)
    b.record(True, 11.0)
    for _ in range(3):
        b.record(False, 12.0)
    assert b.trips == 2


@pytest.mark.parametrize(
    ("failures", "cooldown", "trials"), [(0, 1.0, 1), (True, 1.0, 1), (2, -1.0, 1), (2, 1.0, 0)]
)
def test_bad_settings_are_config_errors(failures: int, cooldown: float, trials: int) -> None:
    with pytest.raises(ConfigError, match="breaker"):
        CircuitBreaker(failures, cooldown, trials)


def test_the_cloud_and_the_edge_use_this_breaker() -> None:
    from splitinfer.cloud import registry
    from splitinfer.edge import failover

    assert registry.CircuitBreaker is CircuitBreaker
    assert failover.CircuitBreaker is CircuitBreaker


def test_a_released_trial_lets_the_next_caller_try_at_once() -> None:
    b = opened()
    assert b.allows(11.0)
    assert not b.allows(11.0)
    b.release()  # the trial got no verdict
    assert b.state(11.0) == "half-open"
    assert b.allows(11.0)
    b.release()
    b.release()  # nothing out: nothing happens
    assert b.available(11.0)
