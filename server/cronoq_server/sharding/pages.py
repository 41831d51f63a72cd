"""How the answers of a fan-out (a read, or a bulk action) are asked of each shard and joined into one."""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from google.protobuf.message import Message

from cronoq.v1 import admin_service_pb2 as admin_pb
from cronoq.v1 import schedule_service_pb2 as schedule_pb
from cronoq.v1 import task_service_pb2 as task_pb
from cronoq.v1 import worker_service_pb2 as worker_pb

from ..config import ShardConfig
from ..core.tasks import page_size, page_token_id
from ..errors import invalid
from ..ids import MAX_ID, shard_of


class Merge:
    """How a fan-out read is asked of each shard, and how the answers are joined."""

    # Whether the call changes tasks: each shard is then given server.forward_timeout to answer,
    # not the few seconds a read waits for a shard.
    changes = False

    def pool(self, request: Any) -> str:
        """The one pool the request names (its shard alone is asked); "": every shard."""
        return getattr(request, "pool", "")

    def requests(self, request: Any, shards: list[ShardConfig]) -> dict[str, Message]:
        return {shard.name: request for shard in shards}

    def merge(self, request: Any, responses: list[Any], complete: bool = True) -> Message:
        """One answer from the shards' (in shard order); complete: every shard asked answered
        or is named missing (else `enough` stopped early)."""
        raise NotImplementedError

    def enough(self, request: Any, responses: list[Any]) -> bool:
        """Whether the first shards' answers make the whole answer (the rest need not be asked)."""
        return False


class Concat(Merge):
    """Answers joined in shard order: the `field` lists of each shard's response."""

    def __init__(self, response: type[Message], field: str):
        self.response, self.field = response, field

    def merge(self, request: Any, responses: list[Any], complete: bool = True) -> Message:
        merged = self.response()
        for response in responses:
            getattr(merged, self.field).extend(getattr(response, self.field))
        return merged


# A newest-first page token across shards: this, then where each shard not yet done goes on.
NEWEST_TOKEN_PREFIX = "n"


class TaskPages(Merge):
    """ListTasks across shards.

    In id order: shards are numbered in id order, so the page token (the last id shown) says it
    all: lower shards are done, its own shard continues after it, higher shards start from
    their first task. Each is asked for a whole page, in parallel, and a page the lower shards
    fill is answered without waiting for the higher ones.

    newest_first: by creation time, newest first (ties: the higher id first), merged from each
    shard's listing in descending id order, its order of submission (the stores index no
    creation time; taking each shard's tasks in that order, none is skipped or shown twice even
    where two creation times are out of id order). Any shard may hold the next task, so every
    shard is asked for a whole page and waited for,
    and the token says where each shard not yet done goes on: before the last task of it shown,
    or before the newest it had when first asked (so tasks submitted since are not listed, as
    they are newer than the first page). A shard that could not be asked is named in
    unavailable_shards and left out of the later pages, as in id order."""

    def pool(self, request: Any) -> str:
        return str(request.pool or request.filter.pool)

    def requests(self, request: Any, shards: list[ShardConfig]) -> dict[str, Message]:
        if request.newest_first:
            return self._newest_requests(request, shards)
        size = page_size(request.page_size)
        after = page_token_id(request.page_token) if request.page_token else 0
        if after and shard_of(after) not in {s.number for s in shards}:
            raise invalid(f"page_token: {request.page_token!r} was not issued for this listing")
        requests: dict[str, Message] = {}
        for shard in sorted(shards, key=lambda s: s.number):
            if after and shard.number < shard_of(after):  # done
                continue
            asked = task_pb.ListTasksRequest()
            asked.CopyFrom(request)
            asked.page_size = size
            asked.page_token = request.page_token if shard.number == shard_of(after) else ""
            requests[shard.name] = asked
        return requests

    def _newest_requests(self, request: Any, shards: list[ShardConfig]) -> dict[str, Message]:
        """Each shard not yet done, asked for a whole page before its place in the token."""
        by_number = {s.number: s for s in shards}
        places = {s.number: 0 for s in shards}  # 0: from its newest task
        if request.page_token:
            places = newest_token_places(request.page_token, set(by_number))
        requests: dict[str, Message] = {}
        for number, before in sorted(places.items()):
            asked = task_pb.ListTasksRequest()
            asked.CopyFrom(request)
            asked.page_size = page_size(request.page_size)
            asked.page_token = str(before) if before else ""
            requests[by_number[number].name] = asked
        return requests

    def enough(self, request: Any, responses: list[Any]) -> bool:
        """The lower shards' tasks come first: once they fill the page, the higher shards'
        tasks are on later pages (and a higher shard that is down is named there). Newest
        first: any shard may hold the next task, so every one is waited for."""
        if request.newest_first:
            return False
        return bool(responses) and (
            bool(responses[-1].next_page_token) or sum(len(r.tasks) for r in responses) >= page_size(request.page_size)
        )

    def merge(self, request: Any, responses: list[Any], complete: bool = True) -> Message:
        if request.newest_first:
            return self._merge_newest(request, responses)
        size = page_size(request.page_size)
        more = not complete or sum(len(r.tasks) for r in responses) > size or any(r.next_page_token for r in responses)
        holding = [r for r in responses if r.tasks]
        if len(holding) == 1 and len(holding[0].tasks) <= size:  # the usual page: one shard's, as it is
            merged = holding[0]
            merged.next_page_token = ""
        else:
            merged = task_pb.ListTasksResponse()
            for response in responses:  # in the order asked, which is id order
                merged.tasks.extend(response.tasks[: size - len(merged.tasks)])
        if merged.tasks and more:
            merged.next_page_token = str(merged.tasks[-1].id)
        return merged

    def _merge_newest(self, request: Any, responses: list[Any]) -> Message:
        """The newest tasks of the shards' pages, taken from each page in its own order (so what
        is shown of a shard is always a first part of its page, whatever its creation times)."""
        size = page_size(request.page_size)
        newest = heapq.merge(*(r.tasks for r in responses), key=creation_order, reverse=True)
        merged = task_pb.ListTasksResponse(tasks=itertools.islice(newest, size))
        shown = {task.id for task in merged.tasks}
        places: list[int] = []
        for response in responses:
            taken = sum(1 for task in response.tasks if task.id in shown)
            if taken == len(response.tasks) and not response.next_page_token:
                continue  # done: nothing of it (or nothing more) to list
            # Before the last shown, or, nothing shown yet, before the newest it had when asked.
            places.append(response.tasks[taken - 1].id if taken else response.tasks[0].id + 1)
        if places:
            merged.next_page_token = NEWEST_TOKEN_PREFIX + ".".join(str(place) for place in sorted(places))
        return merged


