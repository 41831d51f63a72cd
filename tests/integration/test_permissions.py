"""The permission matrix: every RPC and every HTTP route x credentials -> expected code,
against real cronoq-server processes (SQLite, pools "a" and "b", [[tokens]] by sha256).

Rules asserted:
1. A task in a pool the caller may not `read` is, to that caller, a missing task: NOT_FOUND
   with the very message a missing id/key of the same shape gets (Get, Wait, Cancel by id or
   key, and as a dependency). Who may read but lacks `cancel` gets PERMISSION_DENIED.
2. A key naming a task of another pool: ALREADY_EXISTS "key K already names a task of another
   pool", no task in the answer, nothing of a batch admitted. A deduplicated submission shows
   the full task only to a caller who may read its pool, else only id, pool and key.
3. A worker id belongs to the principal that registered it; a finish report for a task leased
   to another worker (or attempt) is refused per outcome; a heartbeat for it reports it lost.
4. ListWorkers, ListTasks, Watch and GetSnapshot show only pools the caller may read.
5. Nothing changes on refusal: a full listing (by an all-pools admin token) is compared before
   and after every refused call.

The matrix is a table of call specs (`Call`): a name, the permission, how to call over gRPC
and over HTTP, which target to prepare, the expected code per token, and optional checks of an
accepted answer or of a refusal. Add rows to `matrix_calls()`; every row runs against every
credential in CREDS. Each test starts one server and collects every mismatch, asserting once.

Over mTLS (the *_mtls tests): a second server with [server.tls] (cert, key, client_ca: a
client certificate is required on both listeners), the same [[tokens]], and [[clients]] for
certificate principals mirroring some tokens (CN=full-a, CN=read-a, ... with the same pools
and permissions), CN=carrier (everything) and CN=none (nothing). The same table runs there:
a credential is a (token header, client certificate) pair (`Cred`), and the Env presents the
call's certificate on its gRPC channel (grpc.ssl_channel_credentials) or HTTPS connection
(an ssl.SSLContext). Columns: tokens, sent with the certificate of CN=carrier (a token
wins over the certificate, so it must get exactly what it gets over plaintext); every
[[clients]] certificate without a token (judged by its entry's pools and permissions, as a
token with the same ones; the subject is the principal's name); the bad tokens with the
carrier certificate, and the certificate of a subject no [[clients]] entry names, without a
token: UNAUTHENTICATED on every call and route. Every row runs there, with the token columns of
MTLS_TOKEN_COLUMNS; plaintext runs every column, a group of rows per server (MATRIX_GROUPS).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import queue
import ssl
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from _helpers import store_table  # type: ignore[import-not-found]
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from tls_pki import Pair, Pki

from cronoq.jsonform import to_dict
from cronoq.v1 import (
    admin_service_pb2 as apb,
)
from cronoq.v1 import (
    admin_service_pb2_grpc,
    schedule_service_pb2_grpc,
    task_pb2,
    task_service_pb2_grpc,
    worker_service_pb2_grpc,
)
from cronoq.v1 import (
    schedule_service_pb2 as spb,
)
from cronoq.v1 import (
    task_service_pb2 as tpb,
)
from cronoq.v1 import (
    worker_service_pb2 as wpb,
)

OK = "OK"
UNAUTH = "UNAUTHENTICATED"
DENIED = "PERMISSION_DENIED"
NOT_FOUND = "NOT_FOUND"
EXISTS = "ALREADY_EXISTS"
HTTP_STATUS = {
    OK: 200,
    "INVALID_ARGUMENT": 400,
    UNAUTH: 401,
    DENIED: 403,
    NOT_FOUND: 404,
    EXISTS: 409,
    "ABORTED": 409,
    "FAILED_PRECONDITION": 409,
    "RESOURCE_EXHAUSTED": 429,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
POOLS = ("a", "b")
PERMISSIONS = ("submit", "read", "cancel", "work", "schedule", "admin")
MISSING_ID = 987654321  # shard 0, a sequence no test reaches
MISSING_KEY = "kx-999999"  # the shape of every key below: k<pool>-<6 digits>
# A gRPC Watch that neither fails nor sends within this is an open stream. A refusal comes at
# once, so where one is expected the call is given longer (a slow server is not taken for OK).
WATCH_OPEN_S = 0.5
WATCH_REFUSAL_S = 5.0
TIMEOUT = 10


# -- credentials ------------------------------------------------------------------


@dataclass(frozen=True)
class Tok:
    """One [[tokens]] entry; `label` is unique, `name` is the principal's name."""

    label: str
    name: str
    pools: tuple[str, ...]
    perms: frozenset[str]

    @property
    def secret(self) -> str:
        return f"secret-{self.label}"

    @property
    def header(self) -> str:
        return f"Bearer {self.secret}"

    def may(self, permission: str, pool: str) -> bool:
        return permission in self.perms and ("*" in self.pools or pool in self.pools)

    def readable(self) -> set[str]:
        return {p for p in POOLS if self.may("read", p)}


def _tok(label: str, pools: list[str], perms: Any, name: str | None = None) -> Tok:
    return Tok(label, name or label, tuple(pools), frozenset(perms))


TOKENS: dict[str, Tok] = {
    t.label: t
    for t in [
        _tok("admin-all", ["*"], PERMISSIONS),  # takes the listings that show nothing changed
        _tok("full-a", ["a"], PERMISSIONS),
        _tok("full-b", ["b"], PERMISSIONS),
        _tok("full-ab", ["a", "b"], PERMISSIONS),
        *[_tok(f"{p}-a", ["a"], [p]) for p in PERMISSIONS],  # schedule-a: the "none" token for the rest
        *[_tok(f"no-{p}-a", ["a"], [q for q in PERMISSIONS if q != p]) for p in PERMISSIONS],
        # A token whose principal has another name ("shared"); token names are unique, so a
        # principal has one grant: all its permissions on all its pools.
        _tok("shared-work", ["a"], ["work"], name="shared"),
    ]
}
# Refused before any permission is looked at.
BAD_CREDENTIALS: dict[str, str | None] = {
    "no token": None,
    "unknown token": "Bearer secret-nobody",
    "Basic scheme": "Basic eDp5",
    "empty Bearer": "Bearer",
}


@dataclass(frozen=True)
class Cred:
    """What a call is sent with: an authorization header and, over mTLS, a client certificate
    (a key of CERT_SUBJECTS; None: the Env's default, the carrier). `tok` is the principal the
    call must be judged as (None: a bad credential, UNAUTHENTICATED everywhere)."""

    label: str
    header: str | None
    tok: Tok | None
    cert: str | None = None


CREDS: list[Cred] = [Cred(k, v, None) for k, v in BAD_CREDENTIALS.items()] + [
    Cred(t.label, t.header, t) for t in TOKENS.values()
]

# -- mTLS: the same matrix over [server.tls] with client_ca (a certificate is required) ------
# [[clients]]: certificate principals mirroring tokens (the same pools and permissions; the
# subject is the principal's name, so "CN=full-a" is not the token principal "full-a"), plus
# "CN=carrier" (every permission on every pool) and "CN=none" (pool a, no permission).
CERT_TOKS: dict[str, Tok] = {
    f"CN={t.label}": Tok(f"CN={t.label}", f"CN={t.label}", t.pools, t.perms)
    for t in (TOKENS[x] for x in ("full-a", "full-b", "full-ab", "read-a", "work-a", "submit-a", "no-read-a"))
}
CERT_TOKS["CN=carrier"] = Tok("CN=carrier", "CN=carrier", ("*",), frozenset(PERMISSIONS))
CERT_TOKS["CN=none"] = Tok("CN=none", "CN=none", ("a",), frozenset())
# Client certificates by name: one per [[clients]] entry (named as its label without "CN="),
# a second one of subject CN=full-a (another key: the same principal), and one of a subject
# that no [[clients]] entry names.
CERT_SUBJECTS: dict[str, str] = {
    **{label.removeprefix("CN="): label for label in CERT_TOKS},
    "full-a-2": "CN=full-a",
    "stranger": "CN=stranger",
}
# Every token is sent with the certificate of CN=carrier, which may do everything: a token
# must win over the certificate (docs/configuration.md), so a token column over mTLS expects
# exactly what it expects over plaintext. Were the certificate's permissions used instead of
# the token's, or added to them, every cell where the token is refused would turn OK (and
# change state); were the certificate's name used, the "worker of full-a" rows would turn OK.
# (Sending no token with it is the certificate column CN=carrier.)
CARRIER = "carrier"
MTLS_BAD_CREDS: list[Cred] = [
    Cred(f"{k} (with certificate CN=carrier)", v, None, CARRIER) for k, v in BAD_CREDENTIALS.items() if v is not None
] + [Cred("certificate of an unknown subject (CN=stranger), no token", None, None, "stranger")]


def cert_cred(label: str, cert: str | None = None) -> Cred:
    """A certificate column: the certificate of a [[clients]] principal, no token."""
    return Cred(f"certificate {label}", None, CERT_TOKS[label], cert or label.removeprefix("CN="))


MTLS_CERT_CREDS: list[Cred] = [cert_cred(label) for label in CERT_TOKS]


def tok_of(label: str) -> Tok:
    """A principal by label: a token's label, or a certificate principal's ("CN=...")."""
    return TOKENS[label] if label in TOKENS else CERT_TOKS[label]


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def token_config() -> dict[str, Any]:
    return {
        # Its workers never heartbeat: a lease_ttl longer than the test keeps them listed (a worker
        # silent for twice its lease_ttl is left out of listings).
        "pools": [{"name": "a", "lease_ttl": "10m"}, {"name": "b", "lease_ttl": "10m"}],
        "tokens": [
            {"name": t.name, "sha256": sha256(t.secret), "pools": list(t.pools), "permissions": sorted(t.perms)}
            for t in TOKENS.values()
        ],
    }


def future_ts() -> Timestamp:
    """A run_at a day ahead: seeded tasks are never leased by the matrix's LeaseTasks calls."""
    ts = Timestamp()
    ts.FromSeconds(int(time.time()) + 86400)
    return ts


# -- one server, its stubs and the checks -------------------------------------------


@dataclass
class Target:
    """What a call acts on: a task (id, key, pool) and/or a worker; dependent_id: a task of
    another pool that the task's end ended."""

    task_id: int = 0
    key: str = ""
    pool: str = "a"
    worker_id: str = ""
    dependent_id: int = 0


@dataclass
class Outcome:
    code: str  # OK or a gRPC status code name
    message: str = ""
    body: Any = None  # the answer in its JSON form (to_dict for gRPC)
    status: int | None = None  # HTTP status
    raw: bytes = b""


Metadata = list[tuple[str, str]] | None


class Stubs:
    """The four service stubs of one channel."""

    def __init__(self, channel: grpc.Channel):
        self.channel = channel
        self.tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        self.workers = worker_service_pb2_grpc.WorkerServiceStub(channel)
        self.admin = admin_service_pb2_grpc.AdminServiceStub(channel)
        self.schedules = schedule_service_pb2_grpc.ScheduleServiceStub(channel)


