"""In-flight checkpoints: the samples a producer is generating, saved on NS.inflight so that a crash costs no
generation (``--checkpoint-interval``; 0: off).

- **Where.** NS.inflight is compacted and keyed ``GROUP_ID/SAMPLE_INDEX`` (`InflightCheckpoint`): the newest
  state of each sample wins. A prompt of NS.prompts partition p has its checkpoints on NS.inflight partition
  ``p % partitions`` (the same p when both have as many partitions, as ``rollstream topics create`` makes them),
  so the producer that is assigned p reads one partition to find them.
- **Writing** (`CheckpointWriter`) is off the generation path: `Progress.save` only records the newest state
  of a sample; one write per sample is in flight at a time, on a client of its own (never queued before a
  group's record), and a state saved while one is in flight replaces the one waiting. A write that fails
  is logged and counted: the next one, or generating the sample again, covers it. So at most 2 states per
  sample being generated are held, whatever the broker does.
- **Tombstones.** Once a group is acknowledged, each key of it that has a checkpoint gets a tombstone: the ones
  this producer saved and the ones it found, or all of them when the partition's checkpoints were unreadable (a
  group that finished within its first interval, the usual case,
  writes nothing at all). A checkpoint left behind (a crash between the group and its tombstones, or one
  written by a producer that lost the prompt after its new owner read the partition) is found by the next
  reader of its partition: its prompt is committed by then, so it is tombstoned too.
- **Resuming** (`InflightCheckpoints.progress_for`): the first prompt of a partition under a new assignment
  reads that partition's checkpoints (`read_partition`, in the infra threads) once; each prompt then resumes the
  samples whose checkpoint is of its attempt and of the trainer run the producer follows (`GroupProgress`). A
  checkpoint of another run, or older than ``--checkpoint-max-staleness`` versions, is discarded and the
  sample generated again. The group id and the dedupe rules are unchanged: a resumed group is published once.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from rollstream.infra import KafkaConfig, KafkaIOError
from rollstream.infra.deadline import Deadline
from rollstream.infra.kafka_io import committed_offsets, partitions_of, read_assigned, reader, watermarks
from rollstream.producers._threads import ProducerThreads
from rollstream.producers.engines.progress import SampleState
from rollstream.producers.intake import TakenPrompt
from rollstream.producers.metrics import ProducerMetrics
from rollstream.producers.publisher import Publisher, PublishError
from rollstream.schemas import (
    InflightCheckpoint,
    Prompt,
    RollstreamError,
    checkpoint_key,
    decode,
    encode,
    float32_array,
    int32_array,
    now_ms,
)
from rollstream.schemas.inflight import versions_array

log = logging.getLogger(__name__)
_READ_TIMEOUT_S = 30.0
_OPEN_MIN_S = 5.0  # reading NS.inflight's partitions at startup, whatever the startup deadline left
Checkpoints = dict[str, dict[int, InflightCheckpoint]]  # group id -> sample index -> its newest checkpoint


@dataclass(frozen=True)
class _Tombstone:
    partition: int


class CheckpointWriter:
    """Writes checkpoints and tombstones to NS.inflight through `publisher` (its own client). Loop-only."""

    def __init__(self, publisher: Publisher, partitions: int, metrics: ProducerMetrics) -> None:
        self._publisher = publisher
        self._partitions = partitions
        self._metrics = metrics
        self._waiting: dict[str, InflightCheckpoint | _Tombstone] = {}  # the newest state not yet sent, per key
        self._writers: dict[str, asyncio.Task[None]] = {}

    def partition_of(self, prompt_partition: int) -> int:
        return prompt_partition % self._partitions

    def save(self, checkpoint: InflightCheckpoint) -> None:
        """Write `checkpoint` (after the one of its sample in flight, if any; replacing one waiting). Never blocks."""
        self._queue(checkpoint.key, checkpoint)

    def forget(self, group_id: str, samples: Iterable[int], prompt_partition: int) -> None:
        """Tombstone the checkpoints of a group's `samples` (indexes; after any write of theirs). Never blocks."""
        for index in samples:
            self._queue(checkpoint_key(group_id, index), _Tombstone(self.partition_of(prompt_partition)))

    def remove(self, checkpoints: Iterable[InflightCheckpoint]) -> None:
        """Tombstone `checkpoints` (left behind by a producer that published their groups). Never blocks."""
        for c in checkpoints:
            self._queue(c.key, _Tombstone(self.partition_of(c.prompt_partition)))

    def pending(self) -> int:
        """Samples with a write in flight or waiting."""
        return len(self._writers)

    async def settle(self, deadline: Deadline) -> None:
        """Wait for the writes in flight and waiting, until `deadline`; cancel what is left (it stays unwritten)."""
        writers = set(self._writers.values())
        if writers:
            _, left = await asyncio.wait(writers, timeout=deadline.seconds(math.inf))
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    def _queue(self, key: str, item: InflightCheckpoint | _Tombstone) -> None:
        self._waiting[key] = item
        if key not in self._writers:
            self._writers[key] = asyncio.create_task(self._write(key), name=f"rollstream-checkpoint-{key}")

    async def _write(self, key: str) -> None:
        try:
            while (item := self._waiting.pop(key, None)) is not None:
                await self._write_one(key, item)
        finally:
            self._writers.pop(key, None)

    async def _write_one(self, key: str, item: InflightCheckpoint | _Tombstone) -> None:
        tombstone = isinstance(item, _Tombstone)
        partition = item.partition if isinstance(item, _Tombstone) else self.partition_of(item.prompt_partition)
        value = None if isinstance(item, _Tombstone) else encode(item)
        try:
            await self._publisher.publish(key.encode(), value, partition=partition)
        except PublishError as exc:
            self._metrics.checkpoints.labels("failed").inc()
            log.warning("%s of %s not written to %s (%s); %s", "tombstone" if tombstone else "checkpoint", key,
                        self._publisher.topic, exc, "the next reader of its partition removes it" if tombstone
                        else "a newer one follows, or the sample is generated again")
            return
        self._metrics.checkpoints.labels("tombstoned" if tombstone else "written").inc()
        if value is not None:
            self._metrics.checkpoint_bytes.inc(len(value))


