"""Retries, failover, circuit breakers and health checks, on a fake clock."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Mapping

import pytest

from splitinfer.edge.config import UplinkConfig
from splitinfer.edge.failover import (
    CloudRefused,
    CloudUnavailable,
    Uplink,
    error_message,
    retry_after,
)
from splitinfer.edge.transport import FunctionTransport, Reply, TransportError

pytestmark = pytest.mark.unit

Handler = Callable[[str, str, bytes, Mapping[str, str]], Reply]


class World:
    """A fake clock and a sleep that advances it."""

    def __init__(self) -> None:
        self.t = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


def ok(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
    return Reply(200, {}, b"frame:" + body)


def dead(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
    raise TransportError("connection refused")


def status(code: int, retry: str | None = None) -> Handler:
    def handler(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        h = {"Retry-After": retry} if retry else {}
        return Reply(code, h, json.dumps({"error": f"nope {code}", "status": code}).encode())

    return handler


def uplink(
    world: World, *handlers: Handler, **config: object
) -> tuple[Uplink, list[FunctionTransport]]:
    transports = [FunctionTransport(h, f"ep{i}") for i, h in enumerate(handlers)]
    up = Uplink(
        transports,
        UplinkConfig(**config),  # type: ignore[arg-type]
        clock=world.clock,
        sleep=world.sleep,
        rng=random.Random(7),
    )
    return up, transports


async def test_first_endpoint_is_preferred_and_bodies_are_posted() -> None:
    world = World()
    up, (a, b) = uplink(world, ok, ok)
    got = await up.post("/v1/models/m/infer", b"xyz")
    assert got.reply.body == b"frame:xyz"
    assert got.endpoint == "ep0"
    assert got.attempts == 1
    assert (a.calls, b.calls) == (1, 0)


async def test_failover_then_backoff_before_a_second_try_of_the_same_endpoint() -> None:
    world = World()
    up, (a, b) = uplink(world, dead, dead, max_attempts=4, backoff_s=0.1, backoff_max_s=1.0)
    with pytest.raises(CloudUnavailable, match="connection refused"):
        await up.post("/p", b"x")
    assert (a.calls, b.calls) == (2, 2)
    # no wait before trying the second endpoint; jittered exponential waits after
    assert len(world.sleeps) == 2
    assert 0 <= world.sleeps[0] <= 0.2
    assert 0 <= world.sleeps[1] <= 0.4


async def test_overload_answers_move_on_and_honour_retry_after() -> None:
    world = World()
    up, (a, b) = uplink(world, status(503, "0.5"), status(429, "2"), max_attempts=3)
    with pytest.raises(CloudUnavailable, match="429 nope 429"):
        await up.post("/p", b"x")
    assert (a.calls, b.calls) == (2, 1)
    assert world.sleeps == [pytest.approx(1.0)]  # Retry-After 2, capped by backoff_max_s 1
    # a 503 counts against the breaker, a 429 does not (the endpoint is alive)
    assert up.endpoints[0].breaker.failures == 2
    assert up.endpoints[1].breaker.failures == 0


@pytest.mark.parametrize("code", [400, 401, 404, 413, 415])
async def test_a_4xx_is_final_and_not_retried(code: int) -> None:
    world = World()
    up, (a, b) = uplink(world, status(code), ok)
    with pytest.raises(CloudRefused, match=f"refused the request: {code} nope {code}") as info:
        await up.post("/p", b"x")
    assert info.value.status == code
    assert info.value.http_status == 502
    assert (a.calls, b.calls) == (1, 0)


async def test_open_breakers_fail_fast_and_health_checks_bring_them_back() -> None:
    world = World()
    alive = {"ep0": False}

    def flaky(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        if not alive["ep0"]:
            raise TransportError("down")
        return Reply(200, {}, b"ok")

    up, (a,) = uplink(world, flaky, breaker_failures=2, breaker_reset_s=5.0, max_attempts=2)
    with pytest.raises(CloudUnavailable):
        await up.post("/p", b"x")
    assert up.states() == {"ep0": "open"}
    calls = a.calls
    with pytest.raises(CloudUnavailable, match="circuit breaker is open"):
        await up.post("/p", b"x")
    assert a.calls == calls  # not even tried
    await up.check_health()
    assert a.calls == calls  # still waiting out the reset
    world.t += 5.0
    alive["ep0"] = True
    rtts: list[float] = []
    await up.check_health(rtts.append)
    assert up.states() == {"ep0": "closed"}
    assert rtts == [0.0]
    assert (await up.post("/p", b"x")).endpoint == "ep0"


async def test_health_checks_open_the_breaker_of_a_dead_endpoint_before_traffic() -> None:
    world = World()
    up, _ = uplink(world, dead, ok, breaker_failures=2)
    await up.check_health()
    await up.check_health()
    assert up.states() == {"ep0": "open", "ep1": "closed"}
    got = await up.post("/p", b"x")
    assert got.endpoint == "ep1"
    assert got.attempts == 1


async def test_the_deadline_bounds_every_attempt() -> None:
    world = World()
    seen: list[float] = []

    class Slow(FunctionTransport):
        async def request(
            self, method: str, path: str, body: bytes, headers: Mapping[str, str], timeout_s: float
        ) -> Reply:
            seen.append(timeout_s)
            world.t += timeout_s
            raise TransportError("timed out", timeout=True)

    up = Uplink(
        [Slow(ok, "a"), Slow(ok, "b")],
        UplinkConfig(timeout_s=5.0, max_attempts=5),
        clock=world.clock,
        sleep=world.sleep,
    )
    with pytest.raises(CloudUnavailable):
        await up.post("/p", b"x", deadline=world.t + 7.0)
    assert seen[0] == 5.0
    assert seen[1] == pytest.approx(2.0)
    assert world.t <= 100.0 + 7.0 + 1e-9


async def test_signing_is_fresh_per_attempt_and_headers_are_sent() -> None:
    world = World()
    got: list[Mapping[str, str]] = []

    def capture(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        got.append(dict(headers))
        raise TransportError("nope")

    n = iter(range(100))
    transports = [FunctionTransport(capture, "a"), FunctionTransport(capture, "b")]
    up = Uplink(
        transports,
        UplinkConfig(max_attempts=2, priority=7),
        clock=world.clock,
        sleep=world.sleep,
        signer=lambda m, p, b: {"X-Splitinfer-Nonce": f"n{next(n)}", "X-Sig": f"{m} {p} {b!r}"},
    )
    with pytest.raises(CloudUnavailable):
        await up.post("/v1/models/m/infer", b"B", headers={"X-Trace": "t"})
    assert [h["X-Splitinfer-Nonce"] for h in got] == ["n0", "n1"]
    for h in got:
        assert h["Content-Type"] == "application/vnd.splitinfer.frame"
        assert h["X-Splitinfer-Priority"] == "7"
        assert h["X-Trace"] == "t"
        assert h["X-Sig"] == "POST /v1/models/m/infer b'B'"


def test_error_bodies_and_retry_after() -> None:
    assert error_message(Reply(400, {}, b'{"error": "bad frame", "status": 400}')) == "bad frame"
    assert error_message(Reply(500, {}, b"<html>\n oops </html>")) == "<html> oops </html>"
    assert retry_after(Reply(503, {"retry-after": "3"})) == 3.0
    assert retry_after(Reply(503, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})) == 0.0
    assert retry_after(Reply(503, {})) == 0.0


async def test_a_half_open_endpoint_gets_its_trials_and_the_rest_go_elsewhere() -> None:
    world = World()
    gate: dict[str, asyncio.Future[None]] = {}
    alive = {"ep0": False}

    class Gated(FunctionTransport):
        async def request(
            self, method: str, path: str, body: bytes, headers: Mapping[str, str], timeout_s: float
        ) -> Reply:
            if self.name == "ep0" and "trial" in gate:
                await gate["trial"]  # the trial is in flight until the test lets it go
            return await super().request(method, path, body, headers, timeout_s)

    def flaky(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        if not alive["ep0"]:
            raise TransportError("down")
        return Reply(200, {}, b"ok")

    up = Uplink(
        [Gated(flaky, "ep0"), Gated(ok, "ep1")],
        UplinkConfig(breaker_failures=1, breaker_reset_s=5.0, max_connections=1),
        clock=world.clock,
        sleep=world.sleep,
        rng=random.Random(7),
    )
    assert (await up.post("/p", b"x")).endpoint == "ep1"  # ep0 failed once: open
    world.t += 5.0
    alive["ep0"] = True
    gate["trial"] = asyncio.get_running_loop().create_future()
    trial = asyncio.ensure_future(up.post("/p", b"x"))
    await asyncio.sleep(0)  # the trial is out on ep0
    assert up.states()["ep0"] == "half-open"
    assert (await up.post("/p", b"y")).endpoint == "ep1"  # one trial per connection
    gate["trial"].set_result(None)
    assert (await trial).endpoint == "ep0"
    assert up.states()["ep0"] == "closed"


async def test_a_trial_without_a_verdict_is_given_back() -> None:
    world = World()
    replies = iter([TransportError("down"), Reply(429, {}, b"{}"), Reply(200, {}, b"ok")])

    def handler(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        r = next(replies)
        if isinstance(r, TransportError):
            raise r
        return r

    up, _ = uplink(world, handler, breaker_failures=1, breaker_reset_s=5.0, max_attempts=1)
    with pytest.raises(CloudUnavailable):
        await up.post("/p", b"x")  # opens the breaker
    world.t += 5.0
    with pytest.raises(CloudUnavailable, match="429"):
        await up.post("/p", b"x")  # the trial is told to back off: no verdict
    assert up.states()["ep0"] == "half-open"
    assert (await up.post("/p", b"x")).endpoint == "ep0"  # the next one may try at once
    assert up.states()["ep0"] == "closed"
