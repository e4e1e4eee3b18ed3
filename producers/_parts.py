"""Building a producer's parts, fully made and started, and closing them in order, each within one deadline.

`open_parts` checks the cluster, sizes the clients to the rollouts topic, makes the producer's thread
pools (`ProducerThreads`: ``rollstream-user`` for sync plug-ins, ``rollstream-infra``), starts the engine,
the publisher, the lag gate, the policy follower and intake, and returns them together; if any step
fails, what was started is closed again before the error propagates. Its broker waits (the cluster check,
the sizing, the first lag reading, the policy catch-up, the prompts check) spend one `Deadline` of
``startup_timeout_s``; the engine's start is no broker wait (a model loads, a user hook runs: its own
bounds apply) and the startup clock stops while it runs.

`Parts.close` undoes it within the stop's `Deadline`, whatever the broker does: the policy follower and the
engine first (nothing generates any more), then the publisher is flushed (what it cannot flush in time is
purged) before intake commits its final watermarks, then the checkpoints waiting are written (in what is left),
and the pools close last (never waiting for a hung
plug-in: its daemon thread is left). A thread that does not end in time (intake's, inside a commit or a
close the broker does not answer) is left to finish on its own: it alone calls its client, and closes it
itself, so no client is ever closed under a call (librdkafka's consumer close has no timeout of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rollstream.infra import KafkaConfig, LagReader
from rollstream.infra.deadline import Deadline
from rollstream.infra.group_protocol import Resolved, resolve_group_protocol, set_group_session
from rollstream.infra.kafka_io import require_topics
from rollstream.infra.threads import in_thread
from rollstream.infra.topics import sized_to_topic
from rollstream.producers._inflight import InflightCheckpoints, open_checkpoints
from rollstream.producers._pipeline import GroupPipeline, GroupSettings
from rollstream.producers._threads import ProducerThreads
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
_CATCH_UP_S = 5.0  # reading NS.control to its end at startup (advice only: early samples may carry an older version)
_PROTOCOL_S = 5.0  # reading the broker's group protocols (and setting the group's session) at startup
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
    inflight: InflightCheckpoints | None = None

    async def close(self, deadline: Deadline) -> None:
        """Stop following the policy, close the engine, flush the publisher (purging what it cannot flush),
        commit intake's final watermarks and leave the group, stop every thread (joins), close the pools.

        Returns within `deadline` plus `GRACE_S`, whatever the broker does (see the module docstring). When it
        returns, every prompt whose group was acknowledged is committed, except those whose commit the broker
        did not confirm in time: those stay uncommitted (or land later, from intake's thread) and their next
        owner generates them again (duplicates the trainer skips, never a loss). Idempotent parts; call once.
        """
        try:
            await self.policy.close()
            await _within(self.engine.close(), deadline, "the engine's close")
            await self.publisher.close(timeout=deadline)
            try:
                await self.intake.close(deadline)
            except TimeoutError:
                log.warning("the prompt consumer did not finish its last commit and close in time (broker not "
                            "answering?): left to finish in its own thread; prompts whose commit did not land are "
                            "generated again by their next owner")
            if self.inflight is not None:  # after the commits: tombstones left unwritten are found and written later
                await self.inflight.close(deadline)
            self.gate.stop()
            await _join({"rollstream-intake": self.intake.join, "rollstream-lag": self.gate.join,
                         "rollstream-control": self.policy.join}, deadline)
        finally:
            self.threads.close()


async def open_parts(settings: ProducerSettings, kafka: KafkaConfig, engine: Engine, reward: Reward | None,
                     metrics: ProducerMetrics, *, producer_id: str,
                     on_fatal: Callable[[BaseException], None]) -> Parts:
    """Start every part of a producer (see the module docstring). Blocks only off-loop: its broker waits
    ``startup_timeout_s`` in all (plus `GRACE_S`), and the engine's start what that takes.

    Raises:
        RollstreamError: the broker is unreachable within ``startup_timeout_s``, a topic is missing,
            the engine cannot start or has no name for a sampling option (ConfigError), or the first lag
            reading failed (in what was left of ``startup_timeout_s``).
    """
    s, names = settings, settings.topics
    startup = Deadline.after(s.startup_timeout_s)
    await in_thread(lambda: require_topics(kafka, [names.prompts, names.rollouts], namespace=s.namespace,
                                           timeout=s.startup_timeout_s),  # the first wait: all of it
                    name="rollstream-startup")
    kafka = await in_thread(lambda: sized_to_topic(kafka, names.rollouts, timeout=startup.seconds(math.inf)),
                            name="rollstream-startup")
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as undo:  # closes what started if a later step fails
        threads = ProducerThreads(s.effective_user_threads)
        undo.callback(threads.close)
        declared = prepare(engine, threads=threads.user, sampling=s.sampling())  # lend threads, check sampling
        startup = await _start_engine(engine, startup)
        undo.push_async_callback(engine.close)
        publisher = Publisher(kafka, names.rollouts, overrides=s.producer_overrides, on_fatal=on_fatal,
                              on_queue_full=metrics.count_queue_full)
        publisher.start(loop)
        undo.push_async_callback(publisher.close, 5.0)
        saves = s.checkpoint_interval_s and declared.saves_progress  # none for an engine that cannot resume
        inflight = None if not saves else await open_checkpoints(
            kafka, names.inflight, prompts_topic=names.prompts, intake_group=s.effective_intake_group,
            producer_id=producer_id, max_staleness=s.checkpoint_max_staleness, interval_s=s.checkpoint_interval_s,
            metrics=metrics, threads=threads, loop=loop, timeout=startup.seconds(math.inf))
        if inflight is not None:
            undo.push_async_callback(inflight.close, Deadline.after(5.0))
        gate = LagGate(kafka, s.trainer_group, names.rollouts, max_lag=s.effective_max_lag,
                       interval_s=s.lag_interval_s, metrics=metrics,
                       fallback_s=s.lag_fallback_s if s.backpressure == "pushed" else None, prompts_topic=names.prompts)
        undo.callback(gate.stop)
        await gate.start(timeout=startup)
        policy = PolicyFollower(engine, kafka, names.control, metrics=metrics, watch=s.watch_control,
                                on_position=gate.follow if s.backpressure == "pushed" else None)
        undo.push_async_callback(policy.close)
        await policy.start(catch_up_timeout=startup.seconds(_CATCH_UP_S))
        protocol = await in_thread(lambda: intake_protocol(kafka, s, startup.seconds(_PROTOCOL_S)),
                                   name="rollstream-startup")
        intake = Intake(kafka, names.prompts, s.effective_intake_group, gate=gate, metrics=metrics,
                        prefetch=s.concurrency, group_protocol=protocol,
                        instance_id=s.producer_id, session_timeout_s=s.session_timeout_s,
                        commit_interval_s=s.commit_interval_s, producer_id=producer_id,
                        drain_on_revoke_s=s.drain_on_revoke_s, overrides=s.intake_overrides)
        metrics.buffered.set_function(lambda: intake.buffered)
        pipeline = GroupPipeline(
            GroupSettings(n_samples=s.n_samples, sampling=s.sampling(), attempts=s.generate_attempts,
                          max_attempts=s.max_attempts,
                          backoff_s=s.retry_backoff_s, timeout_s=s.generate_timeout_s, producer_id=producer_id,
                          prompts_topic=names.prompts, max_message_bytes=kafka.max_message_bytes),
            engine=engine, reward=reward, policy=policy, publisher=publisher, gate=gate, metrics=metrics,
            threads=threads, inflight=inflight)
        intake.start(loop, on_fatal)  # last: nothing can fail after it, so nothing undoes it
        undo.pop_all()  # everything started: from here on `Parts.close` owns it
    if not startup.expired:
        await in_thread(lambda: _warn_if_no_prompts(kafka, names.prompts, s.effective_intake_group, s.namespace,
                                                    startup.seconds(_PROMPTS_CHECK_S)), name="rollstream-startup")
    log.info("producer %s: %s -> %s, group %s, n=%d, concurrency=%d, max_lag=%d (trainer group %s)",
             producer_id, names.prompts, names.rollouts, s.effective_intake_group, s.n_samples,
             s.concurrency, s.effective_max_lag, s.trainer_group)
    return Parts(engine=engine, publisher=publisher, gate=gate, policy=policy, intake=intake, pipeline=pipeline,
                 threads=threads, inflight=inflight)


def intake_protocol(kafka: KafkaConfig, s: ProducerSettings, timeout: float) -> Resolved:
    """The intake group's protocol, ``auto`` decided (one log line saying which and why); under the consumer
    protocol the group gets `ProducerSettings.session_timeout_s` as its own session where the broker allows it.
    Blocks up to ~3 x `timeout`. Raises ConfigError for ``consumer`` on a broker without it."""
    protocol, why = resolve_group_protocol(kafka, s.group_protocol, timeout, static=s.producer_id is not None)
    (log.warning if "unreadable" in why and protocol == "consumer" else log.info)(
        "prompt group %s: %s rebalance protocol (%s)", s.effective_intake_group, protocol, why)
    if protocol == "consumer":
        set_group_session(kafka, s.effective_intake_group, s.session_timeout_s, timeout)
    return protocol


async def _start_engine(engine: Engine, startup: Deadline) -> Deadline:
    """Start `engine` with the startup clock stopped (see the module docstring): return `startup` resumed, with
    what was left of it when the engine's start began."""
    left = startup.remaining()
    await engine.start()
    return Deadline.after(left) if left > 0 else startup


def _warn_if_no_prompts(kafka: KafkaConfig, topic: str, group: str, namespace: str, timeout: float) -> None:
    """Say at startup, once, when NS.prompts holds nothing (or nothing `group` has not consumed): the producer
    waits for prompts, which is right when they come later and a first-day puzzle when nobody loads any.
    A failed read is logged at DEBUG: this is advice, never a reason not to start."""
    try:
        with LagReader(kafka) as reader:
            lag = reader.group_lag(group, topic, timeout=timeout)
    except RollstreamError as exc:
        log.debug("could not read %s at startup: %s", topic, exc)
        return
    load = f"rollstream prompts load FILE.jsonl --namespace {namespace}"
    if all(p.end == p.start for p in lag.partitions):
        log.warning("%s is empty: this producer waits for prompts; load them with '%s'", topic, load)
    elif lag.total == 0:
        log.info("%s holds no prompt %s has not consumed: this producer waits for more ('%s --start-epoch N')",
                 topic, group, load)


async def _join(joins: dict[str, Callable[[float], bool]], deadline: Deadline) -> None:
    """Join each named thread within `deadline`; a thread that does not stop in time is left running (daemon)."""
    for name, join in joins.items():
        if not await in_thread(join, deadline.seconds(math.inf), name=f"{name}-join"):
            log.warning("thread %s did not stop by the stop's deadline; left running (daemon, it closes its own "
                        "client)", name)


async def _within(closing: Awaitable[None], deadline: Deadline, what: str) -> None:
    """Await `closing` until `deadline`; past it, cancel it and say so (the stop goes on)."""
    try:
        await asyncio.wait_for(closing, deadline.timeout())
    except TimeoutError:
        log.warning("%s did not finish by the stop's deadline; cancelled", what)
