"""Where each package declares its version, so that a release sets one version everywhere.

    python release/versions.py            # checks: every declared version equals VERSION
    python release/versions.py --set X.Y.Z   # writes X.Y.Z into VERSION and every place below

The Python distributions' modules read their version from their installed metadata
(cronoq.__version__, cronoq_server.__version__), the Rust crate from Cargo (CARGO_PKG_VERSION),
so only manifests, lock files, the Go and TypeScript constants and the SDKs' install lines in
their READMEs hold it. Go modules have no version in go.mod: their version is the tag
(sdk-go/vX.Y.Z), which must equal VERSION too.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION_FILE = "VERSION"
# X.Y.Z only: a pre-release is spelled differently on PyPI (0.2.0rc1) than on npm, crates.io and
# Go tags (0.2.0-rc.1), and the Python packages report the PyPI spelling.
VERSION_RE = re.compile(r"^\d+\.\d+\.\d+$")


def rust_crate_name(root: Path = ROOT) -> str:
    """The Rust crate's package name, from sdk-rust/Cargo.toml."""
    with open(root / "sdk-rust" / "Cargo.toml", "rb") as f:
        return str(tomllib.load(f)["package"]["name"])


@dataclass(frozen=True)
class Place:
    """Versions in one file: every match of `pattern`, whose group 1 is the version."""

    path: str
    pattern: str

    def regex(self, root: Path) -> re.Pattern[str]:
        return re.compile(self.pattern.replace("{crate}", re.escape(rust_crate_name(root))), re.MULTILINE)

    def read(self, root: Path) -> list[str]:
        return [match.group(1) for match in self.regex(root).finditer((root / self.path).read_text())]

    def write(self, root: Path, version: str) -> None:
        path = root / self.path
        text = path.read_text()
        matches = list(self.regex(root).finditer(text))
        if not matches:
            raise SystemExit(f"{self.path}: no version where /{self.pattern}/ expects one")
        for match in reversed(matches):  # from the end: earlier offsets stay valid
            text = text[: match.start(1)] + version + text[match.end(1) :]
        path.write_text(text)


PLACES = [
    Place("proto/python/pyproject.toml", r'^version = "([^"]*)"'),
    Place("sdk-python/pyproject.toml", r'^version = "([^"]*)"'),
    Place("sdk-python/pyproject.toml", r'"cronoq-api==([^"]*)"'),
    Place("server/pyproject.toml", r'^version = "([^"]*)"'),
    Place("server/pyproject.toml", r'"cronoq-api==([^"]*)"'),
    Place("sdk-ts/package.json", r'^  "version": "([^"]*)"'),
    Place("sdk-ts/package-lock.json", r'^  "version": "([^"]*)"'),
    Place("sdk-ts/package-lock.json", r'^    "": \{\n      "name": "[^"]*",\n      "version": "([^"]*)"'),
    Place("sdk-ts/src/version.ts", r'^export const VERSION = "([^"]*)"'),
    Place("sdk-rust/Cargo.toml", r'^version = "([^"]*)"'),
    Place("sdk-rust/Cargo.lock", r'^name = "{crate}"\nversion = "([^"]*)"'),
    Place("sdk-go/version.go", r'^const Version = "([^"]*)"'),
    # What the READMEs tell users to install.
    Place("sdk-rust/README.md", r'^{crate} = "([^"]*)"'),
    Place("sdk-rust/README.md", r'^{crate} = \{ version = "([^"]*)"'),
    Place("sdk-go/README.md", r"(?:@|sdk-go/)v(\d+\.\d+\.\d+)"),
    Place("sdk-ts/README.md", r"cronoq-(\d+\.\d+\.\d+)\.tgz"),
]


def contract_baseline(root: Path = ROOT) -> Path:
    """The last release's wire contract (proto/releases/vX.Y.Z.binpb, the newest), which
    `buf breaking` compares proto/ with."""
    images = list((root / "proto" / "releases").glob("v*.binpb"))
    if not images:
        raise SystemExit("proto/releases: no vX.Y.Z.binpb (the last release's `buf build`)")
    return max(images, key=lambda p: tuple(int(n) for n in p.name[1:].removesuffix(".binpb").split(".")))


def release_version(root: Path = ROOT) -> str:
    """The version of this checkout's release (the VERSION file)."""
    return (root / VERSION_FILE).read_text().strip()


def mismatches(root: Path = ROOT) -> list[str]:
    """Every place whose version is not VERSION's, as 'path: found X, VERSION says Y'."""
    want = release_version(root)
    problems = [] if VERSION_RE.fullmatch(want) else [f"{VERSION_FILE}: {want!r} is not X.Y.Z"]
    for place in PLACES:
        found = place.read(root)
        for wrong in [v for v in found if v != want] if found else [None]:
            problems.append(f"{place.path}: found {wrong!r} (/{place.pattern}/), {VERSION_FILE} says {want!r}")
    return problems


def set_version(version: str, root: Path = ROOT) -> None:
    """Writes `version` into VERSION and every place that declares it."""
    if not VERSION_RE.fullmatch(version):
        raise SystemExit(f"--set: {version!r} is not X.Y.Z")
    for place in PLACES:
        place.write(root, version)
    (root / VERSION_FILE).write_text(version + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", metavar="VERSION", help="write this version everywhere")
    args = ap.parse_args(argv)
    if args.set:
        set_version(args.set)
    problems = mismatches()
    for problem in problems:
        print(f"versions: {problem}", file=sys.stderr)
    if not problems:
        print(f"versions: every package declares {release_version()}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
