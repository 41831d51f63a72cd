"""MkDocs hook: a link from a page to a file of the repository outside docs/ (../sdk-go/...,
../bench/README.md) becomes a link to that file in the repository, and must name a file that
exists: the build fails on one that does not, as strict mode fails on a broken page link.

The SDKs' API references (api/<sdk>/index.html) are built into the site after mkdocs by
`./dev docs`: the hook puts a placeholder page at each, so that strict mode checks the links to
them as links to any page (a link to another api/ path still fails)."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# A Markdown link or image whose target leaves docs/: ](../path) or ](../path#anchor).
LINK = re.compile(r"\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")
# The SDKs whose API reference noxfile.py's _docs builds into site/api/<sdk>/.
API_REFERENCES = ("python", "typescript", "rust", "go")


def on_files(files: Files, config: Any) -> Files:
    for sdk in API_REFERENCES:
        content = f"<!doctype html><title>cronoq {sdk} API reference</title><p>Built by <code>./dev docs</code>.</p>\n"
        files.append(File.generated(config, f"api/{sdk}/index.html", content=content))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    page_dir = (DOCS / page.file.src_path).parent
    blob = config["repo_url"].rstrip("/") + "/blob/main/"

    def repo_link(match: re.Match[str]) -> str:
        target = Path(posixpath.normpath(page_dir / match.group(1)))
        if not target.exists():
            raise PluginError(f"{page.file.src_path}: link to {match.group(1)}: no such file in the repository")
        return f"]({blob}{target.relative_to(ROOT).as_posix()}{match.group(2) or ''})"

    return LINK.sub(repo_link, markdown)
