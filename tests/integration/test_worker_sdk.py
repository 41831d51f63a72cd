"""The Python Worker against a real server: big payloads and results never kill the worker
or lose a report, and a stopping worker gives unfinished tasks back at once."""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

import cronoq
from cronoq import worker as worker_mod

S = cronoq.TaskState
MB = 1_000_000
MiB = 1 << 20


@contextlib.asynccontextmanager
async def running(worker: cronoq.Worker) -> AsyncIterator[asyncio.Task[None]]:
    """Runs the worker for the block; stops it (and surfaces its failure) on the way out."""
    run = asyncio.create_task(worker.run())
    try:
        yield run
    finally:
        worker.stop()
        await asyncio.wait_for(run, 30)


async def until(check: Callable[[], Any], run: asyncio.Task[None], timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if run.done():
            run.result()  # the worker died: show why
            raise AssertionError(f"the worker stopped before {what}")
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.02)


def worker(server: Any, pool: str, handler: Any, **options: Any) -> cronoq.Worker:
    return cronoq.Worker(server.endpoint, pool, handler, **options)


async def test_lease_replies_of_big_payloads_fit_the_receive_limit(start_server):
    # 160 tasks of 1 MB against a worker with 100 free slots: unbounded, the first reply
    # would be 100 MB, over the SDK's 64 MiB receive limit. The server must cap replies at
    # LeaseTasksRequest.max_bytes; a 30 s lease makes a lost reply show as a timeout.
    server = start_server({"pools": [{"name": "big", "lease_ttl": "30s"}], "limits": {"max_payload_bytes": 2 * MiB}})
    calls: Counter[int] = Counter()

    async def handle(task: cronoq.TaskContext) -> dict[str, int]:
        calls[task.id] += 1
        assert len(task.payload) == MB
        await asyncio.sleep(0.01)
        return {"n": len(task.payload)}

    async with cronoq.Client(server.endpoint) as client:
        ids = [(await client.submit("big", bytes([i]) * MB)).task.id for i in range(160)]
        w = worker(server, "big", handle, concurrency=100)
        async with running(w) as run:
            await until(lambda: len(calls) == 160 and not w._unacked, run, 20, "all 160 tasks reported")
        for task_id in ids:
            task = await client.get(task_id)
            assert (task.state, task.attempt) == (S.Value("TASK_STATE_SUCCEEDED"), 1), task_id
            assert cronoq.result_of(task) == {"n": MB}
    assert calls == Counter({i: 1 for i in ids})


async def test_an_oversized_result_fails_its_task_and_no_other_report_is_lost(start_server):
    server = start_server({"pools": [{"name": "default", "lease_ttl": "5s"}], "limits": {"max_result_bytes": 4 * MiB}})
    calls: Counter[int] = Counter()
    all_started = asyncio.Event()
    big = b"x" * (70 * MB)

    async def handle(task: cronoq.TaskContext) -> Any:
        calls[task.id] += 1
        if len(calls) == 8:
            all_started.set()
        await all_started.wait()  # the eight outcomes are ready together: one report
        return big if task.payload["big"] else {"i": task.payload["i"]}

    async with cronoq.Client(server.endpoint) as client:
        ids = [(await client.submit("default", {"i": i, "big": i == 3})).task.id for i in range(8)]
        async with running(worker(server, "default", handle, concurrency=8)) as run:
            for task_id in ids:
                done = await client.wait(task_id, timeout=15)
                assert done.done, f"task {task_id} still {S.Name(done.task.state)}"
                assert not run.done()
        tasks = [await client.get(task_id) for task_id in ids]
    for i, task in enumerate(tasks):
        if i == 3:
            assert task.state == S.Value("TASK_STATE_FAILED")
            assert task.error == f"result of {70 * MB} bytes exceeds max_result_bytes {4 * MiB}"
            assert task.attempt == 1  # not retried
        else:
            assert (task.state, task.attempt) == (S.Value("TASK_STATE_SUCCEEDED"), 1)
            assert cronoq.result_of(task) == {"i": i}
    assert calls == Counter({task_id: 1 for task_id in ids})  # nothing ran twice


