"""Building a producer's parts, fully made and started, and closing them in order.

`open_parts` checks the cluster, sizes the clients to the rollouts topic, makes the producer's thread
pools (`ProducerThreads`: ``rollstream-user`` for sync plug-ins, ``rollstream-infra``), starts the engine,
the publisher, the lag gate, the policy follower and intake, and returns them together; if any step
fails, what was started is closed again before the error propagates. `Parts.close` undoes it in the
order the guarantees need: the publisher is flushed before intake commits its final watermarks, and the
pools close last (never waiting for a hung plug-in: its daemon thread is left).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from rollstream.infra import KafkaConfig, LagReader, require_topics, sized_to_topic
from rollstream.producers._pipeline import GroupPipeline, GroupSettings
from rollstream.producers._threads import ProducerThreads, in_thread
from rollstream.producers.engines.base import Engine, prepare
from rollstream.producers.gate import LagGate
from rollstream.producers.intake import Intake
from rollstream.producers.metrics import ProducerMetrics
from rollstream.producers.policy import PolicyFollower
from rollstream.producers.publisher import Publisher
from rollstream.producers.rewards import Reward
from rollstream.producers.settings import ProducerSettings
from rollstream.schemas import RollstreamError

log = logging.getLogger(__name__)
_JOIN_TIMEOUT_S = 5.0
_PROMPTS_CHECK_S = 5.0  # reading NS.prompts' offsets at startup (advice only: a slow answer is skipped)


@dataclass(frozen=True)
class Parts:
    """A running producer's parts. Each owns its state; only `rollstream.producers.service` holds them all."""

    engine: Engine
    publisher: Publisher
    gate: LagGate
    policy: PolicyFollower
    intake: Intake
    pipeline: GroupPipeline
    threads: ProducerThreads

    async def close(self, *, publish_timeout: float) -> None:
        """Flush the publisher (up to `publish_timeout` s), commit intake's final watermarks and leave the
        group, stop every thread (bounded joins), the engine and the pools. Idempotent parts; call once."""
        try:
            await self.publisher.close(timeout=publish_timeout)
            try:
                await self.intake.close()
            except TimeoutError:
                log.error("prompt consumer did not close in time; its last commit may be missing")
            self.gate.stop()
            await self.policy.close()
            await _join({"rollstream-intake": self.intake.join, "rollstream-lag": self.gate.join,
                         "rollstream-control": self.policy.join})
            await self.engine.close()
        finally:
            self.threads.close()


