"""Getting a frame to some cloud endpoint: retries, failover, breakers, health checks.

:class:`Uplink` holds the configured endpoints in order of preference, each
with a :class:`~splitinfer.shared.breaker.CircuitBreaker` (the one the cloud's
versions use; after its cooldown up to ``max_connections`` trial requests at a
time, see ``shared/breaker.py``). A request goes to
the first endpoint whose breaker lets it through, preferring one not yet tried
for this request; on no answer (refused, reset, timeout) or a 5xx/429 it moves on,
with a jittered exponential backoff before it tries an endpoint a second time.
Every attempt
is signed afresh (new nonce and timestamp) and bounded by the request's
deadline; when the deadline or the attempts run out, or every breaker is
open, it raises :class:`CloudUnavailable` at once. A 4xx other than 429 is the
cloud's final word on this request (bad frame, bad signature, unknown model)
and raises :class:`CloudRefused` without retrying.

Health checks (``GET /healthz``) run in the background: they open the breaker
of an endpoint that stopped answering before any request is lost to it, close
the breaker of one that came back, and give RTT samples when the agent is idle.
The clock, the sleep and the random source are injected: tests need no time.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from splitinfer.edge.config import UplinkConfig
from splitinfer.edge.transport import Reply, Transport, TransportError
from splitinfer.shared.breaker import BreakerState, CircuitBreaker
from splitinfer.shared.contract import FRAME_TYPE, HEADER_PRIORITY, RETRY_AFTER
from splitinfer.shared.contract import error_message as _error_message
from splitinfer.shared.contract import infer_path as infer_path  # noqa: PLC0414 (pipeline's)
from splitinfer.shared.errors import ConfigError, OverloadError, SplitInferError

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]
Signer = Callable[[str, str, bytes], Mapping[str, str]]
#: Called after each attempt: (endpoint, outcome, seconds). Outcomes: ok, timeout,
#: error, overloaded, refused.
AttemptHook = Callable[[str, str, float], None]


class CloudUnavailable(OverloadError):
    """No cloud endpoint answered in time (or every breaker is open)."""

    http_status = 503


class CloudRefused(SplitInferError):
    """The cloud answered with an error that retrying will not fix (4xx)."""

    http_status = 502

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Endpoint:
    transport: Transport
    breaker: CircuitBreaker

    @property
    def name(self) -> str:
        return self.transport.name


@dataclass(frozen=True)
class Delivery:
    """A 200 answer and how it came."""

    reply: Reply
    endpoint: str
    attempts: int
    #: Seconds of the attempt that succeeded (send to last byte received).
    elapsed_s: float


def retry_after(reply: Reply) -> float:
    """Seconds from a Retry-After header (delta-seconds form), else 0."""
    try:
        value = float(reply.header(RETRY_AFTER, "0"))
    except ValueError:
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def error_message(reply: Reply) -> str:
    """The cloud's one-line error (``{"error": ...}``), or the start of the body."""
    return _error_message(reply.body)


def _summary(problems: Sequence[str]) -> str:
    """Each distinct problem once, in order, with how often it happened."""
    counts: dict[str, int] = {}
    for p in problems:
        counts[p] = counts.get(p, 0) + 1
    parts = [p if n == 1 else f"{p} (x{n})" for p, n in counts.items()]
    return "; ".join(parts) or "no attempt was possible"


