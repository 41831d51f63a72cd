"""TLS and client certificates on both listeners, against real cronoq-server processes, with
certificates the tests make (tests/tls_pki.py: trustme and cryptography).

Two servers serve most tests (one each per module):
- `mtls`: [server.tls] with client_ca (a client certificate is REQUIRED on both listeners),
  [[tokens]] and [[clients]]. Proven: a verified certificate with no token is served as its
  [[clients]] principal (its pools and permissions apply, PERMISSION_DENIED outside them),
  over the SDK, raw gRPC stubs and HTTPS; a multi-attribute subject matches in RFC 4514
  form; a token sent with a certificate wins (a read-only token cannot submit although the
  certificate could; a wrong token is refused); an unknown subject is UNAUTHENTICATED; a
  certificate of another CA, an expired one, or none is refused at the handshake and the SDK
  raises TlsError at once (no retries), saying why; a plaintext client is refused; the CLI
  takes CRONOQ_CA / CRONOQ_CERT / CRONOQ_KEY; a Worker runs tasks over mTLS and fails fast
  with a bad certificate.
- `tls_only`: [server.tls] without client_ca, [[tokens]] only. Proven: tokens work over
  https on both listeners; plaintext HTTP is refused on the TLS port; malformed
  authorization (empty, "Bearer" alone, whitespace in or around the token, non-ASCII bytes,
  over-long) is UNAUTHENTICATED (401) on both listeners, or refused by the transport before
  authentication (64 KiB: gRPC RESOURCE_EXHAUSTED, HTTP 431), and the server keeps serving.
Plus: the server's own certificate checked by the SDK (unknown CA, hostname mismatch,
expired), the safe default for non-loopback listeners, `cronoq-server hash-token`, and
TLS files refused at start with one line.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from ports import free_port  # type: ignore[import-not-found]
from tls_pki import Pair, Pki

import cronoq
from cronoq import errors
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import task_service_pb2_grpc
from cronoq_server import main as server_main

ALL = ["submit", "read", "cancel", "work", "schedule", "admin"]
ADMIN_TOKEN = "admin-s3cret"
READER_TOKEN = "reader-s3cret"
GRPC_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")
FAST = cronoq.RetryConfig(initial_backoff=0.05, max_backoff=0.2, max_elapsed=5)
PATIENT = cronoq.RetryConfig(initial_backoff=0.05, max_backoff=0.5, max_elapsed=30)  # TLS errors must not wait it out


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def server_cmd(config: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "cronoq_server.main", "--config", str(config), *args]


class TlsServer:
    """One cronoq-server process with [server.tls]; readiness is polled over HTTPS."""

    def __init__(self, workdir: Path, name: str, pki: Pki, cert: Pair, client_ca: bool, tail: str):
        self.workdir, self.name, self.pki = workdir, name, pki
        self.grpc_port, self.http_port = free_port(), free_port()
        ca_line = f'client_ca = "{pki.ca_path}"\n' if client_ca else ""
        self.config_path = workdir / f"{name}.toml"
        self.config_path.write_text(
            f'[server]\nlisten = "127.0.0.1:{self.grpc_port}"\nhttp_listen = "127.0.0.1:{self.http_port}"\n'
            f'[server.tls]\ncert = "{cert.cert}"\nkey = "{cert.key}"\n{ca_line}'
            f'[store]\npath = "{workdir / (name + ".db")}"\n'
            '[[pools]]\nname = "default"\n[[pools]]\nname = "other"\n' + tail
        )
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"https://127.0.0.1:{self.grpc_port}"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(server_cmd(self.config_path), stdout=log, stderr=subprocess.STDOUT)

    def start(self, client: Pair | None) -> TlsServer:
        self.spawn()
        assert self.proc is not None
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.https("GET", "/readyz", client=client, timeout=1)[0] == 200:
                    return self
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready in 15 s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def context(self, client: Pair | None = None, ca: str | None = None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=ca or self.pki.ca_path)
        if client is not None:
            ctx.load_cert_chain(client.cert, client.key)
        return ctx

    def https(
        self,
        method: str,
        path: str,
        body: Any = None,
        client: Pair | None = None,
        token: str | None = None,
        timeout: float = 10,
    ) -> tuple[int, Any]:
        req = urllib.request.Request(
            f"https://127.0.0.1:{self.http_port}{path}",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.context(client)) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    def channel(self, client: Pair | None = None, ca: str | None = None) -> grpc.Channel:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(ca or self.pki.ca_path).read_bytes(),
            private_key=Path(client.key).read_bytes() if client else None,
            certificate_chain=Path(client.cert).read_bytes() if client else None,
        )
        return grpc.secure_channel(self.target, creds)


TOKENS = f"""
[[tokens]]
name = "admin"
sha256 = "{sha256(ADMIN_TOKEN)}"
pools = ["*"]
permissions = {json.dumps(ALL)}

