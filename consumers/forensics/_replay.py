"""Read back what was published (by offset range or time) or what a step took (from its manifest).

Replay never commits and never joins the trainer's group; it is safe to run next to a live trainer.
Every function blocks until done (bounded by its timeout without progress) and uses Kafka clients of
its own, so separate calls may run in separate threads; an iterator must stay in the thread that reads it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition
from rollstream.consumers._batch import Batch
from rollstream.consumers._gather import key_text
from rollstream.consumers._ledger import StepLedger
from rollstream.consumers._manifests import read_manifests
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.infra.deadline import Deadline
from rollstream.infra.kafka_errors import kafka_error
from rollstream.infra.kafka_io import partitions_of, position_of, read_ranges, reader, watermarks
from rollstream.schemas import RollstreamError, SchemaError, ScoredGroup, StepManifest, decode

Progress = Callable[[int], None]
_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
READ_AHEAD_KIB = 1024  # decoded bytes librdkafka may hold ahead of a forensic read, and one bounded response more


@dataclass(frozen=True)
class ReplayedRecord:
    """One record read back from NS.rollouts: its position, raw bytes and decoded group (or decode error)."""

    partition: int
    offset: int
    timestamp_ms: int
    key: str | None
    value: bytes
    group: ScoredGroup | None
    error: str | None = None


@dataclass(frozen=True)
class ReplayedStep:
    """The groups a step took, rebuilt from its manifest: same ids, same bytes, same order."""

    manifest: StepManifest
    records: tuple[ReplayedRecord, ...]

    @property
    def groups(self) -> list[ScoredGroup]:
        return [r.group for r in self.records if r.group is not None]

    def to_batch(self) -> Batch:
        """The step as a `Batch` (for `to_tensors`); `offsets` holds only the step's range ends."""
        m = self.manifest
        positions = tuple((r.partition, r.offset) for r in self.records)
        return Batch(step=m.step, groups=tuple(self.groups), positions=positions,
                     ranges=m.ranges, dispositions=m.dispositions, offsets={r.partition: r.end for r in m.ranges},
                     consumer_group=m.consumer_group, topic=m.topic, policy_version=m.policy_version,
                     created_at_ms=m.created_at_ms)


def record_of(msg: Message) -> ReplayedRecord:
    """A fetched record of NS.rollouts as a `ReplayedRecord` (decoded, or with its decode error)."""
    value = msg.value() or b""
    partition, offset = position_of(msg)
    try:
        group: ScoredGroup | None = decode(value, ScoredGroup)
        error = None
    except SchemaError as exc:
        group, error = None, str(exc.located(msg.topic() or "", partition, offset))
    return ReplayedRecord(partition, offset, msg.timestamp()[1], key_text(msg.key()), value, group, error)


def replay_range(config: KafkaConfig, namespace: str, bounds: Mapping[int, tuple[int, int]], *,
                 timeout: float = 30.0, progress: Progress | None = None) -> Iterator[ReplayedRecord]:
    """Records of NS.rollouts in [start, end) per partition (ends clamped to what exists), in order per partition.

    Raises:
        RollstreamError: the topic does not exist, or no progress for `timeout` s.
    """
    topic = TopicNames(namespace).rollouts
    for msg in read_ranges(config, topic, bounds, group_id="rollstream-replay", timeout=timeout, progress=progress,
                           read_ahead_kib=READ_AHEAD_KIB):
        yield record_of(msg)


def since_bounds(config: KafkaConfig, namespace: str, since_ms: int, *, timeout: float = 30.0
                 ) -> dict[int, tuple[int, int]]:
    """Per partition of NS.rollouts, [first offset at or after `since_ms`, current end)."""
    topic = TopicNames(namespace).rollouts
    with reader(config, "rollstream-replay") as consumer:
        partitions = partitions_of(consumer, topic, timeout=timeout)
        ends = {p: watermarks(consumer, topic, p, timeout=timeout)[1] for p in partitions}
        found = offsets_at(consumer, topic, ends, since_ms, timeout=timeout)
    return {p: (found[p], ends[p]) for p in partitions}


def offsets_at(consumer: Consumer, topic: str, ends: Mapping[int, int], at_ms: int, *, timeout: float = 30.0
               ) -> dict[int, int]:
    """Per partition of `ends`, the first offset whose record's timestamp is at or after `at_ms` (its end in
    `ends` when there is none): the records before it were published before `at_ms`, as far as the records'
    timestamps (the producers' clocks) tell. One broker round trip; blocks up to `timeout` s.

    Raises:
        KafkaIOError: the lookup failed.
    """
    try:
        found = consumer.offsets_for_times([TopicPartition(topic, p, at_ms) for p in ends], timeout=timeout)
    except KafkaException as exc:
        raise kafka_error(f"cannot look up offsets by time on {topic}", exc, topic=topic) from exc
    return {tp.partition: tp.offset if tp.offset >= 0 else ends[tp.partition] for tp in found}


def replay_since(config: KafkaConfig, namespace: str, since_ms: int, *, timeout: float = 30.0,
                 progress: Progress | None = None) -> Iterator[ReplayedRecord]:
    """Records of NS.rollouts published at or after `since_ms` (ms since the epoch) until now."""
    return replay_range(config, namespace, since_bounds(config, namespace, since_ms, timeout=timeout),
                        timeout=timeout, progress=progress)


