"""Device authentication for the edge -> cloud HTTP requests.

Each device holds its own credentials (a device id, a key id and a secret); the
cloud holds them all in a TOML file loaded into a :class:`CredentialStore`. The
edge signs every request with :func:`sign`; the cloud checks it with
:class:`Verifier`, which also keeps a bounded cache of recent nonces to refuse
replays. Time is always passed in (``now``, Unix seconds), so nothing here
reads a clock. :func:`server_ssl_context` and :func:`client_ssl_context` build
the TLS contexts for the HTTP layer. The formats are described in
``docs/auth.md``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import re
import secrets
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from splitinfer.shared.errors import AuthError, ConfigError
from splitinfer.shared.nonces import MemoryNonces, NonceStore

log = logging.getLogger("splitinfer.auth")

HEADER_DEVICE = "X-Splitinfer-Device"
HEADER_KEY = "X-Splitinfer-Key"
HEADER_TIMESTAMP = "X-Splitinfer-Timestamp"
HEADER_NONCE = "X-Splitinfer-Nonce"
HEADER_SIGNATURE = "X-Splitinfer-Signature"
HEADER_AUDIENCE = "X-Splitinfer-Audience"  # auth v2: the service the request is for
HEADERS = (HEADER_DEVICE, HEADER_KEY, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE)

#: Shortest secret accepted from a credential file (bytes).
MIN_SECRET_BYTES = 16

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NONCE = re.compile(r"[A-Za-z0-9_-]{16,128}")
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
_SIGNATURE = re.compile(r"[0-9a-f]{64}")
_METHOD = re.compile(r"[A-Z]{1,16}")
#: printable ASCII without spaces (a URL or a name), at most 256 characters
_AUDIENCE = re.compile(r"[!-~]{1,256}")


@dataclass(frozen=True)
class Credential:
    """One key of one device. ``not_after`` (Unix seconds) ends its validity."""

    device_id: str
    key_id: str
    secret: bytes = field(repr=False)
    not_after: float | None = None

    def expired(self, now: float) -> bool:
        return self.not_after is not None and now > self.not_after


class CredentialStore:
    """The credentials of every device, looked up by ``(device_id, key_id)``."""

    def __init__(self, credentials: Iterable[Credential]) -> None:
        self._by_id: dict[tuple[str, str], Credential] = {}
        self._devices: set[str] = set()
        for cred in credentials:
            ident = (cred.device_id, cred.key_id)
            if ident in self._by_id:
                raise ConfigError(f"duplicate key {cred.key_id!r} for device {cred.device_id!r}")
            self._by_id[ident] = cred
            self._devices.add(cred.device_id)

    @classmethod
    def from_file(cls, path: Path | str) -> CredentialStore:
        """Load a credential file; any problem is a one-line :class:`ConfigError`."""
        from splitinfer.shared.options import load_toml

        path = Path(path)
        _check_private(path)
        return cls(_parse(load_toml(path, "credential file"), str(path)))

    def get(self, device_id: str, key_id: str) -> Credential | None:
        return self._by_id.get((device_id, key_id))

    @property
    def devices(self) -> list[str]:
        """The device ids, in the order the credentials came (a file's order)."""
        return list(dict.fromkeys(d for d, _ in self._by_id))

    def keys_of(self, device_id: str) -> list[Credential]:
        """A device's credentials, in the order they came (a file lists the newest last)."""
        return [c for (d, _), c in self._by_id.items() if d == device_id]

    def has_device(self, device_id: str) -> bool:
        return device_id in self._devices

    def __len__(self) -> int:
        return len(self._by_id)


def _check_private(path: Path) -> None:
    """Warn loudly, as ssh does, when a credential file is readable by group or others."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # reading it fails next, with the reason
    if os.name == "posix" and mode & 0o077:
        log.warning(
            "%s: credential file is accessible by group or others (mode %04o): anyone on this "
            "machine can read the device secrets; chmod 600 %s",
            path,
            mode & 0o777,
            path,
        )


def _parse(data: dict[str, Any], src: str) -> list[Credential]:
    extra = sorted(set(data) - {"devices"})
    if extra:
        raise ConfigError(f"{src}: {extra[0]}: unknown field (expected only [devices.*])")
    devices = data.get("devices")
    if not isinstance(devices, dict) or not devices:
        raise ConfigError(f"{src}: devices: missing or empty; add a [devices.<id>] table")
    creds: list[Credential] = []
    for device_id, device in devices.items():
        where = f"devices.{device_id}"
        if not _ID.fullmatch(device_id):
            raise ConfigError(f"{src}: {where}: device id must match {_ID.pattern}")
        if not isinstance(device, dict):
            raise ConfigError(f"{src}: {where}: must be a table")
        extra = sorted(set(device) - {"keys"})
        if extra:
            raise ConfigError(f"{src}: {where}.{extra[0]}: unknown field")
        keys = device.get("keys")
        if not isinstance(keys, list) or not keys:
            raise ConfigError(f"{src}: {where}.keys: missing; add a [[{where}.keys]] entry")
        seen: set[str] = set()
        for i, key in enumerate(keys):
            cred = _parse_key(key, device_id, f"{src}: {where}.keys[{i}]")
            if cred.key_id in seen:
                raise ConfigError(f"{src}: {where}.keys[{i}].id: duplicate key id {cred.key_id!r}")
            seen.add(cred.key_id)
            creds.append(cred)
    return creds


def _parse_key(key: Any, device_id: str, where: str) -> Credential:
    if not isinstance(key, dict):
        raise ConfigError(f"{where}: must be a table")
    extra = sorted(set(key) - {"id", "secret", "not_after"})
    if extra:
        raise ConfigError(f"{where}.{extra[0]}: unknown field")
    key_id = key.get("id")
    if not isinstance(key_id, str):
        raise ConfigError(f"{where}.id: missing or not a string")
    if not _ID.fullmatch(key_id):
        raise ConfigError(f"{where}.id: key id must match {_ID.pattern}")
    secret = key.get("secret")
    if not isinstance(secret, str):
        raise ConfigError(f"{where}.secret: missing or not a string")
    return Credential(
        device_id, key_id, _decode_secret(secret, f"{where}.secret"), _not_after(key, where)
    )


def _decode_secret(text: str, where: str) -> bytes:
    kind, sep, payload = text.partition(":")
    if not sep or kind not in ("base64", "hex"):
        raise ConfigError(f"{where}: must start with 'base64:' or 'hex:'")
    try:
        raw = (
            base64.b64decode(payload, validate=True) if kind == "base64" else bytes.fromhex(payload)
        )
    except (binascii.Error, ValueError) as exc:
        raise ConfigError(f"{where}: not valid {kind}") from exc
    if len(raw) < MIN_SECRET_BYTES:
        raise ConfigError(f"{where}: {len(raw)} bytes; at least {MIN_SECRET_BYTES} are needed")
    return raw


def _not_after(key: dict[str, Any], where: str) -> float | None:
    value = key.get("not_after")
    if value is None:
        return None
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.timestamp()
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(
        f"{where}.not_after: must be Unix seconds or a datetime with an offset "
        "(e.g. 2026-01-01T00:00:00Z)"
    )


def generate_credential(device_id: str, key_id: str, not_after: float | None = None) -> Credential:
    """A fresh credential with a random 32-byte secret."""
    for name, value in (("device id", device_id), ("key id", key_id)):
        if not _ID.fullmatch(value):
            raise ConfigError(f"{name} {value!r} must match {_ID.pattern}")
    return Credential(device_id, key_id, secrets.token_bytes(32), not_after)


def render_toml(cred: Credential) -> str:
    """The ``[[devices.<id>.keys]]`` entry for ``cred``, to paste into a credential file."""
    lines = [
        f'[[devices."{cred.device_id}".keys]]',
        f'id = "{cred.key_id}"',
        f'secret = "base64:{base64.b64encode(cred.secret).decode("ascii")}"',
    ]
    if cred.not_after is not None:
        lines.append(f"not_after = {int(cred.not_after)}")
    return "\n".join(lines) + "\n"


def canonical_string(
    method: str,
    path: str,
    timestamp: str,
    nonce: str,
    body: bytes,
    audience: str | None = None,
    *,
    digest: str | None = None,
) -> bytes:
    """What is signed: method, path, timestamp, nonce, body digest (and audience), one per line.

    Without ``audience`` this is the auth v1 string (five lines); with it, v2
    appends the audience as a sixth line (see docs/auth.md).
    """
    digest = hashlib.sha256(body).hexdigest() if digest is None else digest
    text = f"{method.upper()}\n{path}\n{timestamp}\n{nonce}\n{digest}"
    if audience is not None:
        text += f"\n{audience}"
    return text.encode()


def _mac(secret: bytes, message: bytes) -> str:
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign(
    method: str,
    path: str,
    body: bytes,
    credential: Credential,
    now: float,
    nonce: str | None = None,
    audience: str | None = None,
) -> dict[str, str]:
    """The headers that authenticate one request (``path`` includes any query string).

    ``audience`` (auth v2): the service the request is meant for, e.g. the
    endpoint's base URL; sent as ``X-Splitinfer-Audience`` and signed, so a
    service configured with another audience refuses the request.
    """
    nonce = secrets.token_hex(16) if nonce is None else nonce
    if not _METHOD.fullmatch(method.upper()):
        raise AuthError(f"method {method[:16]!r} is not an HTTP method")
    if not _NONCE.fullmatch(nonce):
        raise AuthError(f"nonce must match {_NONCE.pattern}")
    if "\n" in path or "\r" in path:
        raise AuthError("path must not contain a line break")
    if audience is not None and not _AUDIENCE.fullmatch(audience):
        raise AuthError(f"audience {audience[:64]!r} must match {_AUDIENCE.pattern}")
    timestamp = str(int(now))
    message = canonical_string(method, path, timestamp, nonce, body, audience)
    headers = {
        HEADER_DEVICE: credential.device_id,
        HEADER_KEY: credential.key_id,
        HEADER_TIMESTAMP: timestamp,
        HEADER_NONCE: nonce,
        HEADER_SIGNATURE: _mac(credential.secret, message),
    }
    if audience is not None:
        headers[HEADER_AUDIENCE] = audience
    return headers


def audience_of(url: str) -> str:
    """The audience an endpoint's base URL stands for: the URL without a trailing slash."""
    return url.rstrip("/")


class _Checked:
    """A request whose headers passed :meth:`Verifier.precheck`; the body is still to come."""

    __slots__ = ("audience", "cred", "nonce", "signature", "timestamp")

    def __init__(
        self, cred: Credential, timestamp: str, nonce: str, signature: str, audience: str | None
    ) -> None:
        self.cred = cred
        self.timestamp = timestamp
        self.nonce = nonce
        self.signature = signature
        self.audience = audience


#: The one 401 reason for an unknown device or an unknown key: a prober cannot
#: tell which device ids exist.
UNKNOWN_CREDENTIAL = "unknown device or key"


class Verifier:
    """Checks signed requests against a store; remembers nonces to refuse replays.

    A request is accepted when its timestamp is within ``window_s`` of ``now``,
    so a nonce is remembered until its timestamp plus ``window_s``. The
    per-process store holds at most ``max_nonces``; when all are still needed,
    requests are refused with :class:`ReplayCacheFullError` (503) instead of
    growing the cache. ``nonces`` replaces that store (e.g. ``shared.nonces.RedisNonces``,
    shared by replicas). ``audiences``, when given, are the only
    ``X-Splitinfer-Audience`` values accepted, and the header is then required.

    :meth:`precheck` checks everything the headers alone can tell (before the
    body is read); :meth:`finish` checks the signature over the body and
    remembers the nonce; :meth:`verify` does both.
    """

    def __init__(
        self,
        store: CredentialStore,
        window_s: float = 30,
        max_nonces: int = 100_000,
        *,
        audiences: Iterable[str] = (),
        nonces: NonceStore | None = None,
    ) -> None:
        if window_s <= 0:
            raise ConfigError(f"window_s={window_s}: must be positive")
        self.store = store
        self.window_s = float(window_s)
        self.audiences = frozenset(audience_of(a) for a in audiences)
        self.nonces: NonceStore = nonces if nonces is not None else MemoryNonces(max_nonces)
        # Latest `now` used to evict: a request older than this minus the window
        # is refused even if the clock steps back, as its nonce may be forgotten.
        self._horizon = float("-inf")

    def __len__(self) -> int:
        return len(self.nonces)  # type: ignore[arg-type]

    def verify(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes, now: float
    ) -> Credential:
        """The credential that signed this request, or :class:`AuthError` saying why not."""
        return self.finish(self.precheck(method, path, headers, now), method, path, body, now)

    def precheck(self, method: str, path: str, headers: Mapping[str, str], now: float) -> _Checked:
        """Headers, credential, expiry, window, audience and nonce: all but the signature."""
        values = _headers(headers)
        device_id, key_id = values[HEADER_DEVICE], values[HEADER_KEY]
        timestamp, nonce = values[HEADER_TIMESTAMP], values[HEADER_NONCE]
        audience = values.get(HEADER_AUDIENCE)
        if not _METHOD.fullmatch(method.upper()):
            raise AuthError(f"method {method[:16]!r} is not an HTTP method")
        if "\n" in path or "\r" in path:
            raise AuthError("path contains a line break")
        cred = self.store.get(device_id, key_id)
        if cred is None:
            raise AuthError(UNKNOWN_CREDENTIAL)
        if cred.expired(now):
            raise AuthError(f"key {key_id!r} of device {device_id!r} has expired")
        ts = int(timestamp)
        if abs(ts - now) > self.window_s or ts + self.window_s < self._horizon:
            raise AuthError(f"timestamp {ts} is outside the {self.window_s:g} s window")
        if self.audiences:
            if audience is None:
                raise AuthError(
                    f"header {HEADER_AUDIENCE} is missing: this service accepts only "
                    "signatures bound to its audience (auth v2, docs/auth.md)"
                )
            if audience_of(audience) not in self.audiences:
                raise AuthError(f"audience {audience!r} is not this service (wrong audience)")
        if self.nonces.seen((device_id, nonce)):
            raise AuthError(f"nonce {nonce!r} was already used (replay)")
        return _Checked(cred, timestamp, nonce, values[HEADER_SIGNATURE], audience)

    def finish(
        self,
        checked: _Checked,
        method: str,
        path: str,
        body: bytes,
        now: float,
        *,
        digest: str | None = None,
    ) -> Credential:
        """The signature over the body (or its sha256 ``digest``), then the nonce."""
        cred = checked.cred
        message = canonical_string(
            method, path, checked.timestamp, checked.nonce, body, checked.audience, digest=digest
        )
        expected = _mac(cred.secret, message)
        if not hmac.compare_digest(expected.encode(), checked.signature.encode()):
            raise AuthError("signature does not match")
        self._horizon = max(self._horizon, now)
        expires = int(checked.timestamp) + self.window_s
        self.nonces.add((cred.device_id, checked.nonce), expires, self._horizon)
        return cred


def _headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The auth headers, looked up case-insensitively; each once and well formed."""
    wanted = {name.lower(): name for name in (*HEADERS, HEADER_AUDIENCE)}
    found: dict[str, str] = {}
    for name, value in headers.items():
        canonical = wanted.get(name.lower())
        if canonical is None:
            continue
        if canonical in found:
            raise AuthError(f"header {canonical} given more than once")
        found[canonical] = value
    checks = (
        (HEADER_DEVICE, _ID),
        (HEADER_KEY, _ID),
        (HEADER_TIMESTAMP, _TIMESTAMP),
        (HEADER_NONCE, _NONCE),
        (HEADER_SIGNATURE, _SIGNATURE),
    )
    for name, pattern in checks:
        if name not in found:
            raise AuthError(f"header {name} is missing")
        if not pattern.fullmatch(found[name]):
            raise AuthError(f"header {name} is malformed (must match {pattern.pattern})")
    if HEADER_AUDIENCE in found and not _AUDIENCE.fullmatch(found[HEADER_AUDIENCE]):
        raise AuthError(f"header {HEADER_AUDIENCE} is malformed (must match {_AUDIENCE.pattern})")
    return found


def _existing(path: Path | str, flag: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{flag} {path}: no such file")
    return path


def _ssl_reason(exc: Exception) -> str:
    reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc)
    return " ".join(str(reason).split())


def server_ssl_context(cert: Path | str, key: Path | str) -> ssl.SSLContext:
    """The cloud service's TLS context (``--tls-cert FILE --tls-key FILE``)."""
    cert_path, key_path = _existing(cert, "--tls-cert"), _existing(key, "--tls-key")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_path, key_path)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"--tls-cert {cert_path} --tls-key {key_path}: cannot load ({_ssl_reason(exc)}); "
            "both must be PEM files and the key must match the certificate"
        ) from exc
    return ctx


def client_ssl_context(ca_file: Path | str | None = None) -> ssl.SSLContext:
    """The edge agent's TLS context: the system CAs, or only ``--ca-file`` when given."""
    if ca_file is None:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    else:
        ca_path = _existing(ca_file, "--ca-file")
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_path))
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"--ca-file {ca_path}: cannot load: {_ssl_reason(exc)}") from exc
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx
