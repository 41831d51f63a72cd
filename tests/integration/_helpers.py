"""Shared helpers for integration tests: worker and CLI processes, and polling."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

import grpc

from cronoq.v1 import task_pb2, task_service_pb2_grpc, worker_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

T = TypeVar("T")
WORKER = Path(__file__).with_name("worker_proc.py")


class Api:
    """Raw gRPC calls to one server (no SDK), for tests of the wire behaviour."""

    def __init__(self, target: str):
        self.channel = grpc.insecure_channel(target)
        self.tasks = task_service_pb2_grpc.TaskServiceStub(self.channel)
        self.workers = worker_service_pb2_grpc.WorkerServiceStub(self.channel)

    def submit(self, pool: str = "default", **kw) -> task_pb2.Task:
        deps = [
            task_pb2.TaskRef(id=d) if isinstance(d, int) else task_pb2.TaskRef(key=d) for d in kw.pop("depends_on", [])
        ]
        return self.tasks.SubmitTask(tpb.SubmitTaskRequest(pool=pool, depends_on=deps, **kw)).task

    def get(self, task_id: int) -> task_pb2.Task:
        return self.tasks.GetTask(tpb.GetTaskRequest(task=task_pb2.TaskRef(id=task_id))).task

    def register(self, pools=("default",)) -> str:
        return self.workers.RegisterWorker(
            wpb.RegisterWorkerRequest(name="t", pools=list(pools), concurrency=10)
        ).worker_id

    def lease(self, worker: str, n: int = 10, wait_ms: int = 0) -> list[task_pb2.Task]:
        return list(
            self.workers.LeaseTasks(wpb.LeaseTasksRequest(worker_id=worker, max_tasks=n, wait_ms=wait_ms)).tasks
        )

    def finish(self, worker: str, task: task_pb2.Task, **outcome) -> wpb.FinishTaskResult:
        o = wpb.TaskOutcome(task_id=task.id, attempt=task.attempt, **outcome)
        return self.workers.FinishTasks(wpb.FinishTasksRequest(worker_id=worker, outcomes=[o])).results[0]

    def succeed(self, worker: str, task: task_pb2.Task, result: bytes = b"ok") -> wpb.FinishTaskResult:
        return self.finish(worker, task, success=wpb.TaskSuccess(result=result))

    def fail(self, worker: str, task: task_pb2.Task, retryable: bool = True) -> wpb.FinishTaskResult:
        return self.finish(worker, task, failure=wpb.TaskFailure(error="boom", retryable=retryable))


def store_table(kind: str, request: Any, path: Path | None = None) -> dict[str, Any]:
    """The [store] table of a fresh store: SQLite (at path, or the server's default) or a new
    schema of the session's PostgreSQL."""
    if kind == "postgres":
        pg = request.getfixturevalue("postgres")
        return {"kind": "postgres", "url": pg.url, "schema": f"t_{uuid.uuid4().hex[:10]}"}
    return {"path": str(path)} if path is not None else {}


def start_worker(
    endpoint: str, pool: str, logfile: Path, concurrency: int = 8, token: str | None = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), endpoint, pool, str(logfile), "--concurrency", str(concurrency)]
        + (["--token", token] if token else []),
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
        if parts and parts[0] == kind and len(parts) >= 4:
            out.append((int(parts[1]), int(parts[2]), int(parts[3])))
    return out


def runs_by_task(logfile: Path) -> dict[int, list[tuple[float, float]]]:
    """Each task's executions that finished, (start, end) unix times, from worker_proc's log."""
    starts: dict[tuple[int, int], float] = {}
    out: dict[int, list[tuple[float, float]]] = {}
    for line in logfile.read_text().splitlines() if logfile.exists() else []:
        parts = line.split()
        if len(parts) == 5 and parts[0] in ("start", "done"):
            attempt = (int(parts[1]), int(parts[2]))
            if parts[0] == "start":
                starts[attempt] = float(parts[4])
            elif attempt in starts:
                out.setdefault(attempt[0], []).append((starts[attempt], float(parts[4])))
    return out


def run_intervals(logfile: Path) -> list[tuple[float, float]]:
    """(start, end) unix times of every execution that finished, from worker_proc's log."""
    return [iv for runs in runs_by_task(logfile).values() for iv in runs]


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end before a start at the same time)."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda p: (p[0], p[1]))
    most = running = 0
    for _, step in points:
        running += step
        most = max(most, running)
    return most


def cli(server: Any, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs `cronoq ARGS --endpoint <server>` (server None: no endpoint) to its end."""
    endpoint = ["--endpoint", server.endpoint] if server is not None else []
    cmd = [sys.executable, "-m", "cronoq.cli", *args, *endpoint]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=check)


class LineReader:
    """Reads a process's output lines on a thread, so that a test can wait for them."""

    def __init__(self, stream: IO[str]):
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for(self, check: Callable[[list[str]], T], timeout: float = 20.0, what: str = "output") -> T:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                result = check(list(self.lines))
                if result:
                    return result
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"{what} not seen within {timeout}s; last lines: {self.lines[-5:]}")
                self._changed.wait(remaining)


# Runs the CLI (sys.argv[1:]) with Ctrl-C raising KeyboardInterrupt, as in a terminal.
RUN_WITH_CTRL_C = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv = sys.argv[1:]; runpy.run_module('cronoq.cli', run_name='__main__')"
)


class Watcher:
    """`cronoq watch --json ARGS` (or without --json) running against a server."""

    def __init__(self, server: Any, stderr_path: Path, *args: str, as_json: bool = True):
        self.stderr_path = stderr_path
        json_flag = ["--json"] if as_json else []
        argv = ["cronoq", "watch", *json_flag, "--endpoint", server.endpoint, *args]
        self.proc = subprocess.Popen(
            # Ctrl-C must reach it even from a test runner whose own processes ignore SIGINT. Not
            # with preexec_fn: a fork of this multi-threaded process (grpc) may hang before exec.
            [sys.executable, "-c", RUN_WITH_CTRL_C, *argv],
            stdout=subprocess.PIPE,
            stderr=open(stderr_path, "w"),
            text=True,
        )
        assert self.proc.stdout is not None
        self.reader = LineReader(self.proc.stdout)

    def events(self) -> list[dict[str, Any]]:
        """The events printed so far (with --json)."""
        return [json.loads(line) for line in list(self.reader.lines)]

    def wait_connected(self, api: Api, pool: str = "default", timeout: float = 20.0) -> None:
        """Submits a probe task every 0.3 s until one shows: the watch is live from then on."""
        deadline = time.monotonic() + timeout
        while True:
            api.submit(pool)
            try:
                self.reader.wait_for(bool, timeout=0.3)
                return
            except AssertionError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"cronoq watch saw no event in {timeout}s: {self.stderr()}") from None

    def wait_created(self, task_ids: list[int], timeout: float = 20.0) -> None:
        """Until the creation event (PENDING) of every task is printed."""

        def seen(lines: list[str]) -> bool:
            created = {e["task"]["id"] for e in map(json.loads, lines) if e["task"]["state"] == "TASK_STATE_PENDING"}
            return {str(i) for i in task_ids} <= created

        self.reader.wait_for(seen, timeout, what=f"creation events of {task_ids}")

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def interrupt(self, timeout: float = 10.0) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
