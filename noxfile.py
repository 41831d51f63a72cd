"""Every job of the repository is a nox session: demo, tests, conformance, mutants, proto, lint, release,
bench.

Run them through ./dev (which installs nox itself), e.g. `./dev demo`, `./dev tests`.
"""

from __future__ import annotations

import filecmp
import html
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT / "release"))
from versions import contract_baseline  # noqa: E402  # the last release's protos, for buf breaking

PROTO_FILES = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
# The distribution cronoq-api (proto/python): the generated cronoq.v1 and cronoq.jsonform,
# shared by the server and the SDK; `cronoq` is a namespace the SDK's __init__ joins.
PY_API = ROOT / "proto" / "python"
PY_GENERATED = PY_API / "cronoq" / "v1"
# Pinned so that generated code is reproducible byte for byte.
PROTO_TOOLS = ["grpcio-tools==1.85.1", "mypy-protobuf==5.1.0"]
# The Go SDK's generated package; its plugins are pinned as tools in sdk-go/go.mod and run
# by buf with buf.gen.go.yaml (clean: stale files go).
GO_SDK = ROOT / "sdk-go"
GO_GENERATED = GO_SDK / "gen" / "cronoq" / "v1"
# The TypeScript SDK's generated code (cronoq/v1 and the google/protobuf types it uses), by buf
# with buf.gen.ts.yaml and the ts-proto plugin pinned in sdk-ts/package.json.
TS_SDK = ROOT / "sdk-ts"
TS_GENERATED = TS_SDK / "src" / "gen"
TS_TESTS = sorted(str(p.relative_to(TS_SDK)) for p in (TS_SDK / "test").glob("*.test.ts"))
# The Rust SDK generates its code in build.rs (protox): nothing generated is committed, but the
# protos it compiles (and those they import) are copied into the crate, so that it packages alone.
RUST_MANIFEST = ROOT / "sdk-rust" / "Cargo.toml"
RUST_PROTO = ROOT / "sdk-rust" / "proto"
OPENAPI = ROOT / "docs" / "openapi.json"
RUST_PROTO_FILES = [
    f"cronoq/v1/{name}.proto"
    for name in ("admin_service", "options", "schedule_service", "task", "task_service", "worker_service")
]
# cronoq-api first: the SDK and the server depend on it (uv takes it from here, not an index).
PACKAGES = ["-e", "proto/python", "-e", "sdk-python[otel]", "-e", "server[otel]"]
TEST_DEPS = [
    "pytest>=8",
    "pytest-asyncio>=0.23",
    "pytest-timeout>=2.3",
    "pytest-xdist>=3.5",
    "trustme>=1.1",
    "opentelemetry-sdk>=1.27",  # the SDK's tracing tests: a tracer provider with an in-memory exporter
    "psycopg[binary]>=3.1",  # cronoq.outbox with psycopg connections (tests/integration/test_outbox.py)
    "setuptools>=68",
    "playwright==1.65.2",  # drives Debian's chromium 156 (executable_path) in the browser tests: a known pair
    "openapi-spec-validator>=0.7",  # the OpenAPI document (tests/unit/test_openapi.py)
    "openapi-core>=0.19",  # every HTTP exchange of the integration tests against it (tests/openapi_check.py)
    "openapi-python-client>=0.21",  # a client generated from it (tests/integration/test_openapi.py)
]


def _generate_python(session: nox.Session, out: Path) -> None:
    session.run(
        "python",
        "-m",
        "grpc_tools.protoc",
        "-I",
        "proto",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out=quiet:{out}",
        f"--mypy_grpc_out=quiet:{out}",
        *PROTO_FILES,
        silent=True,
    )
    (out / "cronoq" / "v1" / "__init__.py").write_text(
        '"""Generated from proto/cronoq/v1 by `nox -s proto`; do not edit."""\n'
    )


def _buf(session: nox.Session, *args: str) -> None:
    if not (ROOT / "node_modules" / ".bin" / "buf").exists():
        session.run("npm", "ci", "--no-audit", "--no-fund", external=True)
    session.run(str(ROOT / "node_modules" / ".bin" / "buf"), *args, external=True)


def _buf_breaking(session: nox.Session) -> None:
    """buf breaking (buf.yaml's FILE rules) against the last release's protos: the contract only grows."""
    _buf(session, "breaking", "--against", str(contract_baseline()))


