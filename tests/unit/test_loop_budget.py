"""`rollstream.producers._budget.LoopBudget`: a burst of group work shares the loop's turns instead of holding it.

Pinned: 40 tasks each doing 1 ms of work ready at once hold the loop ~40 ms in one turn without the
budget; with it (2 ms) a 1 ms timer waiting meanwhile is served long before the burst ends, and every
task still runs its work exactly once.
"""

from __future__ import annotations

import asyncio
import time

from rollstream.producers._budget import LoopBudget


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _burst(budget: LoopBudget | None) -> tuple[float, int]:
    """(seconds until a timer armed with the burst fired, tasks that did their work)."""
    done = 0

    async def group() -> None:
        nonlocal done
        if budget is not None:
            await budget.turn()
        _busy(0.001)
        done += 1

    started = time.perf_counter()
    timer = asyncio.create_task(asyncio.sleep(0.001))
    tasks = [asyncio.create_task(group()) for _ in range(40)]
    await timer
    fired = time.perf_counter() - started
    await asyncio.gather(*tasks)
    return fired, done


def test_a_burst_yields_to_timers_within_its_budget() -> None:
    held, done_without = asyncio.run(_burst(None))
    served, done_with = asyncio.run(_burst(LoopBudget(0.002)))
    assert done_without == done_with == 40
    assert held >= 0.035  # without: the timer waits for the whole burst
    assert served < held / 2, (served, held)


def test_groups_wait_in_line_in_order_and_a_cancelled_one_leaves_it() -> None:
    async def scenario() -> list[int]:
        budget = LoopBudget(0.0)  # every group past the first waits for a turn of its own
        order: list[int] = []

        async def group(i: int) -> None:
            await budget.turn()
            order.append(i)

        await asyncio.sleep(0.001)  # the budget's first turn is used up
        tasks = [asyncio.create_task(group(i)) for i in range(6)]
        await asyncio.sleep(0)
        tasks[2].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return order

    assert asyncio.run(scenario()) == [0, 1, 3, 4, 5]
