"""Every whole program the documentation shows is run by a test: a code block a reader can paste
and run as it is (Go with `package main`, Rust with `fn main`, Python with `asyncio.run(` or
`if __name__`, TypeScript importing from "cronoq" with statements of its own) must be one that
tests/integration/test_docs_programs.py or test_sdk_readme.py runs, as they select them. A block
that only shows a few calls is a fragment, and says so by leaving its imports out."""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from test_docs_programs import run_programs  # type: ignore[import-not-found]  # noqa: E402
from test_sdk_readme import SDK_README, code_blocks  # type: ignore[import-not-found]  # noqa: E402

# The markdown files a user reads.
PAGES = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted(REPO.glob("sdk-*/README.md")),
    *(REPO / where / "README.md" for where in ("server", "conformance", "bench")),
]
LANGUAGES = ("python", "go", "ts", "typescript", "rust")
# The same fence the running tests' selections match, so that a block's text compares equal.
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", flags=re.M | re.S)
TS_CRONOQ_IMPORT = re.compile(r"""^import\b[^;]*?\bfrom\s+["']cronoq\b""", flags=re.M)
# A TypeScript line at the top level that declares rather than runs (or continues a statement above it).
TS_DECLARATION = re.compile(
    r"(export\s+)?(import|type|interface|(async\s+)?function|class|declare|enum)\b|//|/\*|\*|[)}\]]"
)


def fenced_blocks(page: Path) -> list[tuple[int, str, str]]:
    """The page's code blocks in the checked languages: the fence's line number, language, text."""
    text = page.read_text()
    return [
        (text.count("\n", 0, match.start()) + 1, match[1], match[2])
        for match in FENCE.finditer(text)
        if match[1] in LANGUAGES
    ]


def python_run_blocks() -> set[str]:
    return set(code_blocks(SDK_README, "python"))


def is_whole_program(language: str, block: str) -> bool:
    if language == "go":
        return re.search(r"^package main\b", block, flags=re.M) is not None
    if language == "rust":
        return re.search(r"\bfn main\s*\(", block) is not None
    if language == "python":
        return "asyncio.run(" in block or "if __name__" in block or block in python_run_blocks()
    return TS_CRONOQ_IMPORT.search(block) is not None and any(
        line.strip() and not line[0].isspace() and not TS_DECLARATION.match(line) for line in block.splitlines()
    )


def run_blocks() -> set[str]:
    return {program for _, program in run_programs().values()} | python_run_blocks()


def test_every_whole_program_of_the_docs_is_run_by_a_test() -> None:
    run = run_blocks()
    unrun = [
        f"{page.relative_to(REPO)}:{line} ({language})"
        for page in PAGES
        if page.exists()
        for line, language, block in fenced_blocks(page)
        if is_whole_program(language, block) and block not in run
    ]
    assert not unrun, (
        "whole programs no test runs (run them in tests/integration/test_docs_programs.py, or leave a "
        f"fragment's imports out): {', '.join(unrun)}"
    )


def test_the_programs_the_tests_run_are_recognised_as_whole() -> None:
    for where, (language, program) in run_programs().items():
        assert is_whole_program(language, program), f"{where}: the scan would not take it for a whole program"
    shown = {block for page in PAGES if page.exists() for _, _, block in fenced_blocks(page)}
    assert run_blocks() <= shown, "a block the tests run is not found by the scan's reading of the pages"


def test_the_scan_tells_programs_from_fragments() -> None:
    whole = {
        "go": "package main\n\nfunc main() {}\n",
        "rust": "fn main() {}\n",
        "python": "import asyncio\n\nasyncio.run(main())\n",
        "ts": 'import {\n  Client,\n} from "cronoq";\n\nconst client = new Client({ endpoint: "x" });\n',
    }
    fragments = {
        "go": "worker, err := cronoq.NewWorker(opts, handle)\n",
        "rust": "let worker = Worker::new(options, double)?;\n",
        "python": "import cronoq\n\nawait client.submit('default', {})\n",
        "ts": 'const client = new Client({ endpoint: "x" });\n',
    }
    declarations_only = 'import { type Task } from "cronoq";\n\nexport function f(task: Task) {\n  return 1;\n}\n'
    for language, block in whole.items():
        assert is_whole_program(language, block), block
    for language, block in fragments.items():
        assert not is_whole_program(language, block), block
    assert not is_whole_program("ts", declarations_only)