def _generate_go(session: nox.Session, out: Path) -> None:
    """The Go SDK's generated code into out (as sdk-go/gen/cronoq/v1 holds it)."""
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "buf.gen.yaml"
        template.write_text((ROOT / "buf.gen.go.yaml").read_text().replace("out: sdk-go/gen", f"out: {tmp}/gen"))
        _buf(session, "generate", "--template", str(template))
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(Path(tmp) / "gen" / "cronoq" / "v1", out)


def _npm_ci_ts(session: nox.Session) -> None:
    """Installs the TypeScript SDK's locked dependencies (its tsc, tsx, ts-proto and TypeDoc) once."""
    if not all((TS_SDK / "node_modules" / ".bin" / tool).exists() for tool in ("protoc-gen-ts_proto", "typedoc")):
        session.run("npm", "--prefix", str(TS_SDK), "ci", "--no-audit", "--no-fund", external=True)


def _generate_ts(session: nox.Session, out: Path) -> None:
    """The TypeScript SDK's generated code into out (as sdk-ts/src/gen holds it)."""
    _npm_ci_ts(session)
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "buf.gen.yaml"
        template.write_text((ROOT / "buf.gen.ts.yaml").read_text().replace("out: sdk-ts/src/gen", f"out: {tmp}/gen"))
        _buf(session, "generate", "--template", str(template))
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(Path(tmp) / "gen", out)


def _copy_rust_protos(out: Path) -> None:
    """The Rust crate's protos into out (as sdk-rust/proto holds them)."""
    shutil.rmtree(out, ignore_errors=True)
    for name in RUST_PROTO_FILES:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / "proto" / name, out / name)


def _tree_diff(left: Path, right: Path) -> list[str]:
    """Files that differ between two trees, or are in one only (relative paths)."""
    names = {p.relative_to(left) for p in left.rglob("*") if p.is_file()}
    names |= {p.relative_to(right) for p in right.rglob("*") if p.is_file()}
    return sorted(
        str(n)
        for n in names
        if not ((left / n).is_file() and (right / n).is_file() and filecmp.cmp(left / n, right / n, shallow=False))
    )


@nox.session
def proto(session: nox.Session) -> None:
    """Lints the protos (buf), checks them against the last release's (buf breaking),
    regenerates the committed Python, Go and TypeScript code and copies the Rust crate's
    protos (clean: stale files go)."""
    session.install(*PROTO_TOOLS)
    _buf(session, "lint")
    _buf_breaking(session)
    with tempfile.TemporaryDirectory() as tmp:
        _generate_python(session, Path(tmp))
        shutil.rmtree(PY_GENERATED, ignore_errors=True)
        shutil.copytree(Path(tmp) / "cronoq" / "v1", PY_GENERATED)
    session.log(f"generated {PY_GENERATED.relative_to(ROOT)}")
    _generate_go(session, GO_GENERATED)
    session.log(f"generated {GO_GENERATED.relative_to(ROOT)}")
    _generate_ts(session, TS_GENERATED)
    session.log(f"generated {TS_GENERATED.relative_to(ROOT)}")
    _copy_rust_protos(RUST_PROTO)
    session.log(f"copied {RUST_PROTO.relative_to(ROOT)}")
    # The HTTP API's OpenAPI document, built from the protos' rules as the server builds its
    # routes (tests/unit/test_openapi.py fails when it is stale).
    session.install(*PACKAGES)
    session.run("python", "-m", "cronoq_server.api.openapi", str(OPENAPI))
    session.log(f"generated {OPENAPI.relative_to(ROOT)}")


def check_generated(session: nox.Session) -> None:
    """Fails when regenerating the protos would change the committed code."""
    session.install(*PROTO_TOOLS)
    _buf(session, "lint")
    _buf_breaking(session)
    with tempfile.TemporaryDirectory() as tmp:
        _generate_python(session, Path(tmp))
        cmp = filecmp.dircmp(Path(tmp) / "cronoq" / "v1", PY_GENERATED, ignore=["__pycache__"])
        stale = cmp.left_only + cmp.right_only + cmp.diff_files
        _generate_go(session, Path(tmp) / "go")
        cmp = filecmp.dircmp(Path(tmp) / "go", GO_GENERATED)
        stale += [f"sdk-go: {name}" for name in cmp.left_only + cmp.right_only + cmp.diff_files]
        _generate_ts(session, Path(tmp) / "ts")
        stale += [f"sdk-ts: {name}" for name in _tree_diff(Path(tmp) / "ts", TS_GENERATED)]
        _copy_rust_protos(Path(tmp) / "rust")
        stale += [f"sdk-rust: {name}" for name in _tree_diff(Path(tmp) / "rust", RUST_PROTO)]
        if stale:
            session.error(f"generated code is stale ({', '.join(sorted(stale))}): run `./dev proto` and commit")
    session.log(
        f"generated code is up to date; buf lint passed; buf breaking against {contract_baseline().name} passed"
    )


