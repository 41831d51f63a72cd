"""Packaging: the server uses cronoq-api (proto/python: the generated cronoq.v1 and
cronoq.jsonform) and never the SDK. `cronoq` is a namespace shared by cronoq-api and the
SDK; importing the generated code must not load the SDK's client, worker or tenacity,
whichever of them is installed, editable or not."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest
from preconditions import missing  # type: ignore[import-not-found]

REPO = Path(__file__).resolve().parents[2]
API_DIR = REPO / "proto" / "python"
SDK_DIR = REPO / "sdk-python"
SERVER_DIR = REPO / "server"
SITE_DIRS = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})

# The SDK's modules, any of which means the SDK was loaded.
SDK_MODULES = ["cronoq.client", "cronoq.worker", "cronoq._transport", "cronoq.sync", "cronoq.cli", "cronoq.errors"]

# Run in a fresh interpreter: the generated code and the server, then nothing of the SDK.
SERVER_SIDE = f"""
import sys
import cronoq.v1.task_service_pb2, cronoq_server.node
import cronoq.jsonform
sdk = [m for m in sys.modules if m == "tenacity" or m.startswith("tenacity.") or m in {SDK_MODULES!r}]
assert not sdk, f"importing the generated code and the server loaded {{sdk}}"
assert "cronoq.worker" not in sys.modules and "tenacity" not in sys.modules
"""

# ... then the SDK's public API, imported on first use.
SDK_SIDE = """
import cronoq
assert cronoq.__file__ is not None and cronoq.__file__.endswith("__init__.py"), cronoq.__file__
assert "cronoq.worker" not in sys.modules
assert cronoq.Client.__name__ == "Client"
assert cronoq.Worker.__name__ == "Worker"
assert issubclass(cronoq.TaskError, Exception)
from cronoq import Client, SyncClient, TaskContext, CronoqError, RetryConfig, TlsConfig, task_spec
assert Client is cronoq.Client and "cronoq.worker" in sys.modules
for name in cronoq.__all__:
    getattr(cronoq, name)
assert set(cronoq.__all__) <= set(dir(cronoq))
from cronoq import errors, worker
try:
    cronoq.NoSuchName
except AttributeError:
    pass
else:
    raise AssertionError("cronoq.NoSuchName did not raise AttributeError")