@dataclass
class ClientTls:
    """The client side of an mTLS server: its CA and the client certificates by name."""

    ca_path: str
    certs: dict[str, Pair]
    default: str = CARRIER  # presented when a call names no certificate

    def channel_credentials(self, cert: str) -> grpc.ChannelCredentials:
        pair = self.certs[cert]
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca_path).read_bytes(),
            private_key=Path(pair.key).read_bytes(),
            certificate_chain=Path(pair.cert).read_bytes(),
        )

    def ssl_context(self, cert: str) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_path)
        pair = self.certs[cert]
        ctx.load_cert_chain(pair.cert, pair.key)
        return ctx


class Env:
    """One server, its stubs and the checks. With `tls`, every gRPC channel and HTTPS connection
    presents a client certificate: the one a call names (Cred.cert), else the default; the
    stubs `tasks`, `workers`, ... are those of the certificate being presented."""

    def __init__(self, server: Any, tls: ClientTls | None = None):
        self.server = server
        self.tls = tls
        self.base_url = f"https://127.0.0.1:{server.http_port}" if tls else server.http_url
        self.prefix = "mTLS " if tls else ""  # of every case name
        self._stubs: dict[str | None, Stubs] = {}
        self._contexts: dict[str, ssl.SSLContext] = {}
        self._current: str | None = tls.default if tls else None
        self.problems: list[str] = []
        self.notes: list[str] = []
        self._n = 0
        self._shared: dict[Any, Target] = {}
        self.auth = bool(getattr(server, "config", {}).get("tokens"))
        self.expecting_ok = True  # set per cell: how long a gRPC Watch is given to be refused

    def close(self) -> None:
        for stubs in self._stubs.values():
            stubs.channel.close()

    def fail(self, case: str, what: str) -> None:
        self.problems.append(f"{self.prefix}{case}: {what}")

    def finish(self) -> None:
        for note in self.notes:
            warnings.warn(note, stacklevel=2)
        assert not self.problems, f"{len(self.problems)} mismatch(es):\n" + "\n".join(self.problems)

    # channels and certificates -----------------------------------------------------

    def stubs(self, cert: str | None = None) -> Stubs:
        """The stubs of a channel presenting `cert` (the default without one; none without TLS)."""
        key = (cert or self.tls.default) if self.tls else None
        if key not in self._stubs:
            if self.tls is None:
                channel = grpc.insecure_channel(self.server.grpc_target)
            else:
                assert key is not None
                channel = grpc.secure_channel(self.server.grpc_target, self.tls.channel_credentials(key))
            self._stubs[key] = Stubs(channel)
        return self._stubs[key]

    def ssl_context(self, cert: str | None) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        key = cert or self.tls.default
        if key not in self._contexts:
            self._contexts[key] = self.tls.ssl_context(key)
        return self._contexts[key]

    @contextlib.contextmanager
    def presenting(self, cert: str | None) -> Iterator[None]:
        """Within: `tasks`, `workers`, `admin`, `schedules` are the stubs presenting `cert`."""
        saved, self._current = self._current, cert
        try:
            yield
        finally:
            self._current = saved

    @property
    def tasks(self) -> task_service_pb2_grpc.TaskServiceStub:
        return self.stubs(self._current).tasks

    @property
    def workers(self) -> worker_service_pb2_grpc.WorkerServiceStub:
        return self.stubs(self._current).workers

    @property
    def admin(self) -> admin_service_pb2_grpc.AdminServiceStub:
        return self.stubs(self._current).admin

    @property
    def schedules(self) -> schedule_service_pb2_grpc.ScheduleServiceStub:
        return self.stubs(self._current).schedules

    def urlopen(self, req: urllib.request.Request, cert: str | None, timeout: float) -> Any:
        return urllib.request.urlopen(req, timeout=timeout, context=self.ssl_context(cert))

    # credentials ----------------------------------------------------------------

    @staticmethod
    def md(header: str | None) -> Metadata:
        return [("authorization", header)] if header is not None else None

    def cred(self, label: str) -> Cred:
        """A principal's credential: a token (over mTLS, with the default certificate) or, for
        a certificate principal ("CN=..."), its certificate and no token."""
        if label in TOKENS:
            return Cred(label, TOKENS[label].header if self.auth else None, TOKENS[label])
        assert self.tls is not None, f"{label}: a certificate principal needs the mTLS server"
        return cert_cred(label)

    def as_(self, label: str) -> Metadata:
        return self.md(self.cred(label).header)

    # transports ------------------------------------------------------------------

    def grpc(self, fn: Callable[[Metadata], Any], header: str | None, cert: str | None = None) -> Outcome:
        try:
            with self.presenting(cert):
                resp = fn(self.md(header))
        except grpc.RpcError as err:
            return Outcome(err.code().name, err.details() or "")
        return Outcome(OK, body=to_dict(resp) if isinstance(resp, Message) else resp)

    def http(self, method: str, path: str, header: str | None, body: Any = None, cert: str | None = None) -> Outcome:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if header is not None:
            req.add_header("Authorization", header)
        try:
            with self.urlopen(req, cert, TIMEOUT) as r:
                status, ctype = r.status, r.headers.get("Content-Type", "")
                # An SSE stream: its first line (a comment or an event) is enough.
                raw = r.readline() if ctype.startswith("text/event-stream") else r.read()
        except urllib.error.HTTPError as err:
            status, ctype, raw = err.code, err.headers.get("Content-Type", ""), err.read()
        parsed: Any = None
        if ctype.startswith("application/json"):
            try:
                parsed = json.loads(raw or b"null")
            except ValueError:
                parsed = None
        if status == 200:
            return Outcome(OK, body=parsed, status=status, raw=raw)
        if not isinstance(parsed, dict) or not isinstance(parsed.get("code"), str):
            return Outcome(f"HTTP {status} without a JSON error body", raw.decode(errors="replace")[:200], None, status)
        return Outcome(parsed["code"], str(parsed.get("message", "")), parsed, status, raw)

    # state: what "nothing changed" compares --------------------------------------

    def state(self) -> tuple[dict[int, bytes], dict[str, bytes]]:
        md = self.as_("admin-all")
        tasks: dict[int, bytes] = {}
        token = ""
        while True:
            resp = self.stubs().tasks.ListTasks(
                tpb.ListTasksRequest(page_size=1000, page_token=token), metadata=md, timeout=TIMEOUT
            )
            tasks.update({t.id: t.SerializeToString(deterministic=True) for t in resp.tasks})
            token = resp.next_page_token
            if not token:
                break
        workers = self.stubs().workers.ListWorkers(wpb.ListWorkersRequest(), metadata=md, timeout=TIMEOUT).workers
        return tasks, {w.id: w.SerializeToString(deterministic=True) for w in workers}

    @staticmethod
    def state_diff(before: Any, after: Any) -> str:
        out: list[str] = []
        pairs = (("task", task_pb2.Task, before[0], after[0]), ("worker", wpb.Worker, before[1], after[1]))
        for kind, msg_type, b, a in pairs:
            for k in sorted(set(b) | set(a), key=str):
                if k not in b:
                    out.append(f"{kind} {k} appeared")
                elif k not in a:
                    out.append(f"{kind} {k} vanished")
                elif a[k] != b[k]:
                    old, new = msg_type.FromString(b[k]), msg_type.FromString(a[k])
                    fields = sorted({f.name for f, _ in old.ListFields()} | {f.name for f, _ in new.ListFields()})
                    changed = [f for f in fields if getattr(old, f) != getattr(new, f)]
                    out.append(f"{kind} {k} changed {changed}")
        return "; ".join(out[:4]) + (f" (+{len(out) - 4} more)" if len(out) > 4 else "")

    def admin_tasks(self) -> list[dict[str, Any]]:
        resp = self.stubs().tasks.ListTasks(
            tpb.ListTasksRequest(page_size=1000), metadata=self.as_("admin-all"), timeout=10
        )
        return [to_dict(tpb.GetTaskResponse(task=t))["task"] for t in resp.tasks]

    def admin_workers(self) -> list[wpb.Worker]:
        req = wpb.ListWorkersRequest()
        return list(self.stubs().workers.ListWorkers(req, metadata=self.as_("admin-all"), timeout=10).workers)

    # fixtures of the matrix -------------------------------------------------------

    def spec(self, pool: str, key: str = "", **extra: Any) -> tpb.SubmitTaskRequest:
        self._n += 1
        return tpb.SubmitTaskRequest(
            pool=pool,
            key=key,
            payload=json.dumps({"n": self._n, "pool": pool}).encode(),
            content_type="application/json",
            run_at=future_ts(),
            **extra,
        )

    def spec_json(self, pool: str, key: str = "", depends_on: list[dict[str, str]] | None = None) -> dict[str, Any]:
        self._n += 1
        body: dict[str, Any] = {"pool": pool, "payload_json": {"n": self._n}, "run_at": future_ts().ToJsonString()}
        if key:
            body["key"] = key
        if depends_on:
            body["depends_on"] = depends_on
        return body

    def new_key(self, pool: str) -> str:
        self._n += 1
        return f"k{pool}-{self._n:06d}"

    def submit(self, pool: str, due_now: bool = False, label: str = "admin-all") -> task_pb2.Task:
        spec = self.spec(pool, self.new_key(pool))
        if due_now:
            spec.ClearField("run_at")
        c = self.cred(label)
        return self.stubs(c.cert).tasks.SubmitTask(spec, metadata=self.md(c.header), timeout=TIMEOUT).task

    def fresh_task(self, pool: str) -> Target:
        t = self.submit(pool)
        return Target(task_id=t.id, key=t.key, pool=pool)

    def cancelled_task(self, pool: str) -> Target:
        target = self.fresh_task(pool)
        req = tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=target.task_id))
        self.stubs().tasks.CancelTask(req, metadata=self.as_("admin-all"), timeout=TIMEOUT)
        return target

    def shared_task(self, pool: str) -> Target:
        if pool not in self._shared:
            self._shared[pool] = self.fresh_task(pool)
        return self._shared[pool]

    def register(self, label: str, pools: list[str], name: str = "w") -> str:
        req = wpb.RegisterWorkerRequest(name=name, pools=pools)
        c = self.cred(label)
        return self.stubs(c.cert).workers.RegisterWorker(req, metadata=self.md(c.header), timeout=TIMEOUT).worker_id

    def worker(self, label: str, fresh: bool) -> Target:
        if fresh:
            return Target(worker_id=self.register(label, ["a"], f"{label}-fresh"))
        if ("worker", label) not in self._shared:
            self._shared[("worker", label)] = Target(worker_id=self.register(label, ["a"], label))
        return self._shared[("worker", label)]


# -- call specs -------------------------------------------------------------------

GrpcFn = Callable[[Env, Target, Metadata], Any]
HttpFn = Callable[[Env, Target], tuple[str, str, Any]]
CheckFn = Callable[[Env, Tok, Target, Outcome], list[str]]


