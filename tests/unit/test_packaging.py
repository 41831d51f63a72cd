"""Packaging: the server uses cronoq-api (proto/python: the generated cronoq.v1 and
cronoq.jsonform) and never the SDK. `cronoq` is a namespace shared by cronoq-api and the
SDK; importing the generated code must not load the SDK's client, worker or tenacity,
whichever of them is installed, editable or not. And the three wheels are what a user
installs: Apache-2.0 with its text, classifiers, project URLs, a readme and py.typed each;
installed into a fresh virtualenv outside the repository, `cronoq-server` and `cronoq` run."""

from __future__ import annotations

import email.message
import email.parser
import email.policy
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
import tomllib
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest
from ports import free_port  # type: ignore[import-not-found]
from preconditions import missing  # type: ignore[import-not-found]

REPO = Path(__file__).resolve().parents[2]
API_DIR = REPO / "proto" / "python"
SDK_DIR = REPO / "sdk-python"
SERVER_DIR = REPO / "server"
LICENSE = REPO / "LICENSE"
# The repository's address, as the Go module path (github.com/cronoq/cronoq/sdk-go) names it.
HOME = "https://github.com/cronoq/cronoq"
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


def _version(project: Path) -> str:
    with open(project / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def _pyproject_dependencies(project: Path) -> set[str]:
    with open(project / "pyproject.toml", "rb") as f:
        return _requirement_names(tomllib.load(f)["project"]["dependencies"])


def _sdk_in_site_packages() -> bool:
    return any(Path(site, "cronoq", "__init__.py").exists() for site in SITE_DIRS)


# -- dependencies ------------------------------------------------------------------


def test_server_depends_on_the_api_not_on_the_sdk() -> None:
    deps = _pyproject_dependencies(SERVER_DIR)
    assert "cronoq-api" in deps
    assert "cronoq-sdk" not in deps, "the server must not depend on the SDK (distribution 'cronoq-sdk')"


def test_installed_server_metadata_names_the_api_not_the_sdk() -> None:
    deps = _requirement_names(importlib.metadata.requires("cronoq-server") or [])
    assert "cronoq-api" in deps and "cronoq-sdk" not in deps


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
    return {"api": _wheel(API_DIR, tmp), "sdk": _wheel(SDK_DIR, tmp), "server": _wheel(SERVER_DIR, tmp)}


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


# -- the wheels' metadata and files ----------------------------------------------------

DISTRIBUTIONS = {"api": ("cronoq-api", API_DIR), "sdk": ("cronoq-sdk", SDK_DIR), "server": ("cronoq-server", SERVER_DIR)}


def _wheel_file(wheel: Path, suffix: str) -> bytes:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(suffix)]
        assert len(names) == 1, f"{wheel.name}: {len(names)} files end with {suffix!r}: {names}"
        return zf.read(names[0])


def _metadata(wheel: Path) -> email.message.Message:
    return email.parser.Parser(policy=email.policy.compat32).parsestr(
        _wheel_file(wheel, ".dist-info/METADATA").decode()
    )


def test_license_is_apache_2() -> None:
    text = LICENSE.read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text
    # Each distribution's folder links to it: license-files may not reach outside the folder.
    for _, project in DISTRIBUTIONS.values():
        assert (project / "LICENSE").read_bytes() == LICENSE.read_bytes(), project / "LICENSE"


@pytest.mark.parametrize("which", sorted(DISTRIBUTIONS))
def test_wheel_metadata(wheels: dict[str, Path], which: str) -> None:
    name, project = DISTRIBUTIONS[which]
    meta = _metadata(wheels[which])
    assert meta["Name"] == name
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    classifiers = meta.get_all("Classifier") or []
    assert {"Typing :: Typed", "Programming Language :: Python :: 3.11", "Development Status :: 3 - Alpha"} <= set(
        classifiers
    ), classifiers
    assert not [c for c in classifiers if c.startswith("License ::")], "the license is the SPDX expression alone"
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert set(urls) == {"Homepage", "Documentation", "Source", "Issues"}, urls
    assert all(u.startswith(HOME) for u in urls.values()), urls
    assert meta["Requires-Python"] == ">=3.11"
    assert meta["Description-Content-Type"] == "text/markdown"
    readme = (project / "README.md").read_text()
    assert str(meta.get_payload()).strip() == readme.strip()
    assert readme.startswith(f"# {name}") or (which == "sdk" and readme.startswith("# cronoq Python SDK"))


@pytest.mark.parametrize("which", sorted(DISTRIBUTIONS))
def test_wheel_carries_the_license(wheels: dict[str, Path], which: str) -> None:
    assert _wheel_file(wheels[which], ".dist-info/licenses/LICENSE") == LICENSE.read_bytes()


def test_wheels_are_typed(wheels: dict[str, Path]) -> None:
    """py.typed marks each typed package: cronoq (shared by cronoq-api and the SDK, which
    depends on it; one owner per installed file) and cronoq_server."""

    def names(which: str) -> set[str]:
        with zipfile.ZipFile(wheels[which]) as zf:
            return set(zf.namelist())

    assert "cronoq/py.typed" in names("api")
    assert "cronoq_server/py.typed" in names("server")
    assert "cronoq/py.typed" not in names("sdk")
    assert (SDK_DIR / "cronoq" / "py.typed").exists()  # for editable installs of the SDK alone
    assert _requirement_names(_metadata(wheels["sdk"]).get_all("Requires-Dist") or []) >= {"cronoq-api"}


