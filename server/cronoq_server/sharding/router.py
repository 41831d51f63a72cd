"""The shard router: between the API layers (gRPC and HTTP) and this server's Node, which
serves one shard only.

Each RPC's routing class (registry.Rpc.routing) picks one strategy in ShardRouter._strategies:

- by_pool (submissions, batches, schedules) and by_task (Get/Wait/Cancel by id; the shard is
  the id's top 8 bits): the Node answers when the pool or task is this server's shard's, and
  the call is forwarded to the owning shard's endpoint otherwise. A worker is not forwarded:
  RegisterWorker for another shard's pools is refused with that shard's endpoint (WRONG_SHARD),
  and the worker's later calls (by_worker) go to the server it registered with.
- by_task with a key: every shard is asked in parallel (GetTask by key). One holds it: that
  task (Get), or the call goes to that shard (Wait, Cancel). Two hold it: FAILED_PRECONDITION,
  use the task id. Shards that could not be asked are named in `unavailable_shards` (and the
  cronoq-unavailable-shards metadata); Cancel by key is refused while any is missing.
- fan_out (ListTasks, ListWorkers, ListSchedules, GetSnapshot): every shard the request
  concerns (one, for a `pool` filter) is asked in parallel and the answers merged; the shards
  that could not be asked are named in `unavailable_shards`. ListTasks pages across shards in
  id order: ids carry their shard number in the top 8 bits, so the page token (the page's
  last id) tells which shards are done, which one continues after it, and which start over.
  Newest first, it merges the shards by creation time, the token holding each shard's place.
- Watch (fan_out, streaming): merged from every shard, with a composite cursor; watch.py.
- A standby answers the reads of its own shard (Get, Wait, listings, snapshot; not Watch) and
  its part of a bulk action by forwarding them to its leader, like a call for another shard
  (unsharded too); other calls get UNAVAILABLE naming the leader.
- Bulk actions (Cancel/Retry/DeleteTasks) fan out like reads, to the shards where the caller
  holds the RPC's permission on some pool (or the filter's pool's shard), each given
  server.forward_timeout; the results are listed per shard and summed (pages.BulkResults).

A forwarded call carries the caller's own token and `cronoq-forwarded: 1`, with a deadline:
the caller's time left, at most server.forward_timeout (a WaitTask: plus the wait it asks
for), so a hung shard costs no caller more (DEADLINE_EXCEEDED naming it). The other shard
authenticates and authorizes it again, and its refusals come back with their code, message
and cronoq-* metadata (but not its `cronoq-leader`, which names the other shard's leader, not
this server's). A standby's UNAVAILABLE naming its
leader is followed, and that leader is used for the shard's next calls until it cannot be
reached: a shard's endpoint may be any of its servers, or a load balancer in front of them.

A call that arrives marked cronoq-forwarded (from a peer, or a client that set it) is
answered for this shard only, never forwarded again: a pool or task id of another shard gets
FAILED_PRECONDITION naming that shard and its endpoint (reason WRONG_SHARD).

Instead of forwarding, FAILED_PRECONDITION naming the shard and its endpoint (message and
cronoq-shard / cronoq-shard-endpoint) for a caller authenticated by client certificate (no
token to forward), and for an http:// endpoint on a non-loopback host unless
server.insecure_peer_http. For reads these shards are listed as unavailable instead, so a
certificate caller's reads cover the receiving shard only. An unreachable shard is UNAVAILABLE
naming it (cronoq-unavailable-shards).

Credentials first: the API layer authenticates and admit() checks the RPC's permission before
any routing, and before any answer that names where a pool is served (a refusal, an
unreachable shard, a batch across shards) the caller's permission on that pool is checked
here, so a caller that may not use a pool learns nothing about where it is served. Nor of a
shard where it may read no pool (may_read): reads and lookups by key leave it out, and a task id
of it is the Node's NOT_FOUND, as a missing task is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, cast

import grpc
from google.protobuf.message import Message

from cronoq.v1 import task_pb2
from cronoq.v1 import task_service_pb2 as task_pb

from ..auth import Principal
from ..config import Config, ShardConfig
from ..errors import ApiError, invalid, not_found
from ..ids import shard_of
from ..metrics import CALLS, FORWARDED
from ..node import Node
from ..registry import ROUTINGS, RegistryError, Rpc, registry
from ..tracing import rpc_span
from .call import Call, may_read
from .pages import MERGES
from .peers import (
    FORWARDED_HEADER,
    UNAVAILABLE_HEADER,
    PeerChannels,
    forward_metadata,
    is_missing,
    peer_error,
    shard_refusal,
)
from .watch import open_watch, shard_watch

log = logging.getLogger("cronoq.router")

# How long a read that asks every shard (a fan-out, a lookup by key) waits for one shard
# before it answers without it (naming it unavailable), when the caller and
# server.forward_timeout allow longer.
PEER_READ_TIMEOUT_S = 5.0

# The pools a by_pool call concerns.
_POOLS_OF: dict[str, Callable[[Any], list[str]]] = {
    "SubmitTask": lambda req: [req.pool],
    "SubmitBatch": lambda req: [t.pool for t in req.tasks],
    "PutSchedule": lambda req: [req.schedule.pool],
    "DeleteSchedule": lambda req: [req.pool],
    "RegisterWorker": lambda req: list(req.pools),
    "PausePool": lambda req: [req.pool],
    "ResumePool": lambda req: [req.pool],
}
# Calls by key that change the task: refused while a shard that may hold the key too cannot be
# asked, and sent to the task's shard by its id.
_VERBS = {"CancelTask": "cancelling", "RetryTask": "retrying", "DeleteTask": "deleting"}
_CHANGES_BY_KEY = frozenset(_VERBS)
# by_pool calls that are sent to their shard (a refusal naming its endpoint), never forwarded:
# a worker's lease, heartbeat and finish calls must reach the shard directly.
_NOT_FORWARDED = {"RegisterWorker": "a worker registers with the shard that owns its pools"}


Strategy = Callable[[Rpc, Message, Call], Awaitable[Message]]


class ShardRouter:
    def __init__(self, node: Node):
        self.node = node
        config: Config = node.config
        self.sharded = config.sharded
        self.rpcs = registry()
        self._shard_by_pool = {pool: s for s in config.shards for pool in s.pools}
        self._shard_by_number = {s.number: s for s in config.shards}
        self._by_name = {s.name: s for s in config.shards}
        self.shards = sorted(config.shards, key=lambda s: s.number)  # id order
        self.peers = PeerChannels(config)
        self._strategies: dict[str, Strategy] = {
            "local": self._local,
            "by_pool": self._to_pool_shard,
            "by_task": self._to_task_shard,
            "fan_out": self._fan_out,
            # A worker calls the server it registered with (its shard's leader, see RegisterWorker).
            "by_worker": self._local,
        }
        missing = set(ROUTINGS.values()) - set(self._strategies)
        if missing:
            raise RegistryError(f"routing classes without a strategy: {', '.join(sorted(missing))}")

    async def close(self) -> None:
        await self.peers.close()

    # -- what the API layers call ---------------------------------------------

    def admit(self, method: str, call: Call) -> None:
        """Before the request is read: for a call that may concern another shard, or a read a
        standby asks its leader, that this server is not draining and the caller holds the
        RPC's permission (the Node checks the rest if it answers); else everything Node.admit
        checks."""
        rpc = self.rpcs[method]
        self.node.admit(method, call.caller, leading=not (self._routed(rpc) or self._read_at_leader(rpc, call)))

    async def call(self, method: str, request: Message, call: Call) -> Message:
        """The answer to one API call, whoever gives it (counted in cronoq_api_calls_total by
        its final code: a forwarded call is counted here and where it was answered)."""
        rpc = self.rpcs[method]
        traceparent, tracestate = call.traceparent, call.tracestate
        if not traceparent and method == "SubmitTask":  # the context the task is submitted in
            traceparent, tracestate = request.trace.traceparent, request.trace.tracestate  # type: ignore[attr-defined]
        with counted(method), rpc_span(rpc.service, method, traceparent, tracestate):
            if not self.sharded:
                if self._read_at_leader(rpc, call):
                    self.admit(method, call)
                    return await self._at_leader(rpc, request, call)
                return await self.node.call(method, request, call.caller)
            self.admit(method, call)
            return await self._strategies[rpc.routing](rpc, request, call)

    async def work(self, requests: AsyncIterator[Message], call: Call) -> AsyncIterator[Message]:
        """A worker's Work stream, served here: a worker streams to the server it registered
        with (by_worker), and a standby answers UNAVAILABLE naming the leader. Counted in
        cronoq_api_calls_total when it ends."""
        with counted("Work"):
            async for answer in self.node.work(requests, call.caller):  # type: ignore[arg-type]
                yield answer

    async def watch(self, request: Message, call: Call) -> Any:
        """A watch.WatchStream. Unsharded: this server's events. Sharded: merged from every
        shard the caller may read (or the pool's shard), with a composite cursor; see watch.py."""
        if not self.sharded:
            return await shard_watch(self.node, request, call.caller)  # type: ignore[arg-type]
        return await open_watch(self.node, self.peers, self.rpcs["Watch"], request, call)  # type: ignore[arg-type]

    # -- strategies -----------------------------------------------------------

    def _routed(self, rpc: Rpc) -> bool:
        """Whether the call may be answered by another shard than this server's: a standby
        forwards those too. (A fan-out read includes this shard's answer: a standby sends the
        caller to its leader.)"""
        return self.sharded and rpc.routing in ("by_pool", "by_task")

    async def _local(self, rpc: Rpc, request: Message, call: Call) -> Message:
        return await self.node.call(rpc.name, request, call.caller)

    def _read_at_leader(self, rpc: Rpc, call: Call) -> bool:
        """Whether this server, a standby, asks its leader for its shard's part of a read (the
        dashboard and the read API work on a standby) or of a bulk action (a fan-out, like a
        read); other changes are refused with the leader named."""
        merge = MERGES.get(rpc.name)
        return (
            not self.node.is_leader
            and not call.forwarded
            and not rpc.standby
            and not rpc.server_streaming
            and ("read" in (rpc.permission, rpc.or_permission) or (merge is not None and merge.changes))
        )

    async def _at_leader(self, rpc: Rpc, request: Message, call: Call) -> Message:
        """A standby's read of its own shard, forwarded to the leader it knows with the caller's
        token, as to another shard; without a leader to send it to (none known, or not for this
        caller, e.g. one with a client certificate) the Node answers: UNAVAILABLE naming it."""
        leader = self.node.leadership.current_leader()
        if not leader or leader == self.node.advertise or self.peers.refusal(leader, call.caller):
            return await self._local(rpc, request, call)
        here = self._by_name.get(self.node.shard_name)
        if here is None:  # unsharded: this server's shard has no [[shards]] entry
            here = ShardConfig.model_construct(
                name=self.node.shard_name, number=self.node.shard_number, pools=[], endpoint=leader
            )
        with self.node.in_flight():
            return await self._forward(rpc, request, call, here.model_copy(update={"endpoint": leader}))

    async def _to_pool_shard(self, rpc: Rpc, request: Message, call: Call) -> Message:
        pools_of = _POOLS_OF.get(rpc.name)
        if pools_of is None:
            return await self._local(rpc, request, call)
        pools = pools_of(request)
        owners: dict[str, ShardConfig] = {}
        for pool in pools:
            shard = self._shard_by_pool.get(pool)
            if shard is not None:
                owners.setdefault(shard.name, shard)
        if not owners:  # no pool, or unknown pools: the Node names the field
            return await self._local(rpc, request, call)
        known = [p for p in pools if p in self._shard_by_pool]
        if len(owners) > 1:
            self._require(rpc, call.caller, known)
            where = ", ".join(f"{p!r} in {self._shard_by_pool[p].name!r}" for p in dict.fromkeys(known))
            shards = ", ".join(repr(n) for n in sorted(owners))
            if rpc.name == "RegisterWorker":
                raise invalid(f"pools: a worker serves the pools of one shard, but these are in shards {shards} "
                              f"({where}); run one worker per shard")  # fmt: skip
            raise invalid(
                f"tasks: a batch is admitted by one shard, but its pools are in shards {shards} ({where}); "
                "submit one batch per shard"
            )
        (shard,) = owners.values()
        why = _NOT_FORWARDED.get(rpc.name)
        if why and shard.name != self.node.shard_name:
            self._require(rpc, call.caller, known)
            raise shard_refusal(shard, why, "WRONG_SHARD")
        return await self._on_shard(rpc, request, call, shard, known)

    async def _to_task_shard(self, rpc: Rpc, request: Message, call: Call) -> Message:
        ref = request.task  # type: ignore[attr-defined]
        if ref.WhichOneof("ref") == "key" and not call.forwarded:
            return await self._by_key(rpc, request, call)
        if ref.WhichOneof("ref") != "id":
            return await self._local(rpc, request, call)
        shard = self._shard_by_number.get(shard_of(ref.id))
        if shard is None or not may_read(call.caller, shard):
            # A shard number no shard has, or a shard where the caller may read no pool (so no
            # task it may see): the Node's "not found", and nothing of where that shard is.
            return await self._local(rpc, request, call)
        return await self._on_shard(rpc, request, call, shard, [])  # the id names its shard anyway

    async def _by_key(self, rpc: Rpc, request: Message, call: Call) -> Message:
        """A Get, Wait or Cancel by key: every shard is asked for the key, in parallel."""
        # this shard answers too: a standby asks its leader, or sends the caller there
        self.node.admit(rpc.name, call.caller, leading=not self._read_at_leader(rpc, call))
        key = request.task.key  # type: ignore[attr-defined]
        if "read" not in call.caller.permissions:  # as on one shard: a task the caller cannot read is not found
            raise not_found(f"no task with key {key!r}")
        lookup = task_pb.GetTaskRequest(task=task_pb2.TaskRef(key=key))
        if isinstance(request, task_pb.GetTaskRequest):  # the GetTask asked for: its options too
            lookup.CopyFrom(request)
        # Only where the caller may read a pool: elsewhere no task is its to see, nor the shard's name.
        readable: dict[str, Message] = {s.name: lookup for s in self.shards if may_read(call.caller, s)}
        answers = await self._ask(self.rpcs["GetTask"], readable, call)
        found: dict[str, task_pb2.Task] = {}
        lookups: dict[str, task_pb.GetTaskResponse] = {}
        missing: list[str] = []
        for name, answer in answers.items():
            if not isinstance(answer, ApiError):
                found[name] = answer.task  # type: ignore[attr-defined]
                lookups[name] = cast(task_pb.GetTaskResponse, answer)
            elif is_missing(answer):
                missing.append(name)
            elif answer.code != grpc.StatusCode.NOT_FOUND:
                raise answer
        if len(found) > 1:
            where = " and ".join(f"{name!r} (id {task.id})" for name, task in found.items())
            raise ApiError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"task.key: {key!r} names tasks in shards {where}; keys are unique only within a shard, "
                "use the task id",
                reason="KEY_IN_SEVERAL_SHARDS",
            )
        if missing and (rpc.name in _CHANGES_BY_KEY or not found):
            raise self._key_unanswered(rpc, call, key, answers, missing, found)
        if not found:
            raise not_found(f"no task with key {key!r}")
        holder, task = next(iter(found.items()))
        if rpc.name == "GetTask":
            lookups[holder].unavailable_shards.extend(missing)
            return lookups[holder]
        shard = self._by_name[holder]
        if rpc.name in _CHANGES_BY_KEY:  # by id: the task found, even if its key was reused since
            by_id = type(request)()
            by_id.CopyFrom(request)
            by_id.task.id = task.id  # type: ignore[attr-defined]
            request = by_id
        response = await self._on_shard(rpc, request, call, shard, [])
        if missing:
            response.unavailable_shards.extend(missing)  # type: ignore[attr-defined]
        return response

    def _key_unanswered(
        self,
        rpc: Rpc,
        call: Call,
        key: str,
        answers: dict[str, Message | ApiError],
        missing: list[str],
        found: dict[str, Any],
    ) -> ApiError:
        """The refusal of a lookup by key that needs the shards that could not be asked."""
        names = ", ".join(repr(n) for n in missing)
        if found:
            (task,) = found.values()
            verb = _VERBS.get(rpc.name, rpc.name)
            what = (
                f"{verb} by key asks every shard, and shards {names} cannot be asked: they may hold "
                f"{key!r} too; use the task id ({task.id})"
            )
        else:
            what = f"no reachable shard holds a task with key {key!r}, and shards {names} cannot be asked"
        metadata = {UNAVAILABLE_HEADER: ",".join(missing)}
        refused = [self._by_name[n] for n in missing if cast(ApiError, answers[n]).reason == "NOT_FORWARDED"]
        if len(refused) == len(missing):  # not to be forwarded (e.g. a certificate caller): no use retrying
            code = grpc.StatusCode.FAILED_PRECONDITION if found else grpc.StatusCode.NOT_FOUND
            shard = refused[0]
            metadata |= {"cronoq-shard": shard.name, "cronoq-shard-endpoint": shard.endpoint}
            why = self.peers.refusal(shard.endpoint, call.caller)
            return ApiError(code, f"task.key: {what}: {why}", metadata, reason="NOT_FORWARDED")
        return ApiError(
            grpc.StatusCode.UNAVAILABLE, f"task.key: {what}", metadata, reason="SHARD_UNAVAILABLE", retry_delay=1.0
        )

    async def _fan_out(self, rpc: Rpc, request: Message, call: Call) -> Message:
        """A read of every shard the request concerns, merged; missing shards named."""
        if call.forwarded:
            return await self._local(rpc, request, call)
        merge = MERGES[rpc.name]
        # The shards the caller may read a pool of: nothing of the others, not even that they are down.
        shards = [s for s in self.shards if may_read(call.caller, s, (rpc.permission, rpc.or_permission))]
        pool = merge.pool(request)
        if pool:
            owner = self._shard_by_pool.get(pool)
            if owner is None:  # the Node names the unknown pool
                return await self._local(rpc, request, call)
            self._require(rpc, call.caller, [pool])
            shards = [owner]
        requests = merge.requests(request, shards)
        patience = self.peers.timeout(rpc, request, call.timeout) if merge.changes else PEER_READ_TIMEOUT_S
        answers = await self._ask(rpc, requests, call, lambda answered: merge.enough(request, answered), patience)
        responses: list[Message] = []
        missing: list[str] = []
        for name, answer in answers.items():
            if isinstance(answer, ApiError):
                if not is_missing(answer):
                    raise answer
                missing.append(name)
            else:
                responses.append(answer)
        response = merge.merge(request, responses, complete=len(answers) == len(requests))
        response.unavailable_shards.extend(missing)  # type: ignore[attr-defined]
        return response

    async def _ask(
        self,
        rpc: Rpc,
        requests: dict[str, Message],
        call: Call,
        enough: Callable[[list[Message]], bool] = lambda answered: False,
        patience: float = PEER_READ_TIMEOUT_S,
    ) -> dict[str, Message | ApiError]:
        """Each shard's answer (or refusal) to its request, asked in parallel, in shard order,
        waited for `patience` seconds at most; once the answers so far are `enough`, the later
        shards' are not waited for (nor named)."""
        loop = asyncio.get_running_loop()
        timeout = patience if call.timeout is None else min(call.timeout, patience)
        deadline = loop.time() + timeout

        async def ask(shard: ShardConfig, request: Message) -> Message | ApiError:
            try:
                left = Call(call.caller, timeout=max(deadline - loop.time(), 0.0))
                return await self._on_shard(rpc, request, left, shard, [])
            except ApiError as err:
                return err

        asked = {name: asyncio.ensure_future(ask(self._by_name[name], req)) for name, req in requests.items()}
        answers: dict[str, Message | ApiError] = {}
        try:
            for name, answer in asked.items():
                answers[name] = await answer
                if enough([a for a in answers.values() if not isinstance(a, ApiError)]):
                    break
        finally:
            for pending in asked.values():
                pending.cancel()
        return answers

    async def _on_shard(self, rpc: Rpc, request: Message, call: Call, shard: ShardConfig, pools: list[str]) -> Message:
        """Answers a call that concerns `shard`: here, or there. `pools` are those the answer
        may reveal the shard of: the caller's permission on them is checked before it does."""
        if shard.name == self.node.shard_name:
            if self._read_at_leader(rpc, call):
                return await self._at_leader(rpc, request, call)
            return await self._local(rpc, request, call)
        if call.forwarded:
            self._require(rpc, call.caller, pools)
            raise shard_refusal(
                shard,
                f"this call is marked {FORWARDED_HEADER} and is answered by shard {self.node.shard_name!r} only",
                "WRONG_SHARD",
            )
        reason = self.peers.refusal(shard.endpoint, call.caller)
        if reason:
            self._require(rpc, call.caller, pools)
            raise shard_refusal(shard, reason, "NOT_FORWARDED")
        with self.node.in_flight():
            try:
                return await self._forward(rpc, request, call, shard)
            except ApiError as err:
                if err.reason == "SHARD_UNAVAILABLE":
                    self._require(rpc, call.caller, pools)
                raise

    def _require(self, rpc: Rpc, caller: Principal, pools: Iterable[str]) -> None:
        if rpc.permission is not None:
            for pool in pools:
                caller.require(rpc.permission, pool)

    async def _forward(self, rpc: Rpc, request: Message, call: Call, shard: ShardConfig) -> Message:
        """forward_to_shard: the call at the shard's leader as last learnt (else its endpoint);
        a standby's answer naming the leader is followed, and a learnt leader that cannot be
        reached is forgotten for the configured endpoint: at most three tries."""
        metadata = forward_metadata(call.caller)
        loop = asyncio.get_running_loop()
        allowed = self.peers.timeout(rpc, request, call.timeout)
        deadline = loop.time() + allowed
        configured = shard.endpoint
        endpoint = self.peers.leader_of(configured, call.caller)
        for tries_left in (2, 1, 0):
            timeout = max(deadline - loop.time(), 0.0)
            try:
                response = await self.peers.unary(endpoint, rpc, request, metadata, timeout)
            except grpc.aio.AioRpcError as err:
                leader = self.peers.leader_to_follow(err, endpoint, call.caller)
                if tries_left and leader:
                    log.debug("%s for shard %s: %s is a standby, leader %s", rpc.name, shard.name, endpoint, leader)
                    self.peers.learn_leader(configured, leader)
                    endpoint = leader
                    continue
                if tries_left and endpoint != configured and err.code() == grpc.StatusCode.UNAVAILABLE:
                    self.peers.learn_leader(configured, None)
                    endpoint = configured
                    continue
                FORWARDED.labels(shard=shard.name, code=err.code().name).inc()
                raise peer_error(shard, endpoint, err, allowed) from None
            FORWARDED.labels(shard=shard.name, code="OK").inc()
            return response
        raise AssertionError("unreachable")


@contextlib.contextmanager
def counted(method: str) -> Iterator[None]:
    """Counts a call in cronoq_api_calls_total by how it ends: OK, its ApiError's code,
    CANCELLED (the caller went away), or INTERNAL."""
    code = "OK"
    try:
        yield
    except ApiError as err:
        code = err.code.name
        raise
    except asyncio.CancelledError:
        code = "CANCELLED"
        raise
    except Exception:
        code = "INTERNAL"
        raise
    finally:
        CALLS.labels(method=method, code=code).inc()


def unavailable_metadata(response: Message) -> dict[str, str]:
    """The cronoq-unavailable-shards metadata of an answer that names shards it could not ask."""
    missing = getattr(response, "unavailable_shards", None)
    return {UNAVAILABLE_HEADER: ",".join(missing)} if missing else {}