@dataclass
class Call:
    """One row of the matrix."""

    name: str
    permission: str | None  # documentation: the permission the call needs
    expect: Callable[[Tok], str | None]  # the code for a valid token; None: not asserted (not called)
    grpc: GrpcFn | None = None
    http: HttpFn | None = None
    prepare: Callable[[Env, Tok | None], Target] = lambda env, tok: Target()
    # Calls that change nothing even when accepted: the listing is compared for OK too.
    pure: bool = False
    # For rule 1: the target of the same shape that does not exist, and the text naming a target.
    missing: Callable[[Target], Target] | None = None
    ref: Callable[[Target], str] | None = None
    check_ok: CheckFn | None = None
    check_refusal: CheckFn | None = None


def needs(permission: str, *pools: str) -> Callable[[Tok], str]:
    pools = pools or ("a",)
    return lambda tok: OK if all(tok.may(permission, p) for p in pools) else DENIED


def anyone(tok: Tok) -> str:
    return OK


def holds(permission: str) -> Callable[[Tok], str]:
    """A call over every pool the caller may see: it needs the permission on some pool."""
    return lambda tok: OK if permission in tok.perms else DENIED


def hidden_unless_readable(permission: str, pool: str) -> Callable[[Tok], str]:
    """Rule 1: without read on the task's pool it is missing; with read, the permission decides.
    A caller who holds the RPC's permission on no pool at all is refused before any lookup."""

    def expect(tok: Tok) -> str:
        if permission not in tok.perms:
            return DENIED
        if not tok.may("read", pool):
            return NOT_FOUND
        return OK if tok.may(permission, pool) else DENIED

    return expect


def depends_across(tok: Tok) -> str:
    """Submitting to a with a dependency on a pool-b task."""
    if not tok.may("submit", "a"):
        return DENIED
    return OK if tok.may("read", "b") else NOT_FOUND


def key_across(tok: Tok) -> str | None:
    """Submitting to a under the key of a pool-b task (asserted for callers who cannot read b)."""
    if not tok.may("submit", "a"):
        return DENIED
    return EXISTS if not tok.may("read", "b") else None


def owned_by(label: str) -> Callable[[Tok], str]:
    owner = TOKENS[label]
    return lambda tok: OK if tok.name == owner.name and tok.may("work", "a") else DENIED


def _ref(kind: str, t: Target) -> task_pb2.TaskRef:
    return task_pb2.TaskRef(id=t.task_id) if kind == "id" else task_pb2.TaskRef(key=t.key)


def _ref_text(kind: str) -> Callable[[Target], str]:
    return lambda t: str(t.task_id) if kind == "id" else t.key


def _missing(kind: str) -> Callable[[Target], Target]:
    return lambda t: Target(task_id=MISSING_ID, key=MISSING_KEY, pool=t.pool)


def _dep_json(kind: str, t: Target) -> dict[str, str]:
    return {"id": str(t.task_id)} if kind == "id" else {"key": t.key}


# checks of accepted answers ---------------------------------------------------------


def _pools_of(tasks: list[dict[str, Any]]) -> set[str]:
    return {t.get("pool", "") for t in tasks}


def check_task_is(state: str | None = None) -> CheckFn:
    def check(env: Env, tok: Tok, target: Target, out: Outcome) -> list[str]:
        task = (out.body or {}).get("task") or {}
        problems = []
        if str(task.get("id")) != str(target.task_id):
            problems.append(f"answer names task {task.get('id')}, want {target.task_id}")
        if state and task.get("state") != state:
            problems.append(f"task state {task.get('state')}, want {state}")
        return problems

    return check


def check_submitted(env: Env, tok: Tok, target: Target, out: Outcome) -> list[str]:
    body = out.body or {}
    tasks = body.get("tasks") or [body.get("task") or {}]
    if _pools_of(tasks) != {"a"} or body.get("deduplicated") or body.get("deduplicated_ids"):
        return [f"expected new pool-a task(s), got {body!r}"]
    return []


def check_listing(pool: str | None) -> CheckFn:
    """ListTasks shows exactly the tasks of the pools the caller may read (or of `pool`)."""

    def check(env: Env, tok: Tok, target: Target, out: Outcome) -> list[str]:
        shown = (out.body or {}).get("tasks", [])
        pools = {pool} if pool else tok.readable()
        want = sorted(str(t["id"]) for t in env.admin_tasks() if t["pool"] in pools)
        got = sorted(str(t["id"]) for t in shown)
        if got != want:
            return [
                f"listed pools {sorted(_pools_of(shown))} ({len(got)} tasks), want pools {sorted(pools)} ({len(want)})"
            ]
        return []

    return check


def check_workers(env: Env, tok: Tok, target: Target, out: Outcome) -> list[str]:
    """ListWorkers: only readable pools, and every worker of a readable pool."""
    readable = tok.readable()
    shown = {w["id"]: w.get("pools", []) for w in (out.body or {}).get("workers", [])}
    want = {w.id: [p for p in w.pools if p in readable] for w in env.admin_workers()}
    want = {k: v for k, v in want.items() if v}
    if shown != want:
        extra = {k: v for k, v in shown.items() if want.get(k) != v}
        return [f"workers shown with pools not as readable {sorted(readable)}: e.g. {dict(list(extra.items())[:3])!r}"]
    return []


def check_snapshot(env: Env, tok: Tok, target: Target, out: Outcome) -> list[str]:
    shards = (out.body or {}).get("shards", [])
    readable = tok.readable()
    shown = readable | {p for p in POOLS if tok.may("admin", p)}  # counts: pools it may read or administer
    problems = []
    pools = sorted(p["pool"] for s in shards for p in s.get("pools", []))
    if pools != sorted(shown):
        problems.append(f"snapshot pools {pools}, want {sorted(shown)}")
    worker_pools = {p for s in shards for w in s.get("workers", []) for p in w.get("pools", [])}
    if not worker_pools <= readable:
        problems.append(f"snapshot shows workers of pools {sorted(worker_pools - readable)}")
    activity = sorted(a["pool"] for s in shards for a in s.get("activity", []))
    if activity != sorted(shown):
        problems.append(f"snapshot activity of pools {activity}, want {sorted(shown)}")
    if "admin" not in tok.perms and any(s.get("resources") for s in shards):
        problems.append("snapshot shows resources to a caller without admin")
    return problems


def check_watch_opened(env: Env, tok: Tok, target: Target, out: Outcome) -> list[str]:
    if out.status is not None and not out.raw.startswith((b":", b"data:")):
        return [f"SSE stream began with {out.raw!r}"]
    return []


DEFAULTS = ("", 0, "0", [], {}, False, None, "TASK_STATE_UNSPECIFIED", "RUN_WHEN_UNSPECIFIED")


def _extra_fields(task: dict[str, Any]) -> list[str]:
    return sorted(k for k, v in task.items() if k not in ("id", "pool", "key") and v not in DEFAULTS)


def check_dedup(batch: bool) -> CheckFn:
    """Rule 2: a deduplicated submission shows the full task only to who may read its pool."""

    def check(env: Env, tok: Tok, target: Target, out: Outcome) -> list[str]:
        body = out.body or {}
        if batch:
            tasks = body.get("tasks") or [{}]
            task = tasks[0]
            deduplicated = [str(i) for i in body.get("deduplicated_ids", [])] == [str(target.task_id)]
        else:
            task = body.get("task") or {}
            deduplicated = body.get("deduplicated") is True
        problems = []
        if not deduplicated or str(task.get("id")) != str(target.task_id):
            problems.append(f"not deduplicated to task {target.task_id}: {body!r}")
        if (task.get("pool"), task.get("key")) != (target.pool, target.key):
            problems.append(f"deduplicated answer lacks pool/key: {task!r}")
        if tok.may("read", target.pool):
            if not (task.get("payload_json") or task.get("payload")) or task.get("state") != "TASK_STATE_PENDING":
                problems.append(f"a reader gets the full task, got {task!r}")
        elif extra := _extra_fields(task):
            problems.append(f"a caller without read sees fields {extra} of the deduplicated task")
        return problems

    return check


# checks of refusals -----------------------------------------------------------------


def check_key_taken(env: Env, tok: Tok, target: Target, out: Outcome) -> list[str]:
    if out.code != EXISTS:
        return []
    problems = []
    want = f"key {target.key} already names a task of another pool"
    if want not in out.message.replace(repr(target.key), target.key).replace(f'"{target.key}"', target.key):
        problems.append(f"message {out.message!r}, want {want!r}")
    if isinstance(out.body, dict) and ({"task", "tasks"} & set(out.body)):
        problems.append(f"the refusal carries a task: {out.body!r}")
    return problems


# the rows ---------------------------------------------------------------------------


def lookup_rows() -> list[Call]:
    rows = []
    for pool in POOLS:
        for kind in ("id", "key"):
            for verb in ("Get", "Wait", "Cancel"):
                permission = "cancel" if verb == "Cancel" else "read"

                def grpc_call(env: Env, t: Target, md: Metadata, verb: str = verb, kind: str = kind) -> Any:
                    ref = _ref(kind, t)
                    if verb == "Get":
                        return env.tasks.GetTask(tpb.GetTaskRequest(task=ref), metadata=md, timeout=TIMEOUT)
                    if verb == "Wait":
                        req = tpb.WaitTaskRequest(task=ref, timeout_ms=1)
                        return env.tasks.WaitTask(req, metadata=md, timeout=TIMEOUT)
                    return env.tasks.CancelTask(tpb.CancelTaskRequest(task=ref), metadata=md, timeout=TIMEOUT)

                def http_call(env: Env, t: Target, verb: str = verb, kind: str = kind) -> tuple[str, str, Any]:
                    base = f"/v1/tasks/{t.task_id}" if kind == "id" else f"/v1/keys/{t.key}"
                    if verb == "Get":
                        return "GET", base, None
                    if verb == "Wait":
                        return "GET", base + "/wait?timeout_ms=1", None
                    return "POST", base + "/cancel", None

                fresh = verb == "Cancel"
                rows.append(
                    Call(
                        f"{verb}Task by {kind} (pool-{pool} task)",
                        permission,
                        hidden_unless_readable(permission, pool),
                        grpc_call,
                        http_call,
                        prepare=(
                            (lambda env, tok, pool=pool: env.fresh_task(pool))
                            if fresh
                            else (lambda env, tok, pool=pool: env.shared_task(pool))
                        ),
                        pure=not fresh,
                        missing=_missing(kind),
                        ref=_ref_text(kind),
                        check_ok=check_task_is("TASK_STATE_CANCELLED" if fresh else None),
                    )
                )
    return rows