def test_readmes_live_in_their_distributions() -> None:
    """setuptools reads `readme` from the project's folder only (a path outside is refused)."""
    for _, project in DISTRIBUTIONS.values():
        with open(project / "pyproject.toml", "rb") as f:
            assert tomllib.load(f)["project"]["readme"] == "README.md", project


# -- the wheels installed as a user installs them ---------------------------------------


def _uv() -> str:
    """uv (./dev installs it into .venv-dev): a fresh virtualenv and the wheels' dependencies
    from the package index, quickly (its cache)."""
    dev = REPO / ".venv-dev" / "bin" / "uv"
    found = shutil.which("uv") or (str(dev) if dev.exists() else None)
    if found is None:
        _not_here("uv not found (./dev installs it into .venv-dev)")
    return str(found)


def _outside_env() -> dict[str, str]:
    """This environment without what would point a process at the repository or this virtualenv."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix))
    return env


@pytest.fixture(scope="module")
def user_venv(wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv outside the repository with the three wheels (and their dependencies)."""
    uv = _uv()
    venv = tmp_path_factory.mktemp("user") / "venv"
    for cmd in (
        [uv, "venv", "--quiet", "--python", sys.executable, str(venv)],
        # --compile-bytecode: the commands below start without compiling (PYTHONDONTWRITEBYTECODE in the tests)
        [
            uv,
            "pip",
            "install",
            "--quiet",
            "--compile-bytecode",
            "--python",
            str(venv / "bin" / "python"),
            *map(str, wheels.values()),
            "trove-classifiers",  # PyPI's list of classifiers, for test_classifiers_are_pypis
        ],
    ):
        proc = subprocess.run(cmd, cwd=venv.parent, env=_outside_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return venv


def _run(venv: Path, *cmd: str, stdin: str | None = None) -> str:
    proc = subprocess.run(
        [str(venv / "bin" / cmd[0]), *cmd[1:]],
        input=stdin,
        cwd=venv.parent,
        env=_outside_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def test_installed_commands_run_outside_the_repository(user_venv: Path) -> None:
    assert "hash-token" in _run(user_venv, "cronoq-server", "--help")
    assert _run(user_venv, "cronoq-server", "--version").strip() == f"cronoq-server {_version(SERVER_DIR)}"
    digest = _run(user_venv, "cronoq-server", "hash-token", stdin="s3cret")
    assert digest == hashlib.sha256(b"s3cret").hexdigest() + "\n"
    help_text = _run(user_venv, "cronoq", "--help")
    for command in ("submit", "get", "wait", "cancel", "tasks", "watch", "workers", "schedules", "snapshot"):
        assert command in help_text, help_text
    assert _run(user_venv, "cronoq", "--version").strip() == f"cronoq {_version(SDK_DIR)}"


def test_installed_packages_are_the_wheels_typed_and_licensed(user_venv: Path) -> None:
    code = textwrap.dedent(
        """
        import importlib.metadata, json, pathlib
        import cronoq, cronoq.v1, cronoq_server
        out = {
            "files": [cronoq.__file__, cronoq.v1.__file__, cronoq_server.__file__],
            "typed": [str(pathlib.Path(p.__file__).parent / "py.typed") for p in (cronoq, cronoq_server)],
            "licenses": {d: importlib.metadata.metadata(d)["License-Expression"] for d in ("cronoq-sdk", "cronoq-api", "cronoq-server")},
        }
        print(json.dumps(out))
        """
    )
    out = json.loads(_run(user_venv, "python", "-c", code))
    for path in out["files"] + out["typed"]:
        assert Path(path).is_relative_to(user_venv) and Path(path).exists(), path
    assert out["licenses"] == dict.fromkeys(("cronoq-sdk", "cronoq-api", "cronoq-server"), "Apache-2.0")


def test_installed_server_and_cli_work_together(user_venv: Path, tmp_path: Path) -> None:
    """The main README's commands, from the fresh virtualenv: a server started with --config,
    then the CLI against it."""
    grpc_port, http_port = free_port(), free_port()
    config = tmp_path / "cronoq.toml"
    config.write_text(
        f'[server]\nlisten = "127.0.0.1:{grpc_port}"\nhttp_listen = "127.0.0.1:{http_port}"\n'
        f'[store]\npath = "{tmp_path / "cronoq.db"}"\n[[pools]]\nname = "default"\n'
    )
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen(
        [str(user_venv / "bin" / "cronoq-server"), "--config", str(config)],
        cwd=tmp_path, env=_outside_env(), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.1)
        endpoint = ["--endpoint", f"http://127.0.0.1:{grpc_port}"]
        submit = ["submit", "--pool", "default", "--payload-json", '{"n": 1}', "--key", "job-1"]
        _run(user_venv, "cronoq", *submit, *endpoint)
        assert '"key": "job-1"' in _run(user_venv, "cronoq", "get", "job-1", "--json", *endpoint)
        assert "default" in _run(user_venv, "cronoq", "snapshot", *endpoint)
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/ui/", timeout=5) as r:  # the dashboard's files
            assert r.status == 200
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def test_classifiers_are_pypis(wheels: dict[str, Path], user_venv: Path) -> None:
    """PyPI refuses an upload with a classifier it does not know."""
    ours = sorted({c for w in wheels.values() for c in _metadata(w).get_all("Classifier") or []})
    code = f"from trove_classifiers import classifiers; print([c for c in {ours!r} if c not in classifiers])"
    assert _run(user_venv, "python", "-c", code).strip() == "[]"
