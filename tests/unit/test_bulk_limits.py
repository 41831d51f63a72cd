"""A caller's bulk calls beyond limits.max_bulk_calls on a shard are refused with
RESOURCE_EXHAUSTED and when to retry; a scan the store stopped is DEADLINE_EXCEEDED."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from cronoq.v1 import task_service_pb2 as pb
from cronoq_server.auth import Principal
from cronoq_server.config import Config, LimitsConfig
from cronoq_server.core.bulk import Bulk
from cronoq_server.core.tasks import Tasks
from cronoq_server.errors import ApiError
from cronoq_server.store.base import ScanTimedOut, State, TaskFilter

ALICE = Principal("alice", None, frozenset({"submit", "read"}))
BOB = Principal("bob", None, frozenset({"submit", "read"}))
DRY_RUN = pb.RetryTasksRequest(filter=pb.TaskFilter(error_contains="x"), dry_run=True)


class HeldScans:
    """A store whose scans wait until released (or raise ScanTimedOut)."""

    bulk_batch_s = 0.002

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.scanning = 0
        self.timed_out = False

    async def match_tasks(self, match: TaskFilter, after_seq: int, limit: int) -> list[tuple[int, State, str]]:
        if self.timed_out:
            raise ScanTimedOut("canceling statement due to statement timeout")
        self.scanning += 1
        await self.release.wait()
        self.scanning -= 1
        return []


def bulk(store: HeldScans, **limits: Any) -> Bulk:
    return Bulk(None, store, None, "unsharded", 0, ["default"], 15.0, LimitsConfig(**limits))  # type: ignore[arg-type]


async def until(check: Any) -> None:
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("never")


async def test_a_callers_call_past_max_bulk_calls_is_refused_with_retry_info_others_are_not() -> None:
    store = HeldScans()
    b = bulk(store, max_bulk_calls=2)
    held = [asyncio.create_task(b.retry_tasks(DRY_RUN, ALICE)) for _ in range(2)]
    await until(lambda: store.scanning == 2)
    with pytest.raises(ApiError) as refused:
        await b.retry_tasks(DRY_RUN, ALICE)
    err = refused.value
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.http_status == 429
    assert err.message == (
        "limits.max_bulk_calls: 'alice' has 2 bulk calls in progress on shard 'unsharded', the most it may "
        "(limit 2); retry once one has answered"
    )
    assert (err.details.reason, err.details.retry_delay) == ("BULK_CALLS_LIMIT", 1.0)
    other = asyncio.create_task(b.retry_tasks(DRY_RUN, BOB))  # another caller's count is its own
    await until(lambda: store.scanning == 3)
    store.release.set()
    assert [r.matched for r in await asyncio.gather(*held, other)] == [0, 0, 0]
    assert (await b.retry_tasks(DRY_RUN, ALICE)).matched == 0  # answered calls count no more


async def test_a_bad_filter_is_refused_as_such_at_the_limit_too() -> None:
    store = HeldScans()
    b = bulk(store, max_bulk_calls=1)
    held = asyncio.create_task(b.retry_tasks(DRY_RUN, ALICE))
    await until(lambda: store.scanning == 1)
    with pytest.raises(ApiError) as refused:
        await b.retry_tasks(pb.RetryTasksRequest(filter=pb.TaskFilter()), ALICE)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    store.release.set()
    await held


async def test_a_scan_the_store_stopped_is_deadline_exceeded_naming_the_limit() -> None:
    store = HeldScans()
    b = bulk(store, max_bulk_calls=1, bulk_scan_timeout="250ms")
    store.timed_out = True
    with pytest.raises(ApiError) as stopped:
        await b.retry_tasks(DRY_RUN, ALICE)
    err = stopped.value
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.reason == "BULK_SCAN_TIMEOUT"
    assert err.message.startswith(
        "filter: finding the tasks it matches took longer than limits.bulk_scan_timeout (0.25 s) on shard 'unsharded'"
    )
    store.timed_out = False
    store.release.set()
    assert (await b.retry_tasks(DRY_RUN, ALICE)).matched == 0  # the call stopped counts no more


async def test_a_listing_by_a_filter_no_index_serves_counts_as_one_of_the_callers_bulk_calls() -> None:
    class HeldListings(HeldScans):
        async def list_matching(self, match: TaskFilter, after_seq: int, limit: int, newest_first: bool) -> list[Any]:
            await self.match_tasks(match, after_seq, limit)
            return []

    store = HeldListings()
    config = Config.model_validate({"pools": [{"name": "default"}], "limits": {"max_bulk_calls": 1}})
    tasks = Tasks(config, store, None, "unsharded", 0, ["default"])  # type: ignore[arg-type]
    b = Bulk(tasks, store, None, "unsharded", 0, ["default"], 15.0, config.limits, tasks.scans)  # type: ignore[arg-type]
    held = asyncio.create_task(b.retry_tasks(DRY_RUN, ALICE))
    await until(lambda: store.scanning == 1)
    scanning = pb.ListTasksRequest(filter=pb.TaskFilter(error_contains="x"))
    with pytest.raises(ApiError) as refused:
        await tasks.list_tasks(scanning, ALICE)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    store.release.set()
    await held
    store.timed_out = True
    with pytest.raises(ApiError) as stopped:
        await tasks.list_tasks(scanning, ALICE)
    assert stopped.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and stopped.value.reason == "BULK_SCAN_TIMEOUT"
    store.timed_out = False
    assert (await tasks.list_tasks(scanning, ALICE)).tasks == []
