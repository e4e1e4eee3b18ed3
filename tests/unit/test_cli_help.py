"""Every command's --help ends with examples, and every example is a command line that parses.

The whole command tree is walked from `typer.main.get_command` (the root, each group, each command). Each
example line is resolved from the root down (the group names must lead to the command) and its arguments
parsed with the command's own ``make_context`` (resilient parsing off: an unknown flag, a missing required
option or a bad value fails), without running anything.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main

from rollstream.cli import app

_EXAMPLE = re.compile(r"^\s*(?:Examples?:\s*)?(rollstream\s.*|rollstream)$", re.MULTILINE)
# What examples name that a parameter requires to exist: files by their suffix, directories as ./NAME.
_FILE_SUFFIXES = (".jsonl", ".properties")


def _tree(command: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _tree(sub, (*path, name))


COMMANDS = list(_tree(typer.main.get_command(app), ("rollstream",)))


def example_lines(command: Any) -> list[str]:
    return _EXAMPLE.findall(command.epilog or "")


def parse(argv: list[str]) -> tuple[str, ...]:
    """Resolve `argv` (after "rollstream") from the root down and parse the last command's arguments; the path
    of the command it names. Raises what click raises for a bad example."""
    command: Any = typer.main.get_command(app)
    ctx = command.make_context("rollstream", list(argv), resilient_parsing=False)
    path = ("rollstream",)
    while hasattr(command, "commands"):
        rest = [*getattr(ctx, "_protected_args", getattr(ctx, "protected_args", [])), *ctx.args]
        if not rest:
            break
        name, command, rest = command.resolve_command(ctx, rest)
        path = (*path, name)
        ctx = command.make_context(name, rest, parent=ctx, resilient_parsing=False)
    return path


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_help_ends_with_examples(path: tuple[str, ...], command: Any) -> None:
    lines = example_lines(command)
    assert lines, f"{' '.join(path)} --help has no 'Example: rollstream ...' line"
    assert all(line.startswith(" ".join(path)) for line in lines), (path, lines)


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_examples_parse(path: tuple[str, ...], command: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                        ) -> None:
    monkeypatch.chdir(tmp_path)
    for line in example_lines(command):
        argv = shlex.split(line)[1:]
        for token in argv:
            if token.endswith(_FILE_SUFFIXES):
                (tmp_path / token).touch()
            elif token.startswith("./"):
                (tmp_path / token).mkdir(exist_ok=True)
        named = parse(argv)
        if len(path) > 1 and path[-1] not in named:
            pytest.fail(f"example {line!r} of {' '.join(path)} names {' '.join(named)}")


def test_help_shows_the_examples() -> None:
    """Rendered by rich as the last lines of --help."""
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["take", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "rollstream take --namespace demo -n 8 --steps 3" in result.output
    assert result.output.rstrip().splitlines()[-1].strip().startswith("rollstream take")
