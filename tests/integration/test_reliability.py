"""Nothing lost, nothing twice: real worker processes, SIGKILLed workers and servers."""

from __future__ import annotations

import asyncio
import collections
import signal
import time

from _helpers import eventually, log_lines, start_worker

import cronoq

SUCCEEDED = cronoq.TaskState.Value("TASK_STATE_SUCCEEDED")


def test_worker_killed_mid_task_is_retried_after_lease_expiry(server, tmp_path):
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    with cronoq.SyncClient(server.endpoint) as client:
        task = client.submit("default", {"sleep_first": 60}).task
        a = start_worker(server.endpoint, "default", log_a)
        eventually(lambda: log_lines(log_a, "start"), what="worker A starts the task")
        a.send_signal(signal.SIGKILL)
        a.wait(10)
        b = start_worker(server.endpoint, "default", log_b)
        try:
            done = client.wait(task.id, timeout=20)
        finally:
            b.terminate()
            b.wait(20)
    assert done.done and done.task.state == SUCCEEDED
    assert done.task.attempt == 2  # attempt 1 died with worker A; its 2 s lease expired
    assert cronoq.result_of(done.task)["pid"] == b.pid
    assert log_lines(log_b, "done") == [(task.id, 2, b.pid)]


def test_worker_killed_mid_task_resumes_from_its_checkpoint_on_another(server, tmp_path):
    """A handler that saves a checkpoint per page is SIGKILLed; the next attempt, on another
    worker, starts at the last checkpoint its heartbeats carried, and no page is skipped."""
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    with cronoq.SyncClient(server.endpoint) as client:
        task = client.submit("default", {"pages": 30, "page_s": 0.1}).task
        a = start_worker(server.endpoint, "default", log_a)
        try:
            # Heartbeats (every third of the 2 s lease) carried a checkpoint past page 5.
            kept = eventually(
                lambda: int(client.get(task.id).checkpoint or b"0") >= 5 or None, what="a checkpoint at page 5"
            )
            assert kept
        finally:
            a.send_signal(signal.SIGKILL)
            a.wait(10)
        seen = client.get(task.id)
        b = start_worker(server.endpoint, "default", log_b)
        try:
            done = client.wait(task.id, timeout=30)
        finally:
            b.terminate()
            b.wait(20)
    assert done.done and done.task.state == SUCCEEDED and done.task.attempt == 2
    pages_a = [int(line.split()[2]) for line in log_a.read_text().splitlines() if line.startswith("page")]
    pages_b = [int(line.split()[2]) for line in log_b.read_text().splitlines() if line.startswith("page")]
    resumed = int(seen.checkpoint)  # the checkpoint as the lease expired: B's first page
    assert 5 <= resumed <= max(pages_a) + 1
    assert pages_b == list(range(resumed, 30))  # from the checkpoint, not from page 0
    assert set(pages_a) | set(pages_b) == set(range(30))  # no page skipped
    assert (done.task.progress.value, done.task.progress.message) == (1.0, "page 30 of 30")


def test_server_killed_and_restarted_keeps_every_acknowledged_task(server, tmp_path):
    acknowledged: list[int] = []

    async def submit_until_killed() -> None:
        async with cronoq.Client(server.endpoint, retry=cronoq.RetryConfig(max_elapsed=0.5)) as client:
            for i in range(10_000):
                try:
                    sub = await client.submit("default", {"i": i}, key=f"k{i}")
                except cronoq.CronoqError:
                    return
                acknowledged.append(sub.task.id)
                if len(acknowledged) == 300:
                    server.proc.send_signal(signal.SIGKILL)

    asyncio.run(submit_until_killed())
    server.proc.wait(10)
    assert len(acknowledged) >= 300
    server.start()  # the same config: the same SQLite file
    log = tmp_path / "w.log"
    worker = start_worker(server.endpoint, "default", log, concurrency=32)
    try:
        with cronoq.SyncClient(server.endpoint) as client:
            for task_id in acknowledged:
                res = client.wait(task_id, timeout=30)
                assert res.done and res.task.state == SUCCEEDED, f"task {task_id} lost or not done"
    finally:
        worker.terminate()
        worker.wait(20)
    done = collections.Counter(t for t, _, _ in log_lines(log, "done"))
    assert all(done[t] == 1 for t in acknowledged)


def test_1000_tasks_through_4_workers_each_finish_exactly_once(server, tmp_path):
    logs = [tmp_path / f"w{i}.log" for i in range(4)]
    workers = [start_worker(server.endpoint, "default", log, concurrency=16) for log in logs]
    try:
        # Every worker is registered (and so polling) before the first task exists.
        eventually(lambda: len(server.http("GET", "/v1/workers")[1]["workers"]) == 4, what="4 workers registered")
        with cronoq.SyncClient(server.endpoint) as client:
            ids: list[int] = []
            for start in range(0, 1000, 50):  # batches of the fixture's max_batch_size
                resp = client.submit_batch([cronoq.task_spec("default", {"n": n}) for n in range(start, start + 50)])
                ids += [t.id for t in resp.tasks]
            results = [client.wait(i, timeout=60) for i in ids]
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            assert w.wait(30) == 0
    assert len(set(ids)) == 1000
    assert all(r.done and r.task.state == SUCCEEDED and r.task.attempt == 1 for r in results)
    done = [line for log in logs for line in log_lines(log, "done")]
    per_task = collections.Counter(t for t, _, _ in done)
    assert sorted(per_task) == sorted(ids) and set(per_task.values()) == {1}
    by_pid = {t: pid for t, _, pid in done}
    assert all(cronoq.result_of(r.task)["pid"] == by_pid[r.task.id] for r in results)
    assert len({pid for _, _, pid in done}) >= 2, "work should spread over the workers"


def test_worker_handler_observes_cancellation(server, tmp_path):
    log = tmp_path / "w.log"
    worker = start_worker(server.endpoint, "default", log)
    try:
        with cronoq.SyncClient(server.endpoint) as client:
            task = client.submit("default", {"sleep": 60}).task
            eventually(lambda: log_lines(log, "start"), what="the task starts")
            assert client.cancel(task.id).cancel_requested
            started = time.monotonic()
            done = client.wait(task.id, timeout=10)
    finally:
        worker.terminate()
        worker.wait(20)
    assert done.done and done.task.state == cronoq.TaskState.Value("TASK_STATE_CANCELLED")
    assert time.monotonic() - started < 3  # learnt at the next heartbeat (every ttl/3 = 0.67 s)
    assert log_lines(log, "done") == []


def test_worker_sigterm_lets_running_tasks_finish(server, tmp_path):
    log = tmp_path / "w.log"
    worker = start_worker(server.endpoint, "default", log)
    with cronoq.SyncClient(server.endpoint) as client:
        ids = [client.submit("default", {"sleep": 1.0}).task.id for _ in range(3)]
        eventually(lambda: len(log_lines(log, "start")) == 3, what="three tasks start")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
        results = [client.get(i) for i in ids]
    assert all(t.state == SUCCEEDED for t in results)
    assert sorted(t for t, _, _ in log_lines(log, "done")) == sorted(ids)
