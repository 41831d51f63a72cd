"""`./dev release --dry-run` on a fresh clone of the repository (its committed files only, nothing
installed or built there before), as on a new machine: the release session installs what its
steps need itself. The npm step (with the names and Python steps, which always run; the Python
one starts the server) is the one that depends on an install (sdk-ts's tsc, for `npm pack`); the
Rust and Go steps are left out here for time: cargo and go fetch what they need by themselves."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from preconditions import missing  # type: ignore[import-not-found]

pytestmark = pytest.mark.timeout(1500)

REPO = Path(__file__).resolve().parents[2]
# ./dev's own bootstrap (nox and uv): not what is tested, reused from the checkout when it has it.
DEV_VENV = REPO / ".venv-dev"


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for tool in ("git", "npm"):
        if shutil.which(tool) is None:
            missing(f"{tool} is not installed")
    clone = tmp_path_factory.mktemp("release") / "cronoq"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=300)
    assert not (clone / "sdk-ts" / "node_modules").exists()
    if (DEV_VENV / "bin" / "nox").exists():
        (clone / ".venv-dev").symlink_to(DEV_VENV)
    return clone


def test_dry_run_builds_and_installs_the_npm_package_on_a_fresh_clone(fresh_clone: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        ["./dev", "release", "--dry-run", "--only", "npm"],
        cwd=fresh_clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=1400,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "release --dry-run: every artifact of" in done.stdout, output[-6000:]
    assert "sdk-ts/examples/worker.ts: the three tasks ended as expected" in done.stdout
