"""The SDK's TLS errors: gRPC's handshake failures become TlsError (not retried) with the reason,
TlsConfig/TlsFiles refuse bad settings at once, and the probe that explains a connection the
server closed after the handshake."""

from __future__ import annotations

import os
import re
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tls_pki import Pki

import cronoq
from cronoq import errors
from cronoq._transport import Endpoint, RetryConfig, TlsFiles, diagnose_tls, probe_tls, with_retries

# Details of real gRPC UNAVAILABLE errors (grpcio 1.85), and the reason each stands for.
DETAILS = {
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:44199: Tls handshake failed "
    "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:"
    "CERTIFICATE_VERIFY_FAILED: certificate has expired: OK": "certificate verify failed: the server's "
    "certificate has expired",
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:45429: Tls handshake failed "
    "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:"
    "CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate: OK": "certificate verify failed: "
    "unknown CA (the server's certificate is not signed by a trusted CA: unable to get local issuer certificate)",
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:33647: Custom verification check "
    "failed with error: UNAUTHENTICATED: Hostname Verification Check failed.": "hostname mismatch: the "
    "server's certificate is not valid for this host",
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:34695: Tls handshake failed "
    "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER: "
    "Invalid certificate verification context: OK": "the server does not speak TLS on this port (wrong version "
    "number): is it an http:// endpoint?",
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:49977: Cannot check peer: missing "
    "selected ALPN property.": "the server does not speak gRPC (HTTP/2) here: is this its HTTP port rather "
    "than its gRPC port?",
}
NOT_TLS = [
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote "
    "host: Connection refused",
    "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:45429: Socket closed",
    "server is draining",
]


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[()]:
        return ()


@pytest.mark.parametrize("details", list(DETAILS))
def test_grpc_handshake_failures_become_tls_errors(details: str) -> None:
    assert errors.tls_failure_reason(details) == DETAILS[details]
    err = errors.from_grpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, details))
    assert isinstance(err, errors.TlsError) and not isinstance(err, errors.Unavailable)
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert str(err) == f"TLS handshake failed: {DETAILS[details]}"


@pytest.mark.parametrize("details", NOT_TLS)
def test_other_unavailable_errors_stay_unavailable(details: str) -> None:
    assert errors.tls_failure_reason(details) is None
    assert type(errors.from_grpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, details))) is errors.Unavailable


async def test_tls_errors_are_not_retried() -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), next(iter(DETAILS))
        )

    with pytest.raises(errors.TlsError):
        await with_retries(call, RetryConfig(initial_backoff=0.01, max_elapsed=30), "GetTask")
    assert calls == 1


async def test_diagnose_tls_leaves_other_failures_alone() -> None:
    refused = NOT_TLS[0]
    assert await diagnose_tls(Endpoint.parse("https://127.0.0.1:1"), None, refused) is None
    assert await diagnose_tls(Endpoint.parse("http://127.0.0.1:1"), None, NOT_TLS[1]) is None  # nothing listens
    named = await diagnose_tls(Endpoint.parse("https://db.example:7443"), None, list(DETAILS)[2])
    assert named is not None
    assert str(named) == (
        "https://db.example:7443: TLS handshake failed: hostname mismatch: "
        "the server's certificate is not valid for 'db.example'"
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def test_bad_tls_settings_are_refused_at_once(pki: Pki, tmp_path: Path) -> None:
    pair = pki.client("CN=w", "w")
    other = pki.client("CN=o", "o")
    with pytest.raises(errors.InvalidArgument, match="give both cert and key"):
        cronoq.TlsConfig(cert=pair.cert)
    with pytest.raises(errors.InvalidArgument, match=r"tls\.ca: cannot read '.*nope.pem': no such file"):
        cronoq.Client("https://127.0.0.1:1", tls=cronoq.TlsConfig(ca=str(tmp_path / "nope.pem")))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("nothing here\n")
    with pytest.raises(errors.InvalidArgument, match=r"tls\.ca: "):
        TlsFiles(cronoq.TlsConfig(ca=str(garbage)))
    with pytest.raises(errors.InvalidArgument, match=r"tls\.cert: "):
        TlsFiles(cronoq.TlsConfig(ca=pki.ca_path, cert=pair.cert, key=other.key))
    files = TlsFiles(cronoq.TlsConfig(ca=pki.ca_path, cert=pair.cert, key=pair.key))
    assert isinstance(files.credentials, grpc.ChannelCredentials)


@pytest.fixture
def tls_server(pki: Pki) -> Iterator[int]:
    """A TLS server (Python's ssl) that requires a client certificate of pki's CA and, like an
    HTTP/2 server, answers what an accepted client sends with a byte."""
    pair = pki.server("127.0.0.1", name="probe")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pair.cert, pair.key)
    ctx.load_verify_locations(pki.ca_path)
    ctx.verify_mode = ssl.CERT_REQUIRED
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                conn.settimeout(5)
                with ctx.wrap_socket(conn, server_side=True) as tls_conn:
                    tls_conn.recv(1024)
                    tls_conn.sendall(b"\x00")
                    while tls_conn.recv(1024):  # until the client closes
                        pass
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    listener.close()
    thread.join(5)


def test_probe_explains_a_refused_client_certificate(pki: Pki, tls_server: int, tmp_path: Path) -> None:
    endpoint = Endpoint.parse(f"https://127.0.0.1:{tls_server}")
    good = pki.client("CN=w", "good")
    expired = pki.client("CN=w", "expired", expired=True)
    foreign = Pki(tmp_path, "foreign").client("CN=w", "foreign")
    assert probe_tls(endpoint, TlsFiles(cronoq.TlsConfig(pki.ca_path, good.cert, good.key))) is None
    reason = probe_tls(endpoint, TlsFiles(cronoq.TlsConfig(pki.ca_path)))
    assert reason is not None and reason.startswith("the server requires a client certificate")
    reason = probe_tls(endpoint, TlsFiles(cronoq.TlsConfig(pki.ca_path, expired.cert, expired.key)))
    assert reason is not None and "has expired" in reason
    reason = probe_tls(endpoint, TlsFiles(cronoq.TlsConfig(pki.ca_path, foreign.cert, foreign.key)))
    assert reason is not None and reason.startswith("the server refused the client certificate")
    reason = probe_tls(endpoint, TlsFiles(cronoq.TlsConfig(Pki(tmp_path, "x").ca_path, good.cert, good.key)))
    assert reason is not None and reason.startswith("certificate verify failed: unknown CA")


# A line of grpc core's own log ("I1201 22:08:12.907486   10256 ssl_transport_security.cc:2563] ...").
GRPC_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ", re.MULTILINE)


def cli_stderr(endpoint: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CRONOQ_", "GRPC_"))}
    out = subprocess.run(
        [sys.executable, "-m", "cronoq.cli", "get", "1", "--endpoint", endpoint],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
    )
    assert out.returncode == 5, out.stderr  # the credentials' exit code: no retry helps
    return out.stderr


def test_cli_keeps_grpc_core_quiet_unless_asked(tls_server: int) -> None:
    endpoint = f"https://127.0.0.1:{tls_server}"  # a certificate of a CA the CLI does not trust
    quiet = cli_stderr(endpoint)
    assert not GRPC_LOG_LINE.search(quiet), quiet
    assert quiet.startswith(f"cronoq get: {endpoint}: TLS handshake failed: certificate verify failed: unknown CA")
    assert len(quiet.splitlines()) == 1
    asked = cli_stderr(endpoint, GRPC_VERBOSITY="INFO")  # the user's own setting wins
    assert GRPC_LOG_LINE.search(asked) and "Handshake failed" in asked, asked
