"""The CLI reference as Markdown, generated from the typer app itself: what each command's ``--help`` says.

`docs/hooks.py` runs this script at every build of the site, in a fresh interpreter (so `mkdocs serve` sees a
changed command), and puts its output where docs/reference/cli.md has the ``<!-- cli-reference: MODULE:APP -->``
marker: nothing generated is checked in, so nothing can drift. Run it by hand to read the page in a terminal:
``python docs/cli_reference.py rollstream.cli:app``.

Everything is read through the command objects' own methods (`typer.main.get_command` gives the tree; typer
bundles its own copy of click, so nothing here imports click): the usage line, the help text, each option's
names, type, default, range and environment variable, the subcommands, and the examples the epilog ends with.
Rich markup in help text ([bold], ...) comes out as the plain text `--help` shows; Markdown-mode help is kept.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Iterator
from enum import Enum
from typing import Any

import typer
import typer.main
from rich.text import Text

# An example line of an epilog, as tests/unit/test_cli_help.py finds them (it checks that each one parses).
_EXAMPLE = re.compile(r"^\s*(?:Examples?:\s*)?(rollstream\s.*|rollstream)$")
# Characters Markdown would read as markup in plain help text: emphasis, links, attribute lists, HTML, tables.
_MARKDOWN_SPECIAL = re.compile(r"([\\*_{}\[\]>|#])")
_BLOCK_START = re.compile(r"^(\d*)([.)+-])(?=\s)")


def commands(root: Any) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    """(path, command, context) of every visible command, depth first in registration order; `root` included."""

    def walk(command: Any, path: tuple[str, ...], parent: Any) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
        ctx = command.context_class(command, info_name=path[-1], parent=parent)
        yield path, command, ctx
        for name, sub in getattr(command, "commands", {}).items():
            if not sub.hidden:
                yield from walk(sub, (*path, name), ctx)

    yield from walk(root, (root.name or "rollstream",), None)


def anchor(path: tuple[str, ...]) -> str:
    """The heading anchor of a command's section (the site's GitHub-style slug of "rollstream broker start")."""
    return "-".join(path).lower()


def render(app: typer.Typer) -> str:
    """The reference of every command of `app`, as Markdown sections (headings from level 2)."""
    root = typer.main.get_command(app)
    return "\n".join(line for path, command, ctx in commands(root) for line in _section(path, command, ctx))


def _section(path: tuple[str, ...], command: Any, ctx: Any) -> Iterator[str]:
    mode = getattr(command, "rich_markup_mode", None)
    yield f"{'#' * max(2, len(path))} {' '.join(path)}"
    yield ""
    yield from ("```text", command.get_usage(ctx), "```", "")
    if command.deprecated:
        yield "**Deprecated.**\n"
    for paragraph in _paragraphs(command.help or "", mode):
        yield from (paragraph, "")
    rows = [_option_row(param, ctx, mode) for param in command.params if not getattr(param, "hidden", False)]
    if rows:
        yield from ("| Option | Type | Default | Help |", "| --- | --- | --- | --- |", *rows, "")
    subcommands = [(name, sub) for name, sub in getattr(command, "commands", {}).items() if not sub.hidden]
    if subcommands:
        yield from ("| Command | What it does |", "| --- | --- |")
        for name, sub in subcommands:
            first = next(iter(_paragraphs(sub.help or "", getattr(sub, "rich_markup_mode", mode))), "")
            yield f"| [{name}](#{anchor((*path, name))}) | {first} |"
        yield ""
    yield from _epilog(command.epilog or "", mode)


def _epilog(text: str, mode: str | None) -> Iterator[str]:
    """The epilog: its example command lines as one shell block (each line as written), the rest as text."""
    text = inspect.cleandoc(text)
    if mode == "rich":
        text = Text.from_markup(text).plain
    examples: list[str] = []
    for line in [*text.splitlines(), ""]:
        example = _EXAMPLE.match(line)
        if example:
            examples.append(example.group(1))
            continue
        if examples:
            yield from ("Example:" if len(examples) == 1 else "Examples:", "", "```bash", *examples, "```", "")
            examples = []
        if line.strip() and not re.fullmatch(r"\s*Examples?:\s*", line):
            yield from (_inline(line.strip(), mode if mode == "markdown" else None), "")


def _paragraphs(text: str, mode: str | None) -> list[str]:
    """Help text as `--help` lays it out: up to a form feed, paragraphs at blank lines, single line breaks joined
    (a paragraph opening with \\b keeps its lines)."""
    text = inspect.cleandoc(text).partition("\f")[0]
    paragraphs = []
    for paragraph in text.split("\n\n"):
        if paragraph.startswith("\b"):
            lines = [_inline(line, mode) for line in paragraph.strip("\b\n").splitlines()]
            paragraphs.append("<br>\n".join(lines))
        elif paragraph.strip():
            paragraphs.append(_inline(" ".join(line.strip() for line in paragraph.splitlines()), mode))
    return paragraphs


def _inline(text: str, mode: str | None) -> str:
    """One line of help text as Markdown: rich markup reduced to its text and escaped; Markdown kept as written."""
    if mode == "markdown":
        return text
    if mode == "rich":
        text = Text.from_markup(text).plain
    parts = re.split(r"(`[^`\n]+`)", text)  # a `code span` in help text stays code; the rest is escaped
    return "".join(part if index % 2 else _escape(part) for index, part in enumerate(parts))


def _escape(text: str) -> str:
    text = _MARKDOWN_SPECIAL.sub(r"\\\1", text.replace("&", "&amp;").replace("<", "&lt;"))
    return _BLOCK_START.sub(r"\1\\\2", text)  # "1. " or "- " opening a paragraph would start a list


def _option_row(param: Any, ctx: Any, mode: str | None) -> str:
    if param.param_type_name == "argument":
        name = (param.metavar or param.name or "") + ("..." if param.nargs != 1 and param.metavar is None else "")
        names = f"`{name}` (argument)"
    else:
        names = ", ".join(f"`{opt}`" for opt in param.opts)
        if param.secondary_opts:
            names += " / " + ", ".join(f"`{opt}`" for opt in param.secondary_opts)
    kind = param.display_type_rich(ctx) if hasattr(param, "display_type_rich") else param.make_metavar(ctx)
    kind = f"`{kind}`" if kind else ""
    bounds = _number_range(getattr(param, "min", None), getattr(param, "max", None))
    if bounds:
        kind += f" {bounds}"
    default = "**required**" if param.required else _default(param, ctx)
    help_text = "<br>".join(_paragraphs(getattr(param, "help", None) or "", mode))
    envvar = param.envvar if getattr(param, "show_envvar", False) else None
    if envvar:
        names_of = [envvar] if isinstance(envvar, str) else list(envvar)
        help_text += f"{'<br>' if help_text else ''}Env: " + ", ".join(f"`{name}`" for name in names_of)
    return f"| {names} | {kind} | {default} | {help_text} |"


def _number_range(low: float | None, high: float | None) -> str:
    """An option's bounds as --help writes them (x>=1), as Markdown."""
    if low is None and high is None:
        return ""
    text = f"x<={high}" if low is None else f"x>={low}" if high is None else f"{low}<=x<={high}"
    return _escape(text)


