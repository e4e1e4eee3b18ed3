"""Every ```python block in the README and docs/ is checked, so an example that names an undefined variable or
imports a name that no longer exists fails here (issue 30: docs that cannot rot):

1. it compiles (top-level `await` allowed: async examples are written that way);
2. ruff's undefined-name checks pass (F821, F822, F823, F811), with the names of a `snippet: given` directive
   defined (the reader's `model`); unused imports are allowed, an example may show where a name comes from;
3. its import statements run, in a fresh interpreter (one for all blocks), so `from rollstream import X` fails
   when X is gone; a third-party package that is not installed here skips the block (the verl extra lives in
   its own venv) but a missing `rollstream` module never does;
4. a block marked `snippet: run` runs in full, in a fresh interpreter in a temporary folder, and exits 0.

A block marked `snippet: skip REASON` is exempt; the reason is required. Directives: tests/docs/_markdown.py.
Each failure names the block as file:line (the line of its opening fence).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs._markdown import DIRECTIVES, ROOT, Block, code_blocks, directive_lines, doc_files, where

PYTHON = ("python", "py", "python3")
UNDEFINED_NAME_RULES = "F821,F822,F823,F811"
RUN_TIMEOUT_S = 120.0
IMPORTS_TIMEOUT_S = 300.0


def _python_blocks() -> list[Block]:
    return [block for path in doc_files() for block in code_blocks(path) if block.language in PYTHON]


BLOCKS = _python_blocks()
CHECKED = [block for block in BLOCKS if block.directive("skip") is None]


def _compile(block: Block) -> ast.Module:
    """The block's syntax tree; a SyntaxError names the line in the Markdown file."""
    try:
        return compile(block.source, block.where, "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as e:
        error = e
    pytest.fail(f"{where(block.path, block.line + (error.lineno or 1))}: does not compile: {error.msg}", pytrace=False)


def _given(block: Block) -> list[str]:
    return (block.directive("given") or "").replace(",", " ").split()


def _undefined_names(block: Block) -> list[str]:
    """ruff's findings, each as file:line: message (the given names defined on a first line, not counted)."""
    given = _given(block)
    prelude = f"{' = '.join(given)} = None\n" if given else ""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--target-version", "py311", "--select",
         UNDEFINED_NAME_RULES, "--output-format", "json", "--stdin-filename", "snippet.py", "-"],
        input=prelude + block.source, capture_output=True, text=True, timeout=60, check=False,
    )
    if result.returncode not in (0, 1):
        raise RuntimeError(f"ruff failed: {result.stderr}")
    offset = block.line - (1 if prelude else 0)
    return [f"{where(block.path, offset + f['location']['row'])}: {f['code']} {f['message']}"
            for f in json.loads(result.stdout)]


def _imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line in the block, source) of each import statement, wherever it is (a function body too)."""
    return [(node.lineno, ast.unparse(node)) for node in ast.walk(tree)
            if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.level == 0)]


# Run in a fresh interpreter: imports every statement it is given, each block in a namespace of its own, and
# prints {block: [[line, kind, message], ...]}; kind "missing" is a third-party package that is not installed.
_IMPORT_RUNNER = """
import importlib.util, json, sys
blocks = json.load(sys.stdin)
report = {}
for key, statements in blocks.items():
    problems = []
    for line, statement in statements:
        try:
            exec(statement, {})
        except ModuleNotFoundError as e:
            root = (e.name or "").split(".")[0]
            third_party = root and root != "rollstream" and importlib.util.find_spec(root) is None
            problems.append([line, "missing" if third_party else "error", f"{type(e).__name__}: {e}"])
        except BaseException as e:
            problems.append([line, "error", f"{type(e).__name__}: {e}"])
    report[key] = problems
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def import_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list]]:
    """Every checked block's imports run once, together, in one fresh interpreter."""
    statements = {}
    for block in CHECKED:
        try:
            tree = compile(block.source, block.where, "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        except SyntaxError:
            continue  # test_snippet reports it
        statements[block.where] = _imports(tree)
    # not run from the checkout: its rollstream/ folder would shadow the installed package (which maps schemas/ ...)
    result = subprocess.run([sys.executable, "-c", _IMPORT_RUNNER], input=json.dumps(statements),
                            cwd=tmp_path_factory.mktemp("imports"), capture_output=True, text=True,
                            timeout=IMPORTS_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"the import runner failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("block", CHECKED, ids=[block.where for block in CHECKED])
def test_snippet(block: Block, import_report: dict[str, list[list]], tmp_path: Path) -> None:
    unknown = [name for name, _ in block.directives if name not in DIRECTIVES]
    if unknown:
        pytest.fail(f"{block.where}: unknown snippet directive {unknown} (known: {DIRECTIVES})", pytrace=False)
    if block.directive("given") is not None and not _given(block):
        pytest.fail(f"{block.where}: `snippet: given` names no names", pytrace=False)
    _compile(block)
    problems = _undefined_names(block)
    missing = []
    for line, kind, message in import_report.get(block.where, []):
        if kind == "missing":
            missing.append(message)
        else:
            problems.append(f"{where(block.path, block.line + line)}: import fails: {message}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
    if missing:
        pytest.skip(f"{block.where}: needs a package not installed here ({'; '.join(missing)})")
    if block.directive("run") is not None:
        _run(block, tmp_path)


def _run(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(block.source, encoding="utf-8")
    try:  # in a temporary folder, importing rollstream as installed, as a reader's script would
        result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                                text=True, timeout=RUN_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: ran past {RUN_TIMEOUT_S:.0f} s", pytrace=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-15:])
        pytest.fail(f"{block.where}: exited {result.returncode}:\n{tail}", pytrace=False)


def test_skip_says_why() -> None:
    unexplained = [b.where for b in BLOCKS if b.directive("skip") is not None and not b.directive("skip")]
    assert not unexplained, f"`snippet: skip` needs a reason (<!-- snippet: skip REASON -->): {unexplained}"


@pytest.mark.parametrize("path", doc_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_directives_sit_on_a_python_block(path: Path) -> None:
    """A `snippet:` comment anywhere but just above a ```python block would silently check nothing."""
    placed = {line for block in code_blocks(path) if block.language in PYTHON for line in block.directive_lines}
    stray = [where(path, line) for line in directive_lines(path) if line not in placed]
    if stray:
        pytest.fail("snippet directives not just above a ```python block: " + ", ".join(stray), pytrace=False)

