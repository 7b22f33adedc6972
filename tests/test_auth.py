"""Device authentication: credential files, request signing, replay window, TLS contexts."""

from __future__ import annotations

import base64
import ssl
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitinfer.shared.auth import (
    HEADER_AUDIENCE,
    HEADER_DEVICE,
    HEADER_KEY,
    HEADER_NONCE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    UNKNOWN_CREDENTIAL,
    Credential,
    CredentialStore,
    Verifier,
    client_ssl_context,
    generate_credential,
    render_toml,
    server_ssl_context,
    sign,
)
from splitinfer.shared.errors import AuthError, ConfigError, OverloadError, ReplayCacheFullError

pytestmark = pytest.mark.unit

NOW = 1_750_000_000.0
CAM = Credential("cam-01", "k1", b"\x01" * 32)
CAM_NEW = Credential("cam-01", "k2", b"\x02" * 32)
CAM_OLD = Credential("cam-01", "k0", b"\x03" * 32, not_after=NOW - 1)
OTHER = Credential("cam-02", "k1", b"\x04" * 32)
PATH = "/v1/infer/demo?version=1"
BODY = b"\x00frame bytes\xff" * 10


def store() -> CredentialStore:
    return CredentialStore([CAM, CAM_NEW, CAM_OLD, OTHER])


def nonce(i: int) -> str:
    return f"nonce-{i:016d}"


# --- signing and verifying ---------------------------------------------------


def test_round_trip_returns_the_signing_credential() -> None:
    headers = sign("post", PATH, BODY, CAM, NOW)
    assert set(headers) == {
        HEADER_DEVICE,
        HEADER_KEY,
        HEADER_TIMESTAMP,
        HEADER_NONCE,
        HEADER_SIGNATURE,
    }
    assert Verifier(store()).verify("POST", PATH, headers, BODY, NOW + 5) == CAM


def test_headers_are_looked_up_case_insensitively() -> None:
    headers = {k.lower(): v for k, v in sign("POST", PATH, BODY, CAM, NOW).items()}
    assert Verifier(store()).verify("POST", PATH, headers, BODY, NOW) == CAM


def test_default_nonces_differ() -> None:
    assert (
        sign("POST", PATH, BODY, CAM, NOW)[HEADER_NONCE]
        != (sign("POST", PATH, BODY, CAM, NOW)[HEADER_NONCE])
    )


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("PUT", PATH, BODY),
        ("POST", "/v1/infer/other?version=1", BODY),
        ("POST", "/v1/infer/demo?version=2", BODY),
        ("POST", PATH, BODY + b"!"),
        ("POST", PATH, b""),
    ],
)
def test_tampered_request_is_rejected(method: str, path: str, body: bytes) -> None:
    headers = sign("POST", PATH, BODY, CAM, NOW)
    with pytest.raises(AuthError, match="signature does not match"):
        Verifier(store()).verify(method, path, headers, body, NOW)


@pytest.mark.parametrize(
    ("header", "value"),
    [
        (HEADER_TIMESTAMP, str(int(NOW) + 1)),
        (HEADER_NONCE, nonce(99)),
        (HEADER_KEY, "k2"),
        (HEADER_DEVICE, "cam-02"),
    ],
)
def test_tampered_header_is_rejected(header: str, value: str) -> None:
    headers = sign("POST", PATH, BODY, CAM, NOW, nonce=nonce(1)) | {header: value}
    with pytest.raises(AuthError, match="signature does not match"):
        Verifier(store()).verify("POST", PATH, headers, BODY, NOW)


def test_tampered_signature_is_rejected_without_revealing_the_expected_one() -> None:
    headers = sign("POST", PATH, BODY, CAM, NOW)
    good = headers[HEADER_SIGNATURE]
    headers[HEADER_SIGNATURE] = ("0" if good[0] != "0" else "1") + good[1:]
    with pytest.raises(AuthError) as info:
        Verifier(store()).verify("POST", PATH, headers, BODY, NOW)
    assert str(info.value) == "signature does not match"
    assert good not in str(info.value)