class Uplink:
    """Posts frames to the first endpoint that answers; see the module docstring."""

    def __init__(
        self,
        transports: Sequence[Transport],
        config: UplinkConfig,
        *,
        signer: Signer | None = None,
        clock: Clock,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
        on_attempt: AttemptHook | None = None,
    ) -> None:
        if not transports:
            raise ConfigError("no cloud endpoint: give --cloud URL[,URL...]")
        self.config = config
        self.endpoints = [
            # half-open: as many trials as connections (for these requests the
            # alternative is failing); the cloud trusts a failing version with one
            Endpoint(
                t,
                CircuitBreaker(
                    config.breaker_failures, config.breaker_reset_s, config.max_connections
                ),
            )
            for t in transports
        ]
        self._signer = signer
        self._clock = clock
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._on_attempt = on_attempt

    # -- sending -----------------------------------------------------------------
    def _pick(self, now: float, tried: Mapping[str, int]) -> Endpoint | None:
        """The available endpoint tried least often for this request; first in order on
        ties. Its breaker's half-open trial is taken only when the request is sent."""
        allowed = [e for e in self.endpoints if e.breaker.available(now)]
        if not allowed:
            return None
        return min(allowed, key=lambda e: tried.get(e.name, 0))

    def _headers(self, path: str, body: bytes, extra: Mapping[str, str]) -> dict[str, str]:
        headers = {"Content-Type": FRAME_TYPE, **extra}
        if self.config.priority is not None:
            headers.setdefault(HEADER_PRIORITY, str(self.config.priority))
        if self._signer is not None:
            headers.update(self._signer("POST", path, body))
        return headers

    def _note(self, endpoint: str, outcome: str, seconds: float) -> None:
        if self._on_attempt is not None:
            self._on_attempt(endpoint, outcome, seconds)

    async def post(
        self,
        path: str,
        body: bytes,
        deadline: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Delivery:
        """POST ``body`` to ``path`` on some endpoint; a 200 answer or an error.

        ``deadline`` is on the injected clock; no attempt starts after it and none
        runs past it.
        """
        cfg = self.config
        tried: dict[str, int] = {}
        problems: list[str] = []
        wait_hint = 0.0
        for attempt in range(cfg.max_attempts):
            now = self._clock()
            endpoint = self._pick(now, tried)
            if endpoint is None:
                problems.append("every endpoint's circuit breaker is open")
                break
            if endpoint.name in tried:
                step = min(cfg.backoff_max_s, cfg.backoff_s * 2 ** (attempt - 1))
                delay = max(self._rng.uniform(0.0, step), min(wait_hint, cfg.backoff_max_s))
                if deadline is not None and now + delay >= deadline:
                    problems.append("the deadline leaves no time for another attempt")
                    break
                if delay > 0:
                    await self._sleep(delay)
                    now = self._clock()
            remaining = math.inf if deadline is None else deadline - now
            if remaining <= 0:
                problems.append("deadline passed")
                break
            if not endpoint.breaker.allows(now):  # its half-open trial went to another request
                problems.append(f"{endpoint.name}: its circuit breaker's one trial is out")
                continue
            tried[endpoint.name] = tried.get(endpoint.name, 0) + 1
            timeout = min(cfg.timeout_s, remaining)
            sent = self._headers(path, body, headers or {})
            t0 = self._clock()
            try:
                reply = await endpoint.transport.request("POST", path, body, sent, timeout)
            except asyncio.CancelledError:
                endpoint.breaker.release()  # no verdict: the next request may try
                raise
            except TransportError as exc:
                endpoint.breaker.record(False, self._clock())
                self._note(endpoint.name, "timeout" if exc.timeout else "error", self._clock() - t0)
                problems.append(str(exc))
                continue
            elapsed = self._clock() - t0
            if reply.status == 200:
                endpoint.breaker.record(True, self._clock())
                self._note(endpoint.name, "ok", elapsed)
                return Delivery(reply, endpoint.name, attempt + 1, elapsed)
            message = error_message(reply)
            if reply.status == 429 or reply.status >= 500:
                if reply.status >= 500:
                    endpoint.breaker.record(False, self._clock())
                else:  # shedding load is no verdict on the endpoint's health
                    endpoint.breaker.release()
                self._note(endpoint.name, "overloaded", elapsed)
                wait_hint = retry_after(reply)
                problems.append(f"{endpoint.name}: {reply.status} {message}")
                continue
            endpoint.breaker.record(True, self._clock())  # it answered: it is up
            self._note(endpoint.name, "refused", elapsed)
            raise CloudRefused(
                f"cloud {endpoint.name} refused the request: {reply.status} {message}",
                reply.status,
            )
        raise CloudUnavailable(f"no cloud endpoint answered ({_summary(problems)})")

    # -- health ------------------------------------------------------------------
    async def check_health(self, on_rtt: Callable[[float], None] | None = None) -> None:
        """One round of ``GET /healthz`` on every endpoint not waiting out its breaker."""

        async def one(endpoint: Endpoint) -> None:
            now = self._clock()
            if not endpoint.breaker.allows(now):
                return
            timeout = min(self.config.timeout_s, self.config.health_interval_s)
            t0 = self._clock()
            try:
                reply = await endpoint.transport.request("GET", "/healthz", b"", {}, timeout)
            except TransportError:
                endpoint.breaker.record(False, self._clock())
                return
            if reply.status == 200:
                endpoint.breaker.record(True, self._clock())
                if on_rtt is not None:
                    on_rtt(self._clock() - t0)
            else:
                endpoint.breaker.record(False, self._clock())

        await asyncio.gather(*(one(e) for e in self.endpoints))

    def states(self) -> dict[str, BreakerState]:
        now = self._clock()
        return {e.name: e.breaker.state(now) for e in self.endpoints}

    def any_available(self) -> bool:
        now = self._clock()
        return any(e.breaker.available(now) for e in self.endpoints)
