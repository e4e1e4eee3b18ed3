"""mkdocs hooks for rollstream's site (`hooks:` in mkdocs.yml), so that a bare `mkdocs build` or `mkdocs serve`
works from a checkout, with nothing to prepare first:

1. **The API reference reads the packages as installed.** `rollstream.schemas` is the folder `schemas/`, and so
   on (pyproject's `[tool.setuptools.package-dir]`); griffe, which reads the source without importing it,
   cannot follow that mapping. `on_config` lays the packages out under `build/docs-layout/rollstream/` as
   links, from that same table (a package added there is documented without touching this file), and
   mkdocstrings' `paths` points there. `make lint` builds mypy's tree the same way for the same reason.
2. **The README is a page of the site** (readme.md), its links rewritten from the repository root to docs/,
   so the strict build checks its links and anchors as it checks the pages'.
3. **Links to repository files outside docs/** (the test that proves a guarantee, `schemas/avro/`): the same
   links work on GitHub, and on the site they must too. A link whose target does not exist is left alone, so
   mkdocs' strict validation fails on it. One that exists goes to the repository browser when mkdocs.yml sets
   `repo_url`; without one (the site must work offline), a file is copied into the site under `repo/` and
   the link points at the copy, and a folder (or a Markdown file that is no page) is reduced to its text.
4. **The CLI reference is generated at every build**, never written by hand: a page's
   `<!-- cli-reference: MODULE:APP -->` line (docs/reference/cli.md has one) becomes the reference of every
   command of that typer app, written by docs/cli_reference.py from the command objects in a fresh
   interpreter (so `mkdocs serve` shows a changed command), before the page's links are checked.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

LAYOUT = Path("build", "docs-layout")  # relative to mkdocs.yml; mkdocstrings' `paths` names it too
COPIES = "repo"  # where, in the site, copies of repository files live (no repo_url)
README_PAGE = "readme.md"  # the README, as a page of the site (its links rewritten from docs/)
CLI_REFERENCE = Path(__file__).with_name("cli_reference.py")  # run as a script: the Markdown on stdout
CLI_TIMEOUT_S = 60.0

_CLI_MARKER = re.compile(r"^<!--\s*cli-reference:\s*(?P<app>[\w.]+:\w+)\s*-->[ \t]*$", re.M)

# A Markdown inline link or image: [text](target "title"). Fenced code is cut out before matching (_prose).
_LINK = re.compile(r"(?P<text>!?\[(?:[^\[\]]|\[[^\]]*\])*\])\((?P<target><[^>]*>|[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,}).*?^(?P=indent)(?P=fence)[ \t]*$", re.M | re.S)


@event_priority(100)  # before mkdocstrings' on_config, which looks for its `paths` (a fresh checkout has none)
def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Lay the installed package tree out as links, before mkdocstrings first reads it."""
    root = Path(config.config_file_path).parent
    _lay_out_packages(root, root / LAYOUT)
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the README as the page readme.md, and (without a repo_url) copies of the repository files linked to."""
    root = Path(config.config_file_path).parent
    readme = _rebase_readme((root / "README.md").read_text(encoding="utf-8"), root, config.docs_dir)
    files.append(File.generated(config, README_PAGE, content=readme))
    if config.repo_url:
        return files
    wanted: set[str] = set()
    for page_file in files.documentation_pages():
        markdown = page_file.content_string
        for _, rel, _ in _outside_links(markdown, page_file.src_uri, root, config.docs_dir):
            if _copied(root / rel):
                wanted.add(rel)
    for rel in sorted(wanted):
        files.append(File.generated(config, f"{COPIES}/{rel}", abs_src_path=str(root / rel)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Point each link to an existing repository file outside docs/ at the repository browser or at its copy."""
    root = Path(config.config_file_path).parent
    markdown = _CLI_MARKER.sub(lambda marker: _cli_reference(marker.group("app"), root), markdown)
    here = posixpath.dirname(page.file.src_uri) or "."
    replacements: list[tuple[re.Match[str], str]] = []
    for match, rel, anchor in _outside_links(markdown, page.file.src_uri, root, config.docs_dir):
        target = root / rel
        if not target.exists():
            continue  # left as written: mkdocs reports it, and the strict build fails
        if rel == "README.md":
            url = posixpath.relpath(README_PAGE, here) + anchor
        elif config.repo_url:
            kind = "tree" if target.is_dir() else "blob"
            url = f"{config.repo_url.rstrip('/')}/{kind}/main/{rel}{anchor}"
        elif _copied(target):
            url = posixpath.relpath(f"{COPIES}/{rel}", here) + anchor
        else:  # a folder, or a Markdown file that is no page of the site: its text, unlinked
            replacements.append((match, match.group("text")[1:-1]))
            continue
        replacements.append((match, f"{match.group('text')}({url}{match.group('title') or ''})"))
    return _replace(markdown, replacements)