def retry_and_delete_rows() -> list[Call]:
    """RetryTask (submit) and DeleteTask (admin) of a CANCELLED task, by id and by key: as the
    other lookups, a task of a pool the caller may not read is a missing one. One pool per
    kind of ref (tokens of either pool alone find the other's tasks missing)."""
    rows = []
    for pool, kind in (("a", "id"), ("b", "key")):
        rows += [
            Call(
                f"RetryTask by {kind} (pool-{pool} cancelled task)",
                "submit",
                hidden_unless_readable("submit", pool),
                # Due a day ahead, as every task here: the matrix's LeaseTasks never takes it.
                lambda env, t, md, kind=kind: env.tasks.RetryTask(
                    tpb.RetryTaskRequest(task=_ref(kind, t), run_at=future_ts()), metadata=md, timeout=TIMEOUT
                ),
                lambda env, t, kind=kind: (
                    "POST",
                    f"{_http_base(kind, t)}/retry",
                    {"run_at": future_ts().ToJsonString()},
                ),
                prepare=lambda env, tok, pool=pool: env.cancelled_task(pool),
                missing=_missing(kind),
                ref=_ref_text(kind),
                check_ok=check_task_is("TASK_STATE_PENDING"),
            ),
            Call(
                f"DeleteTask by {kind} (pool-{pool} cancelled task)",
                "admin",
                hidden_unless_readable("admin", pool),
                lambda env, t, md, kind=kind: env.tasks.DeleteTask(
                    tpb.DeleteTaskRequest(task=_ref(kind, t)), metadata=md, timeout=TIMEOUT
                ),
                lambda env, t, kind=kind: ("DELETE", _http_base(kind, t), None),
                prepare=lambda env, tok, pool=pool: env.cancelled_task(pool),
                missing=_missing(kind),
                ref=_ref_text(kind),
                check_ok=check_deleted,
            ),
        ]
    return rows


def _http_base(kind: str, t: Target) -> str:
    return f"/v1/tasks/{t.task_id}" if kind == "id" else f"/v1/keys/{t.key}"


def _cancelled_with_dependent(env: Env, tok: Tok | None) -> Target:
    """A CANCELLED task of pool a, and its pool-b dependent that the cancel ended."""
    target = env.fresh_task("a")
    spec = env.spec("b", env.new_key("b"), depends_on=[task_pb2.TaskRef(id=target.task_id)])
    md = env.as_("admin-all")
    target.dependent_id = env.stubs().tasks.SubmitTask(spec, metadata=md, timeout=TIMEOUT).task.id
    req = tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=target.task_id))
    env.stubs().tasks.CancelTask(req, metadata=md, timeout=TIMEOUT)
    return target


def check_dependent_restored(bulk: bool) -> CheckFn:
    """A retry brings back (and RetryTask counts) the pool-b dependent only for a caller who may
    submit to b: one who could retry it itself."""

    def check(env: Env, tok: Tok, target: Target, out: Outcome) -> list[str]:
        req = tpb.GetTaskRequest(task=task_pb2.TaskRef(id=target.dependent_id))
        dependent = env.stubs().tasks.GetTask(req, metadata=env.as_("admin-all"), timeout=TIMEOUT).task
        state = task_pb2.TaskState.Name(dependent.state)
        restorable = tok.may("submit", "b")
        want = "TASK_STATE_BLOCKED" if restorable else "TASK_STATE_CANCELLED"
        problems = [] if state == want else [f"pool-b dependent {state}, want {want}"]
        body = out.body or {}
        if bulk:
            counted = int(body.get("changed", 0))
            if counted != 1:
                problems.append(f"changed {counted}, want 1 (the task, not its dependent)")
        else:
            counted = int(body.get("dependents_restored", 0))
            if counted != int(restorable):
                problems.append(f"dependents_restored {counted}, want {int(restorable)}")
        return problems

    return check


def retry_with_dependents_rows() -> list[Call]:
    """RetryTask and RetryTasks of a pool-a task whose end ended a pool-b dependent: the
    dependent waits again only for a caller who may submit to b (else it stays ended and
    RetryTask's dependents_restored does not count it)."""
    return [
        Call(
            "RetryTask by id (pool-a cancelled task with a pool-b dependent)",
            "submit",
            hidden_unless_readable("submit", "a"),
            lambda env, t, md: env.tasks.RetryTask(
                tpb.RetryTaskRequest(task=_ref("id", t), run_at=future_ts()), metadata=md, timeout=TIMEOUT
            ),
            lambda env, t: ("POST", f"{_http_base('id', t)}/retry", {"run_at": future_ts().ToJsonString()}),
            prepare=_cancelled_with_dependent,
            missing=_missing("id"),
            ref=_ref_text("id"),
            check_ok=check_dependent_restored(bulk=False),
        ),
        Call(
            "RetryTasks, pool a (a cancelled task with a pool-b dependent)",
            "submit",
            lambda tok: OK if tok.may("submit", "a") and tok.may("read", "a") else DENIED,
            lambda env, t, md: env.tasks.RetryTasks(
                tpb.RetryTasksRequest(filter=tpb.TaskFilter(pool="a", ids=[t.task_id]), run_at=future_ts()),
                metadata=md,
                timeout=TIMEOUT,
            ),
            lambda env, t: (
                "POST",
                "/v1/tasks/bulk-retry",
                {"filter": {"pool": "a", "ids": [str(t.task_id)]}, "run_at": future_ts().ToJsonString()},
            ),
            prepare=_cancelled_with_dependent,
            check_ok=check_dependent_restored(bulk=True),
        ),
    ]


def check_deleted(env: Env, tok: Tok, target: Target, out: Outcome) -> list[str]:
    problems = []
    if str((out.body or {}).get("id")) != str(target.task_id):
        problems.append(f"answer names task {(out.body or {}).get('id')}, want {target.task_id}")
    if any(str(t["id"]) == str(target.task_id) for t in env.admin_tasks()):
        problems.append(f"task {target.task_id} is still listed")
    return problems


def submit_rows() -> list[Call]:
    rows = [
        Call(
            "SubmitTask",
            "submit",
            needs("submit"),
            lambda env, t, md: env.tasks.SubmitTask(env.spec("a"), metadata=md, timeout=TIMEOUT),
            lambda env, t: ("POST", "/v1/tasks", env.spec_json("a")),
            check_ok=check_submitted,
        ),
        Call(
            "SubmitBatch",
            "submit",
            needs("submit"),
            lambda env, t, md: env.tasks.SubmitBatch(
                tpb.SubmitBatchRequest(tasks=[env.spec("a"), env.spec("a")]), metadata=md, timeout=TIMEOUT
            ),
            lambda env, t: ("POST", "/v1/batches", {"tasks": [env.spec_json("a"), env.spec_json("a")]}),
            check_ok=check_submitted,
        ),
        Call(
            "SubmitTask, pool b",
            "submit",
            needs("submit", "b"),
            lambda env, t, md: env.tasks.SubmitTask(env.spec("b"), metadata=md, timeout=TIMEOUT),
            lambda env, t: ("POST", "/v1/tasks", env.spec_json("b")),
        ),
        Call(
            "SubmitBatch, pools a and b",
            "submit",
            needs("submit", "a", "b"),
            lambda env, t, md: env.tasks.SubmitBatch(
                tpb.SubmitBatchRequest(tasks=[env.spec("a"), env.spec("b")]), metadata=md, timeout=TIMEOUT
            ),
            lambda env, t: ("POST", "/v1/batches", {"tasks": [env.spec_json("a"), env.spec_json("b")]}),
        ),
    ]
    for kind in ("id", "key"):
        rows += [
            Call(
                f"SubmitTask to a, depends_on a pool-b task by {kind}",
                "submit",
                depends_across,
                lambda env, t, md, kind=kind: env.tasks.SubmitTask(
                    env.spec("a", depends_on=[_ref(kind, t)]), metadata=md, timeout=TIMEOUT
                ),
                lambda env, t, kind=kind: ("POST", "/v1/tasks", env.spec_json("a", depends_on=[_dep_json(kind, t)])),
                prepare=lambda env, tok: env.shared_task("b"),
                missing=_missing(kind),
                ref=_ref_text(kind),
            ),
            Call(
                f"SubmitBatch to a, depends_on a pool-b task by {kind}",
                "submit",
                depends_across,
                lambda env, t, md, kind=kind: env.tasks.SubmitBatch(
                    tpb.SubmitBatchRequest(tasks=[env.spec("a"), env.spec("a", depends_on=[_ref(kind, t)])]),
                    metadata=md,
                    timeout=TIMEOUT,
                ),
                lambda env, t, kind=kind: (
                    "POST",
                    "/v1/batches",
                    {"tasks": [env.spec_json("a"), env.spec_json("a", depends_on=[_dep_json(kind, t)])]},
                ),
                prepare=lambda env, tok: env.shared_task("b"),
                missing=_missing(kind),
                ref=_ref_text(kind),
            ),
        ]
    rows += [
        Call(
            "SubmitTask to a under the key of a pool-b task",
            "submit",
            key_across,
            lambda env, t, md: env.tasks.SubmitTask(env.spec("a", t.key), metadata=md, timeout=TIMEOUT),
            lambda env, t: ("POST", "/v1/tasks", env.spec_json("a", t.key)),
            prepare=lambda env, tok: env.shared_task("b"),
            check_refusal=check_key_taken,
        ),
        Call(
            "SubmitBatch to a, second task under the key of a pool-b task",
            "submit",
            key_across,
            lambda env, t, md: env.tasks.SubmitBatch(
                tpb.SubmitBatchRequest(tasks=[env.spec("a", env.new_key("a")), env.spec("a", t.key)]),
                metadata=md,
                timeout=TIMEOUT,
            ),
            lambda env, t: (
                "POST",
                "/v1/batches",
                {"tasks": [env.spec_json("a", env.new_key("a")), env.spec_json("a", t.key)]},
            ),
            prepare=lambda env, tok: env.shared_task("b"),
            check_refusal=check_key_taken,
        ),
        Call(
            "SubmitTask deduplicated (same key, same pool)",
            "submit",
            needs("submit"),
            lambda env, t, md: env.tasks.SubmitTask(env.spec("a", t.key), metadata=md, timeout=TIMEOUT),
            lambda env, t: ("POST", "/v1/tasks", env.spec_json("a", t.key)),
            prepare=lambda env, tok: env.shared_task("a"),
            pure=True,
            check_ok=check_dedup(batch=False),
        ),
        Call(
            "SubmitBatch deduplicated (same key, same pool)",
            "submit",
            needs("submit"),
            lambda env, t, md: env.tasks.SubmitBatch(
                tpb.SubmitBatchRequest(tasks=[env.spec("a", t.key)]), metadata=md, timeout=TIMEOUT
            ),
            lambda env, t: ("POST", "/v1/batches", {"tasks": [env.spec_json("a", t.key)]}),
            prepare=lambda env, tok: env.shared_task("a"),
            pure=True,
            check_ok=check_dedup(batch=True),
        ),
    ]
    return rows


