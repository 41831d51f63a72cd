"""Client.watch's resumption against a tiny in-process gRPC server whose Watch follows a
script: each call sends some events, then ends cleanly or with a status."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
import pytest

import cronoq
from cronoq import errors
from cronoq.v1 import task_pb2, task_service_pb2_grpc
from cronoq.v1 import task_service_pb2 as pb

FAST = cronoq.RetryConfig(initial_backoff=0.001, max_backoff=0.01, max_elapsed=5)


def event(seq: int, task_id: int | None = None, shard: str = "s0") -> task_pb2.TaskEvent:
    task = task_pb2.Task(id=task_id or 100 + seq, pool="default", state=task_pb2.TASK_STATE_PENDING)
    return task_pb2.TaskEvent(task=task, shard=shard, seq=seq, cursor=f"c{seq}")


@dataclass
class Step:
    """One Watch call: the events it sends, then its end (None: a clean end)."""

    events: list[task_pb2.TaskEvent] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    message: str = ""
    trailers: tuple[tuple[str, str], ...] = ()
    initial: tuple[tuple[str, str], ...] = ()  # initial metadata, sent first


class ScriptedWatch(task_service_pb2_grpc.TaskServiceServicer):
    def __init__(self, steps: list[Step]):
        self.steps = steps
        self.requests: list[pb.WatchRequest] = []

    async def Watch(  # type: ignore[override]
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchResponse]:
        self.requests.append(request)
        step = self.steps.pop(0) if self.steps else Step(code=grpc.StatusCode.UNAVAILABLE, message="script over")
        if step.initial:
            await context.send_initial_metadata(step.initial)
        for ev in step.events:
            yield pb.WatchResponse(event=ev)
        if step.code is not None:
            await context.abort(step.code, step.message, trailing_metadata=step.trailers)
        context.set_trailing_metadata(step.trailers)


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[ScriptedWatch, str, list[Step]]]:
    steps: list[Step] = []
    servicer = ScriptedWatch(steps)
    server = grpc.aio.server()
    task_service_pb2_grpc.add_TaskServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"http://127.0.0.1:{port}", steps
    await server.stop(None)


async def take(client: cronoq.Client, n: int, **options: object) -> list[task_pb2.TaskEvent]:
    out: list[task_pb2.TaskEvent] = []
    async for ev in client.watch(**options):  # type: ignore[arg-type]
        out.append(ev)
        if len(out) == n:
            break
    return out


async def test_a_stream_that_ends_or_breaks_resumes_from_the_last_cursor_without_duplicates(scripted):
    servicer, endpoint, steps = scripted
    steps += [
        Step([event(1), event(2), event(3)]),  # a clean end (a draining server)
        Step([event(4), event(5)], grpc.StatusCode.UNAVAILABLE, "shutting down"),
        Step([event(5), event(6)], grpc.StatusCode.ABORTED, "watch fell behind"),  # 5 replayed
        Step([event(7)]),
    ]
    reconnects: list[tuple[str | None, str]] = []
    async with cronoq.Client(endpoint, retry=FAST) as client:
        got = await take(
            client, 7, pool="default", on_reconnect=lambda err, cur: reconnects.append((err and err.code.name, cur))
        )
    assert [e.seq for e in got] == [1, 2, 3, 4, 5, 6, 7]
    assert [r.cursor for r in servicer.requests] == ["", "c3", "c5", "c6"]
    assert all(r.pool == "default" for r in servicer.requests)
    assert reconnects == [(None, "c3"), ("UNAVAILABLE", "c5"), ("ABORTED", "c6")]


async def test_the_first_request_carries_the_callers_cursor_and_options(scripted):
    servicer, endpoint, steps = scripted
    steps += [Step([event(9)]), Step([event(10)])]
    async with cronoq.Client(endpoint, retry=FAST) as client:
        got = await take(client, 2, cursor="c8", include_payloads=True)
    assert [e.seq for e in got] == [9, 10]
    assert [(r.cursor, r.include_payloads, r.pool) for r in servicer.requests] == [
        ("c8", True, ""),
        ("c9", True, ""),
    ]


async def test_a_reconnect_before_any_event_keeps_the_callers_cursor(scripted):
    servicer, endpoint, steps = scripted
    steps += [Step(code=grpc.StatusCode.UNAVAILABLE), Step([event(3)])]
    async with cronoq.Client(endpoint, retry=FAST) as client:
        await take(client, 1, cursor="c2")
    assert [r.cursor for r in servicer.requests] == ["c2", "c2"]


async def test_a_live_stream_that_breaks_before_any_event_resumes_from_where_it_started(scripted):
    """A sharded server states where a live stream starts (cronoq-watch-cursor, one position
    per shard): a reconnect before any event resumes from there, not live again."""
    servicer, endpoint, steps = scripted
    start = (("cronoq-watch-cursor", "1:5,2:7"),)
    steps += [
        Step(code=grpc.StatusCode.UNAVAILABLE, initial=start, trailers=start),  # as the server states it
        Step([event(6, shard="cpu")], initial=start),
    ]
    reconnects: list[str] = []
    async with cronoq.Client(endpoint, retry=FAST) as client:
        await take(client, 1, on_reconnect=lambda err, cur: reconnects.append(cur))
    assert [r.cursor for r in servicer.requests] == ["", "1:5,2:7"]
    assert reconnects == ["1:5,2:7"]


@pytest.mark.parametrize("end", [grpc.StatusCode.UNAVAILABLE, None], ids=["broken", "ended"])
async def test_a_stream_that_ends_at_once_resumes_from_the_start_its_trailers_repeat(scripted, end):
    """grpc.aio gives empty initial metadata to a call that ends before the client reads them:
    the server repeats its start in the trailers, and the client resumes from there."""
    servicer, endpoint, steps = scripted
    start = (("cronoq-watch-cursor", "1:5,2:7"),)
    steps += [Step(code=end, trailers=start), Step([event(6, shard="cpu")])]
    async with cronoq.Client(endpoint, retry=FAST) as client:
        await take(client, 1)
    assert [r.cursor for r in servicer.requests] == ["", "1:5,2:7"]


async def test_a_standby_sends_the_watch_to_the_leader_it_names(scripted):
    leader, leader_endpoint, leader_steps = scripted
    leader_steps += [Step([event(2), event(3)])]
    standby = ScriptedWatch(
        [
            Step([event(1)], grpc.StatusCode.UNAVAILABLE, "shutting down"),  # the old leader, draining
            Step(code=grpc.StatusCode.UNAVAILABLE, message="a standby", trailers=(("cronoq-leader", leader_endpoint),)),
        ]
    )
    server = grpc.aio.server()
    task_service_pb2_grpc.add_TaskServiceServicer_to_server(standby, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with cronoq.Client(f"http://127.0.0.1:{port}", retry=FAST) as client:
            got = await take(client, 3)
            assert str(client.endpoint) == leader_endpoint
    finally:
        await server.stop(None)
    assert [e.seq for e in got] == [1, 2, 3]
    assert [r.cursor for r in standby.requests] == ["", "c1"]
    assert [r.cursor for r in leader.requests] == ["c1"]


async def test_duplicates_are_told_apart_per_shard(scripted):
    _, endpoint, steps = scripted
    steps += [
        Step([event(1, shard="a"), event(1, shard="b"), event(2, shard="a")]),
        Step([event(2, shard="a"), event(1, shard="b"), event(2, shard="b")]),
    ]
    async with cronoq.Client(endpoint, retry=FAST) as client:
        got = await take(client, 4)
    assert [(e.shard, e.seq) for e in got] == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.OUT_OF_RANGE, errors.OutOfRange),
        (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
        (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
    ],
)
async def test_errors_no_reconnect_can_fix_are_raised_at_once(scripted, code, cls):
    servicer, endpoint, steps = scripted
    steps += [Step([event(1)]), Step(code=code, message="cursor 'c1' is older than the events kept")]
    async with cronoq.Client(endpoint, retry=FAST) as client:
        seen: list[int] = []
        with pytest.raises(cls, match="older than"):
            async for ev in client.watch():
                seen.append(ev.seq)
    assert seen == [1]
    assert [r.cursor for r in servicer.requests] == ["", "c1"]


async def test_without_resume_the_stream_ends_the_iterator_or_raises(scripted):
    servicer, endpoint, steps = scripted
    steps += [Step([event(1)]), Step([event(2)], grpc.StatusCode.UNAVAILABLE, "gone")]
    async with cronoq.Client(endpoint, retry=FAST) as client:
        assert [e.seq async for e in client.watch(resume=False)] == [1]
        with pytest.raises(errors.Unavailable, match="gone"):
            async for _ in client.watch(resume=False):
                pass
    assert len(servicer.requests) == 2


async def test_a_row_of_failures_without_events_is_given_up_after_max_elapsed(scripted):
    servicer, endpoint, _ = scripted  # no steps: every call fails with UNAVAILABLE
    retry = cronoq.RetryConfig(initial_backoff=0.01, max_backoff=0.02, max_elapsed=0.3)
    async with cronoq.Client(endpoint, retry=retry) as client:
        with pytest.raises(errors.Unavailable, match="script over"):
            async for _ in client.watch():
                pass
    assert len(servicer.requests) > 3


async def test_an_unreachable_server_is_retried_then_given_up() -> None:
    retry = cronoq.RetryConfig(initial_backoff=0.01, max_backoff=0.02, max_elapsed=0.3)
    async with cronoq.Client("http://127.0.0.1:1", retry=retry) as client:
        with pytest.raises(errors.Unavailable):
            async for _ in client.watch():
                pass


def test_the_sync_client_watches_too(scripted_sync: tuple[ScriptedWatch, str]) -> None:
    servicer, endpoint = scripted_sync
    with cronoq.SyncClient(endpoint, retry=FAST) as client:
        events = client.watch("default")
        got = [next(events).seq for _ in range(3)]
        events.close()
    assert got == [1, 2, 3]
    assert [r.cursor for r in servicer.requests] == ["", "c2"]


@pytest.fixture
def scripted_sync() -> Iterator[tuple[ScriptedWatch, str]]:
    """The scripted server on a thread of its own loop (the SyncClient runs a loop of its own)."""
    import asyncio
    import threading

    servicer = ScriptedWatch([Step([event(1), event(2)], grpc.StatusCode.UNAVAILABLE), Step([event(3)])])
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, object] = {}

    async def serve() -> None:
        server = grpc.aio.server()
        task_service_pb2_grpc.add_TaskServiceServicer_to_server(servicer, server)
        holder["port"] = server.add_insecure_port("127.0.0.1:0")
        holder["server"] = server
        await server.start()
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True)
    thread.start()
    ready.wait(10)
    yield servicer, f"http://127.0.0.1:{holder['port']}"
    asyncio.run_coroutine_threadsafe(holder["server"].stop(None), loop).result(10)  # type: ignore[attr-defined]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
