"""What a request may hold, enforced before the server parses it, on a real server: a caller
without credentials is refused before its message is read, a message over its method's byte
limit (derived from [limits]) and a worker message with a list over its cap are refused
unparsed; a burst of them leaves the server's memory where it was and other callers fast."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from cronoq.v1 import task_service_pb2 as tpb
from cronoq.v1 import worker_service_pb2 as wpb

WORKER_TOKEN = "worker-secret"
READER_TOKEN = "reader-secret"
BURST = 12
KiB, MiB = 1 << 10, 1 << 20
PAYLOAD_LIMIT = 64 * KiB
# SubmitTask's limit: the payload cap plus the 256 KiB every other field of a task may take.
SUBMIT_LIMIT = PAYLOAD_LIMIT + 256 * KiB
OUTCOMES_CAP = 10_000


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _config() -> dict[str, Any]:
    return {
        "pools": [{"name": "default"}, {"name": "other"}],
        "limits": {"max_payload_bytes": PAYLOAD_LIMIT, "max_result_bytes": PAYLOAD_LIMIT, "max_batch_size": 10},
        "tokens": [
            {
                "name": "worker",
                "sha256": _sha256(WORKER_TOKEN),
                "pools": ["default"],
                "permissions": ["submit", "work"],
            },
            {"name": "reader", "sha256": _sha256(READER_TOKEN), "pools": ["*"], "permissions": ["read"]},
        ],
    }


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


class Peak(threading.Thread):
    """The highest RSS of a process, sampled every 10 ms until stopped."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid = pid
        self.highest = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.01):
            self.highest = max(self.highest, rss_bytes(self.pid))


class Lister(threading.Thread):
    """Another caller: ListTasks in a loop on a channel of its own; every latency kept."""

    def __init__(self, target: str):
        super().__init__(daemon=True)
        self.channel = grpc.insecure_channel(target)
        self.list = self.channel.unary_unary(
            "/cronoq.v1.TaskService/ListTasks",
            request_serializer=tpb.ListTasksRequest.SerializeToString,
            response_deserializer=tpb.ListTasksResponse.FromString,
        )
        self.latencies: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            self.list(tpb.ListTasksRequest(pool="default", page_size=10), metadata=_bearer(READER_TOKEN), timeout=30)
            self.latencies.append(time.monotonic() - started)
            time.sleep(0.01)

    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def _burst(calls: list[Callable[[], Any]]) -> list[grpc.RpcError | str]:
    """Runs the calls at once; what each ended with (its RpcError, or "OK")."""

    def one(call: Callable[[], Any]) -> grpc.RpcError | str:
        try:
            call()
        except grpc.RpcError as err:
            return err
        return "OK"

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(one, calls))


def _wrong(ended: list[grpc.RpcError | str], code: grpc.StatusCode, *fragments: str) -> list[str]:
    wrong = []
    for e in ended:
        if isinstance(e, str):
            wrong.append(f"answered {e}, want {code.name}")
        elif e.code() != code or not all(f in (e.details() or "") for f in fragments):
            wrong.append(f"{e.code().name} {e.details()!r}, want {code.name} naming {fragments}")
    return wrong


def test_a_burst_of_oversized_and_unauthenticated_requests_is_refused_unparsed(start_server: Any) -> None:
    srv = start_server(_config())
    channel = grpc.insecure_channel(srv.grpc_target, options=[("grpc.max_send_message_length", 64 * MiB)])
    raw = {
        name: (channel.stream_stream if name == "Work" else channel.unary_unary)(
            f"/cronoq.v1.{service}/{name}", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        for service, name in (
            ("WorkerService", "Work"),
            ("WorkerService", "FinishTasks"),
            ("WorkerService", "RegisterWorker"),
            ("TaskService", "SubmitTask"),
        )
    }
    worker_id = wpb.RegisterWorkerResponse.FromString(
        raw["RegisterWorker"](
            wpb.RegisterWorkerRequest(name="w", pools=["default"], concurrency=1).SerializeToString(),
            metadata=_bearer(WORKER_TOKEN),
            timeout=10,
        )
    ).worker_id
    small = tpb.SubmitTaskRequest(pool="default", payload=b"x").SerializeToString()
    raw["SubmitTask"](small, metadata=_bearer(WORKER_TOKEN), timeout=10)  # warms up every path measured
    lister = Lister(srv.grpc_target)
    lister.start()
    time.sleep(1.0)
    idle = rss_bytes(srv.proc.pid)

    # A worker's Work messages, each of 200,000 outcomes (2 MB): over the 10,000 cap, and
    # some 25 MB each once parsed.
    flood = wpb.WorkRequest(
        worker_id=worker_id,
        outcomes=[wpb.TaskOutcome(task_id=i + 1, attempt=1, released=wpb.TaskReleased()) for i in range(200_000)],
    ).SerializeToString()
    # Submissions just over SubmitTask's limit, and far over it.
    over = [
        tpb.SubmitTaskRequest(pool="default", payload=b"p" * size).SerializeToString()
        for size in (SUBMIT_LIMIT + 1, 4 * MiB)
    ]
    # Unary calls of 16 MB without credentials.
    unauthenticated = wpb.FinishTasksRequest(
        worker_id=worker_id,
        outcomes=[wpb.TaskOutcome(task_id=1, attempt=1, success=wpb.TaskSuccess(result=b"r" * (16 * MiB)))],
    ).SerializeToString()
    peak = Peak(srv.proc.pid)
    peak.start()
    started = time.monotonic()
    floods = _burst(
        [lambda: list(raw["Work"](iter([flood]), metadata=_bearer(WORKER_TOKEN), timeout=60)) for _ in range(BURST)]
    )
    oversized = _burst(
        [lambda i=i: raw["SubmitTask"](over[i % 2], metadata=_bearer(WORKER_TOKEN), timeout=60) for i in range(BURST)]
    )
    strangers = _burst([lambda: raw["FinishTasks"](unauthenticated, timeout=60) for _ in range(BURST)])
    took = time.monotonic() - started
    time.sleep(2.0)  # the server gives freed memory back a second after a refusal
    after = rss_bytes(srv.proc.pid)
    for thread in (lister, peak):
        thread.stop.set()
        thread.join()
    print(
        f"\nburst of {3 * BURST} calls in {took:.2f}s; RSS idle {idle / MiB:.0f} MB, peak {peak.highest / MiB:.0f} MB, "
        f"after {after / MiB:.0f} MB; "
        f"ListTasks p99 {lister.p99():.3f}s, slowest {max(lister.latencies):.3f}s of {len(lister.latencies)}"
    )
    wrong = _wrong(floods, grpc.StatusCode.INVALID_ARGUMENT, f"outcomes: more than {OUTCOMES_CAP} outcomes")
    wrong += _wrong(oversized, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{SUBMIT_LIMIT} bytes", "limits.max_payload_bytes")
    wrong += _wrong(strangers, grpc.StatusCode.UNAUTHENTICATED, "credentials required")
    assert not wrong, "\n".join(wrong)
    assert after < 2 * idle, (idle, after)
    # What is in flight at once (24 MB of floods, then 26 MB of submissions), read once and
    # copied once; parsed, the floods alone would take some 300 MB.
    assert peak.highest < idle + 2 * BURST * len(flood) + 100 * MiB, (idle, peak.highest)
    assert len(lister.latencies) > 5 and lister.p99() < 1.0, (lister.p99(), len(lister.latencies))
    log = srv.log()
    assert "Traceback" not in log, log[log.index("Traceback") - 300 :][:3000]
    channel.close()