def grpc_watch(pool: str) -> GrpcFn:
    def call(env: Env, t: Target, md: Metadata) -> Any:
        wait = WATCH_OPEN_S if env.expecting_ok else WATCH_REFUSAL_S
        stream = env.tasks.Watch(tpb.WatchRequest(pool=pool), metadata=md, timeout=wait)
        try:
            return next(stream)
        except StopIteration:
            return None
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return None  # open, nothing to send yet: accepted
            raise
        finally:
            stream.cancel()

    return call


def list_and_watch_rows() -> list[Call]:
    rows = []
    for pool in ("a", "b", ""):
        req = tpb.ListTasksRequest(pool=pool, page_size=1000)
        rows.append(
            Call(
                f"ListTasks pool={pool or '(all)'}",
                "read",
                needs("read", pool) if pool else holds("read"),
                lambda env, t, md, req=req: env.tasks.ListTasks(req, metadata=md, timeout=TIMEOUT),
                lambda env, t, pool=pool: ("GET", f"/v1/tasks?page_size=1000&pool={pool}", None),
                pure=True,
                check_ok=check_listing(pool or None),
            )
        )
        # The same listing through ListTasks' filter (every state named: it matches every task).
        states = [s for s in task_pb2.TaskState.values() if s]
        freq = tpb.ListTasksRequest(filter=tpb.TaskFilter(pool=pool, states=states), page_size=1000)  # type: ignore[arg-type]
        query = "".join(f"&filter.states={task_pb2.TaskState.Name(s)}" for s in states)
        rows.append(
            Call(
                f"ListTasks filter.pool={pool or '(all)'}",
                "read",
                needs("read", pool) if pool else holds("read"),
                lambda env, t, md, req=freq: env.tasks.ListTasks(req, metadata=md, timeout=TIMEOUT),
                lambda env, t, pool=pool, query=query: (
                    "GET",
                    f"/v1/tasks?page_size=1000&filter.pool={pool}{query}",
                    None,
                ),
                pure=True,
                check_ok=check_listing(pool or None),
            )
        )
    for pool in ("a", "b"):
        rows.append(
            Call(
                f"Watch pool={pool}",
                "read",
                needs("read", pool),
                grpc_watch(pool),
                lambda env, t, pool=pool: ("GET", f"/v1/watch?pool={pool}", None),
                pure=True,
                check_ok=check_watch_opened,
            )
        )
    return rows


def worker_rows() -> list[Call]:
    rows = [
        Call(
            "RegisterWorker pools=[a]",
            "work",
            needs("work"),
            lambda env, t, md: env.workers.RegisterWorker(
                wpb.RegisterWorkerRequest(name="m", pools=["a"]), metadata=md, timeout=TIMEOUT
            ),
            check_ok=lambda env, tok, t, out: [] if (out.body or {}).get("worker_id") else ["no worker_id"],
        ),
        Call(
            "RegisterWorker pools=[a, b]",
            "work",
            needs("work", "a", "b"),
            lambda env, t, md: env.workers.RegisterWorker(
                wpb.RegisterWorkerRequest(name="m", pools=["a", "b"]), metadata=md, timeout=TIMEOUT
            ),
        ),
    ]
    verbs: dict[str, GrpcFn] = {
        "LeaseTasks": lambda env, t, md: env.workers.LeaseTasks(
            wpb.LeaseTasksRequest(worker_id=t.worker_id, max_tasks=1, wait_ms=0), metadata=md, timeout=TIMEOUT
        ),
        "Heartbeat": lambda env, t, md: env.workers.Heartbeat(
            wpb.HeartbeatRequest(worker_id=t.worker_id), metadata=md, timeout=TIMEOUT
        ),
        "FinishTasks": lambda env, t, md: env.workers.FinishTasks(
            wpb.FinishTasksRequest(worker_id=t.worker_id), metadata=md, timeout=TIMEOUT
        ),
        # The worker's stream: one heartbeat, then the caller closes its side; the server
        # answers it and ends the stream (OK), or refuses the stream.
        "Work": lambda env, t, md: list(
            env.workers.Work(
                iter([wpb.WorkRequest(worker_id=t.worker_id, heartbeat=wpb.WorkHeartbeat())]),
                metadata=md,
                timeout=TIMEOUT,
            )
        ),
        "DeregisterWorker": lambda env, t, md: env.workers.DeregisterWorker(
            wpb.DeregisterWorkerRequest(worker_id=t.worker_id), metadata=md, timeout=TIMEOUT
        ),
    }
    for verb, fn in verbs.items():
        fresh = verb == "DeregisterWorker"
        # The worker of full-a: every other principal is refused, whatever it may do (rule 3).
        rows.append(
            Call(
                f"{verb} (worker of full-a)",
                "work",
                owned_by("full-a"),
                fn,
                prepare=lambda env, tok, fresh=fresh: env.worker("full-a", fresh),
            )
        )

        # The caller's own worker (full-a's for a caller that cannot register one).
        def own(env: Env, tok: Tok | None, fresh: bool = fresh) -> Target:
            label = tok.label if tok is not None and tok.may("work", "a") else "full-a"
            return env.worker(label, fresh)

        rows.append(Call(f"{verb} (the caller's own worker)", "work", needs("work"), fn, prepare=own))
    for pool in ("a", "b"):
        rows.append(
            Call(
                f"ListWorkers pool={pool}",
                "read",
                needs("read", pool),
                lambda env, t, md, pool=pool: env.workers.ListWorkers(
                    wpb.ListWorkersRequest(pool=pool), metadata=md, timeout=TIMEOUT
                ),
                lambda env, t, pool=pool: ("GET", f"/v1/workers?pool={pool}", None),
                pure=True,
            )
        )
    rows.append(
        Call(
            "ListWorkers",
            "read",
            holds("read"),
            lambda env, t, md: env.workers.ListWorkers(wpb.ListWorkersRequest(), metadata=md, timeout=TIMEOUT),
            lambda env, t: ("GET", "/v1/workers", None),
            pure=True,
            check_ok=check_workers,
        )
    )
    return rows


def admin_rows() -> list[Call]:
    return [
        Call(
            "GetSnapshot",
            "admin",
            lambda tok: OK if {"admin", "read"} & set(tok.perms) else DENIED,
            lambda env, t, md: env.admin.GetSnapshot(apb.GetSnapshotRequest(), metadata=md, timeout=TIMEOUT),
            lambda env, t: ("GET", "/v1/snapshot", None),
            pure=True,
            check_ok=check_snapshot,
        ),
        Call(
            "GetServerInfo",
            None,
            anyone,
            lambda env, t, md: env.admin.GetServerInfo(apb.GetServerInfoRequest(), metadata=md, timeout=TIMEOUT),
            lambda env, t: ("GET", "/v1/info", None),
            pure=True,
        ),
        Call(
            "/metrics",
            "admin",
            lambda tok: OK if "admin" in tok.perms else DENIED,
            http=lambda env, t: ("GET", "/metrics", None),
            pure=True,
        ),
    ]


# Bulk actions: (permission, the state the action leaves its task in, the HTTP route).
BULK = {
    "CancelTasks": ("cancel", "TASK_STATE_CANCELLED", "bulk-cancel"),
    "RetryTasks": ("submit", "TASK_STATE_PENDING", "bulk-retry"),
    "DeleteTasks": ("admin", "deleted", "bulk-delete"),
}


def _ended_task(env: Env, tok: Tok | None) -> Target:
    """A CANCELLED task of pool a: one that retry and delete apply to."""
    target = env.fresh_task("a")
    req = tpb.CancelTaskRequest(task=task_pb2.TaskRef(id=target.task_id))
    env.stubs().tasks.CancelTask(req, metadata=env.as_("admin-all"), timeout=TIMEOUT)
    return target


def check_bulk(rpc: str, covered: Callable[[Tok], bool]) -> CheckFn:
    """The bulk call changed the task exactly when the caller holds the permission and read on its pool."""
    after = BULK[rpc][1]

    def check(env: Env, tok: Tok, target: Target, out: Outcome) -> list[str]:
        req = tpb.ListTasksRequest(pool="a", page_size=1000)
        listed = env.stubs().tasks.ListTasks(req, metadata=env.as_("admin-all"), timeout=TIMEOUT).tasks
        state = next((task_pb2.TaskState.Name(t.state) for t in listed if t.id == target.task_id), "deleted")
        changed = int((out.body or {}).get("changed", 0))
        ok = changed == 1 and state == after if covered(tok) else changed == 0 and state != after
        return [] if ok else [f"changed {changed}, task {state} (covered: {covered(tok)})"]

    return check


def bulk_rows() -> list[Call]:
    """A refused bulk call changes nothing (rule 5); an accepted one acts on the pools where the
    caller holds the action's permission and read: the named pool, else every such pool."""
    rows = []
    for rpc, (permission, _, route) in BULK.items():
        request = getattr(tpb, rpc.replace("Tasks", "TasksRequest"))
        method = rpc

        def covers(tok: Tok, permission: str = permission) -> bool:
            return tok.may(permission, "a") and tok.may("read", "a")

        prepare = (lambda env, tok: env.fresh_task("a")) if rpc == "CancelTasks" else _ended_task
        # The pools covered without one named are chosen alike for the three: one row shows it.
        for pool in ("a", "") if rpc == "CancelTasks" else ("a",):

            def grpc_call(env: Env, t: Target, md: Metadata, request: Any = request, method: str = method,
                          pool: str = pool) -> Any:  # fmt: skip
                req = request(filter=tpb.TaskFilter(pool=pool, ids=[t.task_id]))
                return getattr(env.tasks, method)(req, metadata=md, timeout=TIMEOUT)

            def http_call(env: Env, t: Target, route: str = route, pool: str = pool) -> tuple[str, str, Any]:
                return "POST", f"/v1/tasks/{route}", {"filter": {"pool": pool, "ids": [str(t.task_id)]}}

            rows.append(
                Call(
                    f"{rpc}, pool {pool or '(none: the pools the caller may act on)'}",
                    permission,
                    (lambda tok, covers=covers: OK if covers(tok) else DENIED) if pool else holds(permission),
                    grpc_call,
                    http_call,
                    prepare=prepare,
                    check_ok=check_bulk(rpc, covers),
                )
            )
    return rows


def _admin_schedules(env: Env) -> list[tuple[str, str]]:
    req = spb.ListSchedulesRequest()
    listed = env.stubs().schedules.ListSchedules(req, metadata=env.as_("admin-all"), timeout=TIMEOUT).schedules
    return [(s.pool, s.name) for s in listed]


def _new_schedule(env: Env, tok: Tok | None, pool: str = "a") -> Target:
    """A schedule name no cell used (a daily cron: it creates no task while the matrix runs)."""
    return Target(key=env.new_key("s"), pool=pool)


def _existing_schedule(env: Env, tok: Tok | None) -> Target:
    target = _new_schedule(env, tok)
    sched = spb.Schedule(pool="a", name=target.key, cron="0 3 * * *")
    env.stubs().schedules.PutSchedule(
        spb.PutScheduleRequest(schedule=sched), metadata=env.as_("admin-all"), timeout=TIMEOUT
    )
    return target


