"""What the upstream checks (`_check_sglang`, `_check_vllm`, run in subprocesses by test_upstream.py) share:
running the checks with the installed package on ``sys.path``, and reading the routes a server declares."""

from __future__ import annotations

import ast
import json
import sys
import traceback
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any


def run_checks(package: str, argv: list[str], checks: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
    """``argv`` is FOLDER IN.json OUT.json: with FOLDER on ``sys.path``, ``checks(todo, result)`` fills ``result``
    from IN.json's todo; OUT.json gets it, with the package's version and, if a check crashed, the traceback."""
    folder, inp, outp = argv[:3]
    sys.path.append(folder)  # after the environment's own packages: its torch and pydantic are the ones used
    todo = json.loads(Path(inp).read_text())
    result: dict[str, Any] = {"version": metadata.version(package)}
    try:
        checks(todo, result)
    except Exception:
        result["crashed"] = traceback.format_exc()[-3000:]
    Path(outp).write_text(json.dumps(result))


def declared_routes(package: str, files: Iterable[str]) -> list[list[str]]:
    """(method, path) of every route the `files` of `package` declare (``@router.get("/x")``, ``.post``, ``.put``,
    ``.delete``, ``.api_route("/x", methods=[...])``), read from their source: importing them needs a GPU."""
    out = []
    dist = metadata.distribution(package)
    for name in files:
        for node in ast.walk(ast.parse(Path(str(dist.locate_file(name))).read_text())):
            if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute) and deco.args
                        and isinstance(deco.args[0], ast.Constant) and isinstance(deco.args[0].value, str)):
                    continue
                verb, path = deco.func.attr, deco.args[0].value
                if verb == "api_route":
                    methods = next((kw.value for kw in deco.keywords if kw.arg == "methods"), None)
                    out += [[m.value, path] for m in getattr(methods, "elts", []) if isinstance(m, ast.Constant)]
                elif verb in ("get", "post", "put", "delete"):
                    out.append([verb.upper(), path])
    return out
