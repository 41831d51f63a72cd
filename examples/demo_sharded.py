"""`./dev demo --sharded`: the deployment of the sharding page, on this machine.

Shard cpu (number 1) owns pool `default` and shard gpu (number 2) owns pool `llm`; each shard
is a cronoq-server process of its own, with its own SQLite file (store.path with {shard}).
Each worker is started at the server of the *other* shard on purpose: the server refuses it
with the endpoint of its pool's shard, and the worker reconnects there. Every task is
submitted through cpu's server, which forwards llm's tasks to gpu's.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo import HERE, STATE, bounded, free_port, keep_serving, uninterrupted, wait_ready

import cronoq

DEADLINE_S = 60  # the whole demo; past it, it stops its processes and fails
SHARDS = {"cpu": (1, "default"), "gpu": (2, "llm")}  # name: (number, pool)
OTHER = {"cpu": "gpu", "gpu": "cpu"}
SUCCEEDED, FAILED = "SUCCEEDED", "FAILED"


class Child:
    """A subprocess whose output (stdout and stderr) is kept line by line, and echoed with a
    prefix when `echo` says so."""

    def __init__(self, label: str, args: list[str], echo: Callable[[str], bool], cwd: Path | None = None):
        self.label = label
        self.lines: list[str] = []
        self._echo = echo
        self._changed = threading.Condition()
        self._closed = False
        # A session of its own: Ctrl-C reaches the demo only, which stops its children in order.
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, start_new_session=True
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
            if self._echo(line):
                print(f"  {self.label} | {line}", flush=True)
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait_for(self, pattern: str, seconds: float) -> re.Match[str] | None:
        """The first line matching `pattern`, waiting up to `seconds` (None: the process ended
        or the time passed without one)."""
        deadline = time.monotonic() + seconds
        with self._changed:
            while True:
                for line in self.lines:
                    if m := re.search(pattern, line):
                        return m
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    return None
                self._changed.wait(left)

    def stop(self, seconds: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Deployment:
    workdir: Path
    grpc: dict[str, str] = field(default_factory=dict)  # shard: its server's gRPC endpoint
    http: dict[str, str] = field(default_factory=dict)
    servers: dict[str, Child] = field(default_factory=dict)
    workers: dict[str, Child] = field(default_factory=dict)  # pool: its worker
    redirects: dict[str, str] = field(default_factory=dict)  # pool: what happened to its worker

    def shard_at(self, endpoint: str) -> str:
        return next((s for s, e in self.grpc.items() if e == endpoint.rstrip("/")), endpoint)

    def stop_all(self) -> None:
        for child in list(self.workers.values()):
            child.stop()
        for child in self.servers.values():  # both drain at once
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in self.servers.values():
            child.stop()


def shared_config(workdir: Path, endpoints: dict[str, str]) -> str:
    """The file of the sharding page, on SQLite: what every server reads."""
    shards = "".join(
        f'\n[[shards]]\nname = "{name}"\nnumber = {number}\npools = ["{pool}"]\nendpoint = "{endpoints[name]}"\n'
        for name, (number, pool) in SHARDS.items()
    )
    pools = "".join(f'[[pools]]\nname = "{pool}"\nretry_backoff = "200ms"\n' for _, pool in SHARDS.values())
    return f'{pools}{shards}\n[store]\npath = "{workdir}/cronoq-{{shard}}.db"   # one SQLite file per shard\n'


def start_servers(dep: Deployment) -> None:
    ports = {name: (free_port(), free_port()) for name in SHARDS}
    for name, (grpc_port, http_port) in ports.items():
        dep.grpc[name] = f"http://127.0.0.1:{grpc_port}"
        dep.http[name] = f"http://127.0.0.1:{http_port}"
    shared = shared_config(dep.workdir, dep.grpc)
    print("The configuration (every server reads the same; on one machine each server's file adds")
    print("its own [server] listen and http_listen):\n")
    print("    " + shared.strip().replace("\n", "\n    ") + "\n")
    for name, (grpc_port, http_port) in ports.items():
        config = dep.workdir / f"{name}.toml"
        config.write_text(
            f'[server]\nlisten = "127.0.0.1:{grpc_port}"\nhttp_listen = "127.0.0.1:{http_port}"\n\n{shared}'
        )
        print(
            f"$ cronoq-server --config {config.name} --shard {name}   # listen 127.0.0.1:{grpc_port}, HTTP {http_port}"
        )
        dep.servers[name] = Child(
            name,
            [sys.executable, "-m", "cronoq_server.main", "--config", str(config), "--shard", name],
            echo=lambda line: " WARNING " in line or " ERROR " in line,
            cwd=dep.workdir,
        )
    for name, child in dep.servers.items():
        if not wait_ready(dep.http[name], 20):
            print("\n".join(child.lines), file=sys.stderr)
            raise SystemExit(f"demo: the server of shard {name} did not become ready")
        for pattern in (r"cronoq-server \S+: shard ", rf"shard {name}: (leader|standby)"):
            if m := child.wait_for(pattern, 5):
                print(f"  {name} | {m.string}")
    print()


def start_worker(dep: Deployment, pool: str, shard: str) -> Child:
    return Child(
        f"worker {pool}",
        [sys.executable, str(HERE / "demo_worker.py"), dep.grpc[shard], "--pool", pool,
         "--name", f"demo-worker-{pool}", "--verbose"],
        echo=lambda line: not line.startswith("registered at "),
    )  # fmt: skip


def start_workers(dep: Deployment) -> None:
    """Each pool's worker at the other shard's server: it should be sent to its own."""
    for shard, (_, pool) in SHARDS.items():
        wrong = OTHER[shard]
        print(f"starting the worker of pool {pool!r} at {wrong}'s server {dep.grpc[wrong]} (its pool is in {shard})")
        dep.workers[pool] = start_worker(dep, pool, wrong)
    for shard, (_, pool) in SHARDS.items():
        wrong, worker = OTHER[shard], dep.workers[pool]
        registered = worker.wait_for(r"^registered at (\S+)", 15)
        at = dep.shard_at(registered.group(1)) if registered else None
        if at == shard:
            followed = worker.wait_for(r"reconnecting to", 0)
            dep.redirects[pool] = (
                f"started at {wrong}, redirected by {wrong}'s server to {shard}"
                if followed
                else f"registered at {shard}"
            )
        else:
            why = (
                f"{wrong}'s server let it register there, for a pool it does not serve"
                if at == wrong
                else f"{wrong}'s server refused it without naming its shard: {refusal(worker)}"
            )
            print(f"  worker {pool} | not redirected: {why}; starting it at {shard}'s server instead")
            worker.stop()
            dep.workers[pool] = worker = start_worker(dep, pool, shard)
            if not worker.wait_for(r"^registered at ", 15):
                raise SystemExit(f"demo: the worker of pool {pool!r} did not register at {shard}'s server")
            dep.redirects[pool] = f"NOT redirected ({why}), started at {shard} instead"
        if m := dep.servers[shard].wait_for(rf"worker \S+ \('demo-worker-{pool}'\) registered.*", 5):
            print(f"  {shard} | {m.string}")
    print()


def refusal(worker: Child) -> str:
    m = worker.wait_for(r"worker: stopped: (.*)", 1)
    return m.group(1) if m else "no registration within 15 s"


def shard_name(task_id: int) -> str:
    number = task_id >> 56
    return next((s for s, (n, _) in SHARDS.items() if n == number), f"number {number}")


async def submit_through_cpu(dep: Deployment) -> dict[str, tuple[int, str]]:
    """Every task through cpu's server; returns each key's task id and expected final state."""
    expected: dict[str, tuple[int, str]] = {}
    async with cronoq.Client(dep.grpc["cpu"]) as client:

        def show(task: cronoq.Task, state: str, note: str = "") -> None:
            expected[task.key if task.key not in expected else f"{task.key} ({task.pool})"] = (task.id, state)
            print(
                f"submitted {task.pool:<7} task {task.id:>18} ({task.key}) via cpu → shard {task.id >> 56} "
                f"({shard_name(task.id)}, the id's top 8 bits){note}"
            )

        submissions: list[tuple[str, dict[str, str], str, str, dict[str, Any]]] = [
            ("default", {"kind": "hello", "to": "world"}, "greeting-1", SUCCEEDED, {}),
            ("default", {"kind": "flaky"}, "flaky", SUCCEEDED, {"max_attempts": 5}),
            ("llm", {"kind": "prompt", "text": "summarise the report"}, "summary-1", SUCCEEDED, {}),
            ("llm", {"kind": "broken"}, "broken", FAILED, {}),
            ("llm", {"kind": "urgent"}, "urgent", SUCCEEDED, {"priority": 10}),
            # keys deduplicate within a shard: the same key makes one task in each
            ("default", {"kind": "report", "of": "cpu"}, "report", SUCCEEDED, {}),
            ("llm", {"kind": "report", "of": "gpu"}, "report", SUCCEEDED, {}),
        ]
        for pool, payload, key, state, options in submissions:
            show((await client.submit(pool, payload, key=key, **options)).task, state)
        batch = await client.submit_batch(
            [
                cronoq.task_spec("llm", {"kind": "embed", "file": "a.csv"}, key="embed"),
                cronoq.task_spec("llm", {"kind": "index"}, key="index", depends_on=["embed"]),
            ]
        )
        for task in batch.tasks:
            show(task, SUCCEEDED, " in one batch" + ("; waits for embed" if task.key == "index" else ""))

        print("\nwhat cannot span shards (refused, nothing created):")
        refusals = {
            "a batch with tasks of both shards": client.submit_batch(
                [cronoq.task_spec("default", {"kind": "a"}), cronoq.task_spec("llm", {"kind": "b"})]
            ),
            f"an llm task depending on default's task {expected['greeting-1'][0]}": client.submit(
                "llm", {"kind": "c"}, depends_on=[expected["greeting-1"][0]]
            ),
        }
        for what, call in refusals.items():
            try:
                await call
                print(f"  {what}: admitted (unexpected)")
                expected[f"<{what}>"] = (0, "refused")
            except cronoq.CronoqError as err:
                print(f"  {what}: {err}")
    return expected


async def wait_through_cpu(dep: Deployment, ids: list[int]) -> list[cronoq.Task]:
    """Waits for every task by id through cpu's server (gpu's tasks: forwarded waits)."""
    async with cronoq.Client(dep.grpc["cpu"]) as client:
        return [(await client.wait(i, timeout=20)).task for i in ids]


async def read_through_cpu(dep: Deployment) -> None:
    """Reads that concern both shards, through cpu's server."""
    print("\nreads through cpu:")
    async with cronoq.Client(dep.grpc["cpu"]) as client:
        page = await client.list(page_size=100)
        held = {name: sum(shard_name(t.id) == name for t in page.tasks) for name in SHARDS}
        missing = ", ".join(page.unavailable_shards) or "none"
        print(
            f"  ListTasks: {len(page.tasks)} tasks, "
            + ", ".join(f"{n} of {name}'s" for name, n in held.items())
            + f" (shards that could not be asked: {missing})"
        )
        for key in ("summary-1", "report"):
            try:
                task = await client.get(key)
                print(f"  GetTask by key {key!r}: task {task.id} in shard {shard_name(task.id)} (every shard asked)")
            except cronoq.CronoqError as err:
                print(f"  GetTask by key {key!r} (a task in each shard): {err}")