@pytest.mark.parametrize("missing", [HEADER_DEVICE, HEADER_NONCE, HEADER_SIGNATURE])
def test_missing_header_is_named(missing: str) -> None:
    headers = sign("POST", PATH, BODY, CAM, NOW)
    del headers[missing]
    with pytest.raises(AuthError, match=f"header {missing} is missing"):
        Verifier(store()).verify("POST", PATH, headers, BODY, NOW)


@pytest.mark.parametrize(
    ("header", "value"),
    [
        (HEADER_TIMESTAMP, "-5"),
        (HEADER_TIMESTAMP, "1e9"),
        (HEADER_NONCE, "short"),
        (HEADER_NONCE, "x" * 16 + "\n"),
        (HEADER_SIGNATURE, "AB" * 32),
        (HEADER_DEVICE, "cam 01"),
    ],
)
def test_malformed_header_is_rejected(header: str, value: str) -> None:
    headers = sign("POST", PATH, BODY, CAM, NOW) | {header: value}
    with pytest.raises(AuthError, match=f"header {header} is malformed"):
        Verifier(store()).verify("POST", PATH, headers, BODY, NOW)


def test_header_given_twice_is_rejected() -> None:
    headers = sign("POST", PATH, BODY, CAM, NOW)
    headers[HEADER_KEY.lower()] = "k2"
    with pytest.raises(AuthError, match="more than once"):
        Verifier(store()).verify("POST", PATH, headers, BODY, NOW)


def test_bad_method_and_path_are_refused_when_signing() -> None:
    with pytest.raises(AuthError, match="not an HTTP method"):
        sign("PO ST", PATH, BODY, CAM, NOW)
    with pytest.raises(AuthError, match="line break"):
        sign("POST", "/a\nb", BODY, CAM, NOW)
    with pytest.raises(AuthError, match="nonce must match"):
        sign("POST", PATH, BODY, CAM, NOW, nonce="a:b")


def test_unknown_device_and_unknown_key_get_one_message() -> None:
    """A prober cannot tell which device ids exist from the 401's reason."""
    stranger = Credential("cam-99", "k1", b"\x01" * 32)
    lost = Credential("cam-01", "k9", b"\x01" * 32)
    reasons = []
    for cred in (stranger, lost):
        with pytest.raises(AuthError) as info:
            Verifier(store()).verify("POST", PATH, sign("POST", PATH, BODY, cred, NOW), BODY, NOW)
        reasons.append(str(info.value))
    assert reasons == [UNKNOWN_CREDENTIAL, UNKNOWN_CREDENTIAL]
    assert "cam" not in UNKNOWN_CREDENTIAL


def test_precheck_refuses_from_the_headers_alone() -> None:
    """Everything but the body's digest is checked before the body exists."""
    verifier = Verifier(store(), window_s=30)
    headers = sign("POST", PATH, BODY, CAM, NOW, nonce=nonce(1))
    checked = verifier.precheck("POST", PATH, headers, NOW)
    assert verifier.finish(checked, "POST", PATH, BODY, NOW) == CAM
    with pytest.raises(AuthError, match="replay"):  # a used nonce: refused before the body
        verifier.precheck("POST", PATH, headers, NOW)
    with pytest.raises(AuthError, match="window"):
        verifier.precheck("POST", PATH, sign("POST", PATH, BODY, CAM, NOW - 60), NOW)
    fresh = verifier.precheck("POST", PATH, sign("POST", PATH, BODY, CAM, NOW), NOW)
    with pytest.raises(AuthError, match="signature"):
        verifier.finish(fresh, "POST", PATH, BODY + b"x", NOW)


