"""Load user plug-ins named ``MODULE:FUNC`` (``--generate``, ``--reward``), with errors that say what is wrong."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from schemas import ConfigError


def load_callable(spec: str, option: str) -> Callable[..., Any]:
    """Import ``module.path:function`` and return the function.

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
        module = importlib.import_module(module_name)
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
