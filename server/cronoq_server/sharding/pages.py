"""How the answers of a fan-out (a read, or a bulk action) are asked of each shard and joined into one."""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message

from cronoq.v1 import admin_service_pb2 as admin_pb
from cronoq.v1 import schedule_service_pb2 as schedule_pb
from cronoq.v1 import task_service_pb2 as task_pb
from cronoq.v1 import worker_service_pb2 as worker_pb

from ..config import ShardConfig
from ..core.tasks import page_size, page_token_id
from ..errors import invalid
from ..ids import shard_of


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


class TaskPages(Merge):
    """ListTasks across shards in id order. Shards are numbered in id order, so the page token
    (the last id shown) says it all: lower shards are done, its own shard continues after it,
    higher shards start from their first task. Each is asked for a whole page, in parallel,
    and a page the lower shards fill is answered without waiting for the higher ones.
    newest_first: the same in descending order (higher shards first)."""

    def requests(self, request: Any, shards: list[ShardConfig]) -> dict[str, Message]:
        size = page_size(request.page_size)
        after = page_token_id(request.page_token) if request.page_token else 0
        if after and shard_of(after) not in {s.number for s in shards}:
            raise invalid(f"page_token: {request.page_token!r} was not issued for this listing")
        requests: dict[str, Message] = {}
        order = sorted(shards, key=lambda s: s.number, reverse=request.newest_first)
        for shard in order:
            done = shard.number > shard_of(after) if request.newest_first else shard.number < shard_of(after)
            if after and done:
                continue
            asked = task_pb.ListTasksRequest()
            asked.CopyFrom(request)
            asked.page_size = size
            asked.page_token = request.page_token if shard.number == shard_of(after) else ""
            requests[shard.name] = asked
        return requests

    def enough(self, request: Any, responses: list[Any]) -> bool:
        """The lower shards' tasks come first: once they fill the page, the higher shards'
        tasks are on later pages (and a higher shard that is down is named there)."""
        return bool(responses) and (
            bool(responses[-1].next_page_token) or sum(len(r.tasks) for r in responses) >= page_size(request.page_size)
        )

    def merge(self, request: Any, responses: list[Any], complete: bool = True) -> Message:
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