def test_a_signature_bound_to_one_audience_is_refused_by_another() -> None:
    a = Verifier(store(), audiences=["http://cloud-a:8080"])
    b = Verifier(store(), audiences=["http://cloud-b:8080/"])
    headers = sign("POST", PATH, BODY, CAM, NOW, audience="http://cloud-a:8080")
    assert headers[HEADER_AUDIENCE] == "http://cloud-a:8080"
    with pytest.raises(AuthError, match="wrong audience"):
        b.verify("POST", PATH, headers, BODY, NOW)
    assert a.verify("POST", PATH, headers, BODY, NOW) == CAM
    # relabelling the audience header breaks the signature
    forged = {**sign("POST", PATH, BODY, CAM, NOW, audience="http://cloud-a:8080")}
    forged[HEADER_AUDIENCE] = "http://cloud-b:8080"
    with pytest.raises(AuthError, match="signature does not match"):
        b.verify("POST", PATH, forged, BODY, NOW)
    # a bound service refuses v1 (unbound) signatures; an unbound one still takes them
    with pytest.raises(AuthError, match="Audience is missing"):
        a.verify("POST", PATH, sign("POST", PATH, BODY, CAM, NOW), BODY, NOW)
    assert Verifier(store()).verify("POST", PATH, sign("POST", PATH, BODY, CAM, NOW), BODY, NOW)


def test_other_devices_secret_does_not_sign_for_this_device() -> None:
    forged = Credential("cam-01", "k1", OTHER.secret)
    with pytest.raises(AuthError, match="signature does not match"):
        Verifier(store()).verify("POST", PATH, sign("POST", PATH, BODY, forged, NOW), BODY, NOW)


# --- replay window -----------------------------------------------------------


def test_replay_is_rejected() -> None:
    verifier = Verifier(store())
    headers = sign("POST", PATH, BODY, CAM, NOW)
    verifier.verify("POST", PATH, headers, BODY, NOW)
    with pytest.raises(AuthError, match="already used"):
        verifier.verify("POST", PATH, headers, BODY, NOW + 1)


def test_same_nonce_from_two_devices_is_not_a_replay() -> None:
    verifier = Verifier(store())
    verifier.verify("POST", PATH, sign("POST", PATH, BODY, CAM, NOW, nonce(1)), BODY, NOW)
    verifier.verify("POST", PATH, sign("POST", PATH, BODY, OTHER, NOW, nonce(1)), BODY, NOW)


def test_rejected_request_does_not_burn_its_nonce() -> None:
    verifier = Verifier(store())
    headers = sign("POST", PATH, BODY, CAM, NOW)
    with pytest.raises(AuthError, match="signature"):
        verifier.verify("POST", PATH, headers, BODY + b"x", NOW)
    assert verifier.verify("POST", PATH, headers, BODY, NOW) == CAM


@pytest.mark.parametrize("skew", [-31.0, 31.0, -3600.0, 1e6])
def test_timestamp_outside_window_is_rejected(skew: float) -> None:
    headers = sign("POST", PATH, BODY, CAM, NOW)
    with pytest.raises(AuthError, match="outside the 30 s window"):
        Verifier(store(), window_s=30).verify("POST", PATH, headers, BODY, NOW - skew)


@pytest.mark.parametrize("skew", [-30.0, 0.0, 30.0])
def test_timestamp_on_window_edge_is_accepted(skew: float) -> None:
    headers = sign("POST", PATH, BODY, CAM, NOW)
    assert Verifier(store(), window_s=30).verify("POST", PATH, headers, BODY, NOW + skew) == CAM


def test_replay_after_clock_steps_back_is_rejected() -> None:
    verifier = Verifier(store(), window_s=30)
    headers = sign("POST", PATH, BODY, CAM, NOW)
    verifier.verify("POST", PATH, headers, BODY, NOW)
    # a later request evicts the first nonce ...
    later = sign("POST", PATH, BODY, CAM, NOW + 100)
    verifier.verify("POST", PATH, later, BODY, NOW + 100)
    assert len(verifier) == 1
    # ... so when the clock steps back, the old request must still be refused
    with pytest.raises(AuthError, match="outside"):
        verifier.verify("POST", PATH, headers, BODY, NOW + 10)