def _cli_reference(app: str, root: Path) -> str:
    """The Markdown reference of the typer app MODULE:APP, from docs/cli_reference.py; its failure fails the build."""
    env = {**os.environ, "PYTHONUTF8": "1"}
    try:
        done = subprocess.run([sys.executable, str(CLI_REFERENCE), app], cwd=root, env=env, capture_output=True,
                              text=True, encoding="utf-8", timeout=CLI_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise PluginError(f"{CLI_REFERENCE.name} {app}: no output within {CLI_TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0 or not done.stdout.strip():
        raise PluginError(f"{CLI_REFERENCE.name} {app} failed (exit {done.returncode}):\n{done.stderr.strip()}")
    return done.stdout


def _copied(target: Path) -> bool:
    """Whether a repository file goes into the site as a copy (a .md file would become a page with its links)."""
    return target.is_file() and target.suffix != ".md"


def _rebase_readme(markdown: str, root: Path, docs_dir: str) -> str:
    """The README's relative links, written from the repository root, rewritten from the docs folder."""
    docs_rel = os.path.relpath(docs_dir, root)
    replacements = []
    for match in _LINK.finditer(_prose(markdown)):
        scheme, netloc, path, _, _ = urlsplit(match.group("target").strip("<>"))
        if scheme or netloc or not path or path.startswith("/"):
            continue
        rebased = posixpath.relpath(posixpath.normpath(path), docs_rel)
        target = match.group("target").replace(path, rebased, 1)
        replacements.append((match, f"{match.group('text')}({target}{match.group('title') or ''})"))
    return _replace(markdown, replacements)


def _replace(markdown: str, replacements: list[tuple[re.Match[str], str]]) -> str:
    for match, new in reversed(replacements):  # from the end, so earlier offsets stay valid
        markdown = markdown[: match.start()] + new + markdown[match.end() :]
    return markdown


def _lay_out_packages(root: Path, layout: Path) -> None:
    """build/docs-layout/<package path> as links to the folders pyproject's package-dir maps them from."""
    with open(root / "pyproject.toml", "rb") as f:
        package_dir: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(layout, ignore_errors=True)
    for package, folder in sorted(package_dir.items(), key=lambda item: item[0].count(".")):
        where = layout.joinpath(*package.split("."))
        source = (root / folder).resolve()
        if package.count(".") == 0:  # the top package: a real folder, so its mapped subpackages can sit in it
            where.mkdir(parents=True)
            for child in source.iterdir():
                if child.is_dir():
                    if child.name != "__pycache__":
                        os.symlink(child, where / child.name)
                else:  # copied: griffe resolves a linked __init__.py to rollstream/, which lacks the subpackages
                    shutil.copy2(child, where / child.name)
        else:
            os.symlink(source, where)


def _outside_links(markdown: str, src_uri: str, root: Path, docs_dir: str) -> list[tuple[re.Match[str], str, str]]:
    """(match, path from the repository root, #anchor) of each relative link in prose that leaves docs/."""
    docs_rel = os.path.relpath(docs_dir, root)
    found = []
    for match in _LINK.finditer(_prose(markdown)):
        target = match.group("target").strip("<>")
        scheme, netloc, path, _, anchor = urlsplit(target)
        if scheme or netloc or not path or path.startswith("/"):
            continue
        rel = posixpath.normpath(posixpath.join(docs_rel, posixpath.dirname(src_uri), path))
        if rel.startswith("../") or rel == docs_rel or rel.startswith(docs_rel + "/"):
            continue  # outside the repository, or a page mkdocs validates itself
        found.append((match, rel, f"#{anchor}" if anchor else ""))
    return found


def _prose(markdown: str) -> str:
    """The Markdown with fenced code blanked out (same length, so offsets still match)."""
    return _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), markdown)