class Watcher:
    """One Watch through cpu's server for the whole run: the events of every shard, merged."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.events: dict[str, int] = {}  # shard: events seen
        self.cursor = ""
        self._task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        async with cronoq.Client(self.endpoint) as client:
            async for event in client.watch():
                self.events[event.shard] = self.events.get(event.shard, 0) + 1
                self.cursor = event.cursor

    async def start(self) -> None:
        self._task = asyncio.create_task(self._watch())
        await asyncio.sleep(0.5)  # the stream is open before the first submission

    async def stop(self) -> None:
        seen = -1
        while seen != sum(self.events.values()):  # until the last events have arrived
            seen = sum(self.events.values())
            await asyncio.sleep(0.3)
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        counts = ", ".join(f"{n} from {shard}" for shard, n in sorted(self.events.items()))
        print(f"  Watch (one stream, opened before the first submission): {seen} events, {counts}")
        print(f"    the last event's cursor, one position per shard: {self.cursor}")


async def exercise(dep: Deployment) -> tuple[dict[str, tuple[int, str]], list[cronoq.Task]]:
    """Submits, waits and reads through cpu's server, watched by one Watch there."""
    watcher = Watcher(dep.grpc["cpu"])
    await watcher.start()
    expected = await submit_through_cpu(dep)
    tasks = await wait_through_cpu(dep, [i for i, _ in expected.values() if i])
    await read_through_cpu(dep)
    await watcher.stop()
    return expected, tasks


