"""Where the cloud remembers accepted nonces: in this process, or in Redis for replicas.

:class:`MemoryNonces` is the per-process default (a dict and an expiry heap,
bounded); :class:`RedisNonces` is shared by replicas that accept the same
frames. docs/auth.md says what each guarantees.
"""

from __future__ import annotations

import heapq
from typing import Protocol

from splitinfer.shared.errors import AuthError, ConfigError, OverloadError, ReplayCacheFullError


class NonceStore(Protocol):
    """Where accepted ``(device, nonce)`` pairs are remembered until they leave the window."""

    def seen(self, ident: tuple[str, str]) -> bool:
        """Whether the pair was already accepted (a cheap look-up before the body is read)."""
        ...

    def add(self, ident: tuple[str, str], expires: float, horizon: float) -> None:
        """Remember the pair until ``expires``; :class:`AuthError` if it is already there."""
        ...


class MemoryNonces:
    """The per-process store: a dict and an expiry heap, at most ``max_nonces`` entries."""

    def __init__(self, max_nonces: int = 100_000) -> None:
        if max_nonces < 1:
            raise ConfigError(f"max_nonces={max_nonces}: must be at least 1")
        self.max_nonces = max_nonces
        self._seen: dict[tuple[str, str], float] = {}
        self._expiry: list[tuple[float, tuple[str, str]]] = []

    def __len__(self) -> int:
        return len(self._seen)

    def seen(self, ident: tuple[str, str]) -> bool:
        expires = self._seen.get(ident)
        return expires is not None

    def add(self, ident: tuple[str, str], expires: float, horizon: float) -> None:
        while self._expiry and self._expiry[0][0] < horizon:
            _, old = heapq.heappop(self._expiry)
            del self._seen[old]
        if ident in self._seen:
            raise AuthError(f"nonce {ident[1]!r} was already used (replay)")
        if len(self._seen) >= self.max_nonces:
            raise ReplayCacheFullError(
                f"replay cache full ({self.max_nonces} nonces within the window); retry later"
            )
        self._seen[ident] = expires
        heapq.heappush(self._expiry, (expires, ident))


class NonceStoreDown(OverloadError):
    """The shared nonce store cannot be reached: refuse (503) rather than accept replays."""

    http_status = 503


class RedisNonces:
    """A nonce store shared by replicas: ``SET key 1 NX PXAT expiry`` in Redis.

    Replicas that share an audience (and so accept the same frames) must share
    this store for a replay to be refused by all of them. Keys expire in Redis
    itself when their window ends; nothing grows without bound. If Redis cannot
    be reached the request is refused with 503 (:class:`NonceStoreDown`), never
    accepted unchecked.
    """

    def __init__(self, url: str, prefix: str = "splitinfer:nonce:", timeout_s: float = 1.0):
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - the extra is not installed
            raise ConfigError(
                f"nonce_store={url!r} needs the redis client: pip install 'splitinfer[redis]'"
            ) from exc
        self.url = url
        self.prefix = prefix
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        try:
            self.client = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
            )
        except ValueError as exc:
            raise ConfigError(f"nonce_store={url!r}: {exc}") from exc

    def _key(self, ident: tuple[str, str]) -> str:
        return f"{self.prefix}{ident[0]}:{ident[1]}"

    def seen(self, ident: tuple[str, str]) -> bool:
        try:
            return bool(self.client.exists(self._key(ident)))
        except self._errors as exc:
            raise NonceStoreDown(f"nonce store {self.url} unreachable: {exc}; retry") from None

    def add(self, ident: tuple[str, str], expires: float, horizon: float) -> None:
        try:
            fresh = self.client.set(self._key(ident), b"1", nx=True, pxat=int(expires * 1000) + 1)
        except self._errors as exc:
            raise NonceStoreDown(f"nonce store {self.url} unreachable: {exc}; retry") from None
        if not fresh:
            raise AuthError(f"nonce {ident[1]!r} was already used (replay)")

    def close(self) -> None:
        self.client.close()
