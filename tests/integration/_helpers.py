"""Shared helpers for integration tests: worker processes and polling."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
WORKER = Path(__file__).with_name("worker_proc.py")


def start_worker(endpoint: str, pool: str, logfile: Path, concurrency: int = 8) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), endpoint, pool, str(logfile), "--concurrency", str(concurrency)],
        stdout=subprocess.DEVNULL,
        stderr=open(str(logfile) + ".stderr", "ab"),
    )


def eventually(check: Callable[[], T], timeout: float = 20.0, interval: float = 0.05, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout}s (last: {last!r})")


def log_lines(logfile: Path, kind: str) -> list[tuple[int, int, int]]:
    if not logfile.exists():
        return []
    out = []
    for line in logfile.read_text().splitlines():
        parts = line.split()
        if parts and parts[0] == kind and len(parts) == 4:
            out.append((int(parts[1]), int(parts[2]), int(parts[3])))
    return out
