"""The lag gate's arithmetic with pushed trainer positions, and the position record (no broker).

Pinned here: a `TrainerPosition` round-trips through the codec and its lag is committed-to-end; the gate
applies its trainer group's positions only, counts on top of a position exactly this producer's records
the broker had not acknowledged by then, ignores a position older than what it applied, and opens and
closes on a position alone.
"""

from __future__ import annotations

import asyncio

import pytest
from rollstream.infra import KafkaConfig
from rollstream.producers.gate import LagGate
from rollstream.producers.metrics import ProducerMetrics
from rollstream.schemas import DecodeError, InvalidRecordError, TrainerPosition, decode, encode, now_ms


def position(lag: int, observed_at_ms: int, group: str = "trainer", topic: str = "ns.rollouts") -> TrainerPosition:
    return TrainerPosition(consumer_group=group, topic=topic, step=1, committed={0: 10, 1: 0},
                           ends={0: 10 + lag, 1: 0}, observed_at_ms=observed_at_ms)


def test_a_position_round_trips_and_knows_its_lag() -> None:
    p = TrainerPosition("g", "ns.rollouts", 7, {0: 5, 2: 1}, {0: 9, 2: 1}, observed_at_ms=123, created_at_ms=456)
    assert decode(encode(p), TrainerPosition) == p and p.lag == 4
    with pytest.raises(InvalidRecordError, match="end offsets of"):
        TrainerPosition("g", "t", 0, {0: 1}, {1: 1}, observed_at_ms=0)
    with pytest.raises(DecodeError):
        decode(encode(p)[:-3], TrainerPosition)


def test_the_gate_counts_what_a_position_cannot_hold() -> None:
    async def scenario() -> None:
        gate = LagGate(KafkaConfig.load("127.0.0.1:1"), "trainer", "ns.rollouts", max_lag=10, interval_s=1.0,
                       metrics=ProducerMetrics())
        gate._loop = asyncio.get_running_loop()  # what start() sets; no lag read in this test
        for _ in range(6):
            gate.note_produced()
        for _ in range(4):
            gate.note_settled()  # four acknowledged, two still in flight
        await asyncio.sleep(0.05)
        later = now_ms()
        gate.follow(position(7, later))
        gate.follow(position(0, later, group="someone-else"))  # another trainer group: ignored
        await asyncio.sleep(0)
        assert gate.estimate == 7 + 2 and gate.is_open()  # the two in flight are not in the trainer's ends
        gate.follow(position(1, later - 10_000))  # older than what was applied: ignored
        await asyncio.sleep(0)
        assert gate.estimate == 9
        gate.follow(position(12, now_ms() + 1))
        await asyncio.sleep(0)
        assert gate.estimate == 14 and not gate.is_open()  # a position alone closes the gate ...
        gate.follow(position(3, now_ms() + 2))
        await asyncio.sleep(0)
        assert gate.is_open() and gate.estimate == 5  # ... and opens it
        await asyncio.wait_for(gate.wait_open(), 1.0)

    asyncio.run(scenario())


def test_a_stalled_trainer_lets_each_producer_use_its_share_of_the_headroom() -> None:
    """The end of the prompts: the trainer waits for a step's last groups and commits nothing, while the
    producers that still have prompts hold their shares. After the stall time the gate admits by its share of
    the headroom (`FleetShare.admits_in_stall`) instead of waiting for a commit that cannot come."""
    async def scenario() -> None:
        gate = LagGate(KafkaConfig.load("127.0.0.1:1"), "trainer", "ns.rollouts", max_lag=8, interval_s=1.0,
                       metrics=ProducerMetrics(), fallback_s=0.2)
        gate._loop = asyncio.get_running_loop()  # what start() sets; no lag read in this test
        gate.share.set_partitions(4)
        gate.set_owned(1)  # share 2
        for offset in range(3):
            gate.note_produced()
            gate.note_settled(0, offset)
        assert not gate.is_open()  # 3 own outstanding > share 2
        await asyncio.sleep(0.25)  # no commit for longer than the stall time
        gate._apply(3, gate._produced, now_ms(), "read", {0: 0})  # a reading: the lag is 3, nothing committed
        assert gate.is_open()  # 0 produced since <= 2/8 x (8 - 3)
        gate.note_produced()
        assert gate.is_open()  # 1 <= 1.25
        gate.note_produced()
        assert not gate.is_open()  # 2 > 1.25
        gate.follow(position(0, now_ms() + 1))  # the trainer commits (partition 0 up to 10): the share rule again
        await asyncio.sleep(0)
        assert gate.share.outstanding == 2 and gate.is_open()  # the 3 acknowledged are committed; 2 <= share 2
        gate.note_produced()
        assert not gate.is_open()  # 3 > 2, and the offsets moved: no stall

    asyncio.run(scenario())
