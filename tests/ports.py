"""Free loopback ports for the servers the tests start.

A port the kernel hands out for port 0 comes from its ephemeral range, the range every
outgoing connection takes its local port from: between the moment a test learns the port and
the moment its server binds it, a client socket of another test may take it ("address already
in use"). These ports come from below that range instead, each pytest-xdist worker drawing from
its own slice, and a port is never handed out twice by one process.
"""

from __future__ import annotations

import os
import random
import socket
import threading

LOWEST = 10_000
_given: set[int] = set()
_lock = threading.Lock()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _slice() -> tuple[int, int]:
    """This worker's share of [LOWEST, the ephemeral range's start)."""
    top = _ephemeral_start()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), index + 1)
    span = (top - LOWEST) // workers
    return LOWEST + index * span, LOWEST + (index + 1) * span


def free_port() -> int:
    low, high = _slice()
    if high - low < 100:  # an unusual ephemeral range: let the kernel choose
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for _ in range(1000):
        port = random.randrange(low, high)
        with _lock:
            if port in _given:
                continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or lingering in TIME_WAIT
        with _lock:
            _given.add(port)
        return port
    raise RuntimeError(f"no free port in {low}..{high}")
