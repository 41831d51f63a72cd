"""Starting a cronoq-server for a benchmark run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

# The SQLite durability the bench runs with (the server's default is "full").
SYNCHRONOUS = os.environ.get("CRONOQ_BENCH_SYNCHRONOUS", "full")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BenchServer:
    def __init__(self, workdir: Path, store_toml: str = ""):
        self.grpc_port, self.http_port = free_port(), free_port()
        self.config = workdir / "bench.toml"
        self.config.write_text(
            f'[server]\nlisten = "127.0.0.1:{self.grpc_port}"\nhttp_listen = "127.0.0.1:{self.http_port}"\n'
            f'[store]\npath = "{workdir}/bench.db"\nsynchronous = "{SYNCHRONOUS}"\n{store_toml}\n'
            '[limits]\nmax_batch_size = 1000\n[[pools]]\nname = "default"\n'
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
