"""A network namespace joined to this one by a veth pair: a non-loopback address (its end of
the pair) that only this machine reaches, for tests of what is sent to another host.

    with NetNs() as ns:                     # needs root and iproute2 (`ip`)
        listener = ns.listen(7070, log)     # records every connection and byte it receives
        ... http://{ns.peer_ip}:7070 ...

Names are unique per process and run (interface names stay within 15 characters), and the
subnet is a /30 of 10.213.0.0/16 that no interface here has. Everything is removed on exit,
also after a failure half way through the setup.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

# Runs inside the namespace: accepts connections on HOST:PORT and appends to LOG
#   ready | accept N PEER | bytes N COUNT FIRST_BYTES_HEX | closed N TOTAL
LISTENER = r"""
import socket, sys, threading
host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lock = threading.Lock()
out = open(path, "a", buffering=1)
def record(line):
    with lock:
        out.write(line + "\n")
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port))
srv.listen(64)
record("ready")
def serve(conn, n):
    total = 0
    while True:
        try:
            data = conn.recv(65536)
        except OSError:
            break
        if not data:
            break
        total += len(data)
        record(f"bytes {n} {len(data)} {data[:32].hex()}")
    record(f"closed {n} {total}")
n = 0
while True:
    conn, peer = srv.accept()
    n += 1
    record(f"accept {n} {peer[0]}")
    threading.Thread(target=serve, args=(conn, n), daemon=True).start()
"""


class NetNsUnavailable(Exception):
    """No `ip`, or no permission to create namespaces and links."""


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


class Listener:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path):
        self.proc, self.log = proc, log

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def connections(self) -> int:
        return sum(1 for line in self.lines() if line.startswith("accept "))

    def bytes_received(self) -> int:
        return sum(int(line.split()[2]) for line in self.lines() if line.startswith("bytes "))

    def first_bytes(self) -> bytes:
        chunks = [line.split() for line in self.lines() if line.startswith("bytes ")]
        return bytes.fromhex(chunks[0][3]) if chunks else b""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


class NetNs:
    def __init__(self) -> None:
        tag = f"{os.getpid() % 100_000:05d}{random.randrange(256):02x}"
        self.name = f"cronoq-test-{tag}"
        self.host_if, self.peer_if = f"cq{tag}h", f"cq{tag}p"  # at most 15 characters
        self.host_ip = self.peer_ip = ""
        self._listeners: list[Listener] = []
        self._created: list[str] = []

    def __enter__(self) -> NetNs:
        if shutil.which("ip") is None:
            raise NetNsUnavailable("`ip` (iproute2) is not installed")
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def _run(self, *args: str) -> None:
        result = _ip(*args)
        if result.returncode != 0:
            raise NetNsUnavailable(f"ip {' '.join(args)}: {result.stderr.strip()}")

    def _free_subnet(self) -> str:
        """The first three bytes and the last's base of a /30 in 10.213.0.0/16 unused here."""
        used = _ip("-4", "-o", "addr").stdout
        subnets = [(n // 64, n % 64 * 4) for n in range(256 * 64)]
        free = [f"10.213.{c}.{d}" for c, d in subnets if f" 10.213.{c}.{d + 1}/" not in used]
        return random.choice(free)

    def _setup(self) -> None:
        self._run("netns", "add", self.name)
        self._created.append("netns")
        self._run("link", "add", self.host_if, "type", "veth", "peer", "name", self.peer_if)
        self._created.append("link")
        self._run("link", "set", self.peer_if, "netns", self.name)
        prefix, last = self._free_subnet().rsplit(".", 1)
        self.host_ip, self.peer_ip = f"{prefix}.{int(last) + 1}", f"{prefix}.{int(last) + 2}"
        self._run("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        self._run("link", "set", self.host_if, "up")
        self._run("-n", self.name, "addr", "add", f"{self.peer_ip}/30", "dev", self.peer_if)
        self._run("-n", self.name, "link", "set", self.peer_if, "up")
        self._run("-n", self.name, "link", "set", "lo", "up")

    def listen(self, port: int, log: Path, timeout: float = 10.0) -> Listener:
        """A TCP listener on peer_ip:port inside the namespace, recording to log."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.name, sys.executable, "-c", LISTENER, self.peer_ip, str(port), str(log)],
            stdout=subprocess.DEVNULL,
            stderr=open(str(log) + ".stderr", "ab"),
        )
        listener = Listener(proc, log)
        self._listeners.append(listener)
        deadline = time.monotonic() + timeout
        while "ready" not in listener.lines():
            if proc.poll() is not None or time.monotonic() > deadline:
                stderr = Path(str(log) + ".stderr").read_text(errors="replace")
                raise RuntimeError(f"listener in {self.name} did not start (exit {proc.poll()}): {stderr}")
            time.sleep(0.02)
        return listener

    def close(self) -> None:
        for listener in self._listeners:
            listener.stop()
        if "link" in self._created:
            _ip("link", "del", self.host_if)  # its peer goes with it
        if "netns" in self._created:
            _ip("netns", "del", self.name)
        self._created = []


def open_for_test() -> NetNs:
    """A NetNs for a test; without one (no root or no `ip`) the test fails in CI (CI=true),
    and is skipped elsewhere."""
    from preconditions import missing

    try:
        return NetNs().__enter__()
    except NetNsUnavailable as err:
        missing(f"no network namespace (needs root and iproute2): {err}")
