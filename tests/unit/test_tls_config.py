"""api/tls.py, tls_files.py, sharding/peers.py (peer credentials) and the TLS parts of config.py: [server.tls] / [server.peer_tls] files checked with
one-line errors naming the key, peer channel credentials, canonical RFC 4514 subjects, and the
subject of a verified client certificate as gRPC and aiohttp report it."""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from tls_pki import Pki

from cronoq_server import tls_files
from cronoq_server.api import tls
from cronoq_server.config import ConfigError, TlsConfig, parse_config, rfc4514_subject, subject_string
from cronoq_server.sharding.peers import peer_channel_credentials

POOLS = [{"name": "default"}]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def config(**server: Any) -> Any:
    return parse_config({"server": server, "pools": POOLS})


def refusal(call: Any) -> str:
    with pytest.raises(ConfigError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message
    return message


# -- [server.peer_tls] ---------------------------------------------------------------


def test_peer_channel_credentials_from_files(pki: Pki) -> None:
    client = pki.client("CN=shard-a", "peer")
    for peer in (None, {"ca": pki.ca_path}, {"ca": pki.ca_path, "cert": client.cert, "key": client.key}):
        cfg = config(peer_tls=peer) if peer is not None else config()
        assert isinstance(peer_channel_credentials(cfg), grpc.ChannelCredentials)


async def test_peer_credentials_present_the_client_certificate(pki: Pki) -> None:
    """A channel with the peer credentials passes a server that requires client certificates,
    and that server sees the peer's subject; without cert/key it is refused."""
    server_pair = pki.server("127.0.0.1")
    seen: list[str | None] = []

    class Health(HealthServicer):
        async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
            seen.append(tls.grpc_cert_subject(context))
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(Health(), server)
    creds = tls.grpc_server_credentials(TlsConfig(cert=server_pair.cert, key=server_pair.key, client_ca=pki.ca_path))
    assert creds is not None
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    try:
        client = pki.client("CN=shard-a,O=acme", "peer2")
        cfg = config(peer_tls={"ca": pki.ca_path, "cert": client.cert, "key": client.key})
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", peer_channel_credentials(cfg)) as channel:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert seen == ["CN=shard-a,O=acme"]
        no_cert = peer_channel_credentials(config(peer_tls={"ca": pki.ca_path}))
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", no_cert) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


def test_peer_tls_files_missing_or_unreadable_name_the_key(pki: Pki, tmp_path: Path) -> None:
    client = pki.client("CN=shard-a", "peer3")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    encrypted = tmp_path / "encrypted.key"
    key = serialization.load_pem_private_key(Path(client.key).read_bytes(), password=None)
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"),
        )
    )
    other_key = pki.client("CN=other", "other").key
    cases = [
        ({"ca": str(tmp_path / "nope.pem")}, "server.peer_tls.ca: cannot read", "no such file"),
        ({"ca": str(tmp_path)}, "server.peer_tls.ca: cannot read", "not a regular file"),
        ({"ca": str(garbage)}, "server.peer_tls.ca: ", "holds no PEM certificate"),
        ({"cert": str(tmp_path / "nope.crt"), "key": client.key}, "server.peer_tls.cert: cannot read", ""),
        ({"cert": client.cert, "key": str(tmp_path / "nope.key")}, "server.peer_tls.key: cannot read", ""),
        ({"cert": client.cert, "key": str(garbage)}, "server.peer_tls.key: ", "holds no PEM private key"),
        ({"cert": client.cert, "key": str(encrypted)}, "server.peer_tls.key: ", "encrypted"),
        ({"cert": client.cert, "key": other_key}, "server.peer_tls.key: ", "is not the key of the certificate"),
    ]
    for peer, where, problem in cases:
        message = refusal(lambda peer=peer: peer_channel_credentials(config(peer_tls=peer), "cronoq.toml"))
        assert message.startswith(f"cronoq.toml: {where}") and problem in message, message
    half = refusal(lambda: config(peer_tls={"cert": client.cert}))
    assert "server.peer_tls" in half and "both 'cert' and 'key'" in half


# -- [server.tls] ----------------------------------------------------------------------


def test_server_tls_files_are_checked(pki: Pki, tmp_path: Path) -> None:
    pair = pki.server("127.0.0.1", name="srv")
    other = pki.server("127.0.0.1", name="srv2")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello\n")
    fifo = tmp_path / "fifo.pem"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.pem"
    huge.write_bytes(b"-" * ((1 << 20) + 1))
    tls_files.check_tls_files(config(tls={"cert": pair.cert, "key": pair.key, "client_ca": pki.ca_path}))
    cases = [
        ({"cert": str(tmp_path / "nope"), "key": pair.key}, "server.tls.cert: cannot read"),
        ({"cert": pair.cert, "key": str(tmp_path / "nope")}, "server.tls.key: cannot read"),
        ({"cert": str(garbage), "key": pair.key}, "server.tls.cert: "),
        ({"cert": pair.cert, "key": other.key}, "server.tls.key: "),
        ({"cert": pair.cert, "key": pair.key, "client_ca": str(garbage)}, "server.tls.client_ca: "),
        ({"cert": pair.cert, "key": pair.key, "client_ca": str(tmp_path / "x")}, "server.tls.client_ca: cannot read"),
        # Not regular files: /dev/zero was read forever, a FIFO waits in open() for a writer.
        ({"cert": pair.cert, "key": "/dev/zero"}, "server.tls.key: cannot read '/dev/zero': not a regular file"),
        (
            {"cert": pair.cert, "key": pair.key, "client_ca": "/dev/zero"},
            "server.tls.client_ca: cannot read '/dev/zero': not",
        ),
        ({"cert": pair.cert, "key": pair.key, "client_ca": str(fifo)}, "server.tls.client_ca: "),
        ({"cert": str(huge), "key": pair.key}, "server.tls.cert: "),
    ]
    for section, where in cases:
        message = refusal(lambda section=section: tls_files.check_tls_files(config(tls=section), "c.toml"))
        assert message.startswith(f"c.toml: {where}"), message