def metric_lines(http: str, name: str) -> list[str]:
    with urllib.request.urlopen(f"{http}/metrics", timeout=5) as r:
        return [ln for ln in r.read().decode().splitlines() if ln.startswith(name)]


def run_sharded_demo(keep: bool = False) -> None:
    """The demo; with `keep`, its servers and workers run on afterwards, until Ctrl-C or SIGTERM."""
    started = time.monotonic()
    interrupted = ""
    wrong: list[str] = []
    with tempfile.TemporaryDirectory(prefix="cronoq-demo-sharded-") as tmp:
        dep = Deployment(Path(tmp))
        try:
            with bounded(DEADLINE_S):
                start_servers(dep)
                start_workers(dep)
                expected, tasks = asyncio.run(exercise(dep))
                print()
                for name in SHARDS:
                    forwarded = metric_lines(dep.http[name], "cronoq_forwarded_calls_total")
                    print(f"{name}'s /metrics: {'; '.join(forwarded) or 'no forwarded calls'}")
                signal.alarm(0)  # the demo is done: what follows is not bounded
                wrong = report(dep, expected, tasks, started)
                if keep:
                    keep_serving(dep.http, [c.proc for c in (*dep.servers.values(), *dep.workers.values())])
        except KeyboardInterrupt as why:
            interrupted = {"SIGALRM": f"took longer than {DEADLINE_S} s"}.get(str(why), str(why) or "SIGINT")
        finally:
            with uninterrupted():
                if interrupted:
                    print(f"\ndemo: stopped ({interrupted}); stopping the servers and workers", file=sys.stderr)
                dep.stop_all()
    if interrupted:
        sys.exit(130)
    if wrong:
        sys.exit(f"demo: unexpected outcome for {wrong}")