async def test_results_too_big_for_one_report_are_reported_in_several(start_server):
    # Twenty results of 4 MB each (under max_result_bytes) finish together: 80 MB, more than
    # one request may carry. Every one must be reported once, none left to its lease expiry.
    server = start_server({"pools": [{"name": "default", "lease_ttl": "5s"}]})
    calls: Counter[int] = Counter()
    all_started = asyncio.Event()

    async def handle(task: cronoq.TaskContext) -> bytes:
        calls[task.id] += 1
        if len(calls) == 20:
            all_started.set()
        await all_started.wait()
        return bytes([task.payload["i"]]) * (4 * MB)

    async with cronoq.Client(server.endpoint) as client:
        ids = [(await client.submit("default", {"i": i})).task.id for i in range(20)]
        async with running(worker(server, "default", handle, concurrency=20)) as run:
            for task_id in ids:
                done = await client.wait(task_id, timeout=15)
                assert done.done, f"task {task_id} still {S.Name(done.task.state)}"
                assert not run.done()
        for i, task_id in enumerate(ids):
            task = await client.get(task_id)
            assert (task.state, task.attempt) == (S.Value("TASK_STATE_SUCCEEDED"), 1)
            assert task.result == bytes([i]) * (4 * MB)
    assert calls == Counter({task_id: 1 for task_id in ids})


async def test_stop_releases_a_task_running_past_the_grace_to_another_worker(start_server):
    # A 30 s lease: only a release, not a lease expiry, can make the task PENDING in time.
    server = start_server({"pools": [{"name": "slow", "lease_ttl": "30s", "max_attempts": 1}]})
    seen: list[tuple[str, int, int]] = []
    started = asyncio.Event()

    async def sleeper(task: cronoq.TaskContext) -> str:
        seen.append(("a", task.id, task.attempt))
        started.set()
        await asyncio.sleep(60)
        return "a"

    async def quick(task: cronoq.TaskContext) -> str:
        seen.append(("b", task.id, task.attempt))
        return "b"

    async with cronoq.Client(server.endpoint) as client:
        task_id = (await client.submit("slow", {"n": 1})).task.id
        a = worker(server, "slow", sleeper, shutdown_grace=0.5)
        run_a = asyncio.create_task(a.run())
        await asyncio.wait_for(started.wait(), 10)
        loop = asyncio.get_running_loop()
        stopped_at = loop.time()
        a.stop()
        await asyncio.wait_for(run_a, 10)
        assert loop.time() - stopped_at < 0.5 + 4  # the grace, then a bounded report

        released = await client.get(task_id)
        assert released.state == S.Value("TASK_STATE_PENDING"), S.Name(released.state)
        assert released.attempt == 0  # the released attempt is not counted
        assert not released.error

        async with running(worker(server, "slow", quick)):
            done = await client.wait(task_id, timeout=10)
    assert done.done and done.task.state == S.Value("TASK_STATE_SUCCEEDED")
    assert done.task.attempt == 1 and cronoq.result_of(done.task) == "b"
    assert seen == [("a", task_id, 1), ("b", task_id, 1)]


async def test_a_repeated_request_id_returns_the_first_submission(server):
    async with cronoq.Client(server.endpoint) as client:
        first = await client.submit("default", {"n": 1}, request_id="req-1")
        again = await client.submit("default", {"n": 1}, request_id="req-1")
        other = await client.submit("default", {"n": 1})
        assert again.task.id == first.task.id and other.task.id != first.task.id

        specs = [cronoq.task_spec("default", {"n": 2}), cronoq.task_spec("default", {"n": 3})]
        batch = await client.submit_batch(specs, request_id="req-2")
        repeat = await client.submit_batch(specs, request_id="req-2")
        assert [t.id for t in repeat.tasks] == [t.id for t in batch.tasks]

        listed = (await client.list("default")).tasks
    assert sorted(t.id for t in listed) == sorted([first.task.id, other.task.id, *(t.id for t in batch.tasks)])


async def test_prefetch_runs_every_task_once_and_at_most_concurrency_at_once(start_server):
    server = start_server({"pools": [{"name": "pf"}]})
    calls: Counter[int] = Counter()
    running_now = most = 0

    async def handle(task: cronoq.TaskContext) -> None:
        nonlocal running_now, most
        calls[task.id] += 1
        running_now += 1
        most = max(most, running_now)
        await asyncio.sleep(0.005)
        running_now -= 1

    async with cronoq.Client(server.endpoint) as client:
        batch = await client.submit_batch([cronoq.task_spec("pf", {"n": i}) for i in range(200)])
        ids = [t.id for t in batch.tasks]
        async with running(worker(server, "pf", handle, concurrency=4, prefetch=12)) as run:
            await until(lambda: len(calls) == len(ids), run, 30, "every task handled")
        tasks = [await client.get(i) for i in ids]
    assert calls == Counter(ids)  # each once
    assert most == 4
    assert {(S.Name(t.state), t.attempt) for t in tasks} == {("TASK_STATE_SUCCEEDED", 1)}