@nox.session
def tests(session: nox.Session) -> None:
    """Every test: generated-code check, buf lint, unit, store and integration tests; without
    arguments also the Go SDK's vet and unit tests, the TypeScript SDK's strict type check and
    unit tests, the Rust SDK's tests, clippy and rustfmt check, the conformance corpus, the
    mutation check of the security-critical lines and the documentation site (strict)."""
    session.install(*PACKAGES, *TEST_DEPS)
    check_generated(session)
    args = session.posargs or ["-n", "2", "--dist", "loadfile"]
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    if not session.posargs:  # the browser tests retake the docs' screenshots of the dashboard
        env["CRONOQ_DOCS_IMAGES"] = str(ROOT / "docs" / "images")
    session.run("pytest", *args, env=env)
    if not session.posargs:  # the whole suite: the SDKs' own checks, the conformance corpus with every driver
        _go_checks(session)
        _ts_checks(session)
        _rust_checks(session)
        _conformance(session, [])
        session.run("python", "tests/mutants.py", "--no-baseline", "--if-clean")  # their tests just passed
        _docs(session)


def _go_checks(session: nox.Session) -> None:
    """go vet and the Go SDK's unit tests (in sdk-go) with the current Go; then vet, the build of
    every package (the conformance driver's too) and the unit tests again with the oldest Go that
    sdk-go/go.mod's `go` directive admits, read from go.mod so the two cannot drift apart (the go
    command fetches that toolchain through the module proxy; the conformance corpus runs once)."""
    session.run("go", "-C", str(GO_SDK), "vet", "./...", external=True)
    session.run("go", "-C", str(GO_SDK), "test", "./...", external=True)
    go_mod = session.run("go", "-C", str(GO_SDK), "mod", "edit", "-json", external=True, silent=True, stderr=None)
    directive = json.loads(str(go_mod))["Go"]
    oldest = {"GOTOOLCHAIN": f"go{directive}"}
    session.run("go", "-C", str(GO_SDK), "version", external=True, env=oldest)
    for command in (["vet", "./..."], ["build", "./..."], ["test", "./..."]):
        session.run("go", "-C", str(GO_SDK), *command, external=True, env=oldest)


def _ts_checks(session: nox.Session) -> None:
    """The TypeScript SDK: its locked dependencies (npm ci), tsc --noEmit (strict), its unit tests."""
    session.run("npm", "--prefix", str(TS_SDK), "ci", "--no-audit", "--no-fund", external=True)
    session.run(str(TS_SDK / "node_modules" / ".bin" / "tsc"), "-p", str(TS_SDK), "--noEmit", external=True)
    with session.chdir(TS_SDK):
        session.run("node", "--import", "tsx", "--test", *TS_TESTS, external=True)


def _rust_checks(session: nox.Session) -> None:
    """The Rust SDK (sdk-rust, its Cargo.lock): cargo test, clippy with warnings as errors, rustfmt,
    rustdoc with warnings as errors."""
    manifest = ["--manifest-path", str(RUST_MANIFEST)]
    session.run("cargo", "test", "--locked", *manifest, external=True)
    session.run("cargo", "test", "--locked", *manifest, "--features", "otel", external=True)
    session.run("cargo", "clippy", "--locked", *manifest, "--all-targets", "--", "-D", "warnings", external=True)
    clippy_otel = ["--all-targets", "--features", "otel,outbox", "--", "-D", "warnings"]  # the conformance driver's
    session.run("cargo", "clippy", "--locked", *manifest, *clippy_otel, external=True)
    session.run("cargo", "fmt", *manifest, "--check", external=True)
    _rust_doc(session)  # the docs.rs build (default features)


def _rust_doc(session: nox.Session, *args: str) -> None:
    """rustdoc of the Rust SDK into sdk-rust/target/doc: broken intra-doc links and stray HTML in doc
    comments fail it."""
    manifest = ["--manifest-path", str(RUST_MANIFEST)]
    session.run(
        "cargo", "doc", "--locked", *manifest, "--no-deps", *args, external=True, env={"RUSTDOCFLAGS": "-D warnings"}
    )


