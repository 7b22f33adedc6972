"""Who may call the cloud service: signatures (checked from the headers before the body
is read), bytes in flight, per-device rates. Framework-free: :class:`Guard` takes the
request's method, raw path, headers and body stream, whatever front end carried them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import TracebackType

from splitinfer.cloud.config import ServiceConfig
from splitinfer.cloud.overload import RateLimiter
from splitinfer.serving.body import BodyBudget, BodyTooLarge, Reservation, read_body
from splitinfer.shared.auth import HEADER_DEVICE, CredentialStore, Verifier
from splitinfer.shared.contract import BodyStream
from splitinfer.shared.errors import ConfigError, ProtocolError
from splitinfer.shared.nonces import NonceStore, RedisNonces


class Guard:
    """Who may call: signature checks (or none with --no-auth) and per-device rates."""

    def __init__(
        self,
        config: ServiceConfig,
        store: CredentialStore | None,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.auth_enabled and store is None:
            raise ConfigError(
                "no device credentials configured: give --credentials FILE "
                "(see docs/auth.md), or --no-auth for development on loopback"
            )
        self.verifier: Verifier | None = None
        self.nonces: NonceStore | None = None
        if store is not None and not config.no_auth:
            if config.nonce_store:
                self.nonces = RedisNonces(config.nonce_store)
            self.verifier = Verifier(
                store,
                window_s=config.auth_window_s,
                audiences=config.audience,
                nonces=self.nonces,
            )
        ov = config.overload
        self.limiter = RateLimiter(ov.device_rate, ov.burst, ov.max_devices)
        self.budget = BodyBudget(config.max_inflight_bytes, config.max_device_inflight_bytes)
        self.body_timeout_s = config.body_timeout_s
        self.wall = wall
        self.clock = clock

    def incoming(
        self,
        method: str,
        raw_path: str,
        headers: Mapping[str, str],
        stream: BodyStream,
        remote: str,
        limit: int,
    ) -> Incoming:
        """``async with`` it: ``(device, body)`` of a request, checked as far as possible
        before the body is read.

        A declared size over ``limit`` is refused first (413); then the headers
        go through the signature pre-check (device, key, expiry, window,
        audience, nonce) before a byte of the body is read; the body is read
        into a reservation of bytes in flight for that device (503 beyond it),
        held until the caller is done; then the signature over the body and
        the rate limit are checked.
        """
        return Incoming(self, method, raw_path, headers, stream, remote, limit)

    async def _admit(self, request: Incoming) -> tuple[str, bytes]:
        """What ``async with guard.incoming(...)`` does on entry (see :meth:`incoming`)."""
        headers, limit = request.headers, request.limit
        method, raw_path = request.method, request.raw_path
        declared = content_length(headers)
        if declared is not None and declared > limit:
            raise BodyTooLarge(
                f"request body of {declared} bytes is over the limit of {limit} bytes"
            )
        checked = None
        if self.verifier is not None:
            checked = self.verifier.precheck(method, raw_path, headers, self.wall())
            owner = checked.cred.device_id
        else:
            owner = headers.get(HEADER_DEVICE, "")[:64] or request.remote
        held = request.held = self.budget.reservation(owner)
        if declared is not None:
            held.grow(declared)
        body = await read_body(
            request.stream,
            declared=declared,
            limit=limit,
            timeout_s=self.body_timeout_s,
            grow=held.grow,
        )
        if self.verifier is not None and checked is not None:
            device = self.verifier.finish(checked, method, raw_path, body, self.wall()).device_id
        else:
            device = headers.get(HEADER_DEVICE, "")[:64]
        self.limiter.check(device or request.remote, self.clock())
        return device, body

    def close(self) -> None:
        if isinstance(self.nonces, RedisNonces):
            self.nonces.close()


class Incoming:
    """One request passing the :class:`Guard` (``async with guard.incoming(...) as
    (device, body)``): its body's reservation of bytes in flight is held until the block
    ends, whatever happens. A plain class, not ``contextlib.asynccontextmanager``: this is
    entered once per request, and a generator-based manager costs several times more."""

    __slots__ = ("guard", "headers", "held", "limit", "method", "raw_path", "remote", "stream")

    def __init__(
        self,
        guard: Guard,
        method: str,
        raw_path: str,
        headers: Mapping[str, str],
        stream: BodyStream,
        remote: str,
        limit: int,
    ) -> None:
        self.guard = guard
        self.method = method
        self.raw_path = raw_path
        self.headers = headers
        self.stream = stream
        self.remote = remote
        self.limit = limit
        self.held: Reservation | None = None

    async def __aenter__(self) -> tuple[str, bytes]:
        try:
            return await self.guard._admit(self)
        except BaseException:
            self._release()
            raise

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._release()

    def _release(self) -> None:
        if self.held is not None:
            self.held.__exit__(None, None, None)
            self.held = None


def content_length(headers: Mapping[str, str]) -> int | None:
    """The declared body size, or None (chunked, or no body)."""
    raw = headers.get("Content-Length")
    if raw is None:
        return None
    raw = raw.strip()
    if not raw.isdigit():
        raise ProtocolError(f"Content-Length: {raw[:32]!r} is not a size")
    return int(raw)
