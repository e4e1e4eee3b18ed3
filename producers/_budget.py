"""A time budget per turn of the event loop, so a burst of groups never holds the loop for long.

When many groups finish generating at once (an engine answering a whole batch, or an instant generate
function), every one of them is ready in the same turn of the loop, and asyncio runs all of them before
it looks at timers or sockets again: 64 groups of 100 KB, each built, encoded and produced in one go,
hold the loop for ~30 ms. `LoopBudget.turn` lets a group go on while the current turn has used less than
`budget_s` and nobody waits; otherwise the group waits in line, and the line moves by one group per turn
(each wake-up is scheduled for the next turn, after the timers, sockets and delivery reports due then).

So a burst costs one future and one turn per waiting group, instead of every waiting group polling the
budget each turn. Loop-only; no locks.
"""

from __future__ import annotations

import asyncio
import collections
import time


class LoopBudget:
    """Share of one loop turn that group work may use before waiting in line. Loop-only."""

    def __init__(self, budget_s: float = 0.002) -> None:
        self._budget_s = budget_s
        self._started = time.perf_counter()
        self._line: collections.deque[asyncio.Future[None]] = collections.deque()
        self._wake_pending = False

    async def turn(self) -> None:
        """Return at once while this turn has budget left and no group waits; else wait in line for a
        later turn. Cancelling the wait leaves the line (the next group is still woken)."""
        if not self._line and time.perf_counter() - self._started <= self._budget_s:
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._line.append(waiter)
        self._schedule_wake(loop)
        await waiter

    def _schedule_wake(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            loop.call_soon(self._wake, loop)

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        """Head of a new turn: a fresh budget, and the first group in line goes on."""
        self._wake_pending = False
        self._started = time.perf_counter()
        while self._line:
            waiter = self._line.popleft()
            if not waiter.done():  # a cancelled waiter left the line
                waiter.set_result(None)
                break
        if self._line:
            self._schedule_wake(loop)
