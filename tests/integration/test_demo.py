"""examples/demo.py, run as `./dev demo` runs it: with --keep its servers keep serving after the
demo (for their dashboards), and SIGTERM to the demo stops every process it started (none left
running, checked by pid), unsharded and --sharded."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
KEPT = r"keeps? running"  # the line that says so


def descendants(pid: int) -> set[int]:
    """Every process below `pid`, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Demo:
    def __init__(self, *args: str):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "demo.py"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not any(re.search(pattern, line) for line in self.lines):
            if self.proc.poll() is not None:
                time.sleep(0.2)  # the last lines
                if any(re.search(pattern, line) for line in self.lines):
                    return
                pytest.fail(f"the demo ended ({self.proc.returncode}) without {pattern!r}:\n" + "\n".join(self.lines))
            if time.monotonic() > deadline:
                pytest.fail(f"no {pattern!r} within {seconds}s:\n" + "\n".join(self.lines))
            time.sleep(0.1)

    def dashboards(self) -> list[str]:
        return sorted({m.group(1) for line in self.lines for m in re.finditer(r"(http://127\.0\.0\.1:\d+)/ui/", line)})


@pytest.mark.parametrize("sharded", [False, True], ids=["unsharded", "sharded"])
def test_keep_leaves_the_servers_up_and_sigterm_stops_every_process(sharded: bool) -> None:
    demo = Demo("--keep", *(["--sharded"] if sharded else []))
    started: set[int] = set()
    try:
        demo.wait_for(KEPT, 150)
        started = descendants(demo.proc.pid)
        dashboards = demo.dashboards()
        assert len(dashboards) == (2 if sharded else 1), demo.lines
        time.sleep(1)  # still up a while after the demo itself finished
        for http in dashboards:
            with urllib.request.urlopen(f"{http}/readyz", timeout=5) as r:
                assert r.status == 200
        assert demo.proc.poll() is None
        assert len([p for p in started if running(p)]) >= len(dashboards)  # its servers (and their helpers)

        demo.proc.send_signal(signal.SIGTERM)
        demo.proc.wait(60)
        deadline = time.monotonic() + 30
        while any(running(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in started if running(p)]
        assert left == [], f"left running after SIGTERM: {left}\n" + "\n".join(demo.lines)
        for http in dashboards:
            with pytest.raises(OSError):
                urllib.request.urlopen(f"{http}/readyz", timeout=2)
    finally:
        if demo.proc.poll() is None:
            demo.proc.kill()
        for pid in started | descendants(demo.proc.pid):
            if running(pid):
                os.kill(pid, signal.SIGKILL)
