"""A real, throwaway PostgreSQL: initdb + pg_ctl into a temp dir on a free loopback port.

Used by the test fixtures and by the benchmarks. As root, the server runs as the
`postgres` system user (initdb refuses root), which is created when missing.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from ports import free_port


def find_bin_dir() -> Path | None:
    """The directory of Debian's PostgreSQL binaries (newest version), or PATH's."""
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[4]), reverse=True):
        if Path(candidate, "initdb").exists():
            return Path(candidate)
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class TempPostgres:
    def __init__(self, bin_dir: Path, root: Path | None = None, settings: dict[str, str] | None = None):
        self.bin_dir = bin_dir
        self.root = Path(root or tempfile.mkdtemp(prefix="cronoq-pg-"))
        self.data = self.root / "data"
        self.sock = self.root / "sock"
        self.port = free_port()
        self.settings = {"max_connections": "200", "shared_buffers": "128MB", **(settings or {})}
        self._as_root = os.geteuid() == 0

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin_dir / args[0]), *args[1:]]
        if self._as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=check, capture_output=True, text=True)

    def init(self) -> TempPostgres:
        self.sock.mkdir(parents=True, exist_ok=True)
        if self._as_root:
            if subprocess.run(["id", "postgres"], capture_output=True).returncode != 0:
                subprocess.run(["useradd", "-M", "-r", "postgres"], check=True)
            shutil.chown(self.root, "postgres")
            shutil.chown(self.sock, "postgres")
            os.chmod(self.root, 0o755)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        return self

    def start(self, timeout: float = 30) -> TempPostgres:
        opts = f"-p {self.port} -k {self.sock} -c listen_addresses=127.0.0.1 " + " ".join(
            f"-c {k}={v}" for k, v in self.settings.items()
        )
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.root / "postgres.log"),
            "-o",
            opts,
            "-w",
            "-t",
            str(int(timeout)),
            "start",
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        raise TimeoutError(f"postgres did not listen on {self.port}: {self.log()}")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def restart(self) -> None:
        self.stop("fast")
        self.start()

    def log(self) -> str:
        path = self.root / "postgres.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def cleanup(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def start_temp_postgres(settings: dict[str, str] | None = None) -> TempPostgres:
    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise FileNotFoundError("PostgreSQL binaries (initdb, pg_ctl) not found; install Debian's 'postgresql'")
    return TempPostgres(bin_dir, settings=settings).init().start()


if __name__ == "__main__":
    pg = start_temp_postgres()
    print(pg.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pg.cleanup()
