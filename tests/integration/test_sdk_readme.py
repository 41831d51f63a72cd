"""The Python SDK's README (sdk-python/README.md) shows only code that works: every Python
example runs as it is against a real server, and every `cronoq` command line of the READMEs
parses with the CLI, so neither can drift from the SDK."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trustme

from cronoq.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
SDK_README = REPO / "sdk-python" / "README.md"
# Every README that shows `cronoq` commands.
CLI_READMES = [REPO / "README.md", SDK_README, REPO / "server" / "README.md"]
# And the docs, where a page shows any.
CLI_DOCS = sorted((REPO / "docs").glob("*.md"))
# The endpoint the examples use; the test's server replaces it.
README_ENDPOINT = "http://127.0.0.1:7070"
# The first line of an example that serves until stopped (a worker, a watcher): the test
# starts it first, runs the others, then stops it with Ctrl-C (SIGINT), which must exit 0.
SERVICE_MARK = "# runs until"


def code_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", path.read_text(), flags=re.M | re.S)


def cli_lines(path: Path) -> list[str]:
    """The `cronoq ...` command lines of a README's sh blocks, without comments and with
    optional parts ([--json]) given."""
    lines = []
    for block in code_blocks(path, "sh"):
        for line in block.splitlines():
            if line.startswith("cronoq "):
                lines.append(re.sub(r"[\[\]]", "", line))
    return lines


def _gauge(server: Any, name: str) -> float:
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, flags=re.M))


def _wait_for(condition: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _tls_files(where: Path) -> None:
    """The files the options example names: a CA and a client certificate with its key."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(where / "ca.pem"))
    leaf = ca.issue_cert("worker-a")
    leaf.cert_chain_pems[0].write_to_path(str(where / "worker-a.crt"))
    leaf.private_key_pem.write_to_path(str(where / "worker-a.key"))


def test_readme_has_the_examples_it_promises() -> None:
    blocks = code_blocks(SDK_README, "python")
    text = "\n".join(blocks)
    for needed in ("cronoq.Worker(", "cronoq.Client(", "cronoq.SyncClient(", ".watch(", "cronoq.TlsConfig(",
                   "cronoq.RetryConfig(", "cronoq.KeepaliveConfig(", "errors.NotFound", "submit_batch(", "ctx.spawn(",
                   "ctx.dependency_results", 'run_when="ended"'):  # fmt: skip
        assert needed in text, f"sdk-python/README.md has no example with {needed}"
    assert sum(b.startswith(SERVICE_MARK) for b in blocks) == 2  # the worker and the watcher


def test_readme_examples_run_against_a_server(start_server: Any, tmp_path: Path) -> None:
    # mapreduce: the workflows example's own pool, which the README's worker does not serve.
    server = start_server({"pools": [{"name": "default", "retry_backoff": "50ms"}, {"name": "mapreduce"}]})
    _tls_files(tmp_path)
    services: list[tuple[subprocess.Popen[bytes], Path, Path]] = []  # process, script, output
    scripts: list[Path] = []
    for i, block in enumerate(code_blocks(SDK_README, "python")):
        path = tmp_path / f"example_{i}.py"
        path.write_text(block.replace(README_ENDPOINT, server.endpoint))
        if block.startswith(SERVICE_MARK):
            out = tmp_path / f"example_{i}.out"
            with open(out, "wb") as sink:
                proc = subprocess.Popen(
                    [sys.executable, str(path)], cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT
                )
            services.append((proc, path, out))
        else:
            scripts.append(path)
    try:
        # The worker's Work stream and the watcher's stream are open before anything is submitted.
        _wait_for(lambda: _gauge(server, "cronoq_work_streams") >= 1, "the README's worker to connect")
        _wait_for(lambda: _gauge(server, "cronoq_watch_streams") >= 1, "the README's watcher to connect")
        outputs = []
        for path in scripts:
            done = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=90)
            assert done.returncode == 0, f"{path.name}:\n{path.read_text()}\n{done.stdout}{done.stderr}"
            outputs.append(done.stdout)
        printed = "".join(outputs)
        assert "{'doubled': 42}" in printed, printed  # the client's task, run by the README's worker
        assert "missing:" in printed and "StatusCode.INVALID_ARGUMENT" in printed, printed  # the errors example
        assert "join TASK_STATE_SUCCEEDED: 5050" in printed and "101 True" in printed, printed  # the workflows one
        watcher = next(out for _, path, out in services if ".watch(" in path.read_text())
        _wait_for(lambda: "job-1 TASK_STATE_SUCCEEDED" in watcher.read_text(), "the watcher's job-1 event")
    finally:
        for proc, _, _ in services:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        codes: list[int | None] = []
        for proc, _, _ in services:
            try:
                codes.append(proc.wait(45))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(None)
    for (_, path, out), code in zip(services, codes, strict=True):
        assert code == 0, f"{path.name} exited {code} on Ctrl-C:\n{path.read_text()}\n{out.read_text()}"


@pytest.mark.parametrize("readme", CLI_READMES + CLI_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_readme_cli_lines_parse(readme: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = cli_lines(readme)
    assert lines or readme in CLI_DOCS, f"{readme} shows no cronoq command"
    parser = build_parser()
    for line in lines:
        argv = shlex.split(line, comments=True)[1:]
        try:
            parser.parse_args(argv)
        except SystemExit as exit:  # --help, --version: printed, exit 0; a bad argument: exit 2
            assert exit.code == 0, f"{readme.name}: `{line}` does not parse: {capsys.readouterr().err}"