def test_replay_cache_is_bounded_and_evicts_old_nonces() -> None:
    verifier = Verifier(store(), window_s=30, max_nonces=3)
    for i in range(3):
        verifier.verify("POST", PATH, sign("POST", PATH, BODY, CAM, NOW, nonce(i)), BODY, NOW)
    full = sign("POST", PATH, BODY, CAM, NOW, nonce(3))
    with pytest.raises(ReplayCacheFullError, match="replay cache full") as info:
        verifier.verify("POST", PATH, full, BODY, NOW + 10)
    assert isinstance(info.value, AuthError)
    assert isinstance(info.value, OverloadError)
    assert info.value.http_status == 503
    assert len(verifier) == 3
    # once the first three leave the window they are evicted and room is made
    fresh = sign("POST", PATH, BODY, CAM, NOW + 31, nonce(4))
    assert verifier.verify("POST", PATH, fresh, BODY, NOW + 31) == CAM
    assert len(verifier) == 1


def test_verifier_rejects_bad_settings() -> None:
    with pytest.raises(ConfigError, match="window_s"):
        Verifier(store(), window_s=0)
    with pytest.raises(ConfigError, match="max_nonces"):
        Verifier(store(), max_nonces=0)


# --- key rotation --------------------------------------------------------------


def test_rotation_old_and_new_keys_both_valid() -> None:
    verifier = Verifier(store())
    assert verifier.verify("POST", PATH, sign("POST", PATH, BODY, CAM, NOW), BODY, NOW) == CAM
    new = sign("POST", PATH, BODY, CAM_NEW, NOW)
    assert verifier.verify("POST", PATH, new, BODY, NOW) == CAM_NEW


def test_expired_key_is_refused() -> None:
    headers = sign("POST", PATH, BODY, CAM_OLD, NOW)
    with pytest.raises(AuthError, match="key 'k0' of device 'cam-01' has expired"):
        Verifier(store()).verify("POST", PATH, headers, BODY, NOW)
    # before its not_after it was fine
    early = sign("POST", PATH, BODY, CAM_OLD, NOW - 1)
    assert Verifier(store()).verify("POST", PATH, early, BODY, NOW - 1) == CAM_OLD


# --- credential files --------------------------------------------------------


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


