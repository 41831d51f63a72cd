"""Fixtures that start real things: cronoq-server processes on free loopback ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pgserver import TempPostgres, find_bin_dir
from ports import free_port

# grpc core's own log lines (in this process, and the servers, workers and CLIs it starts) stay
# out of the test output unless GRPC_VERBOSITY is set: the SDK's and server's errors say what
# failed. grpc reads it once, on import; nothing above imports grpc.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

REPO = Path(__file__).resolve().parent.parent


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def to_toml(config: dict[str, Any]) -> str:
    """Tables and arrays of tables, enough for cronoq configs."""
    lines: list[str] = []
    for name, value in config.items():
        if isinstance(value, dict):
            lines.append(f"[{name}]")
            sub = {k: v for k, v in value.items() if isinstance(v, dict)}
            lines += [f"{k} = {_toml_value(v)}" for k, v in value.items() if k not in sub]
            for k, v in sub.items():
                lines.append(f"[{name}.{k}]")
                lines += [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items()]
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for entry in value:
                lines.append(f"[[{name}]]")
                lines += [f"{k} = {_toml_value(v)}" for k, v in entry.items()]
        else:
            lines.insert(0, f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


class ServerProcess:
    """One real cronoq-server process; its config is written to a file."""

    def __init__(self, workdir: Path, config: dict[str, Any], shard: str | None = None, name: str = "server"):
        self.workdir = workdir
        self.name = name
        self.grpc_port = free_port()
        self.http_port = free_port()
        server = dict(config.get("server", {}))
        server.setdefault("listen", f"127.0.0.1:{self.grpc_port}")
        server.setdefault("http_listen", f"127.0.0.1:{self.http_port}")
        self.grpc_port = int(server["listen"].rsplit(":", 1)[1])
        self.http_port = int(server["http_listen"].rsplit(":", 1)[1])
        store = dict(config.get("store", {}))
        store.setdefault("path", str(workdir / "cronoq.db"))
        self.config = {**config, "server": server, "store": store}
        self.config_path = workdir / f"{name}.toml"
        self.config_path.write_text(to_toml(self.config))
        self.shard = shard
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, wait_ready: bool = True, extra_args: list[str] | None = None) -> ServerProcess:
        cmd = [sys.executable, "-m", "cronoq_server.main", "--config", str(self.config_path), *(extra_args or [])]
        if self.shard:
            cmd += ["--shard", self.shard]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        if wait_ready:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 15.0, leader: bool = True) -> None:
        deadline = time.monotonic() + timeout
        path = "/readyz" if leader else "/healthz"
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.http_url + path, timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def http(
        self,
        method: str,
        path: str,
        body: Any = None,
        raw: bytes | None = None,
        timeout: float = 30,
        token: str | None = None,
    ) -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.http_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, answer, content_type = r.status, r.read(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as err:
            status, answer, content_type = err.code, err.read(), err.headers.get("Content-Type", "")
        if raw is None:  # a body built on purpose to be malformed is not the document's to describe
            import openapi_check  # here: the conformance runner imports this module without the test tools

            openapi_check.check(method, path, data, status, answer, content_type)
        return status, json.loads(answer or b"null")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 20) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


@pytest.fixture(scope="session")
def postgres() -> Iterator[TempPostgres]:
    """A real PostgreSQL for this test process; with CRONOQ_REQUIRE_POSTGRES=1 a missing one fails."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        message = "PostgreSQL binaries (initdb, pg_ctl) not found: install Debian's 'postgresql'"
        if os.environ.get("CRONOQ_REQUIRE_POSTGRES") == "1":
            pytest.fail(message + " (CRONOQ_REQUIRE_POSTGRES=1)")
        pytest.skip(message)
    pg = TempPostgres(bin_dir).init().start()
    yield pg
    pg.cleanup()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Any]:
    """start_server(config=None, shard=None, name=..., wait_ready=True) -> ServerProcess."""
    started: list[ServerProcess] = []

    def start(
        config: dict[str, Any] | None = None, shard: str | None = None, name: str | None = None, wait_ready: bool = True
    ) -> ServerProcess:
        srv = ServerProcess(tmp_path, config or {}, shard, name or f"server{len(started)}")
        started.append(srv)
        return srv.start(wait_ready)

    yield start
    for srv in started:
        srv.kill()


@pytest.fixture
def server(start_server: Any) -> ServerProcess:
    """A server with pools 'default' (lease_ttl 2s) and 'fast' (backoff 50ms)."""
    return start_server(
        {
            "pools": [
                {"name": "default", "lease_ttl": "2s", "retry_backoff": "50ms", "retry_backoff_max": "200ms"},
                {"name": "other", "lease_ttl": "30s"},
            ],
            "limits": {"max_payload_bytes": 4096, "max_batch_size": 50},
        }
    )


# The outcome of a test's call phase, for a fixture's teardown that acts only on a passed test.
CALL_PASSED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[CALL_PASSED] = report.passed
    return report


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


os.environ.setdefault("PYTHONUNBUFFERED", "1")
