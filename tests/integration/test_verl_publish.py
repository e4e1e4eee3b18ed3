"""verl's rollouter publishes with many samples in flight, against a real broker (`_verl_publish`, the
``put_sample`` of `_verl_rollouter.VerlRolloutQueue`). Three behaviours are pinned here:

1. `AckedPublisher.send` never waits for the broker: records sent back to back are all in flight before any
   is acknowledged, and each future resolves once the broker has it.
2. Concurrent ``put_sample`` calls all return True and every sample is on NS.rollouts, with one end marker.
3. A rollouter killed (SIGKILL) while puts are in flight loses nothing verl counted: every sample whose
   ``put_sample`` returned is on NS.rollouts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'rollstream[verl]')")
ray = pytest.importorskip("ray")

from rollstream.consumers._verl_codec import END_KEY  # noqa: E402
from rollstream.consumers._verl_publish import AckedPublisher  # noqa: E402
from rollstream.consumers._verl_rollouter import VerlRolloutQueue  # noqa: E402
from rollstream.consumers.verl import VerlSettings  # noqa: E402
from rollstream.infra import BOOTSTRAP_ENV  # noqa: E402

from tests.integration._kafka import read_all  # noqa: E402
from tests.standins.verl_fully_async.rollouts import rollout_sample  # noqa: E402

CHILD = """
import asyncio, sys, ray
from rollstream.consumers._verl_rollouter import VerlRolloutQueue
from rollstream.consumers.verl import VerlSettings
from tests.standins.verl_fully_async.rollouts import rollout_sample

async def main():
    queue = VerlRolloutQueue(VerlSettings(namespace=sys.argv[1], kafka_config=sys.argv[2], kafka_timeout_s=20.0))
    queue.serve_run(1)  # what verl's trainer hands over at its first weight sync
    gate = asyncio.Semaphore(16)

    async def one(i):
        async with gate:
            sample = rollout_sample(i, n=2)
            await queue.put_sample(ray.cloudpickle.dumps(sample))
            print(sample.sample_id, flush=True)  # what verl counts as produced

    await asyncio.gather(*(one(i) for i in range(100_000)))

asyncio.run(main())
"""


def settings(bootstrap: str, names) -> VerlSettings:
    return VerlSettings(bootstrap_servers=bootstrap, namespace=names.namespace, kafka_timeout_s=20.0)


def test_send_does_not_wait_for_acknowledgements(kafka_config, namespace) -> None:
    publisher = AckedPublisher(kafka_config.producer(), namespace.rollouts, timeout_s=20.0)
    try:
        futures = [publisher.send(f"k{i}", b"x" * 100) for i in range(50)]
        assert not all(f.done() for f in futures)  # 50 sends in well under linger.ms + a round trip
        assert publisher.drain(20.0) and publisher.in_flight == 0
        assert [f.result() for f in futures] == [None] * 50
    finally:
        publisher.close(20.0)
    assert not publisher.running


def test_concurrent_puts_then_end_marker(bootstrap_servers, kafka_config, namespace) -> None:
    async def go() -> list[bool]:
        queue = VerlRolloutQueue(settings(bootstrap_servers, namespace))
        queue.serve_run(1)  # what verl's trainer hands over at its first weight sync
        try:
            puts = [queue.put_sample(ray.cloudpickle.dumps(rollout_sample(i, n=2))) for i in range(24)]
            done = await asyncio.gather(*puts, queue.put_sample(None))
            assert queue.published == 25
            return done
        finally:
            queue.close()

    assert asyncio.run(go()) == [True] * 25
    groups = read_all(kafka_config, namespace.rollouts)
    assert sorted(g.prompt_id for g in groups if not g.metadata.get(END_KEY)) == \
        sorted(f"sample_0_{i}" for i in range(24))
    assert sum(1 for g in groups if g.metadata.get(END_KEY)) == 1


def test_killed_rollouter_loses_no_counted_sample(bootstrap_servers, kafka_config, namespace, tmp_path) -> None:
    env = {**os.environ, BOOTSTRAP_ENV: bootstrap_servers}
    slow = tmp_path / "slow-acks.properties"
    slow.write_text("linger.ms=500\n")  # every record waits in librdkafka half a second: a wide window to lose
    child = subprocess.Popen([sys.executable, "-c", CHILD, namespace.namespace, str(slow)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=os.getcwd())
    counted: list[str] = []
    deadline = time.monotonic() + 120
    try:
        assert child.stdout is not None
        while len(counted) < 40 and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            counted.append(line.strip())
    finally:
        child.send_signal(signal.SIGKILL)  # mid-flight: puts produced and not yet acknowledged die with it
        child.wait(30)
    assert len(counted) >= 40, f"the child rollouter counted only {len(counted)} samples"
    on_topic = {g.prompt_id for g in read_all(kafka_config, namespace.rollouts)}
    assert set(counted) <= on_topic