async def open_parts(settings: ProducerSettings, kafka: KafkaConfig, engine: Engine, reward: Reward | None,
                     metrics: ProducerMetrics, *, producer_id: str,
                     on_fatal: Callable[[BaseException], None]) -> Parts:
    """Start every part of a producer (see the module docstring). Blocks only off-loop.

    Raises:
        RollstreamError: the broker is unreachable within ``startup_timeout_s``, a topic is missing,
            the engine cannot start or has no name for a sampling option (ConfigError), or the first lag
            reading failed.
    """
    s, names = settings, settings.topics
    await in_thread(lambda: require_topics(kafka, [names.prompts, names.rollouts], namespace=s.namespace,
                                           timeout=s.startup_timeout_s), name="rollstream-startup")
    kafka = await in_thread(lambda: sized_to_topic(kafka, names.rollouts, timeout=s.startup_timeout_s),
                            name="rollstream-startup")
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as undo:  # closes what started if a later step fails
        threads = ProducerThreads(s.effective_user_threads)
        undo.callback(threads.close)
        prepare(engine, threads=threads.user, sampling=s.sampling())  # as declared: lend threads, check sampling
        await engine.start()
        undo.push_async_callback(engine.close)
        publisher = Publisher(kafka, names.rollouts, overrides=s.producer_overrides, on_fatal=on_fatal,
                              on_queue_full=metrics.count_queue_full)
        publisher.start(loop)
        undo.push_async_callback(publisher.close, 5.0)
        gate = LagGate(kafka, s.trainer_group, names.rollouts, max_lag=s.effective_max_lag,
                       interval_s=s.lag_interval_s, metrics=metrics,
                       fallback_s=s.lag_fallback_s if s.backpressure == "pushed" else None, prompts_topic=names.prompts)
        undo.callback(gate.stop)
        await gate.start(timeout=s.startup_timeout_s)
        policy = PolicyFollower(engine, kafka, names.control, metrics=metrics, watch=s.watch_control,
                                on_position=gate.follow if s.backpressure == "pushed" else None)
        undo.push_async_callback(policy.close)
        await policy.start(catch_up_timeout=min(5.0, s.startup_timeout_s))
        intake = Intake(kafka, names.prompts, s.effective_intake_group, gate=gate, metrics=metrics,
                        prefetch=s.concurrency,
                        instance_id=s.producer_id, session_timeout_s=s.session_timeout_s,
                        commit_interval_s=s.commit_interval_s, producer_id=producer_id,
                        drain_on_revoke_s=s.drain_on_revoke_s, overrides=s.intake_overrides)
        intake.start(loop, on_fatal)
        undo.push_async_callback(intake.close)
        metrics.buffered.set_function(lambda: intake.buffered)
        pipeline = GroupPipeline(
            GroupSettings(n_samples=s.n_samples, sampling=s.sampling(), attempts=s.generate_attempts,
                          max_attempts=s.max_attempts,
                          backoff_s=s.retry_backoff_s, timeout_s=s.generate_timeout_s, producer_id=producer_id,
                          prompts_topic=names.prompts, max_message_bytes=kafka.max_message_bytes),
            engine=engine, reward=reward, policy=policy, publisher=publisher, gate=gate, metrics=metrics,
            threads=threads)
        undo.pop_all()  # everything started: from here on `Parts.close` owns it
    await in_thread(lambda: _warn_if_no_prompts(kafka, names.prompts, s.effective_intake_group, s.namespace),
                    name="rollstream-startup")
    log.info("producer %s: %s -> %s, group %s, n=%d, concurrency=%d, max_lag=%d (trainer group %s)",
             producer_id, names.prompts, names.rollouts, s.effective_intake_group, s.n_samples,
             s.concurrency, s.effective_max_lag, s.trainer_group)
    return Parts(engine=engine, publisher=publisher, gate=gate, policy=policy, intake=intake, pipeline=pipeline,
                 threads=threads)


def _warn_if_no_prompts(kafka: KafkaConfig, topic: str, group: str, namespace: str) -> None:
    """Say at startup, once, when NS.prompts holds nothing (or nothing `group` has not consumed): the producer
    waits for prompts, which is right when they come later and a first-day puzzle when nobody loads any.
    A failed read is logged at DEBUG: this is advice, never a reason not to start."""
    try:
        with LagReader(kafka) as reader:
            lag = reader.group_lag(group, topic, timeout=_PROMPTS_CHECK_S)
    except RollstreamError as exc:
        log.debug("could not read %s at startup: %s", topic, exc)
        return
    load = f"rollstream prompts load FILE.jsonl --namespace {namespace}"
    if all(p.end == p.start for p in lag.partitions):
        log.warning("%s is empty: this producer waits for prompts; load them with '%s'", topic, load)
    elif lag.total == 0:
        log.info("%s holds no prompt %s has not consumed: this producer waits for more ('%s --start-epoch N')",
                 topic, group, load)


async def _join(joins: dict[str, Callable[[float], bool]]) -> None:
    """Join each named thread (bounded); a thread that does not stop in time is left running (daemon)."""
    for name, join in joins.items():
        if not await in_thread(join, _JOIN_TIMEOUT_S, name=f"{name}-join"):
            log.warning("thread %s did not stop within %g s; left running (daemon)", name, _JOIN_TIMEOUT_S)
