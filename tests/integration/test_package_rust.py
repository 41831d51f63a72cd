"""The Rust SDK as crates.io ships it: `cargo package` and `cargo publish --dry-run` from the
crate's own files, then the .crate unpacked outside the repository and built, with the crate's
MSRV (its rust-version), by a scratch cargo project that submits a task to a real server."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
from preconditions import missing  # type: ignore[import-not-found]

ROOT = Path(__file__).resolve().parents[2]
CRATE = ROOT / "sdk-rust"
MANIFEST = tomllib.loads((CRATE / "Cargo.toml").read_text())["package"]
# Gitignored, kept between runs: a cold build of the crate's dependencies takes minutes.
SCRATCH_TARGET = CRATE / "target" / "scratch"
# What the package may hold besides src/, examples/ and proto/ (cargo adds the first three).
PACKAGE_TOP = {
    ".cargo_vcs_info.json",
    "Cargo.toml.orig",
    "Cargo.lock",
    "Cargo.toml",
    "build.rs",
    "README.md",
    "LICENSE",
}

pytestmark = pytest.mark.timeout(1800)

SCRATCH_MAIN = """\
use cronoq::{Client, Options, TaskSpec};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let endpoint = std::env::args().nth(1).expect("the server's endpoint");
    let client = Client::new(Options::new(endpoint))?;
    let submitted = client.submit(TaskSpec::new("default").key("from-the-packaged-crate")).await?;
    println!("{}", submitted.task.id);
    Ok(())
}
"""


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stderr[-4000:]}"
    return done


def _cargo(*args: str) -> subprocess.CompletedProcess[str]:
    """cargo on the crate in sdk-rust (--allow-dirty: a working tree being edited packages too)."""
    if shutil.which("cargo") is None:
        missing("cargo is not installed")
    return _run(["cargo", *args, "--locked", "--allow-dirty", "--manifest-path", str(CRATE / "Cargo.toml")], ROOT)


@pytest.fixture(scope="module")
def packaged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The .crate `cargo package` makes, unpacked outside the repository (not verified by cargo:
    the scratch project's build below is that check, done as a user's build does it)."""
    _cargo("package", "--no-verify")
    name = f"{MANIFEST['name']}-{MANIFEST['version']}"
    out = tmp_path_factory.mktemp("crate")
    with tarfile.open(CRATE / "target" / "package" / f"{name}.crate") as tar:
        tar.extractall(out, filter="data")
    return out / name


def _msrv_toolchain() -> str:
    """The crate's rust-version as a rustup toolchain, installed (minimal) when missing."""
    msrv = str(MANIFEST["rust-version"])
    if shutil.which("rustup") is None:
        missing("rustup is not installed: the MSRV build needs it")
    if subprocess.run(["rustup", "run", msrv, "rustc", "--version"], capture_output=True).returncode != 0:
        done = subprocess.run(
            ["rustup", "toolchain", "install", msrv, "--profile", "minimal"], capture_output=True, text=True
        )
        if done.returncode != 0:
            missing(f"rustup cannot install Rust {msrv}: {done.stderr.strip()[-500:]}")
    return msrv


def test_package_holds_the_crates_own_files_and_metadata(packaged: Path) -> None:
    files = {str(p.relative_to(packaged)) for p in packaged.rglob("*") if p.is_file()}
    strays = {f for f in files if f not in PACKAGE_TOP and not f.startswith(("src/", "examples/", "proto/cronoq/v1/"))}
    assert not strays, f"the package holds files it does not need: {sorted(strays)}"
    protos = {str(p.relative_to(CRATE)) for p in (CRATE / "proto").rglob("*.proto")}
    assert protos and protos <= files, f"protos missing from the package: {sorted(protos - files)}"
    assert {"LICENSE", "README.md", "build.rs", "src/lib.rs", "Cargo.lock"} <= files
    package = tomllib.loads((packaged / "Cargo.toml").read_text())["package"]
    assert package["name"] == "cronoq-sdk" and package["license"] == "Apache-2.0"
    for field in ("description", "repository", "homepage", "documentation", "readme", "keywords", "categories"):
        assert package.get(field), f"Cargo.toml has no {field}"
    assert package["rust-version"] == MANIFEST["rust-version"]
    assert package.get("publish", True) is True, "the crate says publish = false"
    lib = tomllib.loads((packaged / "Cargo.toml").read_text())["lib"]
    assert lib["name"] == "cronoq", "the library is imported as `cronoq`"


def test_crate_license_is_the_root_license(packaged: Path) -> None:
    root = ROOT / "LICENSE"
    assert root.is_file(), "no LICENSE at the repository's root"
    assert (CRATE / "LICENSE").read_bytes() == root.read_bytes(), "sdk-rust/LICENSE differs from LICENSE: copy it"
    assert (packaged / "LICENSE").read_bytes() == root.read_bytes()


def test_publish_dry_run() -> None:
    done = _cargo("publish", "--dry-run", "--no-verify")
    assert "aborting upload due to dry run" in done.stderr


def test_scratch_project_builds_with_the_msrv_and_submits(packaged: Path, tmp_path: Path, server: Any) -> None:
    msrv = _msrv_toolchain()
    scratch = tmp_path / "scratch"
    (scratch / "src").mkdir(parents=True)
    (scratch / "Cargo.toml").write_text(
        "[package]\n"
        'name = "scratch"\nversion = "0.0.0"\nedition = "2024"\npublish = false\n\n'
        "[dependencies]\n"
        f'cronoq-sdk = {{ path = "{packaged}" }}\n'
        'tokio = { version = "1", features = ["macros", "rt-multi-thread"] }\n'
    )
    (scratch / "src" / "main.rs").write_text(SCRATCH_MAIN)
    # The versions the crate locks (those its MSRV is proven with); cargo adds the scratch root.
    shutil.copyfile(packaged / "Cargo.lock", scratch / "Cargo.lock")
    env = {**os.environ, "CARGO_TARGET_DIR": str(SCRATCH_TARGET)}
    done = _run(["cargo", f"+{msrv}", "run", "--quiet", "--", server.endpoint], scratch, env)
    task_id = int(done.stdout.strip())
    status, body = server.http("GET", f"/v1/tasks/{task_id}")
    assert status == 200 and body["task"]["key"] == "from-the-packaged-crate"
