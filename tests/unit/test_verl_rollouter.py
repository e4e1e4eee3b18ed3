"""`rollstream.consumers._verl_rollouter.VerlRolloutQueue` without a broker (its publisher replaced): puts are
encoded and produced in the ``rollstream-verl-encode`` threads, off the caller's event loop, and the end marker's
put waits for every sample put before it that is still encoding, so the marker goes after them."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'rollstream[verl]')")

from rollstream.consumers._verl_rollouter import VerlRolloutQueue  # noqa: E402
from rollstream.consumers.verl import VerlSettings  # noqa: E402

from tests.standins.verl_fully_async.rollouts import rollout_sample  # noqa: E402


class HeldPublisher:
    """Records what is sent, and in which thread; a sample's send waits for `release`."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []
        self.release = threading.Event()

    def send(self, key: str, value: bytes) -> Future[None]:
        if not key.startswith("verl-end"):
            self.release.wait(10)
        self.sent.append((key, threading.current_thread().name))
        acked: Future[None] = Future()
        acked.set_result(None)
        return acked

    def drain(self, timeout_s: float) -> bool:
        return True

    def close(self, timeout_s: float) -> None:
        pass


def test_samples_are_produced_off_the_loop_and_the_end_marker_after_them() -> None:
    queue = VerlRolloutQueue(VerlSettings(namespace="unit"))
    publisher = queue._publisher = HeldPublisher()  # type: ignore[assignment]
    queue.serve_run(1)

    async def go() -> list[bool]:
        puts = [asyncio.create_task(queue.put_sample(rollout_sample(i))) for i in range(2)]
        await asyncio.sleep(0.2)  # both are in their encode threads, held at the send
        end = asyncio.create_task(queue.put_sample(None))
        await asyncio.sleep(0.2)
        assert not end.done() and publisher.sent == []  # the marker waits for the samples still producing
        publisher.release.set()
        return await asyncio.gather(*puts, end)

    try:
        assert asyncio.run(go()) == [True, True, True]
    finally:
        queue.close()
    keys = [key for key, _ in publisher.sent]
    assert len(keys) == 3 and keys[-1].startswith("verl-end") and queue.published == 3
    assert all(thread.startswith("rollstream-verl-encode") for _, thread in publisher.sent[:2])