def check_schedule_listed(present: bool) -> CheckFn:
    def check(env: Env, tok: Tok, target: Target, out: Outcome) -> list[str]:
        if ((target.pool, target.key) in _admin_schedules(env)) != present:
            return [f"schedule {target.key!r} {'missing' if present else 'exists'} after the call"]
        return []

    return check


def check_schedule_listing(env: Env, tok: Tok, target: Target, out: Outcome) -> list[str]:
    """ListSchedules shows exactly the schedules of the pools the caller may read."""
    shown = sorted((s["pool"], s["name"]) for s in (out.body or {}).get("schedules", []))
    want = sorted(x for x in _admin_schedules(env) if x[0] in tok.readable())
    return [] if shown == want else [f"listed {shown[:4]}..., want those of pools {sorted(tok.readable())}"]


def schedule_rows() -> list[Call]:
    def put(env: Env, t: Target, md: Metadata) -> Any:
        sched = spb.Schedule(pool=t.pool, name=t.key, cron="0 3 * * *", payload=b"{}")
        return env.schedules.PutSchedule(spb.PutScheduleRequest(schedule=sched), metadata=md, timeout=TIMEOUT)

    rows = [
        Call(
            f"PutSchedule pool={pool}",
            "schedule",
            needs("schedule", pool),
            put,
            lambda env, t: ("PUT", f"/v1/pools/{t.pool}/schedules/{t.key}", {"cron": "0 3 * * *", "payload_json": {}}),
            prepare=lambda env, tok, pool=pool: _new_schedule(env, tok, pool),
            check_ok=check_schedule_listed(True),
            check_refusal=check_schedule_listed(False),
        )
        for pool in POOLS
    ]
    rows.append(
        Call(
            "DeleteSchedule",
            "schedule",
            needs("schedule"),
            lambda env, t, md: env.schedules.DeleteSchedule(
                spb.DeleteScheduleRequest(pool=t.pool, name=t.key), metadata=md, timeout=TIMEOUT
            ),
            lambda env, t: ("DELETE", f"/v1/pools/{t.pool}/schedules/{t.key}", None),
            prepare=_existing_schedule,
            check_ok=check_schedule_listed(False),
            check_refusal=check_schedule_listed(True),
        )
    )
    for pool in ("a", "b", ""):
        rows.append(
            Call(
                f"ListSchedules pool={pool or '(all)'}",
                "read",
                needs("read", pool) if pool else holds("read"),
                lambda env, t, md, pool=pool: env.schedules.ListSchedules(
                    spb.ListSchedulesRequest(pool=pool), metadata=md, timeout=TIMEOUT
                ),
                lambda env, t, pool=pool: ("GET", f"/v1/schedules?pool={pool}", None),
                pure=True,
                check_ok=check_schedule_listing if not pool else None,
            )
        )
    return rows


def _pool_paused(env: Env, pool: str) -> bool:
    snapshot = env.admin.GetSnapshot(apb.GetSnapshotRequest(), metadata=env.as_("admin-all"), timeout=TIMEOUT)
    return any(p.paused for s in snapshot.shards for p in s.pools if p.pool == pool)


def _pool_set_paused(paused: bool) -> Callable[[Env, Tok | None], Target]:
    """Pauses (or resumes) pool a as admin-all before a cell: the call then has something to change."""

    def prepare(env: Env, tok: Tok | None) -> Target:
        md = env.as_("admin-all")
        if paused:
            env.admin.PausePool(apb.PausePoolRequest(pool="a"), metadata=md, timeout=TIMEOUT)
        else:
            env.admin.ResumePool(apb.ResumePoolRequest(pool="a"), metadata=md, timeout=TIMEOUT)
        return Target(pool="a")

    return prepare


def check_pool_paused(paused: bool) -> CheckFn:
    def check(env: Env, tok: Tok, target: Target, out: Outcome) -> list[str]:
        if _pool_paused(env, target.pool) != paused:
            return [f"pool {target.pool!r} {'not ' if paused else ''}paused after the call"]
        return []

    return check


def pause_rows() -> list[Call]:
    """PausePool and ResumePool need admin on the pool; a refusal leaves the pool as it was.
    Last in the matrix: no other row finds pool a paused."""
    return [
        Call(
            "PausePool",
            "admin",
            needs("admin"),
            lambda env, t, md: env.admin.PausePool(apb.PausePoolRequest(pool=t.pool), metadata=md, timeout=TIMEOUT),
            lambda env, t: ("POST", f"/v1/pools/{t.pool}/pause", {}),
            prepare=_pool_set_paused(False),
            check_ok=check_pool_paused(True),
            check_refusal=check_pool_paused(False),
        ),
        Call(
            "ResumePool",
            "admin",
            needs("admin"),
            lambda env, t, md: env.admin.ResumePool(apb.ResumePoolRequest(pool=t.pool), metadata=md, timeout=TIMEOUT),
            lambda env, t: ("POST", f"/v1/pools/{t.pool}/resume", {}),
            prepare=_pool_set_paused(True),
            check_ok=check_pool_paused(False),
            check_refusal=check_pool_paused(True),
        ),
    ]


# The matrix's rows by group: each group runs on a server of its own (test_permission_matrix),
# so that a mutant's check runs only the group that guards it.
MATRIX_GROUPS: dict[str, Callable[[], list[Call]]] = {
    "submit": submit_rows,
    "lookup": lookup_rows,
    "retry-delete": lambda: retry_and_delete_rows() + retry_with_dependents_rows(),
    "lists": list_and_watch_rows,
    "workers": worker_rows,
    "admin": admin_rows,
    "schedules": schedule_rows,
    "pause": pause_rows,
    "bulk": bulk_rows,
}


def matrix_calls() -> list[Call]:
    return [call for rows in MATRIX_GROUPS.values() for call in rows()]


# -- the runner -------------------------------------------------------------------


def _norm(message: str, ref: str) -> str:
    return message.replace(ref, "<ref>") if ref else message


def invoke(env: Env, call: Call, transport: str, target: Target, cred: Cred) -> Outcome:
    if transport == "gRPC":
        assert call.grpc is not None
        return env.grpc(lambda md: call.grpc(env, target, md), cred.header, cred.cert)  # type: ignore[misc]
    assert call.http is not None
    method, path, body = call.http(env, target)
    return env.http(method, path, cred.header, body, cred.cert)


def run_cell(env: Env, call: Call, transport: str, cred: Cred, want: str) -> None:
    case = f"{transport} {call.name} as {cred.label}"
    target = call.prepare(env, cred.tok)
    before = env.state() if (want != OK or call.pure) else None
    env.expecting_ok = want == OK
    out = invoke(env, call, transport, target, cred)
    if out.code != want:
        env.fail(case, f"got {out.code} ({out.message!r}), want {want}")
    if out.status is not None and out.code in HTTP_STATUS and out.status != HTTP_STATUS[out.code]:
        env.fail(case, f"HTTP status {out.status} for code {out.code}, want {HTTP_STATUS[out.code]}")
    if before is not None:
        after = env.state()
        if after != before:
            env.fail(
                case, f"changed state ({'accepted' if out.code == OK else 'refused'}): {env.state_diff(before, after)}"
            )
    if out.code == want == OK and call.check_ok and cred.tok is not None:
        for p in call.check_ok(env, cred.tok, target, out):
            env.fail(case, p)
    if out.code == want != OK and call.check_refusal and cred.tok is not None:
        for p in call.check_refusal(env, cred.tok, target, out):
            env.fail(case, p)
    if want == NOT_FOUND == out.code and call.missing and call.ref:
        ghost = call.missing(target)
        miss = invoke(env, call, transport, ghost, cred)
        if miss.code != NOT_FOUND:
            env.fail(case, f"a missing ref of the same shape got {miss.code} ({miss.message!r})")
        elif _norm(out.message, call.ref(target)) != _norm(miss.message, call.ref(ghost)):
            env.fail(
                case,
                f"message {out.message!r} differs from a missing one's {miss.message!r} "
                f"(after substituting {call.ref(target)!r} / {call.ref(ghost)!r})",
            )


def run_matrix(env: Env, calls: list[Call], creds: list[Cred]) -> None:
    for call in calls:
        for cred in creds:
            want = UNAUTH if cred.tok is None else call.expect(cred.tok)
            if want is None:
                continue
            for transport, fn in (("gRPC", call.grpc), ("HTTP", call.http)):
                if fn is not None:
                    run_cell(env, call, transport, cred, want)


# -- tests --------------------------------------------------------------------------


@pytest.fixture
def env(start_server: Any) -> Iterator[Env]:
    e = Env(start_server(token_config()))
    yield e
    e.close()


def mtls_config(pki: Pki, server_cert: Pair) -> dict[str, Any]:
    """The same pools and [[tokens]], [server.tls] with client_ca, and [[clients]] for CERT_TOKS."""
    return {
        **token_config(),
        "server": {"tls": {"cert": server_cert.cert, "key": server_cert.key, "client_ca": pki.ca_path}},
        "clients": [
            {"subject": t.name, "pools": list(t.pools), "permissions": sorted(t.perms)} for t in CERT_TOKS.values()
        ],
    }


def wait_ready_tls(srv: Any, tls: ClientTls, timeout: float = 15.0) -> None:
    """conftest's readiness poll speaks plaintext; this one presents the default certificate."""
    ctx = tls.ssl_context(tls.default)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"{srv.name} exited with {srv.proc.returncode}:\n{srv.log()}")
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{srv.http_port}/readyz", timeout=1, context=ctx) as r:
                if r.status == 200:
                    return
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{srv.name} not ready in {timeout} s:\n{srv.log()}")


@pytest.fixture
def mtls_env(start_server: Any, tmp_path: Path) -> Iterator[Env]:
    """A server with [server.tls] + client_ca: every call presents a client certificate."""
    pki = Pki(tmp_path)
    tls = ClientTls(pki.ca_path, {name: pki.client(subject, name) for name, subject in CERT_SUBJECTS.items()})
    srv = start_server(mtls_config(pki, pki.server()), name="mtls", wait_ready=False)
    wait_ready_tls(srv, tls)
    e = Env(srv, tls)
    yield e
    e.close()


def seed(env: Env) -> None:
    """Tasks in both pools, and workers of a, b and a+b, so that filters have something to hide."""
    for pool in POOLS:
        env.shared_task(pool)
        env.submit(pool)
    env.register("full-ab", ["a", "b"], "both")
    env.register("full-b", ["b"], "only-b")
    env.register("full-a", ["a"], "only-a")


@pytest.mark.timeout(300)  # a table of calls x credentials: long, and longer on a busy machine
@pytest.mark.parametrize("group", list(MATRIX_GROUPS))
def test_permission_matrix(env: Env, group: str) -> None:
    seed(env)
    run_matrix(env, MATRIX_GROUPS[group](), CREDS)
    if group == "admin":
        check_open_routes(env)
    env.finish()


