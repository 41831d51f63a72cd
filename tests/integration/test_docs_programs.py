"""The worker programs of the documentation run as a reader would run them: README.md's
"A worker in each SDK" and docs/getting-started.md's "A worker and a client in each SDK" show one
whole program per SDK, the same text in both, and the Go, TypeScript and Rust SDKs' READMEs open
with their own ("A worker"). Each is built against this checkout's SDK, run against a real server
until the task it submitted has SUCCEEDED, then stopped with Ctrl-C (SIGINT), which must exit 0.
A program that ends by itself (the TypeScript README's workflows and schedules) must exit 0."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# A cold build of the Rust SDK's dependencies takes minutes on a small machine; warm, the file takes well under.
pytestmark = pytest.mark.timeout(1800)

REPO = Path(__file__).resolve().parents[2]
GO_SDK = REPO / "sdk-go"
TS_SDK = REPO / "sdk-ts"
RUST_SDK = REPO / "sdk-rust"
README = REPO / "README.md"
GETTING_STARTED = REPO / "docs" / "getting-started.md"
# Each page's section that holds the programs, one subsection per SDK.
SECTIONS = {
    GETTING_STARTED: "## A worker and a client in each SDK",
    README: "## A worker in each SDK",
}
# Each SDK README's section that opens with its program; its subsections ("### Prefetch") show fragments.
SDK_SECTIONS = {sdk / "README.md": "## A worker" for sdk in (GO_SDK, TS_SDK, RUST_SDK)}
# The SDK READMEs' sections whose program runs to its end by itself, with what it prints (at least).
FINISHING_SECTIONS = {(TS_SDK / "README.md", "## Workflows"): "5050", (TS_SDK / "README.md", "## Schedules"): "seconds:"}
# The pools the finishing programs use.
FINISHING_POOLS = ("default", "reports")
LANGUAGES = ("python", "go", "ts", "rust")
# The endpoint the programs use; the test's server replaces it.
DOCS_ENDPOINT = "http://127.0.0.1:7070"
# The key of the task each program submits.
DOCS_KEY = "job-1"
# The crate's own target dir, which its cargo test and examples fill: the dependencies are built already.
RUST_TARGET = RUST_SDK / "target"


def section_programs(page: Path, heading: str | None = None) -> dict[str, list[str]]:
    """The code blocks of the page's section (its heading in SECTIONS or SDK_SECTIONS unless given), by
    language (shell lines left out)."""
    text = page.read_text()
    start = text.index(f"\n{heading or SECTIONS.get(page) or SDK_SECTIONS[page]}\n") + 1
    end = re.compile(r"^## " if page in SECTIONS else r"^##+ ", flags=re.M).search(text, start + 1)
    section = text[start : end.start() if end else None]
    programs: dict[str, list[str]] = {}
    for language, block in re.findall(r"^```(\w+)\n(.*?)^```$", section, flags=re.M | re.S):
        if language != "sh":
            programs.setdefault(language, []).append(block)
    return programs


def docs_programs() -> dict[str, tuple[str, str]]:
    """Every distinct program of the sections, by the page and language it is first shown in, with
    its language and text: README.md's are getting-started's (checked below), run once."""
    programs: dict[str, tuple[str, str]] = {}
    for page in [*SECTIONS, *SDK_SECTIONS]:
        for language, blocks in section_programs(page).items():
            for block in blocks:
                if (language, block) not in programs.values():
                    programs[f"{page.relative_to(REPO)}:{language}"] = (language, block)
    return programs


def finishing_programs() -> dict[str, tuple[str, str, str]]:
    """FINISHING_SECTIONS' programs, by page and heading, with their language, text and expected output."""
    programs: dict[str, tuple[str, str, str]] = {}
    for (page, heading), printed in FINISHING_SECTIONS.items():
        ((language, (block,)),) = section_programs(page, heading).items()
        programs[f"{page.relative_to(REPO)}:{heading.lstrip('# ')}"] = (language, block, printed)
    return programs


def run_programs() -> dict[str, tuple[str, str]]:
    """Every program this file runs, with its language and text."""
    finishing = {where: (language, block) for where, (language, block, _) in finishing_programs().items()}
    return {**docs_programs(), **finishing}


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, (
        f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-4000:]}"
    )


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed: the documentation's program in its language cannot be checked"
    return path


def build_python(program: str, scratch: Path) -> list[str]:
    (scratch / "main.py").write_text(program)
    return [sys.executable, "main.py"]


def build_go(program: str, scratch: Path) -> list[str]:
    """A module of its own that requires the SDK, replaced by this checkout's (GOCACHE: the shared one)."""
    go = _tool("go")
    (scratch / "main.go").write_text(program)
    (scratch / "go.mod").write_text(
        "module example.com/docs-program\n\ngo 1.26.0\n\n"
        "require github.com/cronoq/cronoq/sdk-go v0.0.0\n\n"
        f"replace github.com/cronoq/cronoq/sdk-go => {GO_SDK}\n"
    )
    shutil.copyfile(GO_SDK / "go.sum", scratch / "go.sum")  # the SDK's dependencies, as it pins them
    unformatted = subprocess.run([_tool("gofmt"), "-d", "main.go"], cwd=scratch, capture_output=True, text=True)
    assert unformatted.stdout == "", f"gofmt would change the Go program:\n{unformatted.stdout}"
    _run([go, "build", "-mod=mod", "-o", "program", "."], scratch)
    return [str(scratch / "program")]


