"""The config file and the server command.

A bad file is refused at start with exit code 2 and exactly one line on stderr that
names the file, the key and what is wrong. Every case runs the server's real main()
in its own process (see FORK_RUNNER); a representative few also run as the literal
`python -m cronoq_server.main --config FILE [--shard NAME]`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from preconditions import missing  # type: ignore[import-not-found]

from cronoq.v1 import admin_service_pb2, admin_service_pb2_grpc

LOOPBACK = '[server]\nlisten = "127.0.0.1:0"\nhttp_listen = "127.0.0.1:0"\n'
POOL = '[[pools]]\nname = "default"\n'
UNSHARDED = LOOPBACK + POOL
SHARD_STORE = '[store]\npath = "cronoq-{shard}.db"\n'
TWO_POOLS = '[[pools]]\nname = "a"\n[[pools]]\nname = "b"\n'


def shard(name: str, number: int, pools: list[str], endpoint: str | None = None) -> str:
    endpoint = endpoint or f"http://127.0.0.1:{7100 + number}"
    return f'[[shards]]\nname = "{name}"\nnumber = {number}\npools = {json.dumps(pools)}\nendpoint = "{endpoint}"\n'


SHARDS = shard("s1", 1, ["a"]) + shard("s2", 2, ["b"])
SHARDED = LOOPBACK + SHARD_STORE + TWO_POOLS + SHARDS
TOKEN_TAIL = 'pools = ["*"]\npermissions = ["read"]\n'
SHA = "a" * 64
UNSET_ENV = "CRONOQ_TEST_SURELY_UNSET_TOKEN"


@dataclass(frozen=True)
class Case:
    id: str
    text: str | None  # None: the file does not exist
    fragments: tuple[str, ...]  # the key and the problem, each must be in the line
    shard: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    command: bool = False  # also run as the literal `python -m cronoq_server.main ...`


CASES = [
    # unknown keys, at every depth
    Case("unknown top-level key", 'colour = "red"\n' + UNSHARDED, ("colour", "unknown key")),
    Case("unknown top-level table", UNSHARDED + "[logging]\nlevel = 1\n", ("logging", "unknown key")),
    Case("unknown key in [server]", LOOPBACK + "port = 7070\n" + POOL, ("server.port", "unknown key"), command=True),
    Case(
        "unknown key in [server.tls]",
        LOOPBACK + '[server.tls]\ncert = "c.pem"\nkey = "k.pem"\npassphrase = "x"\n' + POOL,
        ("server.tls.passphrase", "unknown key"),
    ),
    Case("unknown key in [store]", LOOPBACK + '[store]\nfile = "x.db"\n' + POOL, ("store.file", "unknown key")),
    Case("unknown key in [[pools]]", LOOPBACK + POOL + 'colour = "red"\n', ("pools[0].colour", "unknown key")),
    Case("unknown key in [limits]", UNSHARDED + "[limits]\nmax_payload = 5\n", ("limits.max_payload", "unknown key")),
    Case("unknown key in [[shards]]", SHARDED + "weight = 3\n", ("shards[1].weight", "unknown key"), shard="s1"),
    Case(
        "unknown key in [[tokens]]",
        UNSHARDED + f'[[tokens]]\nname = "t"\nsha256 = "{SHA}"\n' + TOKEN_TAIL + "expires = 1\n",
        ("tokens[0].expires", "unknown key"),
    ),
    # bad types and values
    Case(
        "bad type: integer",
        UNSHARDED + '[limits]\nmax_batch_size = "many"\n',
        ("limits.max_batch_size", "integer", "'many'"),
    ),
    Case(
        "bad type: string",
        '[server]\nlisten = 7070\nhttp_listen = "127.0.0.1:0"\n' + POOL,
        ("server.listen", "string", "7070"),
    ),
    Case("bad type: list", 'pools = "default"\n' + LOOPBACK, ("pools", "list", "'default'")),
    Case(
        "bad type: boolean",
        LOOPBACK + "allow_unauthenticated = 3\n" + POOL,
        ("server.allow_unauthenticated", "bool", "3"),
    ),
    Case("bad type: table", 'store = "sqlite"\n' + UNSHARDED, ("store", "'sqlite'")),
    Case("store.kind unknown", LOOPBACK + '[store]\nkind = "mysql"\n' + POOL, ("store.kind", "'mysql'")),
    Case(
        "max_attempts 0",
        UNSHARDED + "max_attempts = 0\n",
        ("pools[0].max_attempts", "greater than or equal to 1", "0"),
        command=True,
    ),
    Case("max_attempts too big", UNSHARDED + "max_attempts = 100000\n", ("pools[0].max_attempts", "100000")),
    Case("max_attempts negative", UNSHARDED + "max_attempts = -3\n", ("pools[0].max_attempts", "-3")),
    Case("pool name empty", LOOPBACK + '[[pools]]\nname = ""\n', ("pools[0].name", "''")),
    Case("limit zero", UNSHARDED + "[limits]\nmax_payload_bytes = 0\n", ("limits.max_payload_bytes", "0")),
    # durations
    Case("bad duration word", UNSHARDED + 'lease_ttl = "soon"\n', ("pools[0].lease_ttl", "duration", "'soon'")),
    Case("bad duration unit", UNSHARDED + 'retention = "7 weeks"\n', ("pools[0].retention", "duration", "'7 weeks'")),
    Case("negative duration", UNSHARDED + 'retry_backoff = "-1s"\n', ("pools[0].retry_backoff", "duration", "'-1s'")),
    Case("zero duration", UNSHARDED + 'lease_ttl = "0s"\n', ("pools[0].lease_ttl", "positive", "'0s'")),
    Case("boolean duration", UNSHARDED + "lease_ttl = true\n", ("pools[0].lease_ttl", "duration", "True")),
    # listen addresses
    Case(
        "non-loopback listen without credentials",
        '[server]\nlisten = "0.0.0.0:0"\nhttp_listen = "127.0.0.1:0"\n' + POOL,
        ("server.listen", "'0.0.0.0:0'", "loopback", "allow_unauthenticated"),
        command=True,
    ),
    Case(
        "non-loopback http_listen without credentials",
        '[server]\nlisten = "127.0.0.1:0"\nhttp_listen = "[::]:0"\n' + POOL,
        ("server.http_listen", "'[::]:0'", "loopback", "allow_unauthenticated"),
    ),
    Case(
        "listen without a port",
        '[server]\nlisten = "127.0.0.1"\nhttp_listen = "127.0.0.1:0"\nallow_unauthenticated = true\n' + POOL,
        ("server.listen", "'127.0.0.1'", "port"),
    ),
    Case(
        "http_listen with a bad port",
        '[server]\nlisten = "127.0.0.1:0"\nhttp_listen = "127.0.0.1:http"\n' + POOL,
        ("server.http_listen", "'127.0.0.1:http'", "port"),
    ),
    # shards
    Case("pool in no shard", SHARDED + '[[pools]]\nname = "c"\n', ("pools", "'c'", "no shard"), shard="s1"),
    Case(
        "pool in two shards",
        LOOPBACK + SHARD_STORE + TWO_POOLS + shard("s1", 1, ["a"]) + shard("s2", 2, ["b", "a"]),
        ("shards[1].pools", "'a'", "already in shard 's1'"),
        shard="s1",
        command=True,
    ),
    Case(
        "shard with an unknown pool",
        LOOPBACK + SHARD_STORE + TWO_POOLS + shard("s1", 1, ["a", "zzz"]) + shard("s2", 2, ["b"]),
        ("shards[0].pools", "'zzz'", "unknown pool"),
        shard="s1",
    ),
    Case(
        "resource of an unknown shard",
        SHARDED + '[[resources]]\nname = "gpu"\nshard = "s9"\nconcurrency = 1\n',
        ("resources[0].shard", "'s9'", "unknown shard"),
        shard="s1",
    ),
    Case(
        "resource without shard when sharded",
        SHARDED + '[[resources]]\nname = "gpu"\nconcurrency = 1\n',
        ("resources[0].shard", "'gpu'", "required"),
        shard="s1",
    ),
    Case(
        "resource with a shard when unsharded",
        UNSHARDED + '[[resources]]\nname = "gpu"\nshard = "s1"\nconcurrency = 1\n',
        ("resources[0].shard", "'s1'", "unknown shard"),
    ),
    Case(
        "resource of no kind",
        UNSHARDED + '[[resources]]\nname = "gpu"\n',
        ("resources[0]", "'gpu'", "concurrency", "rate"),
    ),
    Case(
        "store.path without {shard} when sharded",
        LOOPBACK + '[store]\npath = "cronoq.db"\n' + TWO_POOLS + SHARDS,
        ("store.path", "{shard}", "'cronoq.db'"),
        shard="s1",
    ),
    Case(
        "store.path defaulted when sharded",
        LOOPBACK + TWO_POOLS + SHARDS,
        ("store.path", "{shard}", "'./cronoq.db'"),
        shard="s1",
    ),
    Case(
        "store.schema without {shard}",
        LOOPBACK + '[store]\nkind = "postgres"\nschema = "cronoq"\n' + TWO_POOLS + SHARDS,
        ("store.schema", "{shard}", "'cronoq'"),
        shard="s1",
    ),
    Case(
        "store.schema without {shard} on sqlite",
        LOOPBACK + '[store]\npath = "c-{shard}.db"\nschema = "shared"\n' + TWO_POOLS + SHARDS,
        ("store.schema", "{shard}", "'shared'"),
        shard="s1",
    ),
    Case(
        "duplicate shard number",
        LOOPBACK + SHARD_STORE + TWO_POOLS + shard("s1", 1, ["a"]) + shard("s2", 1, ["b"]),
        ("shards[1].number", "duplicate", "1"),
        shard="s1",
    ),
    Case(
        "duplicate shard name",
        LOOPBACK + SHARD_STORE + TWO_POOLS + shard("s1", 1, ["a"]) + shard("s1", 2, ["b"]),
        ("shards[1].name", "duplicate", "'s1'"),
        shard="s1",
    ),
    Case("duplicate pool name", UNSHARDED + POOL, ("pools[1].name", "duplicate", "'default'")),
    Case(
        "shard number 0",
        LOOPBACK + SHARD_STORE + TWO_POOLS + shard("s1", 0, ["a"]) + shard("s2", 2, ["b"]),
        ("shards[0].number", "greater than or equal to 1", "0"),
        shard="s1",
    ),
    Case(
        "shard number 256",
        LOOPBACK + SHARD_STORE + TWO_POOLS + shard("s1", 1, ["a"]) + shard("s2", 256, ["b"]),
        ("shards[1].number", "less than or equal to 255", "256"),
        shard="s1",
    ),
    Case(
        "endpoint scheme grpc://",
        LOOPBACK + SHARD_STORE + TWO_POOLS + shard("s1", 1, ["a"], "grpc://127.0.0.1:7101") + shard("s2", 2, ["b"]),
        ("shards[0].endpoint", "'grpc://127.0.0.1:7101'", "http"),
        shard="s1",
    ),
    Case(
        "endpoint without scheme",
        LOOPBACK + SHARD_STORE + TWO_POOLS + shard("s1", 1, ["a"]) + shard("s2", 2, ["b"], "10.0.0.2:7070"),
        ("shards[1].endpoint", "'10.0.0.2:7070'", "http"),
        shard="s1",
    ),
    Case(
        "endpoint port 99999",
        LOOPBACK + SHARD_STORE + TWO_POOLS + shard("s1", 1, ["a"]) + shard("s2", 2, ["b"], "http://127.0.0.1:99999"),
        ("shards[1].endpoint", "shard 's2'", "'http://127.0.0.1:99999'", "port", "1 to 65535"),
        shard="s1",
        command=True,
    ),
    Case(
        "endpoint port 0",
        LOOPBACK + SHARD_STORE + TWO_POOLS + shard("s1", 1, ["a"], "http://127.0.0.1:0") + shard("s2", 2, ["b"]),
        ("shards[0].endpoint", "shard 's1'", "'http://127.0.0.1:0'", "port", "1 to 65535"),
        shard="s1",
    ),
    Case(
        "endpoint with user info",
        LOOPBACK + SHARD_STORE + TWO_POOLS + shard("s1", 1, ["a"]) + shard("s2", 2, ["b"], "http://u:p@host:1"),
        ("shards[1].endpoint", "shard 's2'", "'http://u:p@host:1'", "user"),
        shard="s1",
    ),
    Case(
        "endpoint without host",
        LOOPBACK + SHARD_STORE + TWO_POOLS + shard("s1", 1, ["a"]) + shard("s2", 2, ["b"], "https://:7070"),
        ("shards[1].endpoint", "shard 's2'", "'https://:7070'", "host"),
        shard="s1",
    ),
    Case(
        "endpoint with a query",
        LOOPBACK + SHARD_STORE + TWO_POOLS + shard("s1", 1, ["a"]) + shard("s2", 2, ["b"], "http://h:1?x=1"),
        ("shards[1].endpoint", "shard 's2'", "'http://h:1?x=1'"),
        shard="s1",
    ),
    Case("missing --shard with [[shards]]", SHARDED, ("--shard", "required", "s1", "s2"), command=True),
    Case("unknown --shard", SHARDED, ("--shard", "'s9'"), shard="s9"),
    Case("--shard without [[shards]]", UNSHARDED, ("--shard", "'s1'", "no [[shards]]"), shard="s1"),
    # tokens
    Case(
        "token with neither sha256 nor env",
        UNSHARDED + '[[tokens]]\nname = "ci"\n' + TOKEN_TAIL,
        ("tokens[0]", "'ci'", "sha256", "env"),
        command=True,
    ),
    Case(
        "token with both sha256 and env",
        UNSHARDED + f'[[tokens]]\nname = "ci"\nsha256 = "{SHA}"\nenv = "X"\n' + TOKEN_TAIL,
        ("tokens[0]", "'ci'", "sha256", "env"),
    ),
    Case(
        "token sha256 not hex",
        UNSHARDED + '[[tokens]]\nname = "ci"\nsha256 = "secret"\n' + TOKEN_TAIL,
        ("tokens[0].sha256", "'secret'"),
    ),
    Case(
        "token env variable unset",
        UNSHARDED + f'[[tokens]]\nname = "ci"\nenv = "{UNSET_ENV}"\n' + TOKEN_TAIL,
        ("tokens[0].env", f"'{UNSET_ENV}'"),
        command=True,
    ),
    Case(
        "token env variable not a digest",
        UNSHARDED + f'[[tokens]]\nname = "ci"\nenv = "{UNSET_ENV}_SET"\n' + TOKEN_TAIL,
        ("tokens[0].env", f"'{UNSET_ENV}_SET'", "sha256"),
        env={f"{UNSET_ENV}_SET": "plain-text-token"},
    ),
    Case(
        "token of an unknown pool",
        UNSHARDED + f'[[tokens]]\nname = "ci"\nsha256 = "{SHA}"\npools = ["zzz"]\npermissions = ["read"]\n',
        ("tokens[0].pools", "'zzz'", "unknown pool"),
    ),
    Case(
        "token with an unknown permission",
        UNSHARDED + f'[[tokens]]\nname = "ci"\nsha256 = "{SHA}"\npools = ["*"]\npermissions = ["fly"]\n',
        ("tokens[0].permissions[0]", "'fly'"),
    ),
    # hostile values: every duration and size is finite and bounded, every path non-empty
    *[
        Case(f"{key} = {value}", LOOPBACK + f"{key} = {value}\n" + POOL, (f"server.{key}", shown))
        for key in ("watch_window", "worker_reap_after")
        for value, shown in (("inf", "inf"), ("nan", "nan"), ("1e300", "1e+300"), ('"999999d"', "999999d"))
    ],
    *[
        Case(f"{key} = {value}", UNSHARDED + f"{key} = {value}\n", (f"pools[0].{key}", shown))
        for key in ("lease_ttl", "retry_backoff", "retry_backoff_max", "retention", "timeout")
        for value, shown in (("inf", "inf"), ("nan", "nan"), ("1e300", "1e+300"), ("1e-9", "1e-09"))
    ],
    Case("timeout over 7 days", UNSHARDED + 'timeout = "8d"\n', ("pools[0].timeout", "'8d'", "7d")),
    Case("lease_ttl over a day", UNSHARDED + 'lease_ttl = "2d"\n', ("pools[0].lease_ttl", "'2d'", "1d")),
    Case("multiplier nan", UNSHARDED + "retry_backoff_multiplier = nan\n", ("pools[0].retry_backoff_multiplier",)),
    Case("multiplier inf", UNSHARDED + "retry_backoff_multiplier = inf\n", ("pools[0].retry_backoff_multiplier",)),
    *[
        Case(f"{key} = {value}", UNSHARDED + f"[limits]\n{key} = {value}\n", (f"limits.{key}", str(value)))
        for key in ("max_payload_bytes", "max_result_bytes", "max_batch_size", "max_pending_total")
        for value in (2**40, 2**62, 2**63 - 1)
    ],
    *[
        Case(f"resource {kind} = {value}", UNSHARDED + f'[[resources]]\nname = "r"\n{kind} = {value}\n{extra}', frags)
        for kind, value, extra, frags in (
            ("concurrency", 2**62, "", ("resources[0].concurrency", str(2**62))),
            ("rate", "inf", "", ("resources[0].rate", "inf")),
            ("rate", "nan", "", ("resources[0].rate", "nan")),
            ("rate", "1e300", "", ("resources[0].rate", "1e+300")),
            ("rate", 1, f"burst = {2**62}\n", ("resources[0].burst", str(2**62))),
        )
    ],
    Case("deeply nested array", "x = " + "[" * 5000 + "]" * 5000 + "\n", ("not valid TOML", "nested")),
    Case("deeply nested table", "x = " + "{a = " * 5000 + "1" + "}" * 5000 + "\n", ("not valid TOML", "nested")),
    Case("store.path empty", LOOPBACK + '[store]\npath = ""\n' + POOL, ("store.path", "empty")),
    Case("store.path with NUL", LOOPBACK + '[store]\npath = "a\\u0000b"\n' + POOL, ("store.path", "NUL")),
    Case("store.schema empty", LOOPBACK + '[store]\nschema = ""\n' + POOL, ("store.schema", "at least 1 character")),
    *[
        Case(
            f"tls.{key} {name}",
            LOOPBACK
            + "[server.tls]\n"
            + "".join(f'{k} = "{v}"\n' for k, v in ({"cert": "c.pem", "key": "k.pem"} | {key: path}).items())
            + POOL,
            (f"server.tls.{key}", problem),
        )
        for key, name, path, problem in (
            ("cert", "/dev/zero", "/dev/zero", "not a regular file"),  # it was read forever
            ("cert", "a directory", ".", "not a regular file"),
            *[(key, "empty", "", "empty") for key in ("cert", "key", "client_ca")],
            *[(key, "with NUL", "c\\u0000.pem", "NUL") for key in ("cert", "key", "client_ca")],
        )
    ],
    Case(
        "peer_tls.ca /dev/zero",
        LOOPBACK + '[server.peer_tls]\nca = "/dev/zero"\n' + POOL,
        ("server.peer_tls.ca", "not a regular file"),
    ),
    Case(
        "advertise with NUL", LOOPBACK + 'advertise = "http://a\\u0000b:7070"\n' + POOL, ("server.advertise", "control")
    ),
    Case(
        "token name empty",
        UNSHARDED + f'[[tokens]]\nname = ""\nsha256 = "{SHA}"\n' + TOKEN_TAIL,
        ("tokens[0].name", "at least 1 character"),
    ),
    Case(
        "duplicate token name",
        UNSHARDED
        + f'[[tokens]]\nname = "ci"\nsha256 = "{SHA}"\n'
        + TOKEN_TAIL
        + f'[[tokens]]\nname = "ci"\nsha256 = "{"b" * 64}"\n'
        + TOKEN_TAIL,
        ("tokens[1].name", "duplicate", "'ci'"),
    ),
    Case(
        "duplicate token digest",
        UNSHARDED
        + f'[[tokens]]\nname = "a"\nsha256 = "{SHA}"\n'
        + TOKEN_TAIL
        + f'[[tokens]]\nname = "b"\nsha256 = "{SHA.upper()}"\n'
        + TOKEN_TAIL,
        ("tokens[1].sha256", "duplicate", "tokens[0]"),
    ),
    Case(
        "duplicate token env",
        UNSHARDED
        + f'[[tokens]]\nname = "a"\nenv = "{UNSET_ENV}_D"\n'
        + TOKEN_TAIL
        + f'[[tokens]]\nname = "b"\nenv = "{UNSET_ENV}_D"\n'
        + TOKEN_TAIL,
        ("tokens[1].env", "duplicate", f"'{UNSET_ENV}_D'"),
        env={f"{UNSET_ENV}_D": SHA},
    ),
    # the file itself
    Case("invalid TOML syntax", "[server\nlisten = 1\n", ("not valid TOML", "line 1"), command=True),
    Case("invalid TOML value", LOOPBACK + "allow_unauthenticated = yes\n", ("not valid TOML", "line 4")),
    Case("duplicate TOML key", LOOPBACK + 'listen = "127.0.0.1:1"\n', ("not valid TOML", "line 4")),
    Case("missing file", None, ("file not found",), command=True),
]


@dataclass
class Outcome:
    returncode: int | None  # None: still running at the deadline (a bad file was accepted), then killed
    stdout: str
    stderr: str
    path: str


# Starting the server's Python (grpc, aiohttp, pydantic) costs about a second of CPU, so
# the cases run in one process that imports cronoq_server.main once and forks a child
# per case; each child runs main(argv) with its own cwd, environment and stdout/stderr
# files and exits with main's exit code, exactly as `python -m cronoq_server.main` does.
# The cases marked `command=True` also run as that literal command.
FORK_RUNNER = r"""
import json, os, signal, sys, time, traceback
import cronoq_server.main as server_main