def effective_manifests(config: KafkaConfig, namespace: str, consumer_group: str, *, timeout: float = 30.0
                        ) -> list[StepManifest]:
    """The group's step manifests that count (the rules of `rollstream.consumers._ledger`), in log order
    (also step order: a manifest supersedes every earlier one of its step or a higher one).
    Reads all of NS.steps; blocks until read. Commits nothing.

    Raises:
        KafkaIOError: NS.steps does not exist, or the broker did not answer in time.
    """
    ledger = StepLedger(keep_manifests=True)
    for m in read_manifests(config, TopicNames(namespace).steps, consumer_group, timeout=timeout):
        ledger.add(m)
    return ledger.effective()


def find_step(config: KafkaConfig, namespace: str, consumer_group: str, step: int, *, timeout: float = 30.0
              ) -> StepManifest:
    """The manifest of `step` that counts (the latest one not superseded; see `rollstream.consumers._ledger`).

    Raises:
        RollstreamError: the group has no such step.
    """
    effective = effective_manifests(config, namespace, consumer_group, timeout=timeout)
    for m in effective:
        if m.step == step:
            return m
    steps = [m.step for m in effective]
    known = f"steps {steps[0]}..{steps[-1]}" if steps else "no steps"
    raise RollstreamError(f"group {consumer_group} in namespace {namespace} has no step {step} ({known}); "
                          "check --group and --namespace")


def replay_step(config: KafkaConfig, namespace: str, consumer_group: str, step: int, *, timeout: float = 30.0,
                progress: Progress | None = None) -> ReplayedStep:
    """Rebuild exactly the groups `consumer_group` took at `step`: fetched by offset from its manifest.

    Raises:
        RollstreamError: no such step; a taken offset no longer exists (retention) or holds another
            group than the manifest says (the topic was recreated).
    """
    manifest = find_step(config, namespace, consumer_group, step, timeout=timeout)
    return ReplayedStep(manifest, read_taken(config, manifest, timeout=timeout, progress=progress))


def read_taken(config: KafkaConfig, manifest: StepManifest, *, timeout: float = 30.0,
               progress: Progress | None = None, deadline: Deadline | None = None) -> tuple[ReplayedRecord, ...]:
    """The records `manifest` took, fetched by offset, in the manifest's order. Blocks until read (no progress
    for `timeout` s is an error), at most until `deadline` (None: none).

    Raises:
        RollstreamError: a taken offset no longer exists (retention) or holds another group than the
            manifest says (the topic was recreated); KafkaIOError when a read fails.
    """
    step = manifest.step
    wanted = {(d.partition, d.offset): d.group_id for d in manifest.dispositions if d.kind == "taken"}
    bounds = {r.partition: (r.start, r.end) for r in manifest.ranges}
    found: dict[tuple[int, int], ReplayedRecord] = {}
    # The step's own group (never joined, never committed): a trainer granted only its group may replay.
    for msg in read_ranges(config, manifest.topic, bounds, group_id=manifest.consumer_group, timeout=timeout,
                           progress=progress, deadline=deadline, read_ahead_kib=READ_AHEAD_KIB):
        if position_of(msg) in wanted:
            found[position_of(msg)] = record_of(msg)
    records = []
    for position, group_id in wanted.items():
        record = found.get(position)
        if record is None:
            raise RollstreamError(f"step {step}: {manifest.topic} partition {position[0]} offset {position[1]} "
                                  "no longer exists (deleted by retention?)")
        if record.group is None or record.group.group_id != group_id:
            raise RollstreamError(f"step {step}: {manifest.topic}[{position[0]}]@{position[1]} holds "
                                  f"{record.group.group_id if record.group else 'an undecodable record'}, but the "
                                  f"manifest says {group_id} (was the topic recreated?)")
        records.append(record)
    return tuple(records)


def group_to_json(record: ReplayedRecord, step: int | None = None) -> dict[str, Any]:
    """A JSON-ready dict of a replayed record: position, and the whole decoded group (or the decode error)."""
    out: dict[str, Any] = {"partition": record.partition, "offset": record.offset, "timestamp_ms": record.timestamp_ms}
    if step is not None:
        out["step"] = step
    g = record.group
    if g is None:
        return {**out, "key": record.key, "undecodable": record.error}
    return {**out, "group_id": g.group_id, "prompt_id": g.prompt_id, "epoch": g.epoch, "status": g.status,
            "error": g.error, "producer_id": g.producer_id, "started_at_ms": g.started_at_ms,
            "finished_at_ms": g.finished_at_ms, "prompt": g.prompt, "prompt_tokens": g.prompt_tokens.tolist(),
            "metadata": dict(g.metadata), "rewards": g.rewards,
            "sampling": None if g.sampling is None else vars(g.sampling),
            "samples": [{"tokens": s.tokens.tolist(), "logprobs": None if s.logprobs is None else s.logprobs.tolist(),
                         "text": s.text, "reward": s.reward, "finish_reason": s.finish_reason,
                         "weight_versions": list(s.weight_versions),
                         "loss_mask": None if s.loss_mask is None else s.loss_mask.tolist(),
                         "version_spans": [vars(v) for v in s.version_spans]} for s in g.samples]}


def parse_time(text: str, *, now: float | None = None) -> int:
    """A point in time in ms since the epoch: ISO 8601 (``2025-01-31T12:00``, naive = local time) or
    relative to now (``90s``, ``10m``, ``2h``, ``1d``).

    Raises:
        RollstreamError: neither form; the message shows both.
    """
    if match := _RELATIVE.match(text):
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
        return int(((time.time() if now is None else now) - seconds) * 1000)
    try:
        return int(datetime.fromisoformat(text.strip()).timestamp() * 1000)
    except ValueError:
        raise RollstreamError(f"cannot read time {text!r}: use ISO 8601 (2025-01-31T12:00:00, naive means local "
                              "time) or a duration before now (90s, 10m, 2h, 1d)") from None
