"""Shared helpers for integration tests: worker processes and polling."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

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
        if parts and parts[0] == kind and len(parts) >= 4:
            out.append((int(parts[1]), int(parts[2]), int(parts[3])))
    return out


def run_intervals(logfile: Path) -> list[tuple[float, float]]:
    """(start, end) unix times of every execution that finished, from worker_proc's log."""
    starts: dict[tuple[int, int], float] = {}
    out = []
    for line in logfile.read_text().splitlines() if logfile.exists() else []:
        parts = line.split()
        if len(parts) == 5 and parts[0] in ("start", "done"):
            attempt = (int(parts[1]), int(parts[2]))
            if parts[0] == "start":
                starts[attempt] = float(parts[4])
            elif attempt in starts:
                out.append((starts[attempt], float(parts[4])))
    return out


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end before a start at the same time)."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda p: (p[0], p[1]))
    most = running = 0
    for _, step in points:
        running += step
        most = max(most, running)
    return most