def read_partition(kafka: KafkaConfig, topic: str, partition: int, *, prompts_topic: str, prompt_partition: int,
                   intake_group: str, timeout: float = _READ_TIMEOUT_S) -> tuple[Checkpoints, list[InflightCheckpoint]]:
    """The live checkpoints of the prompts of `prompt_partition` (on `topic`'s `partition`), and those among
    them whose prompt `intake_group` has committed (left behind: to tombstone). Reads the partition from its
    first record to its end with a client of its own; commits nothing. A record that does not decode is
    logged and skipped. Blocks (off the loop), up to `timeout` s without progress.

    Raises:
        KafkaIOError: the partition could not be read.
    """
    newest: dict[str, InflightCheckpoint | None] = {}
    with reader(kafka, intake_group) as consumer:
        low, high = watermarks(consumer, topic, partition, timeout=timeout)
        committed = committed_offsets(consumer, prompts_topic, [prompt_partition], timeout=timeout)[prompt_partition]
        for msg in read_assigned(consumer, topic, {partition: (low, high)}, timeout=timeout):
            key, value = (msg.key() or b"").decode(errors="replace"), msg.value()
            if value is None:
                newest[key] = None
                continue
            try:
                checkpoint = decode(value, InflightCheckpoint)
            except RollstreamError as exc:
                log.warning("%s[%d]@%s: not a checkpoint, skipped (%s)", topic, partition, msg.offset(), exc)
                continue
            if checkpoint.prompt_partition == prompt_partition:
                newest[key] = checkpoint
    live: Checkpoints = {}
    left_behind = []
    for checkpoint in (c for c in newest.values() if c is not None):
        if committed is not None and checkpoint.prompt_offset < committed:
            left_behind.append(checkpoint)
        else:
            live.setdefault(checkpoint.group_id, {})[checkpoint.sample_index] = checkpoint
    return live, left_behind


