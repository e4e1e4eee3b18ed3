"""A time budget per turn of the event loop, so a burst of groups never holds the loop for long.

When many groups finish generating at once (an engine answering a whole batch, or an instant generate
function), every one of them is ready in the same turn of the loop, and asyncio runs all of them before
it looks at timers or sockets again: 64 groups of 100 KB, each built, encoded and produced in one go,
hold the loop for ~30 ms. `LoopBudget.turn` lets a group go on while the current turn has used less than
`budget_s`, and otherwise yields it to a later turn (``asyncio.sleep(0)``), so a turn does about
`budget_s` of group work and then serves timers, delivery reports and control records.

A turn starts when the first group of it is yielded: a callback scheduled then (``call_soon``) runs at
the head of the next turn and opens a fresh budget there. Loop-only; no locks.
"""

from __future__ import annotations

import asyncio
import time


class LoopBudget:
    """Share of one loop turn that group work may use before yielding. Loop-only."""

    def __init__(self, budget_s: float = 0.002) -> None:
        self._budget_s = budget_s
        self._started = time.perf_counter()
        self._renewal_pending = False

    async def turn(self) -> None:
        """Return at once while this turn has budget left; else yield to a later turn first (as often as
        needed: a turn that runs out again yields again)."""
        while time.perf_counter() - self._started > self._budget_s:
            if not self._renewal_pending:
                self._renewal_pending = True
                asyncio.get_running_loop().call_soon(self._renew)
            await asyncio.sleep(0)

    def _renew(self) -> None:
        """Head of a new turn: a fresh budget."""
        self._started = time.perf_counter()
        self._renewal_pending = False
