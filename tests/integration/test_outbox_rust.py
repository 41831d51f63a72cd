"""The Rust SDK's outbox helpers (features `outbox` and `outbox-sqlx`, which `cargo test` without
features leaves out) against a real PostgreSQL: their cargo tests with its URL, and clippy."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from pgserver import TempPostgres  # type: ignore[import-not-found]
from preconditions import missing  # type: ignore[import-not-found]

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "sdk-rust" / "Cargo.toml"
FEATURES = "outbox,outbox-sqlx"

# A cold build of tokio-postgres and sqlx takes minutes on a small machine.
pytestmark = pytest.mark.timeout(1800)


def _cargo(*args: str, env: dict[str, str] | None = None) -> str:
    if shutil.which("cargo") is None:
        missing("cargo is not installed")
    cmd = ["cargo", *args[:1], "--locked", "--manifest-path", str(MANIFEST), *args[1:]]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    assert done.returncode == 0, (
        f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-4000:]}"
    )
    return done.stdout


def test_default_features_pull_no_postgres_driver() -> None:
    tree = _cargo("tree", "-e", "normal", "--prefix", "none")
    assert not re.findall(r"^(tokio-postgres|sqlx\S*|postgres-\S+) ", tree, re.MULTILINE)


def test_outbox_cargo_tests_against_postgres(postgres: TempPostgres) -> None:
    # CI set: a test that finds no database fails rather than skips.
    env = {"CRONOQ_TEST_DATABASE_URL": postgres.url, "CI": "true"}
    out = _cargo("test", "--features", FEATURES, "--lib", "--", "outbox_tests", "checks_tests", env=env)
    passed = re.findall(r"^test (outbox_tests::\S+) \.\.\. ok$", out, re.MULTILINE)
    assert len(passed) >= 5, out[-3000:]


def test_outbox_clippy() -> None:
    _cargo("clippy", "--all-targets", "--features", FEATURES, "--", "-D", "warnings")