# Tokens sent with a certificate: a token wins over the certificate the same way whatever its
# grant, so a few grants stand for all (plaintext runs every token).
MTLS_TOKEN_COLUMNS = ("admin-all", "full-a", "read-a", "submit-a", "no-read-a")


@pytest.mark.timeout(300)  # a table of every call x credential: long, and longer on a busy machine
def test_permission_matrix_mtls(mtls_env: Env) -> None:
    """The whole table over mTLS: the token columns of MTLS_TOKEN_COLUMNS (each sent with the
    certificate of CN=carrier: it must get what it gets over plaintext), a column per [[clients]]
    certificate without a token (judged by its entry's pools and permissions, as the token with
    the same ones), the bad tokens with a good certificate, and a certificate of an unknown
    subject without a token (UNAUTHENTICATED on every call and route)."""
    env = mtls_env
    seed(env)
    tokens = [c for c in CREDS if c.tok is not None and c.label in MTLS_TOKEN_COLUMNS]
    run_matrix(env, matrix_calls(), MTLS_BAD_CREDS + MTLS_CERT_CREDS + tokens)
    check_open_routes(env, cert="stranger")  # open: no [[clients]] entry needed, only a certificate
    env.finish()


def check_open_routes(env: Env, cert: str | None = None) -> None:
    """/healthz and /readyz answer without credentials, and name no pool."""
    for path in ("/healthz", "/readyz"):
        out = env.http("GET", path, None, cert=cert)
        if out.code != OK:
            env.fail(
                f"HTTP {path} without a token" + (f" (certificate {CERT_SUBJECTS[cert]})" if cert else ""),
                f"got {out.code} ({out.message!r}), want 200",
            )
            continue

        def strings(v: Any) -> Iterator[str]:
            if isinstance(v, dict):
                for k, x in v.items():
                    yield k
                    yield from strings(x)
            elif isinstance(v, list):
                for x in v:
                    yield from strings(x)
            elif isinstance(v, str):
                yield v

        named = [s for s in strings(out.body) if s in POOLS or s == "pools"]
        if named:
            env.fail(f"HTTP {path}", f"body names pools: {out.body!r}")


# -- rule 4: Watch of all pools streams only readable pools --------------------------


def _await_task(events: queue.Queue[Any], task_id: int, timeout: float) -> list[Any] | None:
    """Events up to and including the one of task_id (None if it did not come in time)."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            item = events.get(timeout=left)
        except queue.Empty:
            break
        got.append(item)
        if isinstance(item, Exception):
            return got
        if str(item["task"]["id"]) == str(task_id):
            return got
    return None


def _watch_pools(label: str) -> tuple[str, list[str]]:
    """A pool the token may read (its marker events must come) and those it may not."""
    readable = tok_of(label).readable()
    return sorted(readable)[0], [p for p in POOLS if p not in readable]


def check_grpc_watch_all(env: Env, label: str) -> None:
    case = f"gRPC Watch (all pools) as {label}"
    cred = env.cred(label)
    stream = env.stubs(cred.cert).tasks.Watch(tpb.WatchRequest(), metadata=env.md(cred.header), timeout=30)
    events: queue.Queue[Any] = queue.Queue()

    def reader() -> None:
        try:
            for resp in stream:
                events.put(to_dict(resp)["event"])
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                events.put(err)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        shown, hidden = _watch_pools(label)
        seen: list[Any] | None = None
        for _ in range(20):  # the stream is live once a probe task's event arrives
            seen = _await_task(events, env.submit(shown).id, 0.5)
            if seen is not None:
                break
        if seen is None:
            env.fail(case, f"no event for pool-{shown} tasks within 10 s")
            return
        for pool in hidden:
            env.submit(pool)
        marker = env.submit(shown)
        more = _await_task(events, marker.id, 5)
        if more is None:
            env.fail(case, f"the pool-{shown} marker event never came")
            return
        _check_events(env, case, label, seen + more)
    finally:
        stream.cancel()
        thread.join(5)


def check_sse_watch_all(env: Env, label: str) -> None:
    case = f"HTTP Watch (all pools) as {label}"
    cred = env.cred(label)
    req = urllib.request.Request(env.base_url + "/v1/watch")
    if cred.header is not None:
        req.add_header("Authorization", cred.header)
    try:
        resp = env.urlopen(req, cred.cert, timeout=5)
    except urllib.error.HTTPError as err:
        env.fail(case, f"HTTP {err.code}: {err.read()!r}")
        return
    with resp:
        first = resp.readline()
        if not first.startswith(b":"):
            env.fail(case, f"stream began with {first!r}, want the ': watching' comment")
        shown, hidden = _watch_pools(label)
        for pool in hidden:
            env.submit(pool)
        marker = env.submit(shown)
        got: list[Any] = []
        try:
            while True:
                line = resp.readline()
                if not line:
                    env.fail(case, "stream ended before the marker event")
                    return
                if line.startswith(b"data:"):
                    got.append(json.loads(line[5:]))
                    if str(got[-1]["task"]["id"]) == str(marker.id):
                        break
        except TimeoutError:
            env.fail(case, f"the pool-{shown} marker event never came (got {len(got)} events)")
            return
        _check_events(env, case, label, got)


def _check_events(env: Env, case: str, label: str, events: list[Any]) -> None:
    errors = [e for e in events if isinstance(e, Exception)]
    if errors:
        env.fail(case, f"stream failed: {errors[0]!r}")
    pools = {e["task"]["pool"] for e in events if not isinstance(e, Exception)}
    if not pools <= tok_of(label).readable():
        env.fail(case, f"streamed events of pools {sorted(pools - tok_of(label).readable())}")


def check_visibility(env: Env, p: str) -> None:
    """Rule 4, beyond the matrix: what each caller sees of workers, tasks and events. `p` is
    prepended to the principals' labels: "" for tokens, "CN=" for certificate principals."""
    seed(env)
    both = env.register(p + "full-ab", ["a", "b"], "ab-explicit")
    for label, want_pools in ((p + "read-a", ["a"]), (p + "full-b", ["b"]), (p + "full-ab", ["a", "b"])):
        cred = env.cred(label)
        for transport in ("gRPC", "HTTP"):
            if transport == "gRPC":
                out = env.grpc(
                    lambda md: env.workers.ListWorkers(wpb.ListWorkersRequest(), metadata=md, timeout=TIMEOUT),
                    cred.header,
                    cred.cert,
                )
            else:
                out = env.http("GET", "/v1/workers", cred.header, cert=cred.cert)
            shown = {w["id"]: w.get("pools") for w in (out.body or {}).get("workers", [])}
            if shown.get(both) != want_pools:
                env.fail(
                    f"{transport} ListWorkers as {label}",
                    f"worker of a+b shows pools {shown.get(both)}, want {want_pools}",
                )
    for label in (p + "read-a", p + "full-b", p + "full-ab"):
        check_grpc_watch_all(env, label)
        check_sse_watch_all(env, label)
    for label, pool in ((p + "read-a", "b"), (p + "full-b", "a"), (p + "submit-a", "a")):
        cred = env.cred(label)
        for transport, out in (
            ("gRPC", env.grpc(lambda md, pool=pool: grpc_watch(pool)(env, Target(), md), cred.header, cred.cert)),
            ("HTTP", env.http("GET", f"/v1/watch?pool={pool}", cred.header, cert=cred.cert)),
            (
                "gRPC ListTasks",
                env.grpc(
                    lambda md, pool=pool: env.tasks.ListTasks(tpb.ListTasksRequest(pool=pool), metadata=md, timeout=10),
                    cred.header,
                    cred.cert,
                ),
            ),
        ):
            if out.code != DENIED:
                env.fail(f"{transport} pool={pool} as {label}", f"got {out.code} ({out.message!r}), want {DENIED}")
    env.finish()


def test_visibility_of_pools(env: Env) -> None:
    check_visibility(env, "")


def test_visibility_of_pools_mtls(mtls_env: Env) -> None:
    """The same, for certificate principals (no token) over mTLS."""
    check_visibility(mtls_env, "CN=")


# -- rule 3: workers belong to their principal; reports are fenced by worker -----------


def _task(env: Env, task_id: int) -> task_pb2.Task:
    req = tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task_id))
    return env.stubs().tasks.GetTask(req, metadata=env.as_("admin-all"), timeout=TIMEOUT).task