class GroupProgress:
    """One group's `Progress`: the samples it resumes (another producer's checkpoints of the prompt, when
    still valid) and the states it saves. Loop-only."""

    def __init__(self, taken: TakenPrompt, prompt: Prompt, found: dict[int, InflightCheckpoint], *,
                 writer: CheckpointWriter, producer_id: str, policy_run: int, version: int,
                 max_staleness: int | None, interval_s: float, metrics: ProducerMetrics) -> None:
        self.interval_s, self.version = interval_s, version
        self._taken, self._prompt = taken, prompt
        self._writer, self._producer_id, self._policy_run = writer, producer_id, policy_run
        self._metrics = metrics
        self._restored = {i: s for i, c in found.items()
                          if (s := self._usable(c, version, max_staleness)) is not None}
        self._resumed: dict[int, str] = {}  # sample index -> how it was resumed (the last generation attempt's)
        self.keyed = set(found)  # samples with a checkpoint (found, or saved here): tombstoned once published

    def count_resumed(self) -> None:
        """Count how the samples with a checkpoint were resumed (once their generation ended)."""
        for index, how in self._resumed.items():
            self._metrics.resumed.labels(how).inc()
            if how != "restarted":
                self._metrics.resumed_tokens.inc(len(self._restored[index].tokens))

    def restored(self, index: int) -> SampleState | None:
        state = self._restored.get(index)
        if state is not None:
            self._resumed[index] = "kept" if state.finish_reason else "continued"
        return state

    def save(self, index: int, state: SampleState) -> None:
        try:
            checkpoint = InflightCheckpoint(
                group_id=self._prompt.group_id, prompt_id=self._prompt.id, attempt=self._prompt.attempt,
                sample_index=index, prompt_partition=self._taken.partition, prompt_offset=self._taken.offset,
                producer_id=self._producer_id, written_at_ms=now_ms(), policy_run=self._policy_run,
                tokens=int32_array(state.tokens, "tokens"), logprobs=float32_array(state.logprobs, "logprobs"),
                loss_mask=None if state.loss_mask is None else np.asarray(state.loss_mask, np.uint8),
                versions=versions_array([self.version if v is None else v for v in state.versions]),
                finish_reason=state.finish_reason,
                policy_turns=state.policy_turns, environment_state=state.environment_state,
                resume_points=state.resume_points, resumed_from=state.resumed_from, text=state.text,
                prompt_tokens=None if state.prompt_ids is None else int32_array(state.prompt_ids, "prompt_tokens"))
        except RollstreamError as exc:  # a state that does not fit a checkpoint must not fail the generation
            log.warning("sample %d of group %s not checkpointed: %s", index, self._prompt.group_id, exc)
            return
        self.keyed.add(index)
        self._writer.save(checkpoint)

    def restarted(self, index: int, why: str) -> None:
        self._resumed[index] = "restarted"
        log.info("sample %d of group %s starts again rather than from its checkpoint: %s", index,
                 self._prompt.group_id, why)

    def _usable(self, c: InflightCheckpoint, version: int, max_staleness: int | None) -> SampleState | None:
        """`c` as the state to resume from, or None (discarded, and counted) when it may not be resumed."""
        if c.attempt != self._prompt.attempt:
            return None  # another attempt's, left behind: the tombstones of this group remove it
        why = None
        if c.policy_run != self._policy_run:
            why = f"it was generated in trainer run {c.policy_run}, the producer follows run {self._policy_run}"
        else:
            known = [v for v in c.token_versions() if v is not None]
            if max_staleness is not None and known and version - min(known) > max_staleness:
                why = f"its oldest tokens are of version {min(known)}, {version - min(known)} behind version " \
                      f"{version} (--checkpoint-max-staleness {max_staleness})"
        if why is not None:
            self._metrics.resumed.labels("discarded").inc()
            log.info("checkpoint of sample %d of group %s (by %s) discarded: %s", c.sample_index, c.group_id,
                     c.producer_id, why)
            return None
        return SampleState(
            tokens=c.tokens.tolist(), logprobs=None if c.logprobs is None else c.logprobs.tolist(),
            loss_mask=None if c.loss_mask is None else c.loss_mask.tolist(), versions=c.token_versions(),
            finish_reason=c.finish_reason, policy_turns=c.policy_turns, environment_state=c.environment_state,
            resume_points=(*c.resume_points, len(c.tokens)), resumed_from=(*c.resumed_from, c.producer_id),
            text=c.text, prompt_ids=None if c.prompt_tokens is None else c.prompt_tokens.tolist())


async def open_checkpoints(kafka: KafkaConfig, topic: str, *, prompts_topic: str, intake_group: str, producer_id: str,
                           max_staleness: int | None, interval_s: float, metrics: ProducerMetrics,
                           threads: ProducerThreads, loop: asyncio.AbstractEventLoop,
                           timeout: float) -> InflightCheckpoints | None:
    """Start checkpointing on `topic` (NS.inflight); None, with a warning, when the namespace has no such topic
    (made by an older rollstream: the warning names the command that adds it) or the broker did not say how
    many partitions it has within `timeout` s (a startup that spent its time: checkpoints are worth no failed
    start). Blocks off the loop up to `timeout` s (at least 5)."""
    def count_partitions() -> int:
        with reader(kafka, intake_group) as consumer:
            return len(partitions_of(consumer, topic, timeout=max(timeout, _OPEN_MIN_S)))

    try:
        partitions = await threads.infra.run(count_partitions)
    except KafkaIOError as exc:
        if exc.code != "UNKNOWN_TOPIC_OR_PART":  # `missing_topic_error`
            log.warning("cannot read the partitions of %s (%s): in-flight samples are not checkpointed by this "
                        "producer (a crash costs their generation); it generates as usual", topic, exc)
            return None
        namespace = topic.removesuffix(".inflight")
        log.warning("%s does not exist: in-flight samples are not checkpointed (a crash costs their generation); "
                    "add it with 'rollstream topics create --namespace %s', or pass --checkpoint-interval 0 to "
                    "say so", topic, namespace)
        return None
    publisher = Publisher(kafka, topic)
    publisher.start(loop)
    return InflightCheckpoints(kafka, publisher, partitions, prompts_topic=prompts_topic, intake_group=intake_group,
                               producer_id=producer_id, max_staleness=max_staleness, interval_s=interval_s,
                               metrics=metrics, threads=threads)