DOCS_TOOLS = ["mkdocs==1.6.1", "mkdocs-material==9.8.2", "pdoc==16.0.0"]
SITE = ROOT / "site"
# Each SDK's API reference, built after the mkdocs site into SITE / "api" / <sdk> (the hook
# docs/_hooks/repo_links.py holds the same names for the site's links to them).
API_SITE = SITE / "api"


def _docs(session: nox.Session) -> None:
    """The documentation site from docs/ (mkdocs.yml), in strict mode: a broken link or anchor,
    a page missing from the navigation or a link to a repository file that does not exist
    fails it. Then each SDK's API reference by the language's own tool, warnings as errors, into
    site/api/<sdk>/: pdoc, TypeDoc, rustdoc, and go doc with a check that every exported Go
    identifier has a doc comment."""
    session.install(*PACKAGES, *DOCS_TOOLS)
    session.run("mkdocs", "build", "--strict", "--site-dir", str(SITE), env={"NO_MKDOCS_2_WARNING": "1"})
    for sdk, build in (("python", _api_python), ("typescript", _api_typescript), ("rust", _api_rust), ("go", _api_go)):
        out = API_SITE / sdk
        shutil.rmtree(out, ignore_errors=True)  # mkdocs' placeholder page
        build(session, out)
        session.log(f"API reference: {(out / 'index.html').relative_to(ROOT)}")


def _api_python(session: nox.Session, out: Path) -> None:
    """pdoc of the package's public API: `cronoq` (its __all__) and `cronoq.outbox`."""
    # pdoc reports what it cannot render (an import that fails, a docstring it cannot parse) as warnings.
    args = ["--docformat", "markdown", "--output-directory", str(out), "cronoq", "cronoq.outbox"]
    session.run("python", "-W", "error", "-m", "pdoc", *args, env={"PYTHONDONTWRITEBYTECODE": "1"})


def _api_typescript(session: nox.Session, out: Path) -> None:
    """TypeDoc (sdk-ts/typedoc.json: warnings as errors) of the sources of package.json's "exports"."""
    _npm_ci_ts(session)
    exports = json.loads((TS_SDK / "package.json").read_text())["exports"]
    # ./dist/X.d.ts is tsc's output of src/X.ts (tsconfig.build.json)
    sources = [
        str(Path("src", Path(e["types"]).relative_to("dist"))).removesuffix(".d.ts") + ".ts" for e in exports.values()
    ]
    with session.chdir(TS_SDK):
        session.run(str(TS_SDK / "node_modules" / ".bin" / "typedoc"), "--out", str(out), *sources, external=True)


def _api_rust(session: nox.Session, out: Path) -> None:
    """rustdoc of the crate with every feature (the outbox and OpenTelemetry APIs too)."""
    _rust_doc(session, "--all-features")
    shutil.copytree(RUST_MANIFEST.parent / "target" / "doc", out)
    (out / "index.html").write_text(
        '<!doctype html><meta charset="utf-8"><meta http-equiv="refresh" content="0; url=cronoq/index.html">'
        '<title>cronoq (Rust SDK)</title><a href="cronoq/index.html">cronoq</a>\n'
    )


def _api_go(session: nox.Session, out: Path) -> None:
    """`go doc -all` of each importable package of sdk-go (not main, not internal) as one page; fails
    when an exported identifier of theirs has no doc comment (sdk-go/internal/doccheck)."""
    listed = session.run(
        "go",
        "-C",
        str(GO_SDK),
        "list",
        "-f",
        "{{.Name}} {{.ImportPath}} {{.Dir}}",
        "./...",
        external=True,
        silent=True,
        stderr=None,
    )
    packages = [line.split(" ", 2)[1:] for line in str(listed).splitlines() if not line.startswith("main ")]
    packages = [(path, directory) for path, directory in packages if "/internal/" not in path + "/"]
    session.run("go", "-C", str(GO_SDK), "run", "./internal/doccheck", *(d for _, d in packages), external=True)
    sections = []
    for path, _ in packages:
        text = session.run("go", "-C", str(GO_SDK), "doc", "-all", path, external=True, silent=True, stderr=None)
        sections.append(f'<h2 id="{html.escape(path)}">{html.escape(path)}</h2>\n<pre>{html.escape(str(text))}</pre>')
    toc = "".join(f'<li><a href="#{html.escape(p)}">{html.escape(p)}</a></li>' for p, _ in packages)
    out.mkdir(parents=True)
    (out / "index.html").write_text(
        '<!doctype html>\n<html lang="en"><meta charset="utf-8"><title>cronoq (Go SDK): go doc -all</title>\n'
        f"<h1>cronoq Go SDK: <code>go doc -all</code></h1>\n<ul>{toc}</ul>\n" + "\n".join(sections) + "\n</html>\n"
    )


