"""A curated mutation check of the security-critical lines: each mutant of tests/mutants.toml
changes one line (a check deleted, a condition negated), the tests it names are run, and they
must fail. A mutant they do not catch is a check that could be deleted with every test green.

    python tests/mutants.py              # every mutant (./dev mutants)
    python tests/mutants.py NAME...      # these only
    python tests/mutants.py --list       # the mutants, and whether each line is found
    python tests/mutants.py --no-baseline --if-clean  # in ./dev tests, right after those tests passed

Each mutant is applied in place and its file is always restored (SIGINT and SIGTERM too), so
the files it mutates must be unmodified in git: the check refuses to start otherwise. Before
any mutant, the named tests run once on the unmutated tree and must pass (a test failing for
another reason would pass for a catch), unless --no-baseline says they just did. A line that is not found exactly once fails the check:
a refactor that moves or rewords a line must update the list, not test nothing silently.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "tests" / "mutants.toml"
# How far below its `after` line a mutant's line may be.
AFTER_WITHIN = 20
RUN_TIMEOUT_S = 900
ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # no stale .pyc of a mutant outlives it


@dataclass
class Mutant:
    name: str
    file: str
    line: str  # a substring of the line to change; found once (below `after`, if given)
    mutant: str  # what that substring becomes
    why: str
    after: str = ""  # a substring of a line found once, above the line (when `line` alone is not unique)
    tests: list[str] = field(default_factory=list)  # pytest node ids that must catch it
    command: list[str] = field(default_factory=list)  # or a command that must fail (run from the root)

    def locate(self, text: str) -> int:
        """The index of the line this mutant changes; ValueError naming what is not found once."""
        lines = text.splitlines(keepends=True)
        start, end = 0, len(lines)
        if self.after:
            anchors = [i for i, line in enumerate(lines) if self.after in line]
            if len(anchors) != 1:
                raise ValueError(f"`after` {self.after!r} is on {len(anchors)} lines of {self.file}, not 1")
            start, end = anchors[0] + 1, min(anchors[0] + 1 + AFTER_WITHIN, len(lines))
        found = [i for i in range(start, end) if self.line in lines[i]]
        where = f"within {AFTER_WITHIN} lines below {self.after!r}" if self.after else f"in {self.file}"
        if not found or (len(found) > 1 and not self.after):
            raise ValueError(f"{self.line!r} is on {len(found)} lines {where}, not 1")
        return found[0]

    def apply(self, text: str) -> str:
        lines = text.splitlines(keepends=True)
        i = self.locate(text)
        lines[i] = lines[i].replace(self.line, self.mutant, 1)
        return "".join(lines)


def load(path: Path = LIST) -> list[Mutant]:
    with path.open("rb") as f:
        entries = tomllib.load(f)["mutant"]
    mutants = [Mutant(**entry) for entry in entries]
    for m in mutants:
        if bool(m.tests) == bool(m.command):
            raise ValueError(f"mutant {m.name}: give `tests` or `command`, one of them")
    names = [m.name for m in mutants]
    if len(set(names)) != len(names):
        raise ValueError("mutant names must be unique")
    return mutants


def run(argv: list[str]) -> tuple[int, float, str]:
    """Its exit code, seconds and output. Stopped (a timeout, SIGINT, SIGTERM), it is sent SIGINT
    first, so that pytest stops the servers it started."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
        code, output = proc.returncode, stderr + stdout  # the last line: the outcome it printed
    except BaseException as err:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if not isinstance(err, subprocess.TimeoutExpired):
            raise
        code, output = -1, f"timed out after {RUN_TIMEOUT_S}s"
    return code, time.monotonic() - started, output


def pytest(ids: list[str], stop_first: bool = True) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["-x"] if stop_first else []), *ids]


def checks(m: Mutant) -> list[list[str]]:
    """How a mutant is tested: its pytest ids, or its command ("python" is this interpreter)."""
    if m.tests:
        return [pytest(m.tests)]
    return [[sys.executable if arg == "python" else arg for arg in m.command]]


