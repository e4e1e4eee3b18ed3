"""Record builders shared by unit and integration tests: small valid scored groups, and putting them (or
garbage) on NS.rollouts with a plain confluent Producer, as a producer would.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from confluent_kafka import Producer

from infra import KafkaConfig, TopicNames
from schemas import Sample, ScoredGroup, encode, make_group_id


def make_group(prompt_id: str, epoch: int = 0, *, rewards: Sequence[float | None] = (0.0, 1.0),
               status: str = "ok", versions: Sequence[int] = (), prompt_len: int = 3, response_len: int = 4,
               logprobs: bool = True, producer_id: str = "test") -> ScoredGroup:
    """A small valid group: `prompt_len` prompt tokens, one sample per reward."""
    samples = [
        Sample(tokens=[100 + 10 * j + t for t in range(response_len + j)],
               logprobs=[-0.5 - t for t in range(response_len + j)] if logprobs else None,
               text=f"answer {j}", reward=r, weight_versions=tuple(versions))
        for j, r in enumerate(rewards)
    ]
    return ScoredGroup(group_id=make_group_id(prompt_id, epoch), prompt_id=prompt_id, epoch=epoch,
                       prompt_tokens=list(range(1, prompt_len + 1)), samples=samples, started_at_ms=1,
                       finished_at_ms=2, prompt=f"prompt {prompt_id}", producer_id=producer_id, status=status,
                       error="engine exploded" if status == "failed" else None)


def publish(config: KafkaConfig, names: TopicNames, groups: Iterable[ScoredGroup | bytes], *,
            partition: int | None = None) -> list[tuple[int, int]]:
    """Publish groups (or raw bytes) keyed by group id; return each one's (partition, offset), in order."""
    producer = Producer(config.producer())
    positions: list[tuple[int, int] | None] = []

    def delivered(index: int):
        def cb(err, msg) -> None:
            if err is not None:
                raise RuntimeError(f"delivery failed: {err}")
            positions[index] = (msg.partition(), msg.offset())
        return cb

    for i, g in enumerate(groups):
        positions.append(None)
        value, key = (g, b"garbage") if isinstance(g, bytes) else (encode(g), g.group_id.encode())
        extra = {} if partition is None else {"partition": partition}
        producer.produce(names.rollouts, value, key=key, on_delivery=delivered(i), **extra)
        producer.poll(0)
    if producer.flush(30) != 0:
        raise RuntimeError("publish: not every group was acknowledged in 30 s")
    if any(p is None for p in positions):
        raise RuntimeError("publish: a delivery report is missing")
    return positions  # type: ignore[return-value]


def publish_many(config: KafkaConfig, names: TopicNames, count: int, *, prefix: str = "p", epoch: int = 0,
                 partition: int | None = None) -> list[ScoredGroup]:
    """Publish `count` distinct acceptable groups ``{prefix}{i}#{epoch}``; return them in publish order."""
    groups = [make_group(f"{prefix}{i}", epoch) for i in range(count)]
    publish(config, names, groups, partition=partition)
    return groups