def test_listener_credentials(pki: Pki) -> None:
    pair = pki.server("127.0.0.1", name="srv3")
    assert tls.grpc_server_credentials(None) is None and tls.http_ssl_context(None) is None
    plain = TlsConfig(cert=pair.cert, key=pair.key)
    mutual = TlsConfig(cert=pair.cert, key=pair.key, client_ca=pki.ca_path)
    assert isinstance(tls.grpc_server_credentials(plain), grpc.ServerCredentials)
    assert isinstance(tls.grpc_server_credentials(mutual), grpc.ServerCredentials)
    plain_ctx, mutual_ctx = tls.http_ssl_context(plain), tls.http_ssl_context(mutual)
    assert plain_ctx is not None and plain_ctx.verify_mode == ssl.CERT_NONE
    assert mutual_ctx is not None and mutual_ctx.verify_mode == ssl.CERT_REQUIRED  # required, as on gRPC
    assert mutual_ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert tls.describe(None) == "off" and "client certificates required" in tls.describe(mutual)


# -- subjects --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "canonical"),
    [
        ("CN=worker-a", "CN=worker-a"),
        ("CN=worker-a,O=acme", "CN=worker-a,O=acme"),
        ("cn=worker-a, o=acme", "CN=worker-a,O=acme"),
        (" CN = worker-a ,  O = acme ", "CN=worker-a,O=acme"),
        ("O=acme,CN=worker-a", "O=acme,CN=worker-a"),  # order is kept: it is part of the name
        ("OU=b+CN=a,O=c", "CN=a+OU=b,O=c"),  # a multi-valued RDN's attributes in a fixed order
        ("CN=a\\,b", "CN=a\\,b"),
        ("CN=a\\ ", "CN=a\\ "),  # an escaped trailing space is kept
        ("emailAddress=ops@example.com,CN=x", "1.2.840.113549.1.9.1=ops@example.com,CN=x"),
        ("UID=u1,DC=example,DC=com", "UID=u1,DC=example,DC=com"),
        ("2.5.4.3=worker-a", "CN=worker-a"),
    ],
)
def test_subjects_are_kept_in_canonical_rfc4514_form(written: str, canonical: str) -> None:
    assert rfc4514_subject(written) == canonical
    assert rfc4514_subject(canonical) == canonical


@pytest.mark.parametrize("bad", ["", "   ", "worker-a", "CN=", "X=y", "CN=a,,O=b", "=a", "CN=" + "a" * 65])
def test_bad_subjects_are_refused_in_the_config(bad: str) -> None:
    message = refusal(
        lambda: parse_config({"pools": POOLS, "clients": [{"subject": bad, "pools": ["*"], "permissions": ["read"]}]})
    )
    assert "clients[0].subject: not a distinguished name" in message


def test_subjects_equal_after_normalising_are_duplicates() -> None:
    clients = [
        {"subject": "CN=w,O=acme", "pools": ["*"], "permissions": ["read"]},
        {"subject": "cn=w, o=acme", "pools": ["*"], "permissions": ["work"]},
    ]
    assert "clients[1].subject: duplicate value 'CN=w,O=acme'" in refusal(
        lambda: parse_config({"pools": POOLS, "clients": clients})
    )


def test_certificate_subjects_as_grpc_and_aiohttp_report_them(pki: Pki) -> None:
    pair = pki.client("CN=worker-b+UID=7,OU=ops,O=acme", "multi")
    pem = Path(pair.cert).read_bytes()
    cert = x509.load_pem_x509_certificate(pem)
    der = cert.public_bytes(serialization.Encoding.DER)
    expected = subject_string(cert.subject)
    assert expected == rfc4514_subject("cn=worker-b + uid=7, ou=ops, o=acme") == "CN=worker-b+UID=7,OU=ops,O=acme"

    def grpc_context(auth: dict[str, list[bytes]]) -> Any:
        return SimpleNamespace(auth_context=lambda: auth)

    assert tls.grpc_cert_subject(grpc_context({"x509_pem_cert": [pem]})) == expected
    assert tls.grpc_cert_subject(grpc_context({})) is None  # no client certificate
    assert tls.grpc_cert_subject(grpc_context({"x509_pem_cert": [b"garbage"]})) is None
    # grpc's own x509_subject text is not used: it names what the peer certificate says only loosely
    assert tls.grpc_cert_subject(grpc_context({"x509_subject": [b"CN=forged"]})) is None

    def request(ssl_object: Any, transport: bool = True) -> Any:
        extra = {"ssl_object": ssl_object}
        return SimpleNamespace(transport=SimpleNamespace(get_extra_info=extra.get) if transport else None)

    assert tls.http_cert_subject(request(SimpleNamespace(getpeercert=lambda binary_form: der))) == expected
    assert tls.http_cert_subject(request(SimpleNamespace(getpeercert=lambda binary_form: None))) is None
    assert tls.http_cert_subject(request(None)) is None  # plaintext
    assert tls.http_cert_subject(request(None, transport=False)) is None  # connection gone
