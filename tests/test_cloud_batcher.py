"""The batcher, its estimators and the overload primitives: pure logic, times are numbers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitinfer.cloud.batcher import Batch, Batcher, Item, QueueKey
from splitinfer.cloud.config import BatchingConfig
from splitinfer.cloud.estimate import ArrivalRate, LatencyModel
from splitinfer.cloud.overload import (
    DeadlineUnmeetable,
    QueueFull,
    RateLimited,
    RateLimiter,
)
from splitinfer.shared.contract import retry_after_header

pytestmark = pytest.mark.unit

K = QueueKey(uid=1, cut_id="c1", shape=((4,),))
K2 = QueueKey(uid=1, cut_id="c1", shape=((8,),))


def make(**kw: object) -> Batcher[str]:
    return Batcher(BatchingConfig(**kw))  # type: ignore[arg-type]


def item(name: str, rows: int = 1, key: QueueKey = K, **kw: object) -> Item[str]:
    return Item(key=key, rows=rows, payload=name, **kw)  # type: ignore[arg-type]


def names(batch: Batch[str]) -> list[str]:
    return [i.payload for i in batch.items]


def seeded(b: Batcher[str], key: QueueKey = K, a: float = 0.010, c: float = 0.001) -> None:
    """Teach the batcher t(n) = a + c*n for ``key``."""
    for n in (1, 8, 32):
        b.latency(key).observe(n, a + c * n)


# -- when batches start ---------------------------------------------------------


def test_an_idle_model_runs_a_lone_request_at_once() -> None:
    b = make(max_queue_delay_ms=50)
    b.submit(item("a"), now=0.0)
    d = b.schedule(0.0)
    assert [names(x) for x in d.batches] == [["a"]]
    assert d.batches[0].reason == "idle"
    assert b.running == 1
    assert d.wake_at is None


def test_requests_arriving_while_busy_form_the_next_batch() -> None:
    b = make(max_batch_size=8, max_concurrent_batches=1, max_queue_delay_ms=1)
    b.submit(item("a"), 0.0)
    (first,) = b.schedule(0.0).batches
    for n in range(5):
        b.submit(item(f"r{n}"), 0.001 * n)
    # the one slot is busy: no batch starts however long they wait
    d = b.schedule(0.5)
    assert d.batches == ()
    assert d.wake_at is None  # only a completion can start the next batch
    b.complete(first, 0.5, 0.5)
    (second,) = b.schedule(0.5).batches
    assert names(second) == ["r0", "r1", "r2", "r3", "r4"]
    assert second.reason == "idle"


def test_with_a_free_slot_a_queue_waits_for_fullness_or_the_delay() -> None:
    b = make(max_batch_size=4, max_concurrent_batches=2, max_queue_delay_ms=10)
    b.submit(item("a"), 0.0)
    b.schedule(0.0)  # "a" runs: the model is busy, one slot free
    b.submit(item("b"), 0.001)
    d = b.schedule(0.001)
    assert d.batches == ()
    assert d.wake_at == pytest.approx(0.011)
    for n in range(3):
        b.submit(item(f"c{n}"), 0.002)
    (full,) = b.schedule(0.002).batches
    assert full.reason == "full"
    assert names(full) == ["b", "c0", "c1", "c2"]
    b.complete(full, 0.003, 0.001)  # "a" still runs: one slot free again
    b.submit(item("d"), 0.003)
    assert b.schedule(0.0129).batches == ()
    (late,) = b.schedule(0.0131).batches
    assert late.reason == "delay"
    assert names(late) == ["d"]


def test_a_batch_never_exceeds_max_batch_size_rows() -> None:
    b = make(max_batch_size=5)
    for n, rows in enumerate((2, 2, 2, 3)):
        b.submit(item(f"x{n}", rows=rows), 0.0)
    (batch,) = b.schedule(0.0).batches
    assert batch.rows == 4
    assert b.queued_rows == 5
    # a request larger than a whole batch still runs, alone
    b2 = make(max_batch_size=2, max_queue_size=16)
    b2.submit(item("big", rows=7), 0.0)
    (alone,) = b2.schedule(0.0).batches
    assert alone.rows == 7


def test_only_requests_of_one_queue_key_share_a_batch() -> None:
    b = make(max_batch_size=8, max_concurrent_batches=2)
    b.submit(item("a", key=K), 0.0)
    b.submit(item("b", key=K2), 0.0)
    b.submit(item("c", key=K), 0.0)
    d = b.schedule(0.0)
    # idle: the first queue goes at once; the other waits for the delay
    assert [names(x) for x in d.batches] == [["a", "c"]]
    assert d.batches[0].key == K
    (other,) = b.schedule(0.0021).batches
    assert other.key == K2


def test_higher_priority_goes_first_and_fills_a_batch_first() -> None:
    b = make(max_batch_size=2)
    b.submit(item("low1", priority=1), 0.0)
    b.submit(item("high", priority=9), 0.001)
    b.submit(item("low2", priority=1), 0.002)
    b.submit(item("mid", priority=5), 0.003)
    (batch,) = b.schedule(0.003).batches
    assert names(batch) == ["high", "mid"]
    b.complete(batch, 0.01, 0.007)
    (rest,) = b.schedule(0.01).batches
    assert names(rest) == ["low1", "low2"]


def test_batching_off_runs_every_request_alone() -> None:
    b = make(enabled=False, max_concurrent_batches=2)
    for n in range(3):
        b.submit(item(f"r{n}"), 0.0)
    d = b.schedule(0.0)
    assert [names(x) for x in d.batches] == [["r0"], ["r1"]]
    assert all(x.reason == "unbatched" for x in d.batches)


def test_solo_keys_never_batch() -> None:
    solo = QueueKey(uid=2, cut_id="c0", solo=True)
    b = make(max_concurrent_batches=4)
    for n in range(3):
        b.submit(item(f"s{n}", key=solo), 0.0)
    assert [len(x.items) for x in b.schedule(0.0).batches] == [1, 1, 1]


# -- deadlines and the queue bound -------------------------------------------------


def test_a_request_that_cannot_meet_its_deadline_is_refused_at_submit() -> None:
    b = make(max_batch_size=4, max_concurrent_batches=1)
    seeded(b, a=0.010, c=0.001)  # a batch of 4 takes 14 ms
    b.submit(item("first", rows=4), 0.0)
    b.schedule(0.0)  # runs until ~0.014
    for n in range(4):
        b.submit(item(f"q{n}"), 0.0)  # the next batch: 0.014 .. 0.028
    with pytest.raises(DeadlineUnmeetable, match="cannot be met") as err:
        b.submit(item("late", deadline=0.030), 0.0)  # would run third: ~0.042
    assert err.value.retry_after > 0
    b.submit(item("soon", deadline=0.030, priority=9), 0.0)  # jumps the queue: ~0.028
    with pytest.raises(DeadlineUnmeetable, match="already passed"):
        b.submit(item("past", deadline=-1.0), 0.0)
    assert b.queued == 5


def test_before_anything_is_learned_only_past_deadlines_are_refused() -> None:
    b = make()
    b.submit(item("a", deadline=0.0005), 0.0)
    with pytest.raises(DeadlineUnmeetable):
        b.submit(item("b", deadline=0.0), 0.0)


def test_a_waiting_request_expires_as_soon_as_its_deadline_is_out_of_reach() -> None:
    b = make(max_batch_size=4, max_concurrent_batches=1)
    seeded(b, a=0.010, c=0.0)
    b.submit(item("run"), 0.0)
    (running,) = b.schedule(0.0).batches
    b.submit(item("tight", deadline=0.025), 0.001)  # fits: runs 0.010 .. 0.020
    b.submit(item("loose"), 0.001)
    d = b.schedule(0.001)
    # 0.025 minus 10 ms compute: the last moment it can start
    assert d.wake_at == pytest.approx(0.015, abs=1e-5)
    assert b.schedule(0.015).expired == ()
    d = b.schedule(0.0151)  # the running batch is slower than expected
    assert [i.payload for i in d.expired] == ["tight"]
    b.complete(running, 0.02, 0.02)
    (nxt,) = b.schedule(0.02).batches
    assert names(nxt) == ["loose"]


def test_a_deadline_starts_a_batch_early_when_a_slot_is_free() -> None:
    b = make(max_batch_size=8, max_concurrent_batches=2, max_queue_delay_ms=100)
    seeded(b, a=0.010, c=0.0)
    b.submit(item("run"), 0.0)
    b.schedule(0.0)
    b.submit(item("urgent", deadline=0.030), 0.0)
    d = b.schedule(0.0)
    assert d.batches == ()
    assert d.wake_at == pytest.approx(0.020)
    (batch,) = b.schedule(0.020).batches
    assert batch.reason == "deadline"


def test_the_queue_is_bounded_in_samples() -> None:
    b = make(max_batch_size=2, max_queue_size=4, max_concurrent_batches=1)
    b.submit(item("a", rows=2), 0.0)
    b.schedule(0.0)
    b.submit(item("b", rows=3), 0.0)
    assert b.load == pytest.approx(0.75)
    with pytest.raises(QueueFull, match="max_queue_size=4"):
        b.submit(item("c", rows=2), 0.0)
    b.submit(item("d", rows=1), 0.0)
    assert b.load == 1.0


def test_cancel_and_drain_empty_the_queue() -> None:
    b = make(max_concurrent_batches=1)
    b.submit(item("run"), 0.0)
    b.schedule(0.0)
    gone, kept = item("gone", deadline=5.0), item("kept")
    b.submit(gone, 0.0)
    b.submit(kept, 0.0)
    assert b.cancel(gone)
    assert not b.cancel(gone)
    assert [i.payload for i in b.drain()] == ["kept"]
    assert b.queued_rows == 0
    assert b.schedule(1.0) == b.schedule(1.0)  # nothing left, nothing to wake for


# -- adaptation ------------------------------------------------------------------


def test_aimd_shrinks_the_batch_limit_on_slow_batches_and_grows_it_back() -> None:
    b = make(max_batch_size=20, aimd=True, aimd_target_ms=10)
    b.submit(item("x"), 0.0)
    (batch,) = b.schedule(0.0).batches
    b.complete(batch, 0.03, 0.030)
    assert b.max_rows == 18
    for _ in range(3):
        b.submit(item("y"), 0.0)
        (batch,) = b.schedule(0.0).batches
        b.complete(batch, 0.0, 0.001)
    assert b.max_rows == 20  # capped at max_batch_size


def test_adaptive_delay_waits_only_when_the_next_request_is_due_soon() -> None:
    b = make(adaptive_delay=True, max_queue_delay_ms=50, max_concurrent_batches=2)
    seeded(b, a=0.004, c=0.001)
    # sparse arrivals: 100 ms apart, far more than the 4 ms per-batch cost
    for n in range(3):
        b.submit(item(f"s{n}"), 0.1 * n)
        for batch in b.schedule(0.1 * n).batches:
            b.complete(batch, 0.1 * n, 0.005)
    assert b.delay(K) == 0.0
    # dense arrivals: 0.5 ms apart
    for n in range(40):
        b._arrivals.observe(1.0 + 0.0005 * n)
    assert b.delay(K) == pytest.approx(0.004, rel=0.05)


# -- invariants under random traffic -----------------------------------------------

events = st.lists(
    st.tuples(
        st.sampled_from(["submit", "complete", "tick"]),
        st.integers(1, 5),  # rows
        st.integers(0, 9),  # priority
        st.floats(0.0, 0.01),  # time step
        st.sampled_from([K, K2]),
        st.one_of(st.none(), st.floats(0.0, 0.05)),  # relative deadline
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    events,
    st.integers(1, 8),
    st.integers(1, 3),
    st.floats(0.0, 5.0),
    st.booleans(),
    st.booleans(),
)
def test_random_traffic_keeps_every_invariant(
    evs: list[tuple[str, int, int, float, QueueKey, float | None]],
    max_batch: int,
    slots: int,
    delay_ms: float,
    enabled: bool,
    aimd: bool,
) -> None:
    cfg = BatchingConfig(
        enabled=enabled,
        max_batch_size=max_batch,
        max_queue_size=max(max_batch, 12),
        max_concurrent_batches=slots,
        max_queue_delay_ms=delay_ms,
        aimd=aimd,
        aimd_target_ms=3,
    )
    b: Batcher[int] = Batcher(cfg)
    now, counter = 0.0, 0
    fates: dict[int, str] = {}
    running: list[Batch[int]] = []
    for kind, rows, prio, step, key, rel in evs:
        now += step
        if kind == "submit":
            counter += 1
            deadline = math.inf if rel is None else now + rel
            it = Item(key=key, rows=rows, payload=counter, priority=prio, deadline=deadline)
            try:
                b.submit(it, now)
                fates[counter] = "queued"
            except (QueueFull, DeadlineUnmeetable):
                fates[counter] = "refused"
        elif kind == "complete" and running:
            done = running.pop(0)
            b.complete(done, now, 0.001 * done.rows + 0.002)
        d = b.schedule(now)
        for it in d.expired:
            assert fates[it.payload] == "queued"
            assert it.deadline < math.inf
            fates[it.payload] = "expired"
        for batch in d.batches:
            assert len({i.key for i in batch.items}) == 1
            assert batch.rows <= cfg.max_batch_size or len(batch.items) == 1
            assert enabled or len(batch.items) == 1
            for it in batch.items:
                assert fates[it.payload] == "queued"
                fates[it.payload] = "ran"
            running.append(batch)
        assert b.running == len(running) <= slots
        if not running:
            assert b.queued == 0, "an idle model must not keep requests waiting"
        if d.wake_at is not None:
            assert d.wake_at >= now
        assert b.queued == sum(1 for f in fates.values() if f == "queued")
        assert 0.0 <= b.load <= 1.0


# -- estimators --------------------------------------------------------------------


def test_the_latency_model_recovers_a_line_and_follows_drift() -> None:
    m = LatencyModel()
    assert m.estimate(8) == 0.0
    assert not m.known
    m.observe(4, 0.010)
    assert m.estimate(2) == pytest.approx(0.010)  # one size seen: never below it
    assert m.estimate(8) == pytest.approx(0.020)  # and proportional above it
    m = LatencyModel()
    for n in (1, 2, 4, 8, 16, 32) * 3:
        m.observe(n, 0.003 + 0.0005 * n)
    a, c = m.coefficients()
    assert a == pytest.approx(0.003, rel=1e-6)
    assert c == pytest.approx(0.0005, rel=1e-6)
    for n in (1, 32) * 60:
        m.observe(n, 2 * (0.003 + 0.0005 * n))  # the machine got twice as slow
    assert m.estimate(16) == pytest.approx(2 * (0.003 + 0.0005 * 16), rel=0.05)


def test_arrival_rate_is_the_smoothed_gap() -> None:
    r = ArrivalRate(alpha=0.5)
    assert math.isinf(r.gap)
    r.observe(0.0)
    r.observe(1.0)
    assert r.gap == 1.0
    r.observe(1.5)
    assert r.gap == pytest.approx(0.75)


# -- overload primitives -------------------------------------------------------------


def test_the_rate_limiter_is_a_token_bucket_per_device() -> None:
    rl = RateLimiter(rate=2.0, burst=3, max_devices=2)
    for _ in range(3):
        rl.check("cam", 0.0)
    with pytest.raises(RateLimited, match="'cam'") as err:
        rl.check("cam", 0.0)
    assert err.value.retry_after == pytest.approx(0.5)
    assert err.value.http_status == 429
    rl.check("gate", 0.0)  # other devices are not affected
    rl.check("cam", 0.5)  # one token back after 0.5 s
    rl.check("third", 0.5)
    assert len(rl) == 2  # bounded: the least recent device was dropped
    RateLimiter(rate=0, burst=0).check("any", 0.0)  # 0 = unlimited


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert retry_after_header(0.01) == "1"
    assert retry_after_header(2.2) == "3"
    assert retry_after_header(math.inf) == "60"