MAX_RUNNING = 8

jobs = json.load(open(sys.argv[1]))
deadline_s = float(sys.argv[2])


def start(job):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(job["cwd"])
            os.environ.update(job["env"])
            os.dup2(os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
            os.dup2(os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            try:
                server_main.main(job["argv"])
                code = 0
            except SystemExit as exit:
                if exit.code is None or isinstance(exit.code, int):
                    code = exit.code or 0
                else:
                    print(exit.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


# A few children at a time, each with its own deadline: a long table on a loaded machine must
# not run its last cases out of time.
waiting = list(reversed(jobs))
children, results, killed = {}, {}, set()
while children or waiting:
    while waiting and len(children) < MAX_RUNNING:
        job = waiting.pop()
        children[start(job)] = (job["id"], time.monotonic() + deadline_s)
    pid, status = os.waitpid(-1, os.WNOHANG)
    if pid:
        job_id, _ = children.pop(pid)
        results[job_id] = None if pid in killed else os.waitstatus_to_exitcode(status)
        continue
    for pid, (_, until) in children.items():
        if time.monotonic() > until and pid not in killed:
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
    time.sleep(0.01)
json.dump(results, sys.stdout)
"""
CHILD_DEADLINE_S = 10.0  # each case's, from its start


def _case_env(case: Case) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(UNSET_ENV)} | case.env


def _write_case(case: Case, workdir: Path) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "cronoq.toml"
    if case.text is not None:
        path.write_text(case.text)
    return path


def _argv(case: Case, path: Path) -> list[str]:
    return ["--config", str(path)] + (["--shard", case.shard] if case.shard else [])


def _run_forked(cases: list[Case], root: Path) -> dict[str, Outcome]:
    jobs: list[dict[str, Any]] = []
    paths: dict[str, Path] = {}
    for i, case in enumerate(cases):
        workdir = root / f"forked{i}"
        paths[case.id] = path = _write_case(case, workdir)
        jobs.append(
            {
                "id": case.id,
                "cwd": str(workdir),
                "env": case.env,
                "argv": _argv(case, path),
                "stdout": str(workdir / "stdout"),
                "stderr": str(workdir / "stderr"),
            }
        )
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if not k.startswith(UNSET_ENV)}
    proc = subprocess.run(
        [sys.executable, "-c", FORK_RUNNER, str(root / "jobs.json"), str(CHILD_DEADLINE_S)],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_DEADLINE_S * len(jobs) + 60,
    )
    assert proc.returncode == 0, proc.stderr
    codes = json.loads(proc.stdout)
    return {
        job["id"]: Outcome(
            codes[job["id"]], Path(job["stdout"]).read_text(), Path(job["stderr"]).read_text(), str(paths[job["id"]])
        )
        for job in jobs
    }


def _run_command(case: Case, workdir: Path) -> Outcome:
    path = _write_case(case, workdir)
    cmd = [sys.executable, "-m", "cronoq_server.main", *_argv(case, path)]
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=_case_env(case), capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as err:  # it started serving: a bad file was accepted
        return Outcome(None, str(err.stdout or ""), str(err.stderr or ""), str(path))
    return Outcome(proc.returncode, proc.stdout, proc.stderr, str(path))


PARAMS = [pytest.param(c, "forked", id=c.id) for c in CASES] + [
    pytest.param(c, "command", id=f"{c.id} [python -m]") for c in CASES if c.command
]


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], Future[Outcome]]:
    """Runs the selected cases in the background; each test waits for its own outcome."""
    selected = {
        (item.callspec.params["case"].id, item.callspec.params["mode"])
        for item in request.session.items
        if hasattr(item, "callspec") and isinstance(item.callspec.params.get("case"), Case)
    }
    root = tmp_path_factory.mktemp("configs")
    pool = ThreadPoolExecutor(max_workers=3)
    request.addfinalizer(lambda: pool.shutdown(wait=True, cancel_futures=True))
    forked_cases = [c for c in CASES if (c.id, "forked") in selected]
    forked = pool.submit(_run_forked, forked_cases, root) if forked_cases else None
    futures: dict[tuple[str, str], Future[Outcome]] = {}
    for i, case in enumerate(CASES):
        if (case.id, "command") in selected:
            futures[(case.id, "command")] = pool.submit(_run_command, case, root / f"command{i}")
        if forked is not None and (case.id, "forked") in selected:
            futures[(case.id, "forked")] = _pick(forked, case.id)
    return futures


def _pick(batch: Future[dict[str, Outcome]], case_id: str) -> Future[Outcome]:
    one: Future[Outcome] = Future()

    def done(f: Future[dict[str, Outcome]]) -> None:
        if f.exception() is not None:
            one.set_exception(f.exception())  # type: ignore[arg-type]
        else:
            one.set_result(f.result()[case_id])

    batch.add_done_callback(done)
    return one


@pytest.mark.parametrize("case, mode", PARAMS)
def test_bad_config_is_refused(case: Case, mode: str, outcomes: dict[tuple[str, str], Future[Outcome]]) -> None:
    out = outcomes[(case.id, mode)].result(timeout=600)
    assert out.returncode == 2, f"exit code {out.returncode}, want 2; stderr:\n{out.stderr}"
    lines = out.stderr.splitlines()
    assert len(lines) == 1, f"want exactly one line on stderr, got {len(lines)}:\n{out.stderr}"
    line = lines[0]
    assert "Traceback" not in line
    assert line.startswith(f"cronoq-server: {out.path}: "), f"the line does not begin with the file {out.path}: {line}"
    for frag in case.fragments:
        assert frag in line, f"the line does not name {frag!r}: {line}"
    assert out.stdout == "", out.stdout


# -- files that start ----------------------------------------------------------


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_valid_sharded_file_serves_its_shard(start_server: Any, tmp_path: Path) -> None:
    config = {
        "store": {"path": str(tmp_path / "cronoq-{shard}.db")},
        "pools": [{"name": "a"}, {"name": "b", "max_attempts": 5}],
        "resources": [{"name": "gpu", "shard": "s2", "concurrency": 2}],
        "shards": [
            {"name": "s1", "number": 1, "pools": ["a"], "endpoint": "http://127.0.0.1:7101"},
            {"name": "s2", "number": 200, "pools": ["b"], "endpoint": "https://shard-two.example:7070"},
        ],
    }
    srv = start_server(config, shard="s2")
    status, info = srv.http("GET", "/v1/info")
    assert status == 200, info
    assert (info["shard"], info["shard_number"], info["role"]) == ("s2", 200, "ROLE_LEADER")
    with grpc.insecure_channel(srv.grpc_target) as channel:
        grpc_info = admin_service_pb2_grpc.AdminServiceStub(channel).GetServerInfo(
            admin_service_pb2.GetServerInfoRequest(), timeout=10
        )
    assert (grpc_info.shard, grpc_info.shard_number) == ("s2", 200)
    status, body = srv.http("POST", "/v1/tasks", {"pool": "b", "resources": {"gpu": 1}})
    assert status == 200, body
    assert int(body["task"]["id"]) >> 56 == 200 and body["task"]["max_attempts"] == 5
    assert (tmp_path / "cronoq-s2.db").exists() and not (tmp_path / "cronoq-s1.db").exists()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        # As the server does: connections of an earlier run in TIME_WAIT do not make a port busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_no_arguments_serves_the_default_pool(tmp_path: Path) -> None:
    if not (_port_free(7070) and _port_free(7080)):
        missing("127.0.0.1:7070 or :7080 is in use")  # CI's machine has them free
    exe = Path(sys.executable).with_name("cronoq-server")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "cronoq_server.main"]
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while True:
            assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()}"
            try:
                if _get_json("http://127.0.0.1:7080/readyz")["status"] == "leader":
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            assert time.monotonic() < deadline, f"not ready:\n{log.read_text()}"
            time.sleep(0.05)
        info = _get_json("http://127.0.0.1:7080/v1/info")
        assert (info["shard_number"], info["role"]) == (0, "ROLE_LEADER")
        req = urllib.request.Request(
            "http://127.0.0.1:7080/v1/tasks", data=b'{"pool": "default", "payload_json": 1}', method="POST"
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            task = json.loads(r.read())["task"]
        assert task["pool"] == "default" and int(task["id"]) >> 56 == 0
        with grpc.insecure_channel("127.0.0.1:7070") as channel:
            grpc_info = admin_service_pb2_grpc.AdminServiceStub(channel).GetServerInfo(
                admin_service_pb2.GetServerInfoRequest(), timeout=10
            )
        assert grpc_info.shard == info["shard"] and grpc_info.shard_number == 0
        assert (tmp_path / "cronoq.db").exists()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    assert proc.returncode == 0, log.read_text()
