"""The layout's rules, read from the source (no import runs). Pinned here:

1. Every library import goes through the one namespace: ``rollstream.schemas``, ``rollstream.infra``,
   ``rollstream.producers``, ``rollstream.consumers``; nothing (tests included) imports the top-level folders
   by their bare names, which would load a second copy of each module beside the installed one.
2. The dependency direction: schemas <- infra <- {producers, consumers} <- the composition root
   (`rollstream.cli`, the demo). producers and consumers never import each other; no library imports the root.
3. `rollstream.schemas` imports neither Kafka nor torch at module level.
4. `from rollstream import X` works for every name the public surface lists.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rollstream

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ("schemas", "infra", "producers", "consumers")
# what each library may import of the others (by its namespace name)
ALLOWED = {
    "schemas": set(),
    "infra": {"schemas"},
    "producers": {"schemas", "infra"},
    "consumers": {"schemas", "infra"},
}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at_module_level) for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, id(node) in top_level))
    return found


def _python_files(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]


def test_no_import_uses_a_bare_package_name():
    bare = [f"{path.relative_to(ROOT)}: {module}"
            for path in _python_files(*LIBRARIES, "rollstream", "tests")
            for module, _ in _imports(path)
            if module.split(".")[0] in LIBRARIES]
    assert bare == []


@pytest.mark.parametrize("package", LIBRARIES)
def test_dependency_direction(package):
    wrong = []
    for path in _python_files(package):
        for module, _ in _imports(path):
            parts = module.split(".")
            if parts[0] != "rollstream":
                continue
            other = parts[1] if len(parts) > 1 else "rollstream"
            if other != package and other not in ALLOWED[package]:
                wrong.append(f"{path.relative_to(ROOT)}: {package} imports {module}")
    assert wrong == []


def test_schemas_imports_neither_kafka_nor_torch_at_module_level():
    heavy = [f"{path.relative_to(ROOT)}: {module}"
             for path in _python_files("schemas")
             for module, top in _imports(path)
             if top and module.split(".")[0] in {"confluent_kafka", "torch"}]
    assert heavy == []


def test_public_surface_resolves():
    assert set(rollstream.__all__) == {"__version__", *rollstream._PACKAGE_OF}
    missing = [name for name in rollstream.__all__ if not hasattr(rollstream, name)]
    assert missing == []
    assert rollstream.RolloutConsumer.__module__.startswith("rollstream.consumers")
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        rollstream.NoSuchName  # noqa: B018
