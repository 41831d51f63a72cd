"""The demo: an embedded cronoq server on SQLite, a worker in its own process, and
tasks flowing through them. Run it with `./dev demo`.

`./dev demo --sharded`: two shards, each its own server process and SQLite file, with
calls forwarded between them and workers redirected to their pool's shard (demo_sharded.py).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import cronoq

HERE = Path(__file__).parent
STATE = {v: k.removeprefix("TASK_STATE_") for k, v in cronoq.TaskState.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)


@contextmanager
def bounded(seconds: int | None = None) -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGALRM (after `seconds`, if given) raise KeyboardInterrupt naming the
    signal, so that the demo stops the processes it started before it ends."""

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {s: signal.signal(s, interrupt) for s in STOPPING_SIGNALS}
    if seconds:
        signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def uninterrupted() -> Iterator[None]:
    """Stopping the processes is not cut short by another signal (it is bounded by itself)."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in STOPPING_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def keep_serving(dashboards: Mapping[str, str], processes: Sequence[subprocess.Popen[Any]]) -> None:
    """--keep: the demo's processes run on (for the dashboards at `dashboards`' HTTP addresses)
    until Ctrl-C or SIGTERM (inside `bounded`), or until one of them ends."""
    print()
    for name, http in dashboards.items():
        print(f"{name}'s dashboard: {http}/ui/")
    print("the demo keeps running: Ctrl-C (or SIGTERM) stops its servers and workers", flush=True)
    try:
        while all(p.poll() is None for p in processes):
            time.sleep(0.5)
    except KeyboardInterrupt:
        return
    print(f"demo: a process ended by itself ({', '.join(str(p.args) for p in processes if p.poll() is not None)})")


def start_server(workdir: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    grpc_port, http_port = free_port(), free_port()
    config = workdir / "cronoq.toml"
    config.write_text(
        f'[server]\nlisten = "127.0.0.1:{grpc_port}"\nhttp_listen = "127.0.0.1:{http_port}"\n'
        '[[pools]]\nname = "default"\nretry_backoff = "200ms"\n'
    )
    print(f"$ cronoq-server --config {config}   (SQLite at {workdir}/cronoq.db)")
    # A session of its own: Ctrl-C reaches the demo only, which stops its children in order.
    proc = subprocess.Popen(
        [sys.executable, "-m", "cronoq_server.main", "--config", str(config)], cwd=workdir, start_new_session=True
    )
    http = f"http://127.0.0.1:{http_port}"
    wait_ready(http)
    return proc, f"http://127.0.0.1:{grpc_port}", http


def wait_ready(http: str, seconds: float = 10.0) -> bool:
    """Whether the server answers /readyz 200 (it leads its shard) within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{http}/readyz", timeout=1):
                return True
        except OSError:
            time.sleep(0.05)
    return False


async def submit_and_watch(endpoint: str) -> list[cronoq.Task]:
    async with cronoq.Client(endpoint) as client:
        first = await client.submit("default", {"kind": "hello", "to": "world"}, key="greeting-1")
        again = await client.submit("default", {"kind": "hello", "to": "someone else"}, key="greeting-1")
        print(
            f"submitted task {first.task.id} with key greeting-1; "
            f"the same key again -> task {again.task.id}, deduplicated={again.deduplicated}"
        )
        batch = await client.submit_batch(
            [
                cronoq.task_spec("default", {"kind": "extract", "file": "a.csv"}, key="extract"),
                cronoq.task_spec("default", {"kind": "load"}, key="load", depends_on=["extract"]),
            ]
        )
        print(
            f"batch: extract={batch.tasks[0].id}, load={batch.tasks[1].id} "
            f"(load is {STATE[batch.tasks[1].state]} until extract succeeds)"
        )
        flaky = await client.submit("default", {"kind": "flaky"}, key="flaky", max_attempts=5)
        broken = await client.submit("default", {"kind": "broken"}, key="broken")
        urgent = await client.submit("default", {"kind": "urgent"}, priority=10)
        print(
            f"a flaky task {flaky.task.id} (fails twice, then succeeds), a broken one {broken.task.id}, "
            f"an urgent one {urgent.task.id} (priority 10)"
        )
        ids = [first.task.id, *(t.id for t in batch.tasks), flaky.task.id, broken.task.id, urgent.task.id]
        return [(await client.wait(i, timeout=30)).task for i in ids]


def stop(proc: subprocess.Popen[bytes] | None, seconds: float = 30) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_demo(workdir: Path, keep: bool) -> list[cronoq.Task]:
    """The demo's tasks as they ended; with `keep`, the server runs on until Ctrl-C or SIGTERM.
    Whatever happens, the server and the worker are stopped before it returns."""
    server = worker = None
    try:
        server, endpoint, http = start_server(workdir)
        print(f"server ready: gRPC {endpoint}, HTTP {http}; its dashboard: {http}/ui/")
        worker = subprocess.Popen([sys.executable, str(HERE / "demo_worker.py"), endpoint], start_new_session=True)
        tasks = asyncio.run(submit_and_watch(endpoint))
        stop(worker)
        print(f"\n{'id':>4}  {'key':<11} {'state':<10} {'attempts':>8}  result / error")
        for t in tasks:
            outcome = cronoq.result_of(t) if t.state == cronoq.TaskState.Value("TASK_STATE_SUCCEEDED") else t.error
            print(f"{t.id:>4}  {t.key or '-':<11} {STATE[t.state]:<10} {t.attempt:>8}  {outcome}")
        with urllib.request.urlopen(f"{http}/metrics") as r:
            finished = [ln for ln in r.read().decode().splitlines() if ln.startswith("cronoq_tasks_finished_total")]
        print("\nfrom /metrics:", "; ".join(finished))
        if keep:
            keep_serving({"the server": http}, [server])
        return tasks
    finally:
        with uninterrupted():
            stop(worker)
            stop(server)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sharded", action="store_true", help="two shards, forwarding and worker redirects")
    ap.add_argument("--keep", action="store_true", help="keep the servers running afterwards (for their dashboards)")
    args = ap.parse_args()
    if args.sharded:
        from demo_sharded import run_sharded_demo

        run_sharded_demo(args.keep)
        return
    with tempfile.TemporaryDirectory(prefix="cronoq-demo-") as tmp:
        try:
            with bounded():
                tasks = run_demo(Path(tmp), args.keep)
        except KeyboardInterrupt as why:
            sys.exit(f"demo: stopped ({why or 'SIGINT'}); the server and the worker were stopped")
    expected = {
        "greeting-1": "SUCCEEDED",
        "extract": "SUCCEEDED",
        "load": "SUCCEEDED",
        "flaky": "SUCCEEDED",
        "broken": "FAILED",
    }
    wrong = [t.key for t in tasks if t.key in expected and STATE[t.state] != expected[t.key]]
    if wrong:
        sys.exit(f"demo: unexpected outcome for {wrong}")
    print("\ndemo finished: every task ended as expected")


if __name__ == "__main__":
    main()
