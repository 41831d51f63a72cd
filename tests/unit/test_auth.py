"""Authenticator and Principal: tokens by sha256, mTLS subjects, pool scopes."""

from __future__ import annotations

import hashlib

import grpc
import pytest

from cronoq_server.auth import ANONYMOUS, Authenticator
from cronoq_server.config import PERMISSIONS, parse_config
from cronoq_server.errors import ApiError

POOLS = [{"name": "default"}, {"name": "emails"}]


def sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def authenticator(**sections: object) -> Authenticator:
    return Authenticator(parse_config({"pools": POOLS, **sections}))


def refused(auth: Authenticator, authorization: str | None, subject: str | None = None) -> ApiError:
    with pytest.raises(ApiError) as err:
        auth.authenticate(authorization, subject)
    return err.value


def test_no_credentials_configured_means_anonymous_with_every_permission() -> None:
    auth = authenticator()
    assert not auth.enabled
    for authorization in (None, "Bearer whatever", "garbage"):
        principal = auth.authenticate(authorization, None)
        assert principal is ANONYMOUS
        assert principal.pools is None and principal.permissions == frozenset(PERMISSIONS)
        for permission in PERMISSIONS:
            principal.require(permission, "any-pool")


def test_token_matched_by_its_sha256() -> None:
    auth = authenticator(
        tokens=[
            {"name": "ops", "sha256": sha256("s3cret").upper(), "pools": ["*"], "permissions": ["read", "admin"]},
            {"name": "mailer", "sha256": sha256("m41l"), "pools": ["emails"], "permissions": ["submit", "read"]},
        ]
    )
    assert auth.enabled
    ops = auth.authenticate("Bearer s3cret", None)
    assert (ops.name, ops.pools, ops.permissions, ops.token) == ("ops", None, frozenset({"read", "admin"}), "s3cret")
    mailer = auth.authenticate("bearer m41l", None)
    assert (mailer.name, mailer.pools, mailer.token) == ("mailer", frozenset({"emails"}), "m41l")


def test_token_hash_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRONOQ_TEST_TOKEN_SHA", sha256("from-env"))
    auth = authenticator(
        tokens=[{"name": "env", "env": "CRONOQ_TEST_TOKEN_SHA", "pools": ["*"], "permissions": ["read"]}]
    )
    assert auth.authenticate("Bearer from-env", None).name == "env"


@pytest.mark.parametrize(
    ("authorization", "problem"),
    [
        ("Bearer wrong", "unknown token"),
        ("Bearer S3CRET", "unknown token"),
        ("Bearer ", "expected 'Bearer <token>'"),
        ("Basic czNjcmV0", "expected 'Bearer <token>'"),
        ("s3cret", "expected 'Bearer <token>'"),
        (None, "credentials required"),
        ("", "credentials required"),
    ],
)
def test_wrong_or_missing_token_is_unauthenticated(authorization: str | None, problem: str) -> None:
    auth = authenticator(tokens=[{"name": "ops", "sha256": sha256("s3cret"), "pools": ["*"], "permissions": ["read"]}])
    err = refused(auth, authorization)
    assert err.code == grpc.StatusCode.UNAUTHENTICATED and problem in err.message
    assert err.http_status == 401
    assert "s3cret" not in err.message


def test_client_certificate_subjects() -> None:
    auth = authenticator(clients=[{"subject": "CN=worker", "pools": ["default"], "permissions": ["work"]}])
    principal = auth.authenticate(None, "CN=worker")
    assert principal.via_certificate and principal.pools == frozenset({"default"})
    assert refused(auth, None, "CN=stranger").code == grpc.StatusCode.UNAUTHENTICATED
    assert refused(auth, "Bearer anything", "CN=worker").code == grpc.StatusCode.UNAUTHENTICATED