[[tokens]]
name = "reader"
sha256 = "{sha256(READER_TOKEN)}"
pools = ["*"]
permissions = ["read"]
"""

CLIENTS = """
[[clients]]
subject = "CN=worker-a"
pools = ["default"]
permissions = ["submit", "read"]

[[clients]]
subject = "cn=worker-b, o=acme"     # written loosely; the certificate's RFC 4514 form is CN=worker-b,O=acme
pools = ["other"]
permissions = ["read"]

[[clients]]
subject = "CN=worker-w"
pools = ["default"]
permissions = ["submit", "read", "work"]
"""


class Certs:
    def __init__(self, directory: Path):
        self.pki = Pki(directory, "ca")
        self.other = Pki(directory, "other-ca")
        self.server = self.pki.server("127.0.0.1")  # not localhost: for the hostname-mismatch test
        self.a = self.pki.client("CN=worker-a", "a")
        self.b = self.pki.client("CN=worker-b,O=acme", "b")
        self.w = self.pki.client("CN=worker-w", "w")
        self.stranger = self.pki.client("CN=stranger", "stranger")
        self.foreign = self.other.client("CN=worker-a", "foreign")  # right subject, wrong CA
        self.expired = self.pki.client("CN=worker-a", "expired", expired=True)

    def tls(self, client: Pair | None, ca: str | None = None) -> cronoq.TlsConfig:
        return cronoq.TlsConfig(ca or self.pki.ca_path, client.cert if client else None, client.key if client else None)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return Certs(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mtls(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    srv = TlsServer(tmp_path_factory.mktemp("mtls"), "mtls", certs.pki, certs.server, True, TOKENS + CLIENTS)
    try:
        yield srv.start(client=certs.a)
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def tls_only(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    srv = TlsServer(tmp_path_factory.mktemp("tls"), "tls", certs.pki, certs.server, False, TOKENS)
    try:
        yield srv.start(client=None)
    finally:
        srv.kill()


def code(call: Any) -> str:
    try:
        call()
    except grpc.RpcError as err:
        return err.code().name  # type: ignore[attr-defined]
    return "OK"


# -- mTLS: the certificate is the principal ------------------------------------------


async def test_certificate_is_the_principal_over_the_sdk(mtls: TlsServer, certs: Certs) -> None:
    async with cronoq.Client(mtls.endpoint, tls=certs.tls(certs.a), retry=FAST) as client:
        sub = await client.submit("default", {"n": 1})
        assert (await client.get(sub.task.id)).id == sub.task.id
        with pytest.raises(errors.PermissionDenied) as denied:
            await client.submit("other", {"n": 1})
        assert "'CN=worker-a'" in denied.value.message and "'other'" in denied.value.message
    async with cronoq.Client(mtls.endpoint, tls=certs.tls(certs.b), retry=FAST) as client:
        assert (await client.list("other")).tasks is not None  # CN=worker-b,O=acme may read "other"
        with pytest.raises(errors.PermissionDenied) as denied:
            await client.submit("other", {"n": 1})
        assert "'CN=worker-b,O=acme'" in denied.value.message


def test_certificate_and_token_over_raw_stubs(mtls: TlsServer, certs: Certs) -> None:
    with mtls.channel(certs.a) as channel:
        stub = task_service_pb2_grpc.TaskServiceStub(channel)

        def submit(pool: str, token: str | None = None) -> Any:
            md = (("authorization", f"Bearer {token}"),) if token else ()
            return lambda: stub.SubmitTask(tpb.SubmitTaskRequest(pool=pool), metadata=md, timeout=10)

        assert code(submit("default")) == "OK"
        assert code(submit("other")) == "PERMISSION_DENIED"
        assert code(submit("other", ADMIN_TOKEN)) == "OK"  # the token's principal, not the certificate's
        assert code(submit("default", READER_TOKEN)) == "PERMISSION_DENIED"  # token wins though the cert may submit
        assert code(submit("default", "wrong-token")) == "UNAUTHENTICATED"  # a wrong token is not rescued by the cert
    with mtls.channel(certs.stranger) as channel:
        stub = task_service_pb2_grpc.TaskServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitTask(tpb.SubmitTaskRequest(pool="default"), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        assert "'CN=stranger'" in err.value.details()  # type: ignore[attr-defined]
        md = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
        assert stub.SubmitTask(tpb.SubmitTaskRequest(pool="other"), metadata=md, timeout=10).task.id > 0


def test_certificate_and_token_over_https(mtls: TlsServer, certs: Certs) -> None:
    assert mtls.https("POST", "/v1/tasks", {"pool": "default"}, client=certs.a)[0] == 200
    status, body = mtls.https("POST", "/v1/tasks", {"pool": "other"}, client=certs.a)
    assert (status, body["code"]) == (403, "PERMISSION_DENIED") and "'CN=worker-a'" in body["message"]
    assert mtls.https("GET", "/v1/tasks?pool=other", client=certs.b)[0] == 200
    assert mtls.https("POST", "/v1/tasks", {"pool": "other"}, client=certs.b)[0] == 403
    assert mtls.https("POST", "/v1/tasks", {"pool": "other"}, client=certs.a, token=ADMIN_TOKEN)[0] == 200
    assert mtls.https("POST", "/v1/tasks", {"pool": "default"}, client=certs.a, token=READER_TOKEN)[0] == 403
    assert mtls.https("POST", "/v1/tasks", {"pool": "default"}, client=certs.a, token="wrong")[0] == 401
    status, body = mtls.https("POST", "/v1/tasks", {"pool": "default"}, client=certs.stranger)
    assert (status, body["code"]) == (401, "UNAUTHENTICATED") and "'CN=stranger'" in body["message"]
    assert mtls.https("POST", "/v1/tasks", {"pool": "other"}, client=certs.stranger, token=ADMIN_TOKEN)[0] == 200
    assert mtls.https("GET", "/healthz", client=certs.stranger)[0] == 200  # open, but only over a verified connection
    # The dashboard learns who it serves from /v1/info: the certificate's principal and grants.
    status, body = mtls.https("GET", "/v1/info", client=certs.a)
    assert status == 200 and body["caller"]["name"] == "CN=worker-a", body
    assert body["caller"]["pools"] == ["default"] and not body["caller"]["all_pools"]


async def test_unknown_subject_is_unauthenticated_in_the_sdk(mtls: TlsServer, certs: Certs) -> None:
    async with cronoq.Client(mtls.endpoint, tls=certs.tls(certs.stranger), retry=FAST) as client:
        with pytest.raises(errors.Unauthenticated) as err:
            await client.submit("default", {"n": 1})
    assert "'CN=stranger'" in err.value.message and "[[clients]]" in err.value.message


# -- mTLS: refused at the handshake --------------------------------------------------

REFUSED = {
    "another CA": ("foreign", "the server refused the client certificate"),
    "expired": ("expired", "has expired"),
    "no certificate": (None, "the server requires a client certificate"),
}


@pytest.mark.parametrize("case", list(REFUSED))
async def test_refused_at_handshake_the_sdk_says_why_at_once(mtls: TlsServer, certs: Certs, case: str) -> None:
    attr, reason = REFUSED[case]
    pair = getattr(certs, attr) if attr else None
    started = time.monotonic()
    async with cronoq.Client(mtls.endpoint, tls=certs.tls(pair), retry=PATIENT) as client:
        with pytest.raises(errors.TlsError) as err:
            await client.submit("default", {"n": 1})
    assert time.monotonic() - started < 5, "a TLS failure must not be retried"
    assert not isinstance(err.value, errors.Unavailable)
    assert str(err.value).startswith(f"{mtls.endpoint}: TLS handshake failed: "), str(err.value)
    assert reason in str(err.value)
    with mtls.channel(pair) as channel:  # raw gRPC: UNAVAILABLE, the connection never carries a call
        stub = task_service_pb2_grpc.TaskServiceStub(channel)
        assert code(lambda: stub.SubmitTask(tpb.SubmitTaskRequest(pool="default"), timeout=5)) == "UNAVAILABLE"
    with pytest.raises((OSError, http.client.HTTPException)):  # HTTPS: the handshake fails (a TLS alert)
        mtls.https("GET", "/v1/tasks?pool=default", client=pair, token=ADMIN_TOKEN)
    assert mtls.https("GET", "/v1/tasks?pool=default", client=certs.a)[0] == 200  # still serving


async def test_plaintext_client_is_refused(mtls: TlsServer, certs: Certs) -> None:
    plain = f"http://127.0.0.1:{mtls.grpc_port}"
    async with cronoq.Client(plain, retry=PATIENT) as client:
        with pytest.raises(errors.TlsError) as err:
            await client.get(1)
    assert str(err.value) == f"{plain}: the server speaks TLS on this port: use {mtls.endpoint}"
    with grpc.insecure_channel(mtls.target) as channel:
        stub = task_service_pb2_grpc.TaskServiceStub(channel)
        assert code(lambda: stub.SubmitTask(tpb.SubmitTaskRequest(pool="default"), timeout=5)) == "UNAVAILABLE"
    conn = http.client.HTTPConnection("127.0.0.1", mtls.http_port, timeout=5)
    with pytest.raises((OSError, http.client.HTTPException)):
        conn.request("GET", "/healthz")
        conn.getresponse()
    conn.close()
    assert mtls.https("GET", "/readyz", client=certs.a)[0] == 200


async def test_the_sdk_checks_the_server_certificate_ca(mtls: TlsServer, certs: Certs) -> None:
    started = time.monotonic()
    async with cronoq.Client(mtls.endpoint, tls=certs.tls(certs.a, ca=certs.other.ca_path), retry=PATIENT) as client:
        with pytest.raises(errors.TlsError) as err:
            await client.get(1)
    assert time.monotonic() - started < 5
    assert str(err.value).startswith(f"{mtls.endpoint}: TLS handshake failed: certificate verify failed: unknown CA")


def wait_listening(srv: TlsServer) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        assert srv.proc is not None and srv.proc.poll() is None, srv.log()
        try:
            for port in (srv.grpc_port, srv.http_port):
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(srv.log())


SERVER_CERT_PROBLEMS = {
    # the server's certificate -> the reason the SDK and the CLI give
    "expired": ("certificate verify failed: the server's certificate has expired"),
    "another name": ("hostname mismatch: the server's certificate is not valid for '127.0.0.1'"),
}


@pytest.mark.parametrize("problem", list(SERVER_CERT_PROBLEMS))
async def test_the_sdk_and_cli_check_the_server_certificate(certs: Certs, tmp_path: Path, problem: str) -> None:
    if problem == "expired":
        cert = certs.pki.server("127.0.0.1", name="expired-server", expired=True)
    else:
        cert = certs.pki.server("cronoq.invalid", name="named-server")
    srv = TlsServer(tmp_path, "srv", certs.pki, cert, False, "")
    srv.spawn()
    try:
        wait_listening(srv)
        if problem == "expired":
            assert "server.tls.cert" in srv.log() and "expired on" in srv.log()  # a warning; it still serves
        expected = f"{srv.endpoint}: TLS handshake failed: {SERVER_CERT_PROBLEMS[problem]}"
        started = time.monotonic()
        async with cronoq.Client(srv.endpoint, tls=cronoq.TlsConfig(certs.pki.ca_path), retry=PATIENT) as client:
            with pytest.raises(errors.TlsError) as err:
                await client.get(1)
        assert time.monotonic() - started < 5
        assert str(err.value) == expected
        out = cli("get", "1", "--endpoint", srv.endpoint, "--ca", certs.pki.ca_path, env={})
        assert (out.returncode, out.stderr.strip()) == (5, f"cronoq get: {expected}")  # 5: credentials
    finally:
        srv.kill()


# -- the SDK's Worker and the CLI over mTLS ------------------------------------------


async def test_worker_over_mtls_and_fail_fast(mtls: TlsServer, certs: Certs) -> None:
    import asyncio

    async def handle(task: cronoq.TaskContext) -> Any:
        return {"doubled": task.payload["n"] * 2}

    tls = certs.tls(certs.w)
    worker = cronoq.Worker(mtls.endpoint, "default", handle, tls=tls, retry=FAST, shutdown_grace=1)
    running = asyncio.create_task(worker.run())
    try:
        async with cronoq.Client(mtls.endpoint, tls=tls, retry=FAST) as client:
            sub = await client.submit("default", {"n": 21})
            done = await client.wait(sub.task.id, timeout=15)
        assert done.done and cronoq.result_of(done.task) == {"doubled": 42}
    finally:
        worker.stop()
        await asyncio.wait_for(running, 15)
    bad = cronoq.Worker(mtls.endpoint, "default", handle, tls=certs.tls(certs.foreign))
    with pytest.raises(errors.TlsError) as err:
        await asyncio.wait_for(bad.run(), 10)  # registration fails at once instead of retrying forever
    assert "the server refused the client certificate" in str(err.value)


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The CLI's result, with grpc core's own log lines ("I1130 13:50:25.33 ... Handshake failed
    ...", printed when GRPC_VERBOSITY is not set before grpc is imported) dropped from stderr."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CRONOQ_")}
    out = subprocess.run(
        [sys.executable, "-m", "cronoq.cli", *args], capture_output=True, text=True, timeout=60, env={**clean, **env}
    )
    out.stderr = "".join(line for line in out.stderr.splitlines(True) if not GRPC_LOG_LINE.match(line))
    return out


def test_cli_takes_ca_cert_and_key_from_the_environment(mtls: TlsServer, certs: Certs) -> None:
    env = {"CRONOQ_ENDPOINT": mtls.endpoint, "CRONOQ_CA": certs.pki.ca_path}
    with_cert = {**env, "CRONOQ_CERT": certs.a.cert, "CRONOQ_KEY": certs.a.key}
    ok = cli("submit", "--pool", "default", "--json", env=with_cert)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["key"] == ""  # CRONOQ_KEY is the client key file, not submit's --key
    keyed = cli("submit", "--pool", "default", "--key", "cli-tls", "--json", env=with_cert)
    assert json.loads(keyed.stdout)["key"] == "cli-tls"
    assert json.loads(cli("get", "cli-tls", "--key", "--json", env=with_cert).stdout)["key"] == "cli-tls"
    task_id = json.loads(ok.stdout)["id"]
    flags = cli("get", task_id, "--cert", certs.a.cert, "--key-file", certs.a.key, "--json", env=env)
    assert flags.returncode == 0 and json.loads(flags.stdout)["id"] == task_id
    no_cert = cli("get", task_id, env=env)
    assert no_cert.returncode == 5
    assert no_cert.stderr.startswith(f"cronoq get: {mtls.endpoint}: TLS handshake failed: the server requires a client")
    assert len(no_cert.stderr.strip().splitlines()) == 1
    wrong_ca = cli(
        "get", task_id, env={**env, "CRONOQ_CA": certs.other.ca_path, "CRONOQ_CERT": certs.a.cert,
                             "CRONOQ_KEY": certs.a.key},
    )  # fmt: skip
    assert wrong_ca.returncode == 5 and "certificate verify failed: unknown CA" in wrong_ca.stderr
    half = cli("get", task_id, "--cert", certs.a.cert, env=env)
    assert half.returncode != 0 and "--key-file" in half.stderr
    token = cli("get", task_id, "--token", READER_TOKEN, env={**env, "CRONOQ_CERT": certs.stranger.cert,
                                                                 "CRONOQ_KEY": certs.stranger.key})  # fmt: skip
    assert token.returncode == 0  # the token's principal, although the certificate's subject is unknown


# -- TLS without client certificates: tokens -----------------------------------------


async def test_tokens_over_tls_on_both_listeners(tls_only: TlsServer, certs: Certs) -> None:
    tls = cronoq.TlsConfig(certs.pki.ca_path)
    async with cronoq.Client(tls_only.endpoint, token=ADMIN_TOKEN, tls=tls, retry=FAST) as client:
        sub = await client.submit("other", {"n": 1})
        assert (await client.get(sub.task.id)).pool == "other"
    async with cronoq.Client(tls_only.endpoint, tls=tls, retry=FAST) as client:
        with pytest.raises(errors.Unauthenticated):
            await client.get(sub.task.id)
    status, body = tls_only.https("GET", f"/v1/tasks/{sub.task.id}", token=READER_TOKEN)
    assert status == 200 and body["task"]["pool"] == "other"
    assert tls_only.https("GET", f"/v1/tasks/{sub.task.id}")[0] == 401
    # a client certificate is neither asked for nor needed
    assert tls_only.https("GET", f"/v1/tasks/{sub.task.id}", client=certs.a, token=READER_TOKEN)[0] == 200
    conn = http.client.HTTPConnection("127.0.0.1", tls_only.http_port, timeout=5)
    with pytest.raises((OSError, http.client.HTTPException)):  # plaintext HTTP on the TLS port
        conn.request("GET", "/healthz")
        conn.getresponse()
    conn.close()
    assert tls_only.https("GET", "/healthz")[0] == 200


# Malformed authorization values: every one is UNAUTHENTICATED (nothing echoed back).
BAD_AUTHORIZATION = [
    "",
    "Bearer",
    "Bearer ",
    "bearer",
    "Basic YWRtaW46eA==",
    "Bearer admin s3cret",
    f"Bearer {ADMIN_TOKEN} ",  # spaces around: gRPC keeps them (refused); HTTP trims them (a valid token there)
    f" Bearer {ADMIN_TOKEN}",
    "Bearer " + "x" * 5000,  # over the 4096-character cap, under the transports' header limits
    "Token " + ADMIN_TOKEN,
]


def test_bad_authorization_input_on_grpc(tls_only: TlsServer, certs: Certs) -> None:
    with tls_only.channel() as channel:
        stub = task_service_pb2_grpc.TaskServiceStub(channel)

        def get(value: str) -> Any:
            return lambda: stub.ListTasks(tpb.ListTasksRequest(), metadata=(("authorization", value),), timeout=10)

        for value in BAD_AUTHORIZATION:
            assert code(get(value)) == "UNAUTHENTICATED", value[:40]
        # 64 KiB: over gRPC's hard metadata limit (16 KiB), refused by the transport
        assert code(get("Bearer " + "x" * 65536)) == "RESOURCE_EXHAUSTED"
        # (grpcio refuses to send non-ASCII or control characters in metadata at all; the
        # authenticator's own refusal of them is in tests/unit/test_auth.py)
        assert code(get(f"Bearer {ADMIN_TOKEN}")) == "OK"
        assert code(get(f"bearer   {ADMIN_TOKEN}")) == "OK"  # any case, 1*SP (RFC 7235)
    assert tls_only.alive()


def test_bad_authorization_input_on_https(tls_only: TlsServer, certs: Certs) -> None:
    def get(value: bytes | str) -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPSConnection("127.0.0.1", tls_only.http_port, timeout=10, context=tls_only.context())
        try:
            conn.putrequest("GET", "/v1/tasks")
            conn.putheader("Authorization", value)
            conn.endheaders()
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"null")
        finally:
            conn.close()

    trimmed_valid = {f"Bearer {ADMIN_TOKEN} ", f" Bearer {ADMIN_TOKEN}"}
    cases: list[bytes | str] = [v for v in BAD_AUTHORIZATION if v not in trimmed_valid]
    cases += ["Bearer caf\u00e9".encode(), b"Bearer \xff\xfe", b"Bearer a\tb", "Bearer \u00a0x".encode()]
    for value in cases:
        status, body = get(value)
        assert (status, body["code"]) == (401, "UNAUTHENTICATED"), (value[:40], status, body)
        assert "s3cret" not in body["message"] and "xxxx" not in body["message"]
    status, body = get("Bearer " + "x" * 65536)  # over the listener's 8 KiB header field limit
    assert status == 431 and body["code"] == "INVALID_ARGUMENT"
    assert get(f"Bearer {ADMIN_TOKEN}")[0] == 200
    for value in trimmed_valid:
        assert get(value)[0] == 200  # HTTP trims a header value
    assert tls_only.alive()


# -- start-up: the safe default, hash-token, TLS files -------------------------------


@pytest.mark.parametrize("key", ["listen", "http_listen"])
def test_non_loopback_without_credentials_is_refused(tmp_path: Path, key: str) -> None:
    port = free_port()
    listens = {"listen": f"127.0.0.1:{free_port()}", "http_listen": f"127.0.0.1:{free_port()}"}
    listens[key] = f"0.0.0.0:{port}"
    config = tmp_path / "open.toml"
    config.write_text(
        "[server]\n" + "".join(f'{k} = "{v}"\n' for k, v in listens.items())
        + f'[store]\npath = "{tmp_path / "c.db"}"\n[[pools]]\nname = "default"\n'
    )  # fmt: skip
    out = subprocess.run(server_cmd(config), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert f"server.{key}: '0.0.0.0:{port}' is not loopback" in lines[0]
    assert "allow_unauthenticated" in lines[0]
    assert not (tmp_path / "c.db").exists()  # refused before anything was opened or bound


def test_hash_token(capsys: pytest.CaptureFixture[str]) -> None:
    def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "cronoq_server.main", "hash-token", *args]
        return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=30)

    out = run(stdin=ADMIN_TOKEN + "\n")  # the real command, as `printf '%s\n' "$TOKEN" | cronoq-server hash-token`
    assert out.returncode == 0 and out.stdout == sha256(ADMIN_TOKEN) + "\n"
    helped = run("--help")
    assert helped.returncode == 0 and "sha256" in helped.stdout and "stdin" in helped.stdout
    refused = run(stdin="two words\n")
    assert refused.returncode == 2 and refused.stdout == "" and len(refused.stderr.strip().splitlines()) == 1
    # the same function in this process, for the other inputs
    assert server_main.hash_token(io.StringIO(ADMIN_TOKEN)) == 0  # no newline
    assert capsys.readouterr().out == sha256(ADMIN_TOKEN) + "\n"
    for bad in ("", "\n", "caf\u00e9\n", "a\nb\n", "tab\there\n", "x" * 5000):
        assert server_main.hash_token(io.StringIO(bad)) == 2, bad
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith("cronoq-server hash-token:"), bad
        assert len(captured.err.strip().splitlines()) == 1


def bad_files(tmp_path: Path, certs: Certs) -> dict[str, tuple[str, str]]:
    """config tail -> (the key named, the problem)."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    server, other_key = certs.server, certs.a.key
    tls = f'[server.tls]\ncert = "{server.cert}"\nkey = "{server.key}"\n'
    return {
        "missing cert": (f'[server.tls]\ncert = "{tmp_path}/nope.crt"\nkey = "{server.key}"\n', "server.tls.cert: cannot read"),
        "cert is a directory": (f'[server.tls]\ncert = "{tmp_path}"\nkey = "{server.key}"\n', "server.tls.cert: cannot read"),
        "key of another certificate": (
            f'[server.tls]\ncert = "{server.cert}"\nkey = "{other_key}"\n', "server.tls.key: "
        ),
        "cert not PEM": (f'[server.tls]\ncert = "{garbage}"\nkey = "{server.key}"\n', "server.tls.cert: "),
        "client_ca not PEM": (tls + f'client_ca = "{garbage}"\n', "server.tls.client_ca: "),
        "client_ca missing": (tls + f'client_ca = "{tmp_path}/nope.pem"\n', "server.tls.client_ca: cannot read"),
        "peer_tls ca missing": (f'[server.peer_tls]\nca = "{tmp_path}/nope.pem"\n', "server.peer_tls.ca: cannot read"),
        "clients without client_ca": (
            tls + '[[clients]]\nsubject = "CN=x"\npools = ["*"]\npermissions = ["read"]\n', "clients: "
        ),
        "bad subject": (
            tls + f'client_ca = "{certs.pki.ca_path}"\n[[clients]]\nsubject = "worker-a"\npools = ["*"]\n'
            'permissions = ["read"]\n',
            "clients[0].subject: not a distinguished name",
        ),
    }  # fmt: skip