def dirty(files: set[str]) -> list[str]:
    out = subprocess.run(
        ["git", "status", "--porcelain", "--", *sorted(files)], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [line[3:] for line in out.splitlines()]


def tail(output: str, n: int = 25) -> str:
    return "\n".join("    " + line for line in output.strip().splitlines()[-n:])


def first_failure(output: str) -> str:
    """What failed first, from pytest's short summary (FAILED or ERROR and the node id); for a
    command, its last line."""
    lines = [line for line in output.splitlines() if line.strip()]
    failed = [line.split(" - ")[0] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return f": {(failed or lines or [''])[0 if failed else -1]}"


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # through the finally that restores the file


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="run these mutants only")
    ap.add_argument("--list", action="store_true", help="list the mutants and check that each line is found")
    ap.add_argument("--no-baseline", action="store_true", help="the named tests just passed: do not run them unmutated")
    ap.add_argument(
        "--if-clean",
        action="store_true",
        help="when a file to mutate has changes not committed, say so and succeed (not with CI=true: fail)",
    )
    args = ap.parse_args()
    mutants = load()
    unknown = set(args.names) - {m.name for m in mutants}
    if unknown:
        print(f"mutants: unknown {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    chosen = [m for m in mutants if not args.names or m.name in args.names]

    problems = []
    for m in chosen:
        try:
            m.locate((ROOT / m.file).read_text())
        except (OSError, ValueError) as err:
            problems.append(f"{m.name}: {err}")
        if args.list:
            print(f"{m.name:32} {m.file}: {m.line.strip()!r} -> {m.mutant.strip()!r}")
    if problems:
        print("mutants: lines not found (update tests/mutants.toml):\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    if args.list:
        return 0
    changed = dirty({m.file for m in chosen})
    if changed:
        if args.if_clean and not os.environ.get("CI"):
            print(f"mutants: skipped, changes not committed in {', '.join(changed)} (commit, then ./dev mutants)")
            return 0
        print(
            f"mutants: refusing to mutate files with changes not committed: {', '.join(changed)} "
            "(a run killed mid-mutant leaves one: `git diff` shows it, `git checkout -- FILE` restores)",
            file=sys.stderr,
        )
        return 2

    signal.signal(signal.SIGTERM, _terminate)
    started = time.monotonic()
    ids = list(dict.fromkeys(t for m in chosen for t in m.tests))
    baseline = ([pytest(ids, stop_first=False)] if ids else []) + [checks(m)[0] for m in chosen if m.command]
    if not args.no_baseline:
        print(f"mutants: the named tests, unmutated ({len(chosen)} mutants)", flush=True)
    for argv in [] if args.no_baseline else baseline:
        code, took, output = run(argv)
        if code != 0:
            print(f"mutants: these must pass before any mutant ({took:.0f}s):\n{tail(output)}", file=sys.stderr)
            return 1

    survived, errors = [], []
    for m in chosen:
        path = ROOT / m.file
        original = path.read_text()
        try:
            path.write_text(m.apply(original))
            outcomes = [run(argv) for argv in checks(m)]
        finally:
            path.write_text(original)
        took = sum(o[1] for o in outcomes)
        codes = [o[0] for o in outcomes]
        if m.tests and codes[0] not in (0, 1):  # 2-5: interrupted, collection or usage error; -1: timeout
            errors.append(m.name)
            print(f"ERROR     {m.name} ({took:.0f}s): pytest exited {codes[0]}\n{tail(outcomes[0][2])}", flush=True)
        elif any(codes):
            print(f"caught    {m.name} ({took:.0f}s){first_failure(outcomes[0][2])}", flush=True)
        else:
            survived.append(m.name)
            print(
                f"SURVIVED  {m.name} ({took:.0f}s): {m.why}\n    {m.file}: {m.line.strip()!r} -> {m.mutant.strip()!r}"
            )
    if dirty({m.file for m in chosen}):
        print("mutants: a file was not restored", file=sys.stderr)
        return 1
    caught = len(chosen) - len(survived) - len(errors)
    print(f"mutants: {caught} of {len(chosen)} caught in {time.monotonic() - started:.0f}s", flush=True)
    if survived:
        print(f"mutants: SURVIVED (a check that can be deleted with its tests green): {', '.join(survived)}")
    if errors:
        print(f"mutants: could not run: {', '.join(errors)}")
    return 1 if survived or errors else 0


if __name__ == "__main__":
    sys.exit(main())