async def test_a_prefetched_task_whose_timeout_runs_out_while_held_fails_without_running(start_server, monkeypatch):
    # A worker that gives no slots (as one predating WorkRequest.slots) is sent every credit,
    # so it holds the second task behind the first's handler.
    server = start_server({"pools": [{"name": "held", "lease_ttl": "30s", "max_attempts": 1}]})
    pb = worker_mod.pb
    monkeypatch.setattr(
        worker_mod,
        "pb",
        types.SimpleNamespace(**{**vars(pb), "WorkRequest": lambda **kw: pb.WorkRequest(**{**kw, "slots": 0})}),
    )
    seen: list[int] = []

    async def handle(task: cronoq.TaskContext) -> str:
        seen.append(task.id)
        await asyncio.sleep(0.8)
        return "ok"

    async with cronoq.Client(server.endpoint) as client:
        first = (await client.submit("held", {"n": 1})).task.id
        second = (await client.submit("held", {"n": 2}, timeout=0.3)).task.id
        async with running(worker(server, "held", handle, concurrency=1, prefetch=1)):
            done = await client.wait(second, timeout=10)
            assert (await client.wait(first, timeout=10)).task.state == S.Value("TASK_STATE_SUCCEEDED")
    # Its deadline counts from its lease: the server ends it there ("lease expired"), or the
    # worker's report as it would start does. Either way FAILED, and its handler never ran.
    assert done.task.state == S.Value("TASK_STATE_FAILED"), S.Name(done.task.state)
    assert done.task.error in ("lease expired", "timed out after 300 ms, before it could start"), done.task.error
    assert seen == [first]


@pytest.mark.parametrize("slow_first", [True, False], ids=["slow-first", "both-waiting"])
async def test_a_slow_worker_holds_nothing_a_fast_one_could_start(start_server, slow_first):
    # Both with the default prefetch (4 tasks a slot). The slow worker is sent its free slots
    # and nothing beyond them (it starts nothing within a step), so every other task goes to the
    # fast one at once rather than waiting a second behind the slow one's handlers.
    server = start_server({"pools": [{"name": "mixed"}]})
    slow_ran: list[int] = []
    fast_ran: list[int] = []

    async def slow(task: cronoq.TaskContext) -> None:
        slow_ran.append(task.id)
        await asyncio.sleep(1.5)

    async def fast(task: cronoq.TaskContext) -> None:
        fast_ran.append(task.id)

    slow_worker, fast_worker = (
        worker(server, "mixed", slow, concurrency=2),
        worker(server, "mixed", fast, concurrency=2),
    )
    assert slow_worker.prefetch == fast_worker.prefetch == 8
    async with cronoq.Client(server.endpoint) as client, running(slow_worker) as slow_run:
        await until(lambda: slow_worker.worker_id, slow_run, 10, "the slow worker registered")
        if not slow_first:
            await asyncio.sleep(0.2)  # its Work stream waits for tasks
        async with contextlib.AsyncExitStack() as stack:
            if not slow_first:
                fast_run = await stack.enter_async_context(running(fast_worker))
                await until(lambda: fast_worker.worker_id, fast_run, 10, "the fast worker registered")
                await asyncio.sleep(0.2)
            ids = [t.id for t in (await client.submit_batch([cronoq.task_spec("mixed", {}) for _ in range(20)])).tasks]
            if slow_first:
                await until(lambda: slow_ran, slow_run, 10, "the slow worker started a task")
                fast_run = await stack.enter_async_context(running(fast_worker))
            # Everything the slow worker does not run ends well before its first handler does.
            await until(
                lambda: len(fast_ran) == len(ids) - len(slow_ran), fast_run, 1.2, "the fast worker ran the rest"
            )
    assert 1 <= len(slow_ran) <= 2 if slow_first else len(slow_ran) <= 2, slow_ran
    assert sorted(slow_ran + fast_ran) == sorted(ids)


def test_prefetch_is_checked():
    for concurrency, prefetch in ((1, -1), (99_999, 2)):
        with pytest.raises(ValueError, match="prefetch"):
            cronoq.Worker("http://127.0.0.1:1", "p", lambda t: None, concurrency=concurrency, prefetch=prefetch)