def check_fenced_finish(env: Env, owner: str) -> None:
    """w1 holds task T (attempt 1); w2, registered by the same principal, cannot finish it;
    nor can w1 report another attempt; w2's heartbeat reports it lost and extends nothing."""
    cred = env.cred(owner)
    md, workers = env.md(cred.header), env.stubs(cred.cert).workers
    w1 = env.register(owner, ["a"], "w1")
    w2 = env.register(owner, ["a"], "w2")
    task_id = env.submit("a", due_now=True).id
    leased = workers.LeaseTasks(
        wpb.LeaseTasksRequest(worker_id=w1, max_tasks=1, wait_ms=2000), metadata=md, timeout=TIMEOUT
    ).tasks
    assert [(t.id, t.attempt) for t in leased] == [(task_id, 1)], leased
    running = _task(env, task_id)
    assert running.state == task_pb2.TASK_STATE_RUNNING and running.worker_id == w1, running

    cases = [
        (w2, 1, wpb.TaskOutcome(task_id=task_id, attempt=1, success=wpb.TaskSuccess(result=b"stolen"))),
        (w2, 1, wpb.TaskOutcome(task_id=task_id, attempt=1, failure=wpb.TaskFailure(error="x", retryable=False))),
        (w2, 1, wpb.TaskOutcome(task_id=task_id, attempt=1, cancelled=wpb.TaskCancelled(reason="x"))),
        (w1, 2, wpb.TaskOutcome(task_id=task_id, attempt=2, success=wpb.TaskSuccess(result=b"future"))),
        (w1, 0, wpb.TaskOutcome(task_id=task_id, attempt=0, success=wpb.TaskSuccess(result=b"past"))),
    ]

    def finish(worker: str, outcome: wpb.TaskOutcome) -> Any:
        return workers.FinishTasks(
            wpb.FinishTasksRequest(worker_id=worker, outcomes=[outcome]), metadata=md, timeout=TIMEOUT
        ).results

    def finish_on_stream(worker: str, outcome: wpb.TaskOutcome) -> Any:
        """The outcome on the worker's Work stream (no credits: nothing is leased)."""
        request = wpb.WorkRequest(worker_id=worker, outcomes=[outcome])
        answers = list(workers.Work(iter([request]), metadata=md, timeout=TIMEOUT))
        return [r for a in answers for r in a.results]

    reports = [
        (verb, fn, w, a, o) for verb, fn in (("FinishTasks", finish), ("Work", finish_on_stream)) for w, a, o in cases
    ]
    for verb, report, worker, attempt, outcome in reports:
        case = f"{verb} by {'w2' if worker == w2 else 'w1'} ({outcome.WhichOneof('outcome')}, attempt {attempt})"
        try:
            results = report(worker, outcome)
        except grpc.RpcError as err:
            env.fail(case, f"call failed with {err.code().name} ({err.details()!r}); want a per-outcome refusal")
            continue
        (r,) = results
        want = f"task {task_id} is not leased to worker {worker} at attempt {attempt}"
        message = r.message.replace(repr(worker), worker)
        if r.accepted or r.code != "FAILED_PRECONDITION" or want not in message:
            env.fail(
                case,
                f"result accepted={r.accepted} code={r.code!r} message={r.message!r}; want refused, "
                f"FAILED_PRECONDITION, {want!r}",
            )
        now = _task(env, task_id)
        if now != running:
            env.fail(case, f"task changed: state {task_pb2.TaskState.Name(now.state)}, result {now.result!r}")
            return
    time.sleep(0.01)
    hb = workers.Heartbeat(
        wpb.HeartbeatRequest(worker_id=w2, tasks=[wpb.TaskAttempt(task_id=task_id, attempt=1)]),
        metadata=md,
        timeout=TIMEOUT,
    )
    if list(hb.lost_task_ids) != [task_id] or list(hb.cancelled_task_ids):
        env.fail("Heartbeat by w2 for w1's task", f"lost {list(hb.lost_task_ids)}, want [{task_id}]")
    if _task(env, task_id) != running:
        env.fail("Heartbeat by w2 for w1's task", "the task changed (lease extended?)")
    beat = wpb.WorkRequest(
        worker_id=w2, heartbeat=wpb.WorkHeartbeat(tasks=[wpb.TaskAttempt(task_id=task_id, attempt=1)])
    )
    (answer,) = workers.Work(iter([beat]), metadata=md, timeout=TIMEOUT)
    if list(answer.heartbeat.lost_task_ids) != [task_id] or list(answer.heartbeat.cancelled_task_ids):
        env.fail("Work heartbeat by w2 for w1's task", f"lost {list(answer.heartbeat.lost_task_ids)}, want [{task_id}]")
    if _task(env, task_id) != running:
        env.fail("Work heartbeat by w2 for w1's task", "the task changed (lease extended?)")
    (ok,) = workers.FinishTasks(
        wpb.FinishTasksRequest(
            worker_id=w1, outcomes=[wpb.TaskOutcome(task_id=task_id, attempt=1, success=wpb.TaskSuccess(result=b"ok"))]
        ),
        metadata=md,
        timeout=TIMEOUT,
    ).results
    if not ok.accepted or _task(env, task_id).state != task_pb2.TASK_STATE_SUCCEEDED:
        env.fail("FinishTasks by w1 (its own lease)", f"refused: {ok.code} {ok.message!r}")


def check_foreign_workers(env: Env, cases: list[tuple[Cred, Target, str]]) -> None:
    """The "worker of full-a" rows (gRPC) with the given callers and workers."""
    for call in [r for r in worker_rows() if "worker of full-a" in r.name]:
        for cred, target, want in cases:
            if call.name.startswith("DeregisterWorker") and want == OK:
                continue  # keeps the worker for the next rows; the matrix deregisters own workers
            spec = Call(
                call.name.replace("full-a", "its owner"),
                "work",
                lambda tok, w=want: w,
                call.grpc,
                prepare=lambda env, tok, target=target: target,
            )
            run_cell(env, spec, "gRPC", cred, want)


def test_workers_belong_to_their_principal(env: Env) -> None:
    seed(env)
    # Another principal's worker: refused even with work on the pool (the matrix has more).
    shared = Target(worker_id=env.register("shared-work", ["a"], "shared"))
    theirs = env.worker("full-a", fresh=False)
    check_foreign_workers(
        env,
        [
            (env.cred("work-a"), theirs, DENIED),
            (env.cred("full-ab"), theirs, DENIED),
            (env.cred("shared-work"), shared, OK),
        ],
    )
    check_fenced_finish(env, "full-a")
    env.finish()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_request_id_is_the_callers_own(start_server: Any, request: pytest.FixtureRequest, kind: str) -> None:
    """Two principals that send the same request_id each get a task of their own: the second
    learns nothing of the first's (not its id, payload or key), and each one's retry is its own."""
    srv = start_server({**token_config(), "store": store_table(kind, request)})
    channel = grpc.insecure_channel(srv.grpc_target)
    tasks = task_service_pb2_grpc.TaskServiceStub(channel)

    def submit(label: str, payload: bytes, key: str = "") -> tpb.SubmitTaskResponse:
        req = tpb.SubmitTaskRequest(pool="a", payload=payload, key=key, request_id="same-request")
        return tasks.SubmitTask(req, metadata=[("authorization", TOKENS[label].header)], timeout=TIMEOUT)

    def batch(label: str, payload: bytes) -> tpb.SubmitBatchResponse:
        req = tpb.SubmitBatchRequest(tasks=[tpb.SubmitTaskRequest(pool="a", payload=payload)], request_id="same-batch")
        return tasks.SubmitBatch(req, metadata=[("authorization", TOKENS[label].header)], timeout=TIMEOUT)

    try:
        first = submit("full-a", b"first's", key="ka-000001")
        second = submit("full-ab", b"second's")
        assert not second.deduplicated and second.task.id != first.task.id, second
        assert second.task.payload == b"second's" and not second.task.key, second.task
        assert submit("full-a", b"first's", key="ka-000001").task.id == first.task.id  # what the first call created
        assert submit("full-ab", b"second's").task.id == second.task.id
        # The same, in batches.
        first_batch, second_batch = batch("full-a", b"first's"), batch("full-ab", b"second's")
        assert not second_batch.deduplicated_ids and second_batch.tasks[0].id != first_batch.tasks[0].id
        assert second_batch.tasks[0].payload == b"second's"
    finally:
        channel.close()


def test_workers_belong_to_their_principal_mtls(mtls_env: Env) -> None:
    """Over mTLS: a worker registered with the certificate of CN=full-a (no token) belongs to
    the principal CN=full-a: another certificate principal with work on the pool, the token
    principal "full-a" (another principal, whatever the likeness of names), and CN=full-a's own
    certificate sent with a token (the token wins) are all refused; a second certificate of
    the same subject (another key) is the same principal. And the fenced finish, by CN=full-a."""
    env = mtls_env
    seed(env)
    theirs = env.worker("CN=full-a", fresh=False)
    tokens = env.worker("full-a", fresh=False)  # registered by the token full-a
    tok_full_a, cert_full_a = TOKENS["full-a"], CERT_TOKS["CN=full-a"]
    check_foreign_workers(
        env,
        [
            (cert_cred("CN=work-a"), theirs, DENIED),
            (cert_cred("CN=full-ab"), theirs, DENIED),
            (cert_cred("CN=carrier"), theirs, DENIED),  # every permission on every pool: still not the owner
            (Cred("token full-a (certificate CN=carrier)", tok_full_a.header, tok_full_a, CARRIER), theirs, DENIED),
            (Cred("token full-a with certificate CN=full-a", tok_full_a.header, tok_full_a, "full-a"), theirs, DENIED),
            (Cred("certificate CN=full-a, the token full-a's worker", None, cert_full_a, "full-a"), tokens, DENIED),
            (Cred("a second certificate of CN=full-a (another key)", None, cert_full_a, "full-a-2"), theirs, OK),
        ],
    )
    check_fenced_finish(env, "CN=full-a")
    env.finish()


def test_fenced_finish_without_tokens(start_server: Any) -> None:
    """No credentials configured: still, worker w2 cannot finish w1's task."""
    env = Env(start_server({"pools": [{"name": "a", "lease_ttl": "10m"}, {"name": "b", "lease_ttl": "10m"}]}))
    try:
        check_fenced_finish(env, "admin-all")
        env.finish()
    finally:
        env.close()


# -- rule 6 (documentation): which cases fail if one check in core/ is deleted ---------
# submit  Tasks._validate: caller.require("submit", pool)
#           SubmitTask, SubmitBatch, "SubmitTask, pool b", "SubmitBatch, pools a and b" as
#           read-a, schedule-a, no-submit-a, full-b (and full-a for pool b): want
#           PERMISSION_DENIED, would be admitted (code and "changed state" mismatches).
# read    Tasks.find, the read test for an id and for a key (missing if unreadable)
#           Get/Wait/Cancel by id (resp. by key) of a pool-b task as read-a, full-a...: want
#           NOT_FOUND, would get PERMISSION_DENIED (Get/Wait) or OK (Cancel as cancel-a,
#           no-read-a of a pool-a task, which also changes state).
#         Tasks.readable_pools, caller.require("read", pool)
#           ListTasks pool=a|b and Watch pool=a|b as no-read-a, full-b...: want
#           PERMISSION_DENIED, would be OK; test_visibility_of_pools likewise.
#         Tasks.readable_pools, the filter when no pool is given
#           ListTasks pool=(all) check_ok (exactly the readable pools' tasks);
#           test_visibility_of_pools: Watch of all pools streams no pool-b event to read-a.
#         Tasks._visible (dependencies only on readable tasks)
#           "Submit* to a, depends_on a pool-b task by id|key" as submit-a, full-a: want
#           NOT_FOUND with the missing dependency's message, would be admitted.
#         Tasks._submitted (a deduplicated task shown whole only to readers)
#           "Submit* deduplicated" as submit-a, no-read-a: check_dedup finds payload, state...
#         Leases.list_workers, caller.require("read", pool) and the per-pool filter
#           ListWorkers pool=a|b as no-read-a, full-b: want PERMISSION_DENIED; ListWorkers
#           check_ok and test_visibility_of_pools: a worker of a+b shows ["a"] to read-a.
# work    Leases.register_worker: caller.require("work", pool) for each pool
#           RegisterWorker pools=[a] as no-work-a, read-a, full-b; pools=[a, b] as full-a.
#         Leases._worker: the owner test (worker.principal == caller.name)
#           "... (worker of full-a)" rows as work-a, full-ab, admin-all, no-submit-a...: want
#           PERMISSION_DENIED, would be OK (Deregister also removes the worker).
#         Leases._worker: caller.require("work", pool) for the worker's pools
#           none: only a principal that registered the worker yet lacks work could show it,
#           and token names are unique (one grant a principal), so no case can.


def test_every_rpc_and_route_is_in_the_matrix() -> None:
    """The guard of the guard: a new RPC joins the matrix, over gRPC and over each of its HTTP routes."""
    from cronoq_server.registry import registry

    rows = matrix_calls()

    def rows_of(rpc: str) -> list[Call]:
        return [r for r in rows if r.name.split(",")[0].split(" ")[0] == rpc]

    missing = [f"{name} over gRPC" for name in registry() if not any(r.grpc for r in rows_of(name))]
    missing += [
        f"{name} over HTTP" for name, rpc in registry().items() if rpc.http and not any(r.http for r in rows_of(name))
    ]
    assert not missing, f"RPCs missing from matrix_calls(): {missing}"
