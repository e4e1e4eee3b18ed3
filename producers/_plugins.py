"""Load user plug-ins named ``MODULE:FUNC`` (``--generate``, ``--reward``) or ``MODULE:CLASS``
(``--environment``), with errors that say what is wrong."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from rollstream.schemas import ConfigError


def load_callable(spec: str, option: str, *, expected: str = "MODULE:FUNC, e.g. mypkg.rollout:generate",
                  kind: str = "function") -> Callable[..., Any]:
    """Import ``module.path:function`` and return the function (the working directory is importable).

    Args:
        spec: ``MODULE:FUNC``; FUNC may be dotted (``pkg.mod:Class.method``).
        option: the flag being resolved (``--generate``), named in error messages.
        expected: the form `spec` takes, with an example, for the message when it is malformed.
        kind: what the attribute should be (``function``, ``class``), for the message when it is not callable.
    Raises:
        ConfigError: malformed spec, module not importable, attribute missing or not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{option} {spec!r}: expected {expected}")
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
        raise ConfigError(f"{option} {spec!r}: {attr!r} is a {type(target).__name__}, not a {kind}")
    return target


def _import(module_name: str) -> object:
    """Import `module_name`; when its top-level package is not on sys.path but in the working directory
    (a console script's sys.path lacks it, unlike ``python -m``), import that package from there.

    sys.path is left as it is: only the package found in the working directory is imported (and so
    registered in sys.modules, as every import is), so nothing else can shadow an installed module.
    """
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        if exc.name != top:
            raise
        spec = importlib.machinery.PathFinder.find_spec(top, [os.getcwd()])
        if spec is None or spec.loader is None:
            raise
        module = importlib.util.module_from_spec(spec)
        sys.modules[top] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[top]
            raise
        return importlib.import_module(module_name)