class InflightCheckpoints:
    """A producer's checkpoints: the writer, and the checkpoints it found per prompt partition. Loop-only.

    Args:
        publisher: a started `Publisher` to NS.inflight, which this owns (closed by `close`).
        partitions: NS.inflight's partition count.
    """

    def __init__(self, kafka: KafkaConfig, publisher: Publisher, partitions: int, *, prompts_topic: str,
                 intake_group: str, producer_id: str, max_staleness: int | None, interval_s: float,
                 metrics: ProducerMetrics, threads: ProducerThreads) -> None:
        self._kafka, self._publisher, self._interval_s = kafka, publisher, interval_s
        self._prompts_topic, self._intake_group = prompts_topic, intake_group
        self._producer_id, self._max_staleness = producer_id, max_staleness
        self._metrics, self._threads = metrics, threads
        self.writer = CheckpointWriter(publisher, partitions, metrics)
        self._found: dict[tuple[int, int], asyncio.Task[Checkpoints]] = {}  # (partition, assignment) -> found
        # prompt partition -> group id -> `GroupProgress.keyed` (None: the partition's checkpoints were unreadable)
        self._keyed: dict[int, dict[str, set[int] | None]] = {}

    async def progress_for(self, taken: TakenPrompt, *, policy_run: int, version: int) -> GroupProgress | None:
        """The `GroupProgress` of `taken` (None for an undecodable prompt). Reads its partition's checkpoints
        first when this assignment of the partition has not yet; a failed read resumes nothing (logged)."""
        prompt = taken.prompt
        if prompt is None:
            return None
        place = (taken.partition, taken.generation)
        if place not in self._found:
            self._found = {k: t for k, t in self._found.items() if k[0] != taken.partition}  # older assignments
            self._found[place] = asyncio.create_task(self._read(taken.partition))
            self._keyed[taken.partition] = {}  # groups of an older assignment that were never published
        try:
            found = await asyncio.shield(self._found[place])
        except RollstreamError:
            found = None  # unread: which samples have another producer's checkpoint is not known
        progress = GroupProgress(taken, prompt, {} if found is None else found.pop(prompt.group_id, {}),
                                 writer=self.writer,
                                 producer_id=self._producer_id, policy_run=policy_run, version=version,
                                 max_staleness=self._max_staleness, interval_s=self._interval_s,
                                 metrics=self._metrics)
        self._keyed.setdefault(taken.partition, {})[prompt.group_id] = None if found is None else progress.keyed
        return progress

    def published(self, taken: TakenPrompt, samples: int) -> None:
        """`taken`'s group (of `samples` samples) is acknowledged: tombstone the checkpoints of its samples that
        have one; all of them when its partition's checkpoints could not be read."""
        if taken.prompt is not None:
            keyed = self._keyed.get(taken.partition, {}).pop(taken.prompt.group_id, set())
            self.writer.forget(taken.prompt.group_id, range(samples) if keyed is None else sorted(keyed),
                               taken.partition)

    async def close(self, deadline: Deadline) -> None:
        """Write what is waiting until `deadline`, then close the client (what it cannot flush is dropped)."""
        for task in self._found.values():
            task.cancel()
        await self.writer.settle(deadline)
        await self._publisher.close(timeout=deadline)

    async def _read(self, prompt_partition: int) -> Checkpoints:
        topic = self._publisher.topic
        partition = self.writer.partition_of(prompt_partition)
        try:
            live, left_behind = await self._threads.infra.run(
                lambda: read_partition(self._kafka, topic, partition, prompts_topic=self._prompts_topic,
                                       prompt_partition=prompt_partition, intake_group=self._intake_group))
        except RollstreamError as exc:
            log.warning("cannot read the checkpoints of %s[%d] on %s (%s): its prompts are generated from scratch",
                        self._prompts_topic, prompt_partition, topic, exc)
            raise
        self.writer.remove(left_behind)
        if live:
            log.info("%s[%d]: checkpoints of %d groups in flight when their producer left; resuming them",
                     self._prompts_topic, prompt_partition, len(live))
        return live