def test_pool_scope_and_permission_are_enforced_by_require() -> None:
    auth = authenticator(
        tokens=[{"name": "mailer", "sha256": sha256("m"), "pools": ["emails"], "permissions": ["submit"]}]
    )
    mailer = auth.authenticate("Bearer m", None)
    mailer.require("submit", "emails")
    assert mailer.may("submit", "emails") and not mailer.may("submit", "default") and not mailer.may("read", "emails")
    for permission, pool in (("submit", "default"), ("read", "emails"), ("admin", "emails")):
        with pytest.raises(ApiError) as err:
            mailer.require(permission, pool)
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and err.value.http_status == 403
        assert repr(permission) in err.value.message and repr(pool) in err.value.message


# -- malformed authorization values and certificate subjects -----------------------


@pytest.mark.parametrize(
    ("authorization", "problem"),
    [
        ("Bearer", "expected 'Bearer <token>'"),
        ("Bearer    ", "expected 'Bearer <token>'"),
        ("Bearer\ts3cret", "expected 'Bearer <token>'"),
        (" Bearer s3cret", "expected 'Bearer <token>'"),
        ("Bearer s3 cret", "visible ASCII"),
        ("Bearer s3cret ", "visible ASCII"),
        ("Bearer s3cret\n", "visible ASCII"),
        ("Bearer s3\tcret", "visible ASCII"),
        ("Bearer s3cr\u00e9t", "visible ASCII"),
        ("Bearer \udcff\udcfe", "visible ASCII"),  # undecodable bytes as aiohttp hands them over
        ("Bearer \x00", "visible ASCII"),
        ("Bearer " + "x" * 5000, "longer than 4096"),
        ("Bearer " + "x" * 65536, "longer than 4096"),
        ("x" * 65536, "expected 'Bearer <token>'"),
    ],
)
def test_malformed_authorization_is_unauthenticated_and_never_echoed(authorization: str, problem: str) -> None:
    auth = authenticator(tokens=[{"name": "ops", "sha256": sha256("s3cret"), "pools": ["*"], "permissions": ["read"]}])
    err = refused(auth, authorization)
    assert err.code == grpc.StatusCode.UNAUTHENTICATED and problem in err.message, err.message
    assert "s3" not in err.message and "xxx" not in err.message and len(err.message) < 200


def test_one_or_more_spaces_after_the_scheme() -> None:
    auth = authenticator(tokens=[{"name": "ops", "sha256": sha256("s3cret"), "pools": ["*"], "permissions": ["read"]}])
    for authorization in ("Bearer s3cret", "BEARER   s3cret", "bearer s3cret"):
        assert auth.authenticate(authorization, None).name == "ops"


def test_token_wins_over_certificate_and_subjects_are_canonical() -> None:
    auth = authenticator(
        tokens=[{"name": "reader", "sha256": sha256("r"), "pools": ["*"], "permissions": ["read"]}],
        clients=[{"subject": "cn=worker, o=acme", "pools": ["default"], "permissions": ["work"]}],
    )
    via_cert = auth.authenticate(None, "CN=worker,O=acme")  # what api/tls.py reports for the certificate
    assert via_cert.name == "CN=worker,O=acme" and via_cert.via_certificate and via_cert.token is None
    via_token = auth.authenticate("Bearer r", "CN=worker,O=acme")
    assert via_token.name == "reader" and not via_token.via_certificate and via_token.token == "r"
    err = refused(auth, None, "O=acme,CN=worker")  # another order is another name
    assert err.code == grpc.StatusCode.UNAUTHENTICATED and "'O=acme,CN=worker'" in err.message
    long_subject = "CN=" + "a" * 64 + ",O=" + "b" * 64 + ",OU=" + "c" * 64 + ",L=" + "d" * 64
    assert len(refused(auth, None, long_subject).message) < 300
    err = refused(auth, None, None)
    assert "credentials required" in err.message and "client certificate" in err.message


def test_a_token_and_a_certificate_of_the_same_name_are_different_principals() -> None:
    from cronoq_server.auth import Principal

    token = Principal("CN=worker-a", None, frozenset({"work"}))
    certificate = Principal("CN=worker-a", None, frozenset({"work"}), via_certificate=True)
    assert token.identity != certificate.identity