def creation_order(task: Any) -> tuple[int, int, int]:
    return (task.created_at.seconds, task.created_at.nanos, task.id)


def newest_token_places(token: str, numbers: set[int]) -> dict[int, int]:
    """The shards not yet done in a newest-first page token, each with the id its listing goes
    on before. Raises INVALID_ARGUMENT for a token not issued for a listing of these shards."""
    refused = invalid(f"page_token: {token[:40]!r} was not issued for this listing")
    parts = token.removeprefix(NEWEST_TOKEN_PREFIX).split(".")
    if not token.startswith(NEWEST_TOKEN_PREFIX) or len(parts) > len(numbers):
        raise refused
    places: dict[int, int] = {}
    for part in parts:
        if not (part.isascii() and part.isdigit() and len(part) <= 20) or not 0 < int(part) <= MAX_ID:
            raise refused
        number = shard_of(int(part))
        if number not in numbers or number in places:
            raise refused
        places[number] = int(part)
    return places


class BulkResults(Merge):
    """A bulk action's answers: each shard's result listed, matched and changed summed."""

    changes = True

    def __init__(self, response: type[Message]):
        self.response = response

    def pool(self, request: Any) -> str:
        return str(request.filter.pool)

    def merge(self, request: Any, responses: list[Any], complete: bool = True) -> Message:
        merged: Any = self.response()
        for response in responses:
            merged.shards.extend(response.shards)
            merged.matched += response.matched
            merged.changed += response.changed
            merged.incomplete |= response.incomplete
        return merged


MERGES: dict[str, Merge] = {
    "CancelTasks": BulkResults(task_pb.CancelTasksResponse),
    "RetryTasks": BulkResults(task_pb.RetryTasksResponse),
    "DeleteTasks": BulkResults(task_pb.DeleteTasksResponse),
    "ListTasks": TaskPages(),
    "ListWorkers": Concat(worker_pb.ListWorkersResponse, "workers"),
    "ListSchedules": Concat(schedule_pb.ListSchedulesResponse, "schedules"),
    "GetSnapshot": Concat(admin_pb.GetSnapshotResponse, "shards"),
}