def build_ts(program: str, scratch: Path) -> list[str]:
    """The SDK is this checkout's source ("cronoq": a tsconfig path); tsc type-checks the program and tsx
    runs it, both the SDK's own dev dependencies."""
    node = _tool("node")
    tsc = TS_SDK / "node_modules" / ".bin" / "tsc"
    if not tsc.exists():
        _run([_tool("npm"), "ci", "--no-audit", "--no-fund", "--prefer-offline"], TS_SDK)
    (scratch / "main.ts").write_text(program)
    (scratch / "package.json").write_text(json.dumps({"name": "docs-program", "private": True, "type": "module"}))
    compiler = {
        "target": "ES2022",
        "module": "NodeNext",
        "moduleResolution": "NodeNext",
        "strict": True,
        "noEmit": True,
        "skipLibCheck": True,
        "types": ["node"],
        "typeRoots": [str(TS_SDK / "node_modules" / "@types")],
        "paths": {"cronoq": [str(TS_SDK / "src" / "index.ts")]},
        "allowImportingTsExtensions": True,
    }
    (scratch / "tsconfig.json").write_text(json.dumps({"compilerOptions": compiler, "files": ["main.ts"]}))
    _run([str(tsc), "-p", str(scratch)], scratch)
    (scratch / "node_modules").mkdir()
    (scratch / "node_modules" / "tsx").symlink_to(TS_SDK / "node_modules" / "tsx")
    # node itself (not tsx's CLI, which runs a child) so that the program gets the SIGINT.
    return [node, "--import", "tsx", "main.ts"]


def build_rust(program: str, scratch: Path) -> list[str]:
    """A cargo project with the SDK as a path dependency and the crate's locked versions."""
    cargo = _tool("cargo")
    (scratch / "src").mkdir()
    (scratch / "src" / "main.rs").write_text(program)
    (scratch / "Cargo.toml").write_text(
        "[package]\n"
        'name = "docs-program"\nversion = "0.0.0"\nedition = "2024"\npublish = false\n\n'
        "[dependencies]\n"
        f'cronoq-sdk = {{ path = "{RUST_SDK}" }}\n'
        'serde = { version = "1", features = ["derive"] }\n'
        'serde_json = "1"\n'
        'tokio = { version = "1", features = ["macros", "rt-multi-thread", "signal"] }\n'
    )
    shutil.copyfile(RUST_SDK / "Cargo.lock", scratch / "Cargo.lock")
    _run([cargo, "build", "--quiet"], scratch, {**os.environ, "CARGO_TARGET_DIR": str(RUST_TARGET)})
    return [str(RUST_TARGET / "debug" / "docs-program")]


BUILDS = {"python": build_python, "go": build_go, "ts": build_ts, "rust": build_rust}


def test_each_sdk_has_one_program_the_same_in_the_readme_and_getting_started() -> None:
    readme, getting_started = section_programs(README), section_programs(GETTING_STARTED)
    assert sorted(getting_started) == sorted(LANGUAGES), f"docs/getting-started.md: {sorted(getting_started)}"
    for language in LANGUAGES:
        assert len(getting_started[language]) == 1, f"docs/getting-started.md shows {language} more than once"
        assert readme.get(language) == getting_started[language], (
            f"README.md's {language} program differs from docs/getting-started.md's: copy it"
        )
        (program,) = getting_started[language]
        assert DOCS_ENDPOINT in program and DOCS_KEY in program, f"the {language} program does not submit {DOCS_KEY}"


def _docs_task(server: Any) -> dict[str, Any]:
    status, body = server.http("GET", f"/v1/keys/{DOCS_KEY}")
    return body["task"] if status == 200 else {}


def test_each_sdk_readme_opens_with_one_worker_program_of_its_language() -> None:
    for page, language in zip(SDK_SECTIONS, ("go", "ts", "rust"), strict=True):
        programs = section_programs(page)
        assert list(programs) == [language] and len(programs[language]) == 1, f"{page}: {programs}"
        (program,) = programs[language]
        assert DOCS_ENDPOINT in program and DOCS_KEY in program, f"{page}'s program does not submit {DOCS_KEY}"


@pytest.mark.parametrize("where", list(docs_programs()))
def test_docs_program_runs_its_task_and_stops_on_ctrl_c(where: str, start_server: Any, tmp_path: Path) -> None:
    language, program = docs_programs()[where]
    server = start_server()
    scratch = tmp_path / "program"
    scratch.mkdir()
    cmd = BUILDS[language](program.replace(DOCS_ENDPOINT, server.endpoint), scratch)
    output = tmp_path / "program.out"
    with open(output, "wb") as sink:
        proc = subprocess.Popen(cmd, cwd=scratch, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while (task := _docs_task(server)).get("state") != "TASK_STATE_SUCCEEDED":
            assert proc.poll() is None, f"the {language} program exited {proc.returncode}:\n{output.read_text()}"
            assert time.monotonic() < deadline, f"{DOCS_KEY} is {task.get('state')} after 60s:\n{output.read_text()}"
            time.sleep(0.1)
        assert task["result_json"] == {"doubled": 42}, task
        proc.send_signal(signal.SIGINT)
        code = proc.wait(45)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, f"the {language} program exited {code} on Ctrl-C:\n{output.read_text()}"


@pytest.mark.parametrize("where", list(finishing_programs()))
def test_docs_program_runs_to_its_end(where: str, start_server: Any, tmp_path: Path) -> None:
    language, program, printed = finishing_programs()[where]
    server = start_server({"pools": [{"name": pool} for pool in FINISHING_POOLS]})
    scratch = tmp_path / "program"
    scratch.mkdir()
    cmd = BUILDS[language](program.replace(DOCS_ENDPOINT, server.endpoint), scratch)
    done = subprocess.run(cmd, cwd=scratch, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"the program exited {done.returncode}:\n{done.stdout}{done.stderr}"
    assert printed in done.stdout, done.stdout
