"""The names a release publishes under, each checked against its registry: a name that another
project already holds there would make `pip install`, `npm install` or `cargo add` fetch that
project's package instead of ours.

A name is ours when the registry does not list it yet (the first upload takes it) or when what
the registry lists for it names our repository (a project URL, the repository field). A registry
that cannot be reached gives a warning, not a failure: the check is then left to the next run.

    python release/names.py      # prints one line a name; exits 1 when a name is another project's
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from versions import ROOT

PYTHON_PROJECTS = ["proto/python", "sdk-python", "server"]
REGISTRY_TIMEOUT_S = 60.0


class Unreachable(Exception):
    """The registry gave no answer about the name (no network, a time-out, a server error)."""


@dataclass(frozen=True)
class Listing:
    """What a registry shows for a name that it holds: every URL it gives, and the summary."""

    urls: list[str]
    summary: str


@dataclass(frozen=True)
class Published:
    """One name a release publishes: where, from which manifest, and the repository it declares."""

    registry: str
    name: str
    manifest: str
    repository: str


def published(root: Path = ROOT) -> list[Published]:
    """Every name this checkout publishes, with the repository each manifest declares."""
    names = []
    for project in PYTHON_PROJECTS:
        manifest = f"{project}/pyproject.toml"
        meta = tomllib.loads((root / manifest).read_text())["project"]
        names.append(Published("PyPI", meta["name"], manifest, meta["urls"]["Source"]))
    package = json.loads((root / "sdk-ts" / "package.json").read_text())
    names.append(Published("npm", package["name"], "sdk-ts/package.json", package["repository"]["url"]))
    crate = tomllib.loads((root / "sdk-rust" / "Cargo.toml").read_text())["package"]
    names.append(Published("crates.io", crate["name"], "sdk-rust/Cargo.toml", crate["repository"]))
    go_mod = re.search(r"^module (\S+)$", (root / "sdk-go" / "go.mod").read_text(), re.MULTILINE)
    if go_mod is None:
        raise SystemExit("sdk-go/go.mod has no module line")
    names.append(Published("Go", go_mod.group(1), "sdk-go/go.mod", crate["repository"]))
    return names


def repository_key(url: str) -> str:
    """host/owner/name of a repository URL, however spelled (git+https://…/x.git, a /tree/… page)."""
    bare = re.sub(r"^(git\+)?[a-z]+://(git@)?|^git@", "", url.strip().lower())
    bare = re.sub(r"^([^/:]+):(?!\d)", r"\1/", bare)  # git@host:owner/name, not host:port
    parts = [p for p in bare.split("/") if p][:3]
    return "/".join(parts).removesuffix(".git")


def pypi_listing(name: str) -> Listing | None:
    """PyPI's JSON API: the project's URLs and summary, or None when PyPI has no such project."""
    try:
        with urllib.request.urlopen(f"https://pypi.org/pypi/{name}/json", timeout=REGISTRY_TIMEOUT_S) as reply:
            info = json.load(reply)["info"]
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return None
        raise Unreachable(f"PyPI answered {err.code}") from None
    except (OSError, ValueError) as err:
        raise Unreachable(str(err)) from None
    urls = [info.get("home_page"), info.get("download_url"), *(info.get("project_urls") or {}).values()]
    return Listing([u for u in urls if u], info.get("summary") or "")


def _client(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """A registry's own client, outside any project (cargo would read a Cargo.toml around it)."""
    with tempfile.TemporaryDirectory() as outside:
        try:
            return subprocess.run(cmd, cwd=outside, capture_output=True, text=True, timeout=REGISTRY_TIMEOUT_S)
        except FileNotFoundError:
            raise Unreachable(f"no {cmd[0]} here") from None
        except subprocess.TimeoutExpired:
            raise Unreachable(f"{' '.join(cmd)}: no answer within {REGISTRY_TIMEOUT_S:.0f}s") from None


def npm_listing(name: str) -> Listing | None:
    """`npm view NAME --json`: the package's repository and homepage, or None on E404."""
    done = _client(["npm", "view", name, "name", "description", "repository", "homepage", "--json"])
    try:
        answer = json.loads(done.stdout or "{}")
    except ValueError:
        raise Unreachable(done.stderr.strip()[-300:]) from None
    if done.returncode != 0:
        if answer.get("error", {}).get("code") == "E404":
            return None
        raise Unreachable(str(answer.get("error", {}).get("summary") or done.stderr.strip()[-300:]))
    repository = answer.get("repository")
    urls = [repository.get("url") if isinstance(repository, dict) else repository, answer.get("homepage")]
    return Listing([u for u in urls if u], answer.get("description") or "")


def go_listing(path: str) -> Listing:
    """A Go module is served from the repository its path names: no registry holds the name."""
    return Listing([f"https://{path}"], "the module path names its repository")


def crates_listing(name: str) -> Listing | None:
    """`cargo info NAME`: the crate's repository, homepage and documentation, or None when
    crates.io has no such crate."""
    done = _client(["cargo", "info", name])
    if done.returncode != 0:
        if "could not find" in done.stderr:
            return None
        raise Unreachable(done.stderr.strip()[-300:])
    fields = dict(re.findall(r"^(repository|homepage|documentation): (\S+)$", done.stdout, re.MULTILINE))
    lines = done.stdout.splitlines()
    return Listing(list(fields.values()), lines[1] if len(lines) > 1 else "")


LISTINGS: dict[str, Callable[[str], Listing | None]] = {
    "PyPI": pypi_listing,
    "npm": npm_listing,
    "crates.io": crates_listing,
    "Go": go_listing,
}


def check(names: list[Published], listings: dict[str, Callable[[str], Listing | None]] = LISTINGS) -> list[str]:
    """Prints a line a name; returns one line for each name another project holds."""
    taken = []
    for pub in names:
        where = f"{pub.registry} {pub.name!r} ({pub.manifest})"
        try:
            listing = listings[pub.registry](pub.name)
        except Unreachable as err:
            print(f"    WARNING: {where}: cannot ask {pub.registry} ({err}); not checked", flush=True)
            continue
        if listing is None:
            print(f"    {where}: free (the first upload takes it)", flush=True)
        elif repository_key(pub.repository) in {repository_key(u) for u in listing.urls}:
            print(f"    {where}: ours ({pub.repository})", flush=True)
        else:
            shown = ", ".join(sorted({repository_key(u) for u in listing.urls})) or "no repository given"
            taken.append(
                f"{where} is another project's on {pub.registry} ({shown}: {listing.summary!r}); "
                f"rename it in {pub.manifest}"
            )
    return taken


def main() -> int:
    taken = check(published())
    for line in taken:
        print(f"names: {line}", file=sys.stderr)
    return 1 if taken else 0


if __name__ == "__main__":
    sys.exit(main())