GOOD_FILE = f"""
[[devices.cam-01.keys]]
id = "k1"
secret = "base64:{b64(b"a" * 32)}"
not_after = 2026-01-01T00:00:00Z

[[devices.cam-01.keys]]
id = "k2"
secret = "hex:{(b"b" * 32).hex()}"

[[devices."cam-02".keys]]
id = "k1"
secret = "base64:{b64(b"c" * 16)}"
not_after = 1767225600
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "credentials.toml"
    path.write_text(text)
    return path


def test_credential_file_loads(tmp_path: Path) -> None:
    loaded = CredentialStore.from_file(write(tmp_path, GOOD_FILE))
    assert len(loaded) == 3
    assert loaded.get("cam-01", "k1") == Credential("cam-01", "k1", b"a" * 32, 1767225600.0)
    assert loaded.get("cam-01", "k2") == Credential("cam-01", "k2", b"b" * 32)
    assert loaded.get("cam-02", "k1") == Credential("cam-02", "k1", b"c" * 16, 1767225600.0)
    assert loaded.get("cam-02", "k2") is None


def test_credential_repr_hides_the_secret() -> None:
    assert "x01" not in repr(CAM)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[[devices.cam.keys]]\nsecret = 'hex:" + "00" * 16 + "'\n", "devices.cam.keys[0].id"),
        ("[[devices.cam.keys]]\nid = 'k1'\n", "devices.cam.keys[0].secret"),
        (
            "[[devices.cam.keys]]\nid = 'k1'\nsecret = 'base64:not*base64'\n",
            "devices.cam.keys[0].secret: not valid base64",
        ),
        (
            "[[devices.cam.keys]]\nid = 'k1'\nsecret = 'hex:zz'\n",
            "devices.cam.keys[0].secret: not valid hex",
        ),
        (
            "[[devices.cam.keys]]\nid = 'k1'\nsecret = 'plain'\n",
            "devices.cam.keys[0].secret: must start with",
        ),
        (
            "[[devices.cam.keys]]\nid = 'k1'\nsecret = 'hex:0011'\n",
            "devices.cam.keys[0].secret: 2 bytes; at least 16",
        ),
        (
            "[[devices.cam.keys]]\nid = 'k1'\nsecret = 'hex:" + "00" * 16 + "'\n"
            "[[devices.cam.keys]]\nid = 'k1'\nsecret = 'hex:" + "11" * 16 + "'\n",
            "devices.cam.keys[1].id: duplicate key id 'k1'",
        ),
        (
            "[[devices.cam.keys]]\nid = 'k1'\nsecret = 'hex:" + "00" * 16 + "'\n"
            "not_after = 2026-01-01T00:00:00\n",
            "devices.cam.keys[0].not_after",
        ),
        (
            "[[devices.cam.keys]]\nid = 'k1'\nsecret = 'hex:" + "00" * 16 + "'\nscret = 1\n",
            "devices.cam.keys[0].scret: unknown field",
        ),
        ("[devices.cam]\n", "devices.cam.keys: missing"),
        ("[[devices.'a b'.keys]]\nid = 'k1'\n", "devices.a b: device id must match"),
        ("[[devices.cam.keys]]\nid = 'k 1'\n", "devices.cam.keys[0].id: key id must match"),
        ("title = 'x'\n", "title: unknown field"),
        ("", "devices: missing"),
        ("[devices\n", "not valid TOML"),
    ],
)
def test_credential_file_error_names_file_and_field(tmp_path: Path, text: str, field: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        CredentialStore.from_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert field in message
    assert "\n" not in message


def test_missing_credential_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the credential file"):
        CredentialStore.from_file(tmp_path / "absent.toml")


def test_generated_credential_renders_a_loadable_snippet(tmp_path: Path) -> None:
    cred = generate_credential("cam-07", "2025-06", not_after=1767225600)
    assert len(cred.secret) == 32
    assert generate_credential("cam-07", "2025-06").secret != cred.secret
    snippet = render_toml(cred)
    assert CredentialStore.from_file(write(tmp_path, snippet)).get("cam-07", "2025-06") == cred


def test_generate_rejects_bad_ids() -> None:
    with pytest.raises(ConfigError, match="device id"):
        generate_credential('cam"01', "k1")
    with pytest.raises(ConfigError, match="key id"):
        generate_credential("cam-01", "")


def test_store_rejects_duplicates() -> None:
    with pytest.raises(ConfigError, match="duplicate key 'k1' for device 'cam-01'"):
        CredentialStore([CAM, Credential("cam-01", "k1", b"\x09" * 32)])


# --- property ------------------------------------------------------------------


@given(body=st.binary(min_size=1, max_size=256), data=st.data())
def test_any_single_byte_change_to_the_body_fails(body: bytes, data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(body) - 1), label="index")
    value = data.draw(st.integers(0, 255).filter(lambda v: v != body[index]), label="value")
    changed = body[:index] + bytes([value]) + body[index + 1 :]
    headers = sign("POST", PATH, body, CAM, NOW)
    verifier = Verifier(store())
    with pytest.raises(AuthError, match="signature does not match"):
        verifier.verify("POST", PATH, headers, changed, NOW)
    assert verifier.verify("POST", PATH, headers, body, NOW) == CAM


# --- TLS contexts ----------------------------------------------------------------

# A self-signed P-256 certificate for CN=localhost (valid to 2126) and its key,
# made with `openssl req -x509 -newkey ec`; a second, unrelated key.
TEST_CERT = """-----BEGIN CERTIFICATE-----
MIIBlTCCATugAwIBAgIUMaACZUhZSJE9nU3VdSo0b1HmlIUwCgYIKoZIzj0EAwIw
FDESMBAGA1UEAwwJbG9jYWxob3N0MCAXDTI2MTIwMjExNDEyMFoYDzIxMjYxMTA4
MTE0MTIwWjAUMRIwEAYDVQQDDAlsb2NhbGhvc3QwWTATBgcqhkjOPQIBBggqhkjO
PQMBBwNCAASsXDNUJ4NaHQW8+QP6+w7t9lCzuwn6nvwlWCRwbtoCIGl+CGWDX8pE
VR4/b5IkI6Mx6klUpH0WOkTFWPEe+iD9o2kwZzAdBgNVHQ4EFgQUybBiqTay0AhD
v4MQokUYIneXWzwwHwYDVR0jBBgwFoAUybBiqTay0AhDv4MQokUYIneXWzwwDwYD
VR0TAQH/BAUwAwEB/zAUBgNVHREEDTALgglsb2NhbGhvc3QwCgYIKoZIzj0EAwID
SAAwRQIgPXBU8tj1D2e7jGFsHGUYawukhrpt/TxsbU6iod6mn10CIQCLd/rruW0l
4RPpPD4yIOqQhejQfWDxRfR+Nhrs8Qqy/Q==
-----END CERTIFICATE-----
"""
TEST_KEY = """-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgMBppUwQ5dkd9JD82
eXyscOEdw6vnkM1w9ADFpj0hdZWhRANCAASsXDNUJ4NaHQW8+QP6+w7t9lCzuwn6
nvwlWCRwbtoCIGl+CGWDX8pEVR4/b5IkI6Mx6klUpH0WOkTFWPEe+iD9
-----END PRIVATE KEY-----
"""
OTHER_KEY = """-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgp4AN172GkV2T+4Tk
uhycwX6QDdsNezloknBq7E/OcZChRANCAASNgtRTCCqJ8GyyjyYqEMrd4Hf9ueF1
2GYD1U/ou91H84XXRZAxOQ4QzvdsoNGc9peFEYM9rgYBHKuA9aZXbDtT
-----END PRIVATE KEY-----
"""


@pytest.fixture
def pem(tmp_path: Path) -> dict[str, Path]:
    files = {"cert": TEST_CERT, "key": TEST_KEY, "other": OTHER_KEY, "junk": "not a pem\n"}
    for name, text in files.items():
        (tmp_path / f"{name}.pem").write_text(text)
    return {name: tmp_path / f"{name}.pem" for name in files}


def test_server_context_loads_cert_and_key(pem: dict[str, Path]) -> None:
    ctx = server_ssl_context(pem["cert"], pem["key"])
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert ctx.verify_mode == ssl.CERT_NONE


def test_client_context_trusts_the_ca_file(pem: dict[str, Path]) -> None:
    ctx = client_ssl_context(pem["cert"])
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.check_hostname
    assert [c["subject"] for c in ctx.get_ca_certs()] == [((("commonName", "localhost"),),)]


def test_client_context_defaults_to_system_cas() -> None:
    ctx = client_ssl_context(None)
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.check_hostname


@pytest.mark.parametrize(
    ("cert", "key", "message"),
    [
        ("absent", "key", "--tls-cert .*absent.pem: no such file"),
        ("cert", "absent", "--tls-key .*absent.pem: no such file"),
        ("junk", "key", "--tls-cert .*junk.pem --tls-key .*key.pem: cannot load"),
        ("cert", "junk", "cannot load"),
        ("cert", "other", "cannot load"),
    ],
)
def test_server_context_errors(pem: dict[str, Path], cert: str, key: str, message: str) -> None:
    folder = pem["cert"].parent
    with pytest.raises(ConfigError, match=message) as info:
        server_ssl_context(folder / f"{cert}.pem", folder / f"{key}.pem")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "message"),
    [("absent", "--ca-file .*absent.pem: no such file"), ("junk", "--ca-file .*: cannot load")],
)
def test_client_context_errors(pem: dict[str, Path], name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        client_ssl_context(pem["cert"].parent / f"{name}.pem")
    assert "\n" not in str(info.value)


def test_a_credential_file_readable_by_others_is_warned_about_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "creds.toml"
    path.write_text(render_toml(CAM))
    path.chmod(0o644)
    with caplog.at_level("WARNING", logger="splitinfer.auth"):
        CredentialStore.from_file(path)
    assert any("chmod 600" in r.getMessage() and "0644" in r.getMessage() for r in caplog.records)
    caplog.clear()
    path.chmod(0o600)
    with caplog.at_level("WARNING", logger="splitinfer.auth"):
        CredentialStore.from_file(path)
    assert not caplog.records
