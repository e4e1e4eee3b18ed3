"""Load user plug-ins named ``MODULE:FUNC`` (``--generate``, ``--reward``), with errors that say what is wrong."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from schemas import ConfigError


def load_callable(spec: str, option: str) -> Callable[..., Any]:
    """Import ``module.path:function`` and return the function (the working directory is importable).

    Args:
        spec: ``MODULE:FUNC``; FUNC may be dotted (``pkg.mod:Class.method``).
        option: the flag being resolved (``--generate``), named in error messages.
    Raises:
        ConfigError: malformed spec, module not importable, attribute missing or not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{option} {spec!r}: expected MODULE:FUNC, e.g. mypkg.rollout:generate")
    try:
        module = _import(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{option} {spec!r}: module {module_name!r} not found ({exc}); is it on "
                          "PYTHONPATH, or run from the directory that contains it?") from exc
    except Exception as exc:
        raise ConfigError(f"{option} {spec!r}: importing {module_name!r} failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"{option} {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(target):
        raise ConfigError(f"{option} {spec!r}: {attr!r} is a {type(target).__name__}, not a function")
    return target


def _import(module_name: str) -> object:
    """Import, falling back to the working directory as a console script's sys.path lacks it (as uvicorn does)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        top = module_name.split(".")[0]
        if exc.name != top or cwd in sys.path or "" in sys.path:
            raise
        sys.path.insert(0, cwd)
        return importlib.import_module(module_name)