@nox.session
def docs(session: nox.Session) -> None:
    """Builds the documentation site into site/ (strict: any warning fails); also run by `./dev tests`."""
    _docs(session)


def _conformance(session: nox.Session, args: list[str]) -> None:
    session.run("python", "conformance/runner.py", *args, env={"PYTHONDONTWRITEBYTECODE": "1"})


@nox.session
def conformance(session: nox.Session) -> None:
    """The conformance corpus against every SDK's driver (`-- --sdk python`: one SDK;
    `-- --case NAME --verbose`: one case, with what the driver and the servers saw)."""
    session.install(*PACKAGES, *TEST_DEPS)
    _conformance(session, session.posargs)


@nox.session
def mutants(session: nox.Session) -> None:
    """The mutation check of the security-critical lines (tests/mutants.toml), also run by
    `tests`: each one-line mutant must fail the tests it names (`-- NAME...`: these only;
    `-- --list`)."""
    session.install(*PACKAGES, *TEST_DEPS)
    session.run("python", "tests/mutants.py", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """buf lint, buf breaking against the last release, ruff and mypy."""
    session.install(*PACKAGES, "ruff>=0.6", "mypy>=1.10", "types-protobuf", "grpc-stubs", *TEST_DEPS)
    _buf(session, "lint")
    _buf_breaking(session)
    session.run(
        "ruff",
        "check",
        "server",
        "sdk-python",
        "proto/python",
        "tests",
        "bench",
        "conformance",
        "release",
        "noxfile.py",
    )
    # `cronoq` spans sdk-python/ and proto/python/: module names come from these bases, so
    # that cronoq.jsonform and the generated stubs are checked (not silenced as installed code).
    bases = os.pathsep.join(str(ROOT / d) for d in ("proto/python", "sdk-python", "server"))
    session.run(
        "mypy",
        "--explicit-package-bases",
        "server/cronoq_server",
        "sdk-python/cronoq",
        "proto/python/cronoq",
        env={"MYPYPATH": bases},
    )


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: an embedded server on SQLite, a worker, tasks flowing (`-- --sharded`: two
    shards, calls forwarded between them, workers redirected to their shard)."""
    session.install(*PACKAGES)
    # SIGTERM to ./dev (nox) as Ctrl-C: nox then passes SIGTERM on to the demo, and waits while
    # the demo stops its servers and workers (nox's default is a SIGKILL after 0.2 s).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    session.run("python", "examples/demo.py", *session.posargs, terminate_timeout=90)


@nox.session
def release(session: nox.Session) -> None:
    """`-- --dry-run [--only STEPS] [--keep]`: builds every artifact into dist/ and proves each
    installs and runs outside the repository (release/dry_run.py); `-- --set-version X.Y.Z`:
    writes one version into VERSION and every package (release/versions.py). Publishing is by
    hand (release/README.md)."""
    args = session.posargs
    if args[:1] == ["--dry-run"]:
        _npm_ci_ts(session)  # npm pack builds the TypeScript SDK with its own tsc (prepack)
        session.run("python", "release/dry_run.py", *args[1:], env={"PYTHONDONTWRITEBYTECODE": "1"})
    elif args[:1] == ["--set-version"] and len(args) == 2:
        session.run("python", "release/versions.py", "--set", args[1])
    else:
        session.error("usage: ./dev release --dry-run [--only python,npm,rust,go] [--keep] | --set-version X.Y.Z")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: burn-down, submit→start latency, two shards, an open dashboard (never run as tests)."""
    session.install(*PACKAGES, "py-spy", "trustme>=1.1", "playwright==1.65.2")
    session.run("python", "bench/run_all.py", *session.posargs, env={"PYTHONDONTWRITEBYTECODE": "1"})


if os.environ.get("CI"):
    nox.options.error_on_missing_interpreters = True
