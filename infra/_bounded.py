"""Bounding a blocking librdkafka call that has no timeout of its own (a synchronous offset commit).

librdkafka's synchronous commit waits for the group coordinator's answer with no deadline; a client
whose coordinator is gone for good (confluentinc/librdkafka#5511) would hold its caller forever. The
call runs in a daemon thread instead, and the caller waits at most `timeout`: on a timeout the call
may still finish (and its commit land) later, which callers must allow for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


def call_within(fn: Callable[[], _T], timeout: float, name: str) -> tuple[bool, _T | None]:
    """Run `fn` in daemon thread `name`; wait up to `timeout` s. Returns (finished, result); re-raises
    what `fn` raised when it finished by raising."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return False, None
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return True, outcome.get("result")  # type: ignore[return-value]
