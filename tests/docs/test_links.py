"""The README's and docs/' links and commands point at things that exist (issue 30: docs that cannot rot).

- Every relative link resolves to a file or folder of the repository, and its #anchor to a heading (GitHub's
  slug) or an HTML anchor of the target. This covers what the strict mkdocs build cannot see: the README's
  links on GitHub, and links from any page to tests/..., schemas/... (the site copies or unlinks those).
- Every `rollstream ...` line of a shell block names a real command of the CLI, and only options it has.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import typer

from tests.docs._markdown import ROOT, anchors, code_blocks, doc_files, links, where

SHELL = ("bash", "sh", "shell", "console", "zsh")


@pytest.mark.parametrize("path", doc_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for link in links(path):
        scheme, netloc, target, _, anchor = urlsplit(link.target)
        if scheme or netloc:
            continue  # a web address: not checked (no network in tests)
        if target.startswith("/"):
            broken.append(f"{link.where}: {link.target}: absolute path (breaks on GitHub and on the site)")
            continue
        resolved = (path.parent / unquote(target)).resolve() if target else path
        if not resolved.exists():
            broken.append(f"{link.where}: {link.target}: no such file or folder")
        elif not resolved.is_relative_to(ROOT):
            broken.append(f"{link.where}: {link.target}: outside the repository")
        elif anchor and resolved.suffix == ".md" and unquote(anchor) not in anchors(resolved):
            broken.append(f"{link.where}: {link.target}: {resolved.relative_to(ROOT)} has no heading #{anchor}")
    if broken:
        pytest.fail("broken links:\n" + "\n".join(broken), pytrace=False)


def _cli() -> Any:
    """The CLI as its command tree (typer's own click: nodes with .commands (groups), .params and .name)."""
    from rollstream.cli import app

    return typer.main.get_command(app)


@pytest.mark.parametrize("path", doc_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_shell_lines_name_real_commands(path: Path) -> None:
    cli = _cli()
    wrong = []
    for block in code_blocks(path):
        if block.language not in SHELL:
            continue
        for line, words in _commands(block.source):
            problem = _check(cli, words)
            if problem:
                wrong.append(f"{where(path, block.line + line)}: {' '.join(words)}: {problem}")
    if wrong:
        pytest.fail("commands the CLI does not have:\n" + "\n".join(wrong), pytrace=False)


def _commands(source: str) -> list[tuple[int, list[str]]]:
    """(line in the block, words after `rollstream`) of each rollstream command, continuation lines joined."""
    found = []
    logical, first = "", 0
    for n, raw in enumerate(source.splitlines(), 1):
        text = raw.strip().removeprefix("$ ")
        if not logical:
            first = n
        if text.endswith("\\"):
            logical += text[:-1] + " "
            continue
        logical += text
        try:
            words = shlex.split(logical, comments=True)
        except ValueError:  # an unbalanced quote: not a command line this test understands
            words = []
        logical = ""
        for segment in _segments(words):
            if segment and Path(segment[0]).name == "rollstream":
                found.append((first, segment[1:]))
            elif segment[:3] in (["python", "-m", "rollstream"], ["python3", "-m", "rollstream"]):
                found.append((first, segment[3:]))
    return found


def _segments(words: list[str]) -> list[list[str]]:
    """The commands of a line split at ; && || | &, with leading VAR=value assignments dropped."""
    segments: list[list[str]] = [[]]
    for word in words:
        if word in (";", "&&", "||", "|", "&"):
            segments.append([])
        elif segments[-1] or "=" not in word or word.startswith("-"):
            segments[-1].append(word)
    return segments


def _check(group: Any, words: list[str]) -> str | None:
    """What is wrong with `rollstream WORDS` (None: the command exists and has every --option named)."""
    command = group
    words = list(words)
    while words:
        word = words.pop(0).strip("[]")  # usage notation: [--port N]
        if word.startswith("-") and not word.lstrip("-").isdigit():
            name = word.split("=", 1)[0]
            param = _option(command, name)
            if param is None and name not in ("--help", "-h"):
                return f"`{command.name}` has no option {name}"
            if param is not None and "=" not in word and not getattr(param, "is_flag", True) and words:
                words.pop(0)  # its value
        elif hasattr(command, "commands"):
            if word not in command.commands:
                return f"no command `{word}` (commands: {', '.join(sorted(command.commands))})"
            command = command.commands[word]
    return None


def _option(command: Any, name: str) -> Any:
    """The parameter an option name belongs to, or None."""
    return next((p for p in command.params if name in (*p.opts, *p.secondary_opts)), None)
