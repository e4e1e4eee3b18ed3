"""One group's path on the event loop: generate -> score -> record -> publish, under one deadline.

Each group gets one `Deadline` (``generate_timeout_s``) when it starts: its generation (every engine
retry, continuation and backoff: an engine that declares ``takes_deadline`` gets it, spends it and
never outlasts it) and its scoring share it, and nothing extends or multiplies it. A retriable error the
engine did not retry itself (a custom generate function raised, an in-process engine failed) is tried
again here, up to ``attempts`` and only while the deadline leaves room for the backoff; the HTTP engines
retry their own transport and raise final errors, so their retries are never multiplied. A group out of
time is a failed group marked retriable (the trainer may requeue its prompt). Publishing is outside the
deadline: every prompt ends in a record.

The stages end in an `Outcome` (`rollstream.producers._groups`): ok, or failed with its error, so every prompt is
accounted: the prompt did not decode, the engine gave up, a reward raised or returned junk, or an
unforeseen error (a bug) happened anywhere before the broker acknowledged. `encode_within` turns the
outcome into a record that fits the topic (falling back to a failed record). Only a failed
*publication* (the broker did not acknowledge) raises: the prompt then stays uncommitted.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollstream.producers._budget import LoopBudget
from rollstream.producers._groups import SHAPES, Outcome, Shape, encode_within, oversize_error, sampling_of
from rollstream.producers._inflight import InflightCheckpoints
from rollstream.producers._threads import ProducerThreads
from rollstream.producers.engines._retry import Backoff, Deadline, out_of_time
from rollstream.producers.engines.base import Engine, EngineError, Generation, SamplingParams, capabilities_of
from rollstream.producers.engines.progress import Progress
from rollstream.producers.gate import LagGate
from rollstream.producers.intake import TakenPrompt
from rollstream.producers.metrics import ProducerMetrics
from rollstream.producers.policy import PolicyFollower
from rollstream.producers.publisher import Publisher, PublishError
from rollstream.producers.rewards import Reward, RewardError
from rollstream.schemas import ConfigError, InvalidRecordError, Sampling, ScoredGroup

log = logging.getLogger(__name__)
_ENCODE_OFF_LOOP_BYTES = 1 << 20
_MAX_BACKOFF_S = 10.0


@dataclass(frozen=True)
class GroupSettings:
    """What every group of one producer shares. `recorded_sampling` (derived from `sampling`) is what every
    record carries. Raises ConfigError when the sampling parameters do not fit a record."""

    n_samples: int
    sampling: SamplingParams
    attempts: int  # whole-generation tries within the deadline (retriable errors the engine did not retry)
    max_attempts: int  # attempts of the prompt across the fleet (requeues by the trainer), stamped on groups
    backoff_s: float
    timeout_s: float | None  # the group's deadline: generation with its retries, and scoring (None: none)
    producer_id: str
    prompts_topic: str
    max_message_bytes: int
    recorded_sampling: Sampling = field(init=False)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "recorded_sampling", sampling_of(self.sampling))
        except InvalidRecordError as exc:
            raise ConfigError(str(exc)) from exc


class GroupPipeline:
    """Makes and publishes groups; stateless per group. Loop-only.

    Building and encoding a group runs on the loop; a burst of groups ready at once shares each turn of
    the loop up to `LoopBudget`'s budget (2 ms), so timers and delivery reports are never held for long.
    Sync reward functions run in `threads.user`, a large group's encoding in `threads.infra` (None: pools
    of its own, for tests; `open_parts` passes the producer's, which `Parts.close` closes).
    """

    def __init__(self, settings: GroupSettings, *, engine: Engine, reward: Reward | None, policy: PolicyFollower,
                 publisher: Publisher, gate: LagGate, metrics: ProducerMetrics,
                 threads: ProducerThreads | None = None, inflight: InflightCheckpoints | None = None) -> None:
        self.settings = settings
        self.engine, self.reward, self.policy = engine, reward, policy
        self.publisher, self.gate, self.metrics = publisher, gate, metrics
        self.threads = threads or ProducerThreads(4)
        self._budget = LoopBudget()
        self._backoff = Backoff(settings.backoff_s, max(settings.backoff_s, _MAX_BACKOFF_S))
        self._rng = random.Random()
        declared = capabilities_of(engine)
        self._engine_takes_deadline = declared.takes_deadline
        self.inflight = inflight if declared.saves_progress else None  # checkpoints of the engines that save them

    async def run(self, taken: TakenPrompt) -> None:
        """Make the group and publish it; returns once the broker acknowledged it.

        An unforeseen error while publishing the group publishes a failed stand-in instead.
        Raises:
            PublishError: the broker did not acknowledge the record (the prompt stays uncommitted).
        """
        started = time.perf_counter()
        outcome = await self.outcome(taken)
        self.metrics.generation.observe(time.perf_counter() - started)
        try:
            await self.publish(taken, outcome)
        except PublishError:
            raise
        except Exception as exc:  # a bug or an unforeseen error: account the prompt as a failed group
            log.exception("group of %s failed unexpectedly; publishing it as failed", self._where(taken))
            await self.publish(taken, Outcome(error=f"internal error: {type(exc).__name__}: {exc}"))
        if self.inflight is not None:
            self.inflight.published(taken, self.settings.n_samples)

    async def outcome(self, taken: TakenPrompt) -> Outcome:
        """Generate and score under the group's one deadline. Never raises but for cancellation: a failure
        is a failed `Outcome`."""
        if taken.prompt is None:
            return Outcome(error=f"undecodable prompt: {taken.error}")
        prompt = taken.prompt.plugin_dict()
        run, version_at_start = self.policy.followed  # before generating: see rollstream.producers.policy
        progress = None if self.inflight is None else await self.inflight.progress_for(
            taken, policy_run=run, version=version_at_start)
        deadline = Deadline.after(self.settings.timeout_s)
        try:
            generation = await self.generate(prompt, deadline, progress)
        except Exception as exc:
            log.warning("group %s failed: %s", taken.prompt.group_id, exc)
            return Outcome(error=f"generation failed: {exc}", retriable=getattr(exc, "retriable", False))
        finally:
            if progress is not None:
                progress.count_resumed()
        versions = self.policy.stamp(generation.completions, version_at_start)
        try:
            rewards = await self.score(prompt, generation, deadline)
        except RewardError as exc:
            log.warning("group %s failed: %s", taken.prompt.group_id, exc)
            return Outcome(generation=generation, versions=versions, policy_run=run, error=str(exc),
                           retriable=exc.retriable)
        except Exception as exc:
            log.exception("scoring group %s failed unexpectedly", taken.prompt.group_id)
            return Outcome(generation=generation, versions=versions, policy_run=run,
                           error=f"internal error: {type(exc).__name__}: {exc}")
        return Outcome(generation=generation, rewards=rewards, versions=versions, policy_run=run)

    async def generate(self, prompt: dict[str, Any], deadline: Deadline | None = None,
                       progress: Progress | None = None) -> Generation:
        """`engine.generate` within `deadline` (None: the settings' from now), handing it `progress` (the
        group's checkpoints, for an engine that saves progress); a retriable error is tried again (see the
        module docstring). Raises the last error; a retriable EngineError when time ran out."""
        s = self.settings
        deadline = deadline or Deadline.after(s.timeout_s)
        for attempt in range(1, s.attempts + 1):
            try:
                generation = await self._attempt(prompt, deadline, progress)
                if len(generation.completions) != s.n_samples:
                    raise EngineError(f"engine returned {len(generation.completions)} completions, expected "
                                      f"{s.n_samples}", retriable=False)
                return generation
            except EngineError as exc:
                if not exc.retriable or attempt == s.attempts:
                    raise
                error: Exception = exc
            except Exception as exc:  # an engine bug is retried like a transient error, then reported
                if attempt == s.attempts:
                    raise EngineError(f"{type(exc).__name__}: {exc}", retriable=False) from exc
                error = exc
            delay = self._backoff.delay_s(attempt, self._rng)
            if deadline.expired and isinstance(error, EngineError):
                raise error  # out of time (the deadline's own error, or a last one that came just in time)
            if delay >= deadline.remaining():  # no room for another try: the trainer may requeue the prompt
                raise out_of_time(deadline, "generation", str(error)) from error
            log.info("prompt %s: attempt %d/%d failed (%s); retrying in %.2f s", prompt["id"], attempt,
                     s.attempts, error, delay)
            await asyncio.sleep(delay)
        raise EngineError("no generation attempt was made", retriable=False)

    async def _attempt(self, prompt: dict[str, Any], deadline: Deadline, progress: Progress | None) -> Generation:
        """One `engine.generate` call, bounded by what is left of the deadline (a hung engine or generate
        function becomes a retriable EngineError; a sync function's thread cannot be stopped and is left)."""
        s = self.settings
        declared: dict[str, Any] = {"deadline": deadline} if self._engine_takes_deadline else {}
        if progress is not None:
            declared["progress"] = progress
        try:
            async with asyncio.timeout(deadline.timeout()):  # no task of its own, unlike wait_for: ~8 us a group
                return await self.engine.generate(prompt, s.n_samples, s.sampling, **declared)
        except TimeoutError:
            raise out_of_time(deadline, "generation") from None

    async def score(self, prompt: dict[str, Any], generation: Generation,
                    deadline: Deadline | None = None) -> list[float | None]:
        """One reward per completion (None each without a reward function), within what is left of
        `deadline` (None: the settings' from now). Raises RewardError (also when the deadline runs out)."""
        if self.reward is None:
            return [None] * len(generation.completions)
        reward, pool = self.reward, self.threads.user
        deadline = deadline or Deadline.after(self.settings.timeout_s)
        try:
            async with asyncio.timeout(deadline.timeout()):
                return list(await asyncio.gather(*(reward(prompt, c.to_dict(), threads=pool)
                                                   for c in generation.completions)))
        except TimeoutError:  # a hung verifier must not hang its prompt forever
            raise RewardError(f"reward {reward.name}: the group took longer than {deadline.total_s:g} s, its "
                              "deadline (--group-timeout / generate_timeout_s)", retriable=True) from None

    async def publish(self, taken: TakenPrompt, outcome: Outcome) -> None:
        """Encode the outcome within the topic's limit (off-loop when large) and publish it.

        A broker that refuses a record as too large (its limit is below ours) gets a smaller failed one:
        stripped, then bare (see `rollstream.producers._groups`).
        Raises:
            PublishError: the broker did not acknowledge the record (not even the bare one).
        """
        await self._budget.turn()  # building and encoding is the group's longest stretch on the loop
        group, value = await self._encode(taken, outcome)
        smaller: list[Sequence[Shape]] = [("stripped", "bare"), ("bare",)]
        while True:
            try:
                await self._send(group, value)
                return
            except PublishError as exc:
                if exc.code != "MSG_SIZE_TOO_LARGE" or not smaller:
                    raise
            log.warning("broker refused group %s (%d bytes) as too large: publishing a smaller failed record",
                        group.group_id, len(value))
            limit, namespace = self.settings.max_message_bytes, self.settings.prompts_topic.removesuffix(".prompts")
            refused = Outcome(error=f"{oversize_error(len(value), limit, namespace)} (refused by the broker)")
            group, value = await self._encode(taken, refused, smaller.pop(0))

    async def _encode(self, taken: TakenPrompt, outcome: Outcome,
                      shapes: Sequence[Shape] = SHAPES) -> tuple[ScoredGroup, bytes]:
        s = self.settings
        encode = functools.partial(encode_within, taken, outcome, s.max_message_bytes, producer_id=s.producer_id,
                                   prompts_topic=s.prompts_topic, shapes=shapes, sampling=s.recorded_sampling,
                                   max_attempts=s.max_attempts)
        generation = outcome.generation
        tokens = sum(len(c.tokens) for c in generation.completions) if generation is not None else 0
        if tokens * 8 > _ENCODE_OFF_LOOP_BYTES:  # int32 tokens + float32 logprobs: a big record, encode off-loop
            return await self.threads.infra.run(encode)
        return encode()

    async def _send(self, group: ScoredGroup, value: bytes) -> None:
        self.gate.note_produced()
        started = time.perf_counter()
        delivery = None
        try:
            delivery = await self.publisher.publish(group.group_id.encode(), value)
        finally:  # acknowledged (or refused): no longer in flight to the broker; the share counts it where it landed
            self.gate.note_settled(*((delivery.partition, delivery.offset) if delivery is not None else ()))
        self.metrics.count_published(group.status, len(value), time.perf_counter() - started)

    def _where(self, taken: TakenPrompt) -> str:
        return f"{self.settings.prompts_topic}[{taken.partition}]@{taken.offset}"

