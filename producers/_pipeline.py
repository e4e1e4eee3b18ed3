"""One group's path on the event loop: generate (bounded retries) -> score -> record -> publish.

Every failure before publishing becomes a failed group carrying its error, so it is accounted: the
engine gave up, a reward raised or returned junk, a sample does not fit the schema, the record is
larger than ``max_message_bytes``. Only a failed *publication* (the broker did not acknowledge) raises.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from producers import _groups
from producers.engines.base import Engine, EngineError, Generation, SamplingParams
from producers.gate import LagGate
from producers.intake import TakenPrompt
from producers.metrics import ProducerMetrics
from producers.publisher import Publisher, PublishError
from producers.rewards import Reward, RewardError
from schemas import InvalidRecordError, ScoredGroup, encode

log = logging.getLogger(__name__)
_ENCODE_OFF_LOOP_BYTES = 1 << 20


class GroupPipeline:
    """Stateless per group; shares the engine, reward, publisher and gate of its producer. Loop-only."""

    def __init__(self, *, engine: Engine, reward: Reward | None, sampling: SamplingParams, n_samples: int,
                 attempts: int, backoff_s: float, producer_id: str, prompts_topic: str, max_message_bytes: int,
                 publisher: Publisher, gate: LagGate, metrics: ProducerMetrics,
                 weight_version: Callable[[], int], on_produce: Callable[[], None]) -> None:
        self.engine, self.reward, self.sampling = engine, reward, sampling
        self.n, self.attempts, self.backoff_s = n_samples, attempts, backoff_s
        self.producer_id, self.prompts_topic, self.limit = producer_id, prompts_topic, max_message_bytes
        self.publisher, self.gate, self.metrics = publisher, gate, metrics
        self._weight_version, self._on_produce = weight_version, on_produce

    async def run(self, taken: TakenPrompt) -> None:
        """Make the group and publish it; returns once the broker acknowledged it.

        Raises:
            PublishError: the broker did not acknowledge the record (the prompt stays uncommitted).
        """
        started = time.perf_counter()
        group = await self.make_group(taken)
        self.metrics.generation.observe(time.perf_counter() - started)
        await self.publish(group)

    async def make_group(self, taken: TakenPrompt) -> ScoredGroup:
        """Generate and score; any failure becomes a failed group. Only cancellation escapes."""
        pid, started_ms = self.producer_id, taken.taken_at_ms
        if taken.prompt is None:
            return _groups.undecodable_group(self.prompts_topic, taken.partition, taken.offset, taken.error or "",
                                             producer_id=pid, started_at_ms=started_ms)
        prompt, pdict = taken.prompt, taken.prompt.to_dict()
        version = self._weight_version()
        try:
            generation = await self.generate(pdict)
        except Exception as exc:
            log.warning("group %s failed: %s", prompt.group_id, exc)
            return _groups.failed_group(prompt, f"generation failed: {exc}", producer_id=pid,
                                        started_at_ms=started_ms)
        try:
            rewards = await self.score(pdict, generation)
            samples = _groups.samples_of(generation, rewards, version)
            return _groups.ok_group(prompt, generation, samples, producer_id=pid, started_at_ms=started_ms)
        except (RewardError, InvalidRecordError) as exc:
            log.warning("group %s failed: %s", prompt.group_id, exc)
            try:
                return _groups.failed_group(prompt, str(exc), producer_id=pid, started_at_ms=started_ms,
                                            generation=generation, samples=_unscored(generation, version))
            except InvalidRecordError:  # the generation itself does not fit (e.g. prompt tokens beyond int32)
                return _groups.failed_group(prompt, str(exc), producer_id=pid, started_at_ms=started_ms)

    def failed_stand_in(self, taken: TakenPrompt, error: str) -> ScoredGroup:
        """A failed group for `taken` carrying only `error` (its group could not be made or published)."""
        if taken.prompt is None:
            return _groups.undecodable_group(self.prompts_topic, taken.partition, taken.offset,
                                             f"{taken.error or ''} ({error})",
                                             producer_id=self.producer_id, started_at_ms=taken.taken_at_ms)
        return _groups.failed_group(taken.prompt, error, producer_id=self.producer_id,
                                    started_at_ms=taken.taken_at_ms)

    async def generate(self, prompt: dict[str, Any]) -> Generation:
        """`engine.generate` with bounded retries of retriable errors. Raises the last error."""
        for attempt in range(1, self.attempts + 1):
            try:
                generation = await self.engine.generate(prompt, self.n, self.sampling)
                if len(generation.completions) != self.n:
                    raise EngineError(f"engine returned {len(generation.completions)} completions, expected "
                                      f"{self.n}", retriable=False)
                return generation
            except EngineError as exc:
                if not exc.retriable or attempt == self.attempts:
                    raise
                error: Exception = exc
            except Exception as exc:  # an engine bug is retried like a transient error, then reported
                if attempt == self.attempts:
                    raise EngineError(f"{type(exc).__name__}: {exc}", retriable=False) from exc
                error = exc
            delay = self.backoff_s * 2 ** (attempt - 1)
            log.info("prompt %s: attempt %d/%d failed (%s); retrying in %.2f s", prompt["id"], attempt,
                     self.attempts, error, delay)
            await asyncio.sleep(delay)
        raise EngineError("no generation attempt was made", retriable=False)

    async def score(self, prompt: dict[str, Any], generation: Generation) -> list[float | None]:
        if self.reward is None:
            return [None] * len(generation.completions)
        reward = self.reward
        return list(await asyncio.gather(*(reward(prompt, c.to_dict()) for c in generation.completions)))

    async def publish(self, group: ScoredGroup) -> None:
        """Encode (off-loop when large), replace an oversize or unencodable group by a failed one, publish.

        Raises:
            PublishError: the broker did not acknowledge the record.
        """
        value = await self._encode(group)
        if len(value) > self.limit:
            log.warning("group %s is %d bytes > max_message_bytes %d: published as failed", group.group_id,
                        len(value), self.limit)
            group = _groups.oversize_group(group, len(value), self.limit)
            value = encode(group)
        self._on_produce()
        started = time.perf_counter()
        try:
            await self.publisher.publish(group.group_id.encode(), value)
        except PublishError as exc:
            if exc.code != "MSG_SIZE_TOO_LARGE" or group.status == "failed":
                raise
            log.warning("broker refused group %s as too large: published as failed", group.group_id)
            group = _groups.oversize_group(group, len(value), self.limit)
            value = encode(group)
            await self.publisher.publish(group.group_id.encode(), value)
        self.metrics.publish.observe(time.perf_counter() - started)
        self.metrics.groups.labels(status=group.status).inc()
        self.metrics.bytes.inc(len(value))

    async def _encode(self, group: ScoredGroup) -> bytes:
        try:
            if group.nbytes > _ENCODE_OFF_LOOP_BYTES:
                return await asyncio.to_thread(encode, group)
            return encode(group)
        except InvalidRecordError as exc:
            log.warning("group %s cannot be encoded (%s): published as failed", group.group_id, exc)
            return encode(_groups.stripped_failed(group, f"cannot encode group: {exc}"))


def _unscored(generation: Generation, version: int) -> list[Any]:
    """The samples without rewards, for a group whose scoring failed ([] when they do not fit either)."""
    try:
        return _groups.samples_of(generation, [None] * len(generation.completions), version)
    except InvalidRecordError:
        return []
