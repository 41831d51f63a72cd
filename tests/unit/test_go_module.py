"""The Go SDK's module (sdk-go/go.mod) and what sdk-go/README.md tells its users: the minimum Go
is go.mod's `go` directive, which is also the oldest Go that `./dev tests` builds and tests the
SDK with (noxfile `_go_checks` reads it from go.mod); releases are tags prefixed with the
module's directory, as the go command resolves a module in a subdirectory of its repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GO_MOD = ROOT / "sdk-go" / "go.mod"
README = ROOT / "sdk-go" / "README.md"
# The repository's import path on its forge: the go command finds the module's tags there.
REPOSITORY = "github.com/cronoq/cronoq"


def go_mod(directive: str) -> str:
    found = re.search(rf"^{directive} (\S+)$", GO_MOD.read_text(), re.MULTILINE)
    assert found, f"sdk-go/go.mod has no `{directive}` line"
    return found.group(1)


def test_go_directive_names_a_release_the_old_go_run_can_fetch() -> None:
    # GOTOOLCHAIN=go1.25.0 is a release the module proxy serves; `go 1.25` names a language version.
    assert re.fullmatch(r"1\.\d+\.\d+", go_mod("go")), f"write `go {go_mod('go')}.0` (as `go mod tidy` does)"


def test_readme_states_the_go_directive_as_the_minimum_go() -> None:
    minimum = go_mod("go").removesuffix(".0")
    stated = re.findall(r"\bGo (\d+\.\d+(?:\.\d+)?) or later\b", README.read_text())
    assert stated == [minimum], f"sdk-go/README.md says Go {stated} or later, go.mod's directive is {go_mod('go')}"


def test_readme_documents_the_tag_scheme_of_the_module_directory() -> None:
    directory = GO_MOD.parent.relative_to(ROOT).as_posix()
    module = go_mod("module")
    assert module == f"{REPOSITORY}/{directory}", f"module path {module} does not match the layout ({directory}/)"
    text = " ".join(README.read_text().split())
    assert f"tags `{directory}/vX.Y.Z`" in text
    version = (ROOT / "VERSION").read_text().strip()  # the README's example is the current release
    assert f"`go get {module}@v{version}` resolves the tag `{directory}/v{version}`" in text
    assert f"go get {module}@latest" in text
