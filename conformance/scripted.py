"""The scripted server of the conformance suite: the real cronoq gRPC services, answering as a
case's script says, on as many addresses as the case has roles.

    python conformance/scripted.py PLAN.json LOG.jsonl

PLAN is a list of roles, each {name, host, port, tls, shard, heartbeat_interval_ms, script,
tasks, cancel, lost}. `script` maps a method name to its answers, used in order (the last one
repeats): "ok", {"reply": <the response as proto JSON>}, or a refusal {"code", "message",
"metadata", "details": {"reason", "metadata", "retry_delay"}}; for Work also
{"close_after_tasks": N, "code": ...}, a stream that ends after sending N tasks, and
{"send_at_close": N}, a stream that holds back the last N tasks and sends them once the worker
has closed its side (leased as it closed), then ends, and {"black_hole": true}, a stream whose
connection goes silent (see below). `tasks` are the
tasks the role's Work streams hand out (proto JSON of cronoq.v1.Task), `cancel` the task ids a
heartbeat is answered cancelled for, `lost` those it is answered lost for (their leases gone).

Each role listens on its address through a front that relays bytes to its gRPC server on a
loopback port, so every connection is recorded, also one that never makes a call (a TLS
handshake the client gives up on). A black hole is made there too: the front stops passing
the connection's bytes, either way, and keeps both its sockets open, as a server that vanished
without a FIN (a crash, a partition) looks to the client. LOG gets one JSON object per line: {"ready"}, then
{"role", "event": "connect"}, {"role", "event": "call", "method", "authorization",
"user_agent", "client_cert", "request"} (each message of a Work stream too), {"role", "event": "stream"} for
each Work stream opened, and {"role", "event": "outcome", ...} for every outcome reported.
The runner reads it once the driver is done.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from cronoq.status import DETAILS_KEY, ErrorDetails, encode_details
from cronoq.v1 import task_pb2, task_service_pb2, worker_service_pb2

SERVICES: dict[str, Any] = {"cronoq.v1.TaskService": task_service_pb2, "cronoq.v1.WorkerService": worker_service_pb2}
STREAMS = {"Work"}  # bidirectional; every other method is unary


class Log:
    def __init__(self, path: str):
        self._out = open(path, "a", buffering=1)

    def write(self, **entry: Any) -> None:
        self._out.write(json.dumps({"t": time.time(), **entry}) + "\n")


@dataclass
class Role:
    name: str
    host: str
    port: int
    tls: dict[str, str] | None = None  # cert, key, and client_ca to ask for a client certificate
    shard: str = "default"
    heartbeat_interval_ms: int = 200
    script: dict[str, list[Any]] = field(default_factory=dict)
    tasks: list[dict[str, Any]] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    pending: list[task_pb2.Task] = field(default_factory=list)
    # The front's connections to the gRPC server by their local port (the server's peer
    # port): set, a connection is a black hole.
    holes: dict[int, asyncio.Event] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pending = [json_format.ParseDict(t, task_pb2.Task()) for t in self.tasks]

    def answer(self, method: str) -> Any:
        answers = self.script.get(method) or ["ok"]
        n = self.calls.get(method, 0)
        self.calls[method] = n + 1
        return answers[min(n, len(answers) - 1)]


def _peer_cert(context: grpc.aio.ServicerContext) -> str:
    auth = context.auth_context()
    subject = auth.get("x509_subject") or auth.get("x509_common_name") or []
    return subject[0].decode() if subject else ""


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return ""


async def _refuse(context: grpc.aio.ServicerContext, answer: dict[str, Any]) -> None:
    code = grpc.StatusCode[answer["code"]]
    message = answer.get("message", f"scripted {answer['code']}")
    trailers: list[tuple[str, str | bytes]] = list(answer.get("metadata", {}).items())
    if "details" in answer:
        d = answer["details"]
        details = ErrorDetails(d.get("reason", ""), dict(d.get("metadata", {})), d.get("retry_delay"))
        trailers.append((DETAILS_KEY, encode_details(code.value[0], message, details)))
    await context.abort(code, message, trailing_metadata=tuple(trailers))


class Scripted:
    """One role's gRPC handlers."""

    def __init__(self, role: Role, log: Log):
        self.role, self.log = role, log
        self.workers = 0

    def record(self, context: grpc.aio.ServicerContext, method: str, request: Any) -> None:
        self.log.write(
            role=self.role.name,
            event="call",
            method=method,
            authorization=_metadata(context, "authorization"),
            user_agent=_metadata(context, "user-agent"),
            client_cert=_peer_cert(context),
            request=json_format.MessageToDict(request, preserving_proto_field_name=True),
        )

    def handler(self, module: Any, descriptor: Any) -> grpc.RpcMethodHandler:
        method = descriptor.name
        request_type = getattr(module, descriptor.input_type.name)
        response_type = getattr(module, descriptor.output_type.name)

        if method in STREAMS:

            async def stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for answer in self.work(requests, context):
                    yield answer

            return grpc.stream_stream_rpc_method_handler(
                stream, request_type.FromString, response_type.SerializeToString
            )

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.record(context, method, request)
            answer = self.role.answer(method)
            if isinstance(answer, dict) and "code" in answer:
                await _refuse(context, answer)
            if isinstance(answer, dict) and "reply" in answer:
                return json_format.ParseDict(answer["reply"], response_type())
            return self.ok(method, request, response_type())

        return grpc.unary_unary_rpc_method_handler(unary, request_type.FromString, response_type.SerializeToString)

    def ok(self, method: str, request: Any, response: Any) -> Any:
        if method == "RegisterWorker":
            self.workers += 1
            response.worker_id = f"{self.role.name}-worker-{self.workers}"
            response.heartbeat_interval_ms = self.role.heartbeat_interval_ms
            response.shard = self.role.shard
        elif method == "Heartbeat":
            response.cancelled_task_ids.extend(self._named(request.tasks, self.role.cancel))
            response.lost_task_ids.extend(self._named(request.tasks, self.role.lost))
        elif method == "FinishTasks":
            for outcome in request.outcomes:
                self._outcome(outcome)
                response.results.add(task_id=outcome.task_id, accepted=True)
        return response

    def _named(self, attempts: Any, ids: list[str]) -> list[int]:
        """The ids of the attempts a heartbeat names that are among ids (decimal strings)."""
        return [a.task_id for a in attempts if str(a.task_id) in ids]

    def _outcome(self, outcome: worker_service_pb2.TaskOutcome) -> None:
        kind = outcome.WhichOneof("outcome") or ""
        body = getattr(outcome, kind) if kind else None
        self.log.write(
            role=self.role.name,
            event="outcome",
            task_id=str(outcome.task_id),
            attempt=outcome.attempt,
            kind=kind,
            detail=json_format.MessageToDict(body, preserving_proto_field_name=True) if body is not None else {},
        )

    async def work(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """A Work stream: tasks as credits allow, a result per outcome, heartbeats answered."""
        self.log.write(role=self.role.name, event="stream")
        answer = self.role.answer("Work")
        close_after = None
        held: list[task_pb2.Task] = []  # sent once the worker closed its side
        if isinstance(answer, dict) and answer.get("send_at_close"):
            cut = max(len(self.role.pending) - answer["send_at_close"], 0)
            held, self.role.pending = self.role.pending[cut:], self.role.pending[:cut]
        if isinstance(answer, dict) and "close_after_tasks" in answer:
            close_after = answer["close_after_tasks"]
        elif isinstance(answer, dict) and answer.get("black_hole"):
            self.role.holes[int(context.peer().rsplit(":", 1)[1])].set()
            async for _request in requests:  # none arrive: the stream lasts until the connection ends
                pass
            return
        elif isinstance(answer, dict) and "code" in answer:
            async for request in requests:
                self.record(context, "Work", request)
                break
            await _refuse(context, answer)
            return
        credits, sent = 0, 0
        async for request in requests:
            self.record(context, "Work", request)
            credits += request.credits
            response = worker_service_pb2.WorkResponse()
            for outcome in request.outcomes:
                self._outcome(outcome)
                response.results.add(task_id=outcome.task_id, accepted=True)
            if request.HasField("heartbeat"):
                response.heartbeat.cancelled_task_ids.extend(self._named(request.heartbeat.tasks, self.role.cancel))
                response.heartbeat.lost_task_ids.extend(self._named(request.heartbeat.tasks, self.role.lost))
            while credits and self.role.pending and (close_after is None or sent < close_after):
                task = self.role.pending.pop(0)
                task.attempt = max(task.attempt, 1)
                response.tasks.append(task)
                credits, sent = credits - 1, sent + 1
            if response.tasks or response.results or response.HasField("heartbeat"):
                yield response
            if close_after is not None and sent >= close_after:
                await _refuse(
                    context, {"code": answer.get("code", "UNAVAILABLE"), "message": "scripted: stream closed"}
                )
                return
        for task in held:
            task.attempt = max(task.attempt, 1)
        if held:
            yield worker_service_pb2.WorkResponse(tasks=held)


def server_credentials(tls: dict[str, str]) -> grpc.ServerCredentials:
    """The role's certificate; with client_ca, a client certificate signed by it is required."""
    client_ca = Path(tls["client_ca"]).read_bytes() if tls.get("client_ca") else None
    return grpc.ssl_server_credentials(
        [(Path(tls["key"]).read_bytes(), Path(tls["cert"]).read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hole: asyncio.Event) -> None:
    try:
        while data := await reader.read(65536):
            if hole.is_set():
                continue  # read and dropped: the sender sees no back-pressure, only silence
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def serve_role(role: Role, log: Log) -> tuple[grpc.aio.Server, asyncio.Server]:
    scripted = Scripted(role, log)
    # Clients may ping as often as they like: a case may shorten an SDK's keepalive.
    server = grpc.aio.server(
        options=[
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 0),
            ("grpc.http2.max_ping_strikes", 0),
        ]
    )
    handlers = []
    for name, module in SERVICES.items():
        service = module.DESCRIPTOR.services_by_name[name.rsplit(".", 1)[1]]
        methods = {m.name: scripted.handler(module, m) for m in service.methods}
        handlers.append(grpc.method_handlers_generic_handler(name, methods))
    server.add_generic_rpc_handlers(handlers)
    if role.tls:
        creds = server_credentials(role.tls)
        backend = server.add_secure_port("127.0.0.1:0", creds)
    else:
        backend = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    async def front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        log.write(role=role.name, event="connect")
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", backend)
        except OSError:
            writer.close()
            return
        port = up_writer.get_extra_info("sockname")[1]
        hole = role.holes[port] = asyncio.Event()
        try:
            await asyncio.gather(_relay(reader, up_writer, hole), _relay(up_reader, writer, hole))
        finally:
            del role.holes[port]

    listener = await asyncio.start_server(front, role.host, role.port, reuse_address=True)
    return server, listener


async def main(roles: list[Role], log: Log) -> None:
    served = [await serve_role(role, log) for role in roles]
    log.write(event="ready")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server, listener in served:
        listener.close()
        await server.stop(None)


if __name__ == "__main__":
    plan = json.loads(Path(sys.argv[1]).read_text())
    asyncio.run(main([Role(**r) for r in plan], Log(sys.argv[2])))