def _default(param: Any, ctx: Any) -> str:
    """The default --help shows: none unless shown; a boolean switch by its name; an enum by its value."""
    show = getattr(param, "show_default", None)
    if isinstance(show, str):
        return _escape(show)
    if not (show or ctx.show_default):
        return ""
    value = param.get_default(ctx, call=False)  # the declared default, not one from the environment
    if value is None:
        return ""
    if getattr(param, "is_bool_flag", False):
        if param.secondary_opts:
            return f"`{(param.opts if value else param.secondary_opts)[0]}`"
        return "`on`" if value else ""
    if callable(value):
        return "(dynamic)"
    values = value if isinstance(value, (list, tuple)) else [value]
    return ", ".join(f"`{item.value if isinstance(item, Enum) else item}`" for item in values)


def _load(spec: str) -> typer.Typer:
    """MODULE:ATTRIBUTE, the typer app."""
    module, _, attribute = spec.partition(":")
    app = getattr(importlib.import_module(module), attribute or "app")
    if not isinstance(app, typer.Typer):
        raise TypeError(f"{spec} is a {type(app).__name__}, not a typer.Typer")
    return app


if __name__ == "__main__":
    sys.stdout.write(render(_load(sys.argv[1] if len(sys.argv) > 1 else "rollstream.cli:app")))
