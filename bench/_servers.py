"""Starting a cronoq-server for a benchmark run."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

# The SQLite durability the bench runs with (the server's default is "full").
SYNCHRONOUS = os.environ.get("CRONOQ_BENCH_SYNCHRONOUS", "full")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_store_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--url", help="PostgreSQL URL (default: a throwaway server started for the run)")


class BenchServer:
    """A cronoq-server on SQLite in workdir, or on a fresh schema of a PostgreSQL URL."""

    def __init__(self, workdir: Path, postgres_url: str | None = None, extra_pools: tuple[str, ...] = ()):
        self.grpc_port, self.http_port = free_port(), free_port()
        self.config = workdir / "bench.toml"
        if postgres_url:
            store = f'kind = "postgres"\nurl = "{postgres_url}"\nschema = "bench_{uuid.uuid4().hex[:10]}"'
        else:
            store = f'path = "{workdir}/bench.db"\nsynchronous = "{SYNCHRONOUS}"'
        self.config.write_text(
            f'[server]\nlisten = "127.0.0.1:{self.grpc_port}"\nhttp_listen = "127.0.0.1:{self.http_port}"\n'
            f"[store]\n{store}\n"
            '[limits]\nmax_batch_size = 1000\n[[pools]]\nname = "default"\n'
            + "".join(f'[[pools]]\nname = "{name}"\n' for name in extra_pools)
        )
        self.log = open(workdir / "server.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cronoq_server.main", "--config", str(self.config), "--log-level", "WARNING"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/readyz", timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("bench server did not become ready")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

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