import cronoq.v1.worker_service_pb2 as wpb
assert wpb.DESCRIPTOR.services_by_name["WorkerService"].full_name == "cronoq.v1.WorkerService"
"""

# ... or, without the SDK: `cronoq` is a plain namespace package.
NAMESPACE_ONLY = """
import cronoq
assert getattr(cronoq, "__file__", None) is None, cronoq.__file__
assert type(cronoq.__path__).__name__ == "_NamespacePath", type(cronoq.__path__)
assert not hasattr(cronoq, "Client")
try:
    import cronoq.worker
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("cronoq.worker importable without the SDK")
"""


def _python(code: str, path: list[Path] | None = None) -> None:
    """Runs `code` in a fresh interpreter. With `path`: without site (no .pth files, so no
    editable installs), on exactly these directories then the virtualenv's site-packages."""
    if path is None:
        cmd = [sys.executable, "-c", code]
    else:
        entries = [str(p) for p in path] + SITE_DIRS
        cmd = [sys.executable, "-S", "-c", f"import sys\nsys.path[0:0] = {entries!r}\n{code}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO / "tests")
    assert proc.returncode == 0, proc.stderr


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s;<>=!~\[(@]", r.strip(), maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def _pyproject_dependencies(project: Path) -> set[str]:
    with open(project / "pyproject.toml", "rb") as f:
        return _requirement_names(tomllib.load(f)["project"]["dependencies"])


def _sdk_in_site_packages() -> bool:
    return any(Path(site, "cronoq", "__init__.py").exists() for site in SITE_DIRS)


# -- dependencies ------------------------------------------------------------------


def test_server_depends_on_the_api_not_on_the_sdk() -> None:
    deps = _pyproject_dependencies(SERVER_DIR)
    assert "cronoq-api" in deps
    assert "cronoq" not in deps, "the server must not depend on the SDK (distribution 'cronoq')"


def test_installed_server_metadata_names_the_api_not_the_sdk() -> None:
    deps = _requirement_names(importlib.metadata.requires("cronoq-server") or [])
    assert "cronoq-api" in deps and "cronoq" not in deps


def test_sdk_depends_on_the_api_and_the_api_on_protobuf_and_grpcio_only() -> None:
    assert "cronoq-api" in _pyproject_dependencies(SDK_DIR)
    # googleapis-common-protos: generated code too (google.rpc.Status and its details).
    assert _pyproject_dependencies(API_DIR) == {"grpcio", "protobuf", "googleapis-common-protos"}


# -- imports, in this environment (editable installs under nox) ---------------------


def test_generated_code_and_server_do_not_load_the_sdk() -> None:
    _python(SERVER_SIDE + SDK_SIDE)


def test_generated_code_comes_from_the_api_distribution() -> None:
    _python(
        textwrap.dedent(
            f"""
            from pathlib import Path
            import cronoq.v1, cronoq.jsonform
            for module in (cronoq.v1, cronoq.jsonform):
                assert not Path(module.__file__).is_relative_to({str(SDK_DIR)!r}), module.__file__
            """
        )
    )


def test_whole_server_does_not_load_the_sdk() -> None:
    _python(
        textwrap.dedent(
            """
            import importlib, pkgutil, sys
            import cronoq_server
            for info in pkgutil.walk_packages(cronoq_server.__path__, "cronoq_server."):
                importlib.import_module(info.name)
            """
        )
        + SERVER_SIDE
    )


# -- imports, from the source tree: as editable installs of one or both ---------------


def _not_here(reason: str) -> None:
    """A layout these tests cannot build here (CI runs the tests on editable installs)."""
    missing(reason)


def test_source_tree_api_and_sdk() -> None:
    if _sdk_in_site_packages():
        _not_here("the SDK is installed (not editable) in site-packages")
    _python(SERVER_SIDE + SDK_SIDE, [API_DIR, SDK_DIR, SERVER_DIR])
    _python(SERVER_SIDE + SDK_SIDE, [SDK_DIR, API_DIR, SERVER_DIR])  # either order


def test_source_tree_api_without_sdk_is_a_namespace() -> None:
    if _sdk_in_site_packages():
        _not_here("the SDK is installed (not editable) in site-packages")
    _python(SERVER_SIDE + NAMESPACE_ONLY, [API_DIR, SERVER_DIR])


# -- imports, from the wheels: as normal installs (one cronoq/ directory) -------------


def _wheel(project: Path, tmp: Path) -> Path:
    """Builds `project`'s wheel (from a copy, with this environment's setuptools)."""
    src = tmp / f"src-{project.name}"
    shutil.copytree(project, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist"))
    out = tmp / "dist"
    code = f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out / proc.stdout.strip().splitlines()[-1]


def _unpack(wheels: list[Path], target: Path) -> Path:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(target)
    return target


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("wheels")  # setuptools: in the test session's dependencies
    return {"api": _wheel(API_DIR, tmp), "sdk": _wheel(SDK_DIR, tmp)}


def test_wheels_share_cronoq_without_overlapping(wheels: dict[str, Path]) -> None:
    def files(name: str) -> set[str]:
        with zipfile.ZipFile(wheels[name]) as zf:
            return {n for n in zf.namelist() if ".dist-info/" not in n}

    api, sdk = files("api"), files("sdk")
    assert not api & sdk, f"both wheels install {sorted(api & sdk)}"
    assert "cronoq/__init__.py" in sdk and "cronoq/__init__.py" not in api
    assert {"cronoq/jsonform.py", "cronoq/py.typed", "cronoq/v1/__init__.py", "cronoq/v1/task_pb2.pyi"} <= api
    assert not any(n.startswith("cronoq/v1/") for n in sdk)


def test_installed_wheels_api_and_sdk(wheels: dict[str, Path], tmp_path: Path) -> None:
    if _sdk_in_site_packages():
        _not_here("the SDK is installed (not editable) in site-packages")
    target = _unpack([wheels["api"], wheels["sdk"]], tmp_path / "site")
    _python(SERVER_SIDE + SDK_SIDE, [target, SERVER_DIR])


def test_installed_wheel_api_without_sdk_is_a_namespace(wheels: dict[str, Path], tmp_path: Path) -> None:
    if _sdk_in_site_packages():
        _not_here("the SDK is installed (not editable) in site-packages")
    target = _unpack([wheels["api"]], tmp_path / "site")
    _python(SERVER_SIDE + NAMESPACE_ONLY, [target, SERVER_DIR])