def test_bad_tls_files_are_refused_at_start_in_one_line(
    tmp_path: Path, certs: Certs, capsys: pytest.CaptureFixture[str]
) -> None:
    head = f'[server]\nlisten = "127.0.0.1:{free_port()}"\nhttp_listen = "127.0.0.1:{free_port()}"\n'
    pools = '[[pools]]\nname = "default"\n'
    failures, paths = [], {}
    for name, (tail, expected) in bad_files(tmp_path, certs).items():
        path = paths[name] = tmp_path / f"{name.replace(' ', '-')}.toml"
        tables, _, clients = tail.partition("[[clients]]")
        path.write_text(head + tables + pools + (f"[[clients]]{clients}" if clients else ""))
        # the server's main() in this process: each case is refused before anything starts
        with pytest.raises(SystemExit) as exit_:
            server_main.main(["--config", str(path)])
        lines = capsys.readouterr().err.strip().splitlines()
        if exit_.value.code != 2 or len(lines) != 1 or not lines[0].startswith(f"cronoq-server: {path}: {expected}"):
            failures.append(f"{name}: exit {exit_.value.code}: {lines}")
    assert not failures, "\n".join(failures)
    # and the real command, for one of them
    out = subprocess.run(server_cmd(paths["missing cert"]), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "server.tls.cert: cannot read" in out.stderr
