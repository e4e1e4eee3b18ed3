"""What the docs tests read from the README and docs/**/*.md: fenced code blocks with the `snippet:` directives
before them (sybil's Markdown lexer, which knows fences inside lists and quotes), and links and headings
(markdown-it, the CommonMark parser rich already brings, so nothing in code counts as a link or a heading).

Directives, each an HTML comment (invisible on GitHub and on the site) on the lines just before a block:

- `<!-- snippet: skip REASON -->`: the block is not checked; the reason is required.
- `<!-- snippet: given NAME NAME ... -->`: names the reader supplies (their `model`, `tokenizer`): defined for the
  undefined-name check only, so every other name must still be defined or imported.
- `<!-- snippet: run -->`: the block is run in full, in a fresh interpreter, and must exit 0.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from markdown_it import MarkdownIt
from markdown_it.token import Token
from sybil import Document
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

ROOT = Path(__file__).resolve().parents[2]
DIRECTIVES = ("skip", "given", "run")
_DIRECTIVE = re.compile(r"^[ \t]*<!--\s*snippet:\s*(?P<body>.*?)\s*-->[ \t]*$")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*\b(?:id|name)=[\"']([^\"']+)[\"']", re.I)
_HTML_LINK = re.compile(r"<(?:a|img)\s[^>]*\b(?:href|src)=[\"']([^\"']+)[\"']", re.I)


def doc_files() -> list[Path]:
    """The README and every page under docs/: what the tests check."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language, its source (list or quote prefixes removed) and its directives."""

    path: Path
    line: int  # of the opening fence
    language: str
    source: str
    directives: tuple[tuple[str, str], ...] = field(default=())  # (name, arguments), in the order written
    directive_lines: tuple[int, ...] = field(default=())  # where they are written

    @property
    def where(self) -> str:
        return where(self.path, self.line)

    def directive(self, name: str) -> str | None:
        return next((args for found, args in self.directives if found == name), None)


@cache
def code_blocks(path: Path) -> tuple[Block, ...]:
    text = path.read_text(encoding="utf-8")
    lexer = FencedCodeBlockLexer(language=r"[^\n]*")
    blocks = []
    for region in lexer(Document(text, str(path))):
        language = (region.lexemes["language"].split() or [""])[0].lower()
        line = text.count("\n", 0, region.start) + 1
        found = _directives_before(text, line)
        blocks.append(Block(path, line, language, str(region.lexemes["source"]),
                            tuple((name, args) for _, name, args in found), tuple(n for n, _, _ in found)))
    return tuple(blocks)


def _directives_before(text: str, line: int) -> list[tuple[int, str, str]]:
    """(line, name, arguments) of the `snippet:` comments just above line `line` (blank lines between allowed)."""
    lines = text.splitlines()
    found = []
    for n in range(line - 1, 0, -1):
        if not lines[n - 1].strip():
            continue
        match = _DIRECTIVE.match(lines[n - 1])
        if match is None:
            break
        name, _, args = match.group("body").partition(" ")
        found.append((n, name, args.strip()))
    return found[::-1]


def directive_lines(path: Path) -> list[int]:
    """Lines holding a `snippet:` comment."""
    return [n for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if _DIRECTIVE.match(line)]


@dataclass(frozen=True)
class Link:
    path: Path
    line: int
    target: str

    @property
    def where(self) -> str:
        return where(self.path, self.line)


@cache
def _tokens(path: Path) -> tuple[list[Token], list[str]]:
    text = path.read_text(encoding="utf-8")
    return MarkdownIt("commonmark").enable("table").parse(text), text.splitlines()


@cache
def anchors(path: Path) -> frozenset[str]:
    """The #anchors a Markdown file has on GitHub (and on the site: mkdocs.yml slugifies the same way)."""
    tokens, _ = _tokens(path)
    found: set[str] = set()
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token.type == "heading_open":
            slug = github_slug(_plain_text(tokens[i + 1]))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
        elif token.type in ("html_block", "html_inline", "inline"):
            found.update(_HTML_ANCHOR.findall(token.content))
    return frozenset(found)


def links(path: Path) -> list[Link]:
    """Every link and image target in the file's prose (not in code), with its line."""
    tokens, lines = _tokens(path)
    found = []
    for token in tokens:
        if token.map is None:
            continue
        targets = [href for href in _HTML_LINK.findall(token.content)] if token.type == "html_block" else []
        for child in token.children or []:
            if child.type == "link_open":
                targets.append(str(child.attrs["href"]))
            elif child.type == "image":
                targets.append(str(child.attrs["src"]))
            elif child.type == "html_inline":
                targets.extend(_HTML_LINK.findall(child.content))
        for target in targets:
            found.append(Link(path, _line_of(target, lines, token.map[0], token.map[1]), target))
    return found


def _line_of(target: str, lines: list[str], first: int, last: int) -> int:
    """The line (1-based) in [first, last) where `target` is written; the block's first line when not found."""
    return next((n + 1 for n in range(first, last) if target in lines[n]), first + 1)


def _plain_text(inline: Token) -> str:
    return "".join(child.content for child in inline.children or [] if child.type in ("text", "code_inline"))


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not - or _), each space a hyphen."""
    text = unicodedata.normalize("NFC", heading).strip().lower()
    kept = "".join(ch for ch in text if ch in "-_ " or unicodedata.category(ch)[0] in "LNM")
    return kept.replace(" ", "-")
