"""The site's CLI reference (docs/reference/cli.md, filled at build time by docs/cli_reference.py through
docs/hooks.py) covers every command of the CLI, every visible option and every example, and its Markdown renders
as the text `--help` shows: rich markup reduced to text, nothing read as emphasis, links or table cells.

Nothing generated is checked in, so there is nothing to refresh; the strict build (`make lint`) renders the page.
"""

from __future__ import annotations

import importlib.util
import re
from html import unescape
from types import ModuleType
from typing import Annotated, Any

import markdown
import pytest
import typer

from rollstream.cli import app
from tests.docs._markdown import ROOT
from tests.unit.test_cli_help import COMMANDS, example_lines


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", ROOT / "docs" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REFERENCE = _module("cli_reference")
PAGE = REFERENCE.render(app)


def _sections(page: str) -> dict[str, str]:
    """Each command's section of the generated Markdown, by its command path."""
    parts = re.split(r"^#{2,6} (rollstream.*)$", page, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _html_text(markdown_text: str) -> str:
    html = markdown.markdown(markdown_text, extensions=["tables", "attr_list", "md_in_html"])
    return unescape(re.sub(r"<[^>]+>", "", html))


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_every_command_option_and_example_is_on_the_page(path: tuple[str, ...], command: Any) -> None:
    section = _sections(PAGE).get(" ".join(path))
    assert section is not None, f"no section for {' '.join(path)}"
    for param in command.params:
        if not param.hidden:
            for opt in [*param.opts, *param.secondary_opts]:
                assert f"`{opt}`" in section or param.param_type_name == "argument", (path, opt)
    for line in example_lines(command):
        assert f"\n{line}\n" in section, (path, line)
    for name in getattr(command, "commands", {}):
        assert f"(#{REFERENCE.anchor((*path, name))})" in section, (path, name)


def test_the_page_renders_as_help_says() -> None:
    """Every option row is one table row of four cells, whatever its help holds (|, *, _, {...})."""
    html = markdown.markdown(PAGE, extensions=["tables", "attr_list", "md_in_html"])
    rows = re.findall(r"<tr>(.*?)</tr>", html, flags=re.S)
    assert rows
    assert {len(re.findall(r"<t[dh]", row)) for row in rows} <= {2, 4}
    text = _html_text(PAGE)
    assert "sasl.*, ssl.*" in text  # not emphasis
    assert "<sglang|hf|vllm>" in text  # one cell, not three
    assert '{"role", "content"}' in text  # not an attribute list
    assert "\\" not in text  # no escape shows


def test_rich_markup_comes_out_as_text() -> None:
    demo = typer.Typer(name="rollstream", rich_markup_mode="rich", add_completion=False)

    @demo.command(help="[bold]Loud[/bold] and [red]red[/red] help, with a literal \\[x] and a_b*c*.",
                  epilog="[dim]Example:[/dim] rollstream shout --times 2")
    def shout(times: Annotated[int, typer.Option(help="How [italic]many[/italic] times.")] = 1) -> None:
        """Shout."""

    @demo.command()
    def other() -> None:
        """Another command, so the app is a group."""

    page = REFERENCE.render(demo)
    text = _html_text(page)
    assert "[bold]" not in page and "[/" not in page and "[italic]" not in page
    assert "Loud and red help, with a literal [x] and a_b*c*." in text
    assert "How many times." in text
    assert "rollstream shout --times 2" in page.split("```bash", 1)[1]


def test_the_page_has_the_marker_the_hook_fills() -> None:
    hooks = _module("hooks")
    marker = hooks._CLI_MARKER.search((ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8"))
    assert marker and marker.group("app") == "rollstream.cli:app"
