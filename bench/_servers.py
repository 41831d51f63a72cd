"""Starting a cronoq-server for a benchmark run."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cronoq

# The SQLite durability the bench runs with (the server's default is "full").
SYNCHRONOUS = os.environ.get("CRONOQ_BENCH_SYNCHRONOUS", "full")


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, reaped_children: bool = False) -> float:
    """A process's user + system CPU seconds (/proc/PID/stat), with those of the children it
    has reaped when asked."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    if reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / CLOCK_TICKS


def postgres_cpu_seconds(url: str) -> float | None:
    """The CPU seconds of the local PostgreSQL server listening on url's port: its postmaster,
    the backends it reaped and those alive; None when no such server runs here."""
    port = url.rsplit(":", 1)[1].split("/", 1)[0]
    procs = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
    postmaster = None
    for proc in procs:
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"postgres") and b"-p" in args and port.encode() in args:
            postmaster = int(proc.name)
            break
    if postmaster is None:
        return None
    total = cpu_seconds(postmaster, reaped_children=True)
    for proc in procs:
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                total += cpu_seconds(int(proc.name))
        except OSError:
            continue  # it ended meanwhile: counted in the postmaster's reaped children
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_store_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--url", help="PostgreSQL URL (default: a throwaway server started for the run)")


BENCH_TOKEN = "bench-token"


class BenchServer:
    """A cronoq-server on SQLite in workdir, or on a fresh schema of a PostgreSQL URL.

    secure: TLS on both listeners (a CA made for the run) and a bearer token required; clients
    then connect with `client_options`. extra_config: TOML appended to the config file.
    shard: the shard this server serves (--shard), when extra_config has [[shards]]; its store
    is then the shard's own (a file, or a schema, named with {shard}), and `ports` (gRPC, HTTP)
    are those its [[shards]] endpoint names. default_pool: TOML lines of the pool "default".
    max_batch_size: limits.max_batch_size (a batch's tasks, and those a handler spawns).
    """

    def __init__(
        self,
        workdir: Path,
        postgres_url: str | None = None,
        extra_pools: tuple[str, ...] = (),
        secure: bool = False,
        extra_config: str = "",
        shard: str | None = None,
        ports: tuple[int, int] | None = None,
        synchronous: str = SYNCHRONOUS,
        default_pool: str = "",
        max_batch_size: int = 1000,
    ):
        self.grpc_port, self.http_port = ports or (free_port(), free_port())
        self.secure = secure
        self.client_options: dict[str, Any] = {}
        self._ssl: ssl.SSLContext | None = None
        security = ""
        if secure:
            import trustme

            ca = trustme.CA()
            issued = ca.issue_cert("127.0.0.1")
            ca.cert_pem.write_to_path(str(workdir / "ca.pem"))
            issued.cert_chain_pems[0].write_to_path(str(workdir / "server.pem"))
            issued.private_key_pem.write_to_path(str(workdir / "server.key"))
            digest = hashlib.sha256(BENCH_TOKEN.encode()).hexdigest()
            security = (
                f'[server.tls]\ncert = "{workdir}/server.pem"\nkey = "{workdir}/server.key"\n'
                f'[[tokens]]\nname = "bench"\nsha256 = "{digest}"\npools = ["*"]\n'
                'permissions = ["submit", "read", "cancel", "work", "schedule", "admin"]\n'
            )
            self.client_options = {"token": BENCH_TOKEN, "tls": cronoq.TlsConfig(ca=str(workdir / "ca.pem"))}
            self._ssl = ssl.create_default_context(cafile=str(workdir / "ca.pem"))
        own = f"-{shard}" if shard else ""  # this server's files
        self.config = workdir / f"bench{own}.toml"
        if postgres_url:  # sharded: the server puts its shard's name for {shard}
            schema = f"bench_{uuid.uuid4().hex[:10]}{'_{shard}' if shard else ''}"
            store = f'kind = "postgres"\nurl = "{postgres_url}"\nschema = "{schema}"'
        else:
            store = f'path = "{workdir}/bench{"-{shard}" if shard else ""}.db"\nsynchronous = "{synchronous}"'
        self.config.write_text(
            f'[server]\nlisten = "127.0.0.1:{self.grpc_port}"\nhttp_listen = "127.0.0.1:{self.http_port}"\n'
            f"[store]\n{store}\n"
            f'[limits]\nmax_batch_size = {max_batch_size}\n[[pools]]\nname = "default"\n{default_pool}'
            + "".join(f'[[pools]]\nname = "{name}"\n' for name in extra_pools)
            + security
            + extra_config
        )
        self.log = open(workdir / f"server{own}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cronoq_server.main", "--config", str(self.config), "--log-level", "WARNING"]
            + (["--shard", shard] if shard else []),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.http_url}/readyz", timeout=1, context=self._ssl):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("bench server did not become ready")

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.secure else 'http'}://127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{'https' if self.secure else 'http'}://127.0.0.1:{self.http_port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


@contextlib.contextmanager
def bench_store(store: str, url: str | None) -> Iterator[str | None]:
    """The PostgreSQL URL to run on (starting a throwaway server when none is given), or None for SQLite."""
    if store == "sqlite":
        yield None
        return
    if url:
        yield url
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from pgserver import start_temp_postgres

    pg = start_temp_postgres()
    try:
        yield pg.url
    finally:
        pg.cleanup()
