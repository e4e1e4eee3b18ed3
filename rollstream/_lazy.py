"""Names a package exports but loads on first use (PEP 562), so importing the package costs nothing."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, module_of: Mapping[str, str], namespace: dict[str, Any]
                    ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of `package`: a name in `module_of` is imported from its
    module when first asked for, then kept in `namespace` (the package's globals), so later lookups skip this."""

    def __getattr__(name: str) -> object:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(module_of))

    return __getattr__, __dir__