def report(
    dep: Deployment, expected: dict[str, tuple[int, str]], tasks: list[cronoq.Task], started: float
) -> list[str]:
    """Prints every task and how the workers were redirected; returns what went wrong."""
    print(f"\n{'id':>18}  {'shard':<5} {'pool':<7} {'key':<10} {'state':<10} {'attempts':>8}  result / error")
    for t in tasks:
        ok = t.state == cronoq.TaskState.Value("TASK_STATE_SUCCEEDED")
        outcome = cronoq.result_of(t) if ok else t.error
        print(
            f"{t.id:>18}  {shard_name(t.id):<5} {t.pool:<7} {t.key:<10} {STATE[t.state]:<10} {t.attempt:>8}  {outcome}"
        )
    state_of = {i: state for i, state in expected.values()}
    wrong = [f"{t.key}: {STATE[t.state]}" for t in tasks if STATE[t.state] != state_of[t.id]]
    wrong += [f"{t.key}: in shard {shard_name(t.id)}" for t in tasks if SHARDS[shard_name(t.id)][1] != t.pool]
    wrong += [k for k, (_, state) in expected.items() if state == "refused"]
    wrong += [f"the worker of {pool}: not redirected" for pool, what in dep.redirects.items() if what.startswith("NOT")]
    print("\nworker redirects: " + "; ".join(f"{pool}: {what}" for pool, what in dep.redirects.items()))
    if not wrong:
        print(
            f"\ndemo finished in {time.monotonic() - started:.1f} s: every task ended as expected, in its pool's shard"
        )
    return wrong
