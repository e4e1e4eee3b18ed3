"""`RolloutProducer`: take prompts, generate a group per prompt, score it, publish it, commit the prompt.

Three behaviours are pinned by tests against a real broker (tests/integration/test_producer_*.py):
1. Nothing is lost: a prompt's offset is committed only after its group was acknowledged by the
   broker (acks=all), as a contiguous watermark per partition; a group that cannot be generated,
   scored or fit in a record is published as a failed record with its error, so it is accounted.
2. Backpressure: no new prompt starts while the trainer's lag on NS.rollouts exceeds max_lag (or this
   producer's own uncommitted groups exceed its share of the fleet's max_lag); the
   prompt partitions are paused (and still polled) meanwhile. In-flight groups always finish and
   publish, so lag stays within max_lag + every producer's concurrency.
3. The event loop never blocks: polling, committing, lag reads, a full producer queue, flushing and
   any sync user code run in named threads or executors; delivery reports only schedule callbacks.
   Sync user code has threads of its own (``rollstream-user``, `rollstream.producers._threads`): a hung
   generate or reward function holds its own thread only, never tokenization, publishing or shutdown.

The parts (`rollstream.producers._parts`) each own their state: intake (prompts, watermarks, credits), the lag
gate (what was produced, the lag), the policy follower (versions, weights), the publisher, the group
pipeline. This module keeps the lifecycle and the dispatch loop:
``await slots.acquire(); await gate.wait_open(); taken = await anext(intake); spawn(group)``.

Lifecycle: `run` until `stop` (SIGTERM/SIGINT with `run_sync`), ``exit_when_idle_s``, or a fatal error.
Stopping halts intake, lets in-flight groups finish and publish up to ``drain_timeout_s``, then closes
(flushes, commits the final watermarks, leaves the group) in `_CLOSE_S` more, and returns within
``drain_timeout_s`` + `GRACE_S` whatever the broker does (a frozen or unreachable broker included): one
`Deadline` for the whole stop (`rollstream.producers._parts.Parts.close`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rollstream.infra import KafkaConfig, LagReader
from rollstream.infra.deadline import Deadline
from rollstream.infra.threads import in_thread
from rollstream.producers._parts import Parts, open_parts
from rollstream.producers.engines.base import Engine
from rollstream.producers.engines.custom import as_engine
from rollstream.producers.intake import TakenPrompt
from rollstream.producers.metrics import LoopLagProbe, ProducerMetrics, ProducerStats
from rollstream.producers.rewards import Reward, RewardFn, load_reward
from rollstream.producers.settings import ProducerSettings
from rollstream.schemas import LifecycleError, RollstreamError

log = logging.getLogger(__name__)
_IDLE_OVERSHOOT_S = 1.0  # an idle watcher tick this much late: the process was stopped or starved, not idle
# What a stop may take after its drain to close up (flush, last commit, leave the group, joins): half of GRACE_S,
# so that the stop, the metrics server's close (its 0.5 s poll) and the wake-ups stay within drain_timeout_s + GRACE_S.
_CLOSE_S = 1.0


class RolloutProducer:
    """One producer process's worth of work, runnable in-process.

    Args:
        engine: an `Engine`, or a custom generate function (``async def f(prompt, n, sampling_params)``).
        settings: see `ProducerSettings`.
        kafka: how to reach Kafka (default: ``ROLLSTREAM_BOOTSTRAP_SERVERS``). Size limits follow the
            rollouts topic's ``max.message.bytes``, read at start.
        reward: a built-in name (``math``, ``exact``), ``MODULE:FUNC``, a function, or None (no reward).

    Construction does no I/O. `run` owns every thread and client and releases them when it returns.
    `stop`, `stats` and `policy_version` are thread-safe; everything else belongs to the loop running `run`.
    Raises ConfigError (construction): an engine that declares no `EngineCapabilities`, or whose declaration
    does not hold.
    """

    def __init__(self, engine: Engine | Callable[..., Awaitable[Any]], settings: ProducerSettings | None = None, *,
                 kafka: KafkaConfig | None = None, reward: str | RewardFn | Reward | None = None) -> None:
        self.settings = settings or ProducerSettings()
        self.engine: Engine = as_engine(engine)
        self.reward = load_reward(reward)
        self.kafka = (kafka or KafkaConfig()).with_client_id(f"rollstream-producer-{self.settings.namespace}")
        self.producer_id = self.settings.effective_producer_id
        self.metrics = ProducerMetrics()
        self.metrics_port: int | None = None
        self.exit_reason: str | None = None
        self._probe = LoopLagProbe(self.metrics.loop_lag)
        self._parts: Parts | None = None  # while `run` runs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = asyncio.Event()
        self._stopping = False
        self._force = False
        self._fatal: BaseException | None = None
        self._in_flight: set[asyncio.Task[None]] = set()
        self.metrics.in_flight.set_function(self._in_flight.__len__)  # read when scraped, not set per group

    # -- public, thread-safe ---------------------------------------------------------------------

    def stop(self, *, force: bool = False) -> None:
        """Ask `run` to stop: halt intake, drain in-flight groups (skip the drain with `force`), commit.

        Thread-safe and idempotent; returns at once. `run` then returns within ``drain_timeout_s`` plus
        `GRACE_S` (see `run`).
        """
        loop = self._loop
        if loop is None:
            self._stopping, self._force = True, self._force or force
            return
        try:
            loop.call_soon_threadsafe(self._request_stop, "stop requested", force)
        except RuntimeError:
            pass  # the loop already finished

    @property
    def policy_version(self) -> int:
        """The newest policy version announced on NS.control (0 before any, and before `run`).

        It is what samples are stamped with when their engine reports no version (see `rollstream.producers.policy`)."""
        parts = self._parts
        return parts.policy.policy_version if parts is not None else 0

    @property
    def registry(self) -> Any:
        """This producer's Prometheus registry."""
        return self.metrics.registry

    def stats(self) -> ProducerStats:
        """A snapshot of the counters. Thread-safe (values may be a moment apart)."""
        tally, parts = self.metrics.tally, self._parts
        return ProducerStats(
            prompts_taken=tally.prompts_taken, groups_ok=tally.groups_ok, groups_failed=tally.groups_failed,
            bytes_published=tally.bytes_published, in_flight=len(self._in_flight),
            buffered=parts.intake.buffered if parts is not None else 0,
            paused=parts is not None and not parts.gate.is_open(),
            lag_estimate=parts.gate.estimate if parts is not None else 0,
            loop_lag_p99_ms=self._probe.percentile_ms(0.99), loop_lag_max_ms=self._probe.max_ms(),
            queue_full_waits=tally.queue_full_waits)

    def run_sync(self, *, handle_signals: bool = True) -> ProducerStats:
        """`asyncio.run(self.run())`; with `handle_signals`, SIGTERM/SIGINT stop gracefully, a second one
        skips the drain. Blocks until the producer stops. Raises what `run` raises."""
        async def main() -> ProducerStats:
            if handle_signals:
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, self._on_signal, sig)
            return await self.run()

        return asyncio.run(main())

    async def run(self) -> ProducerStats:
        """Run until stopped, idle (``exit_when_idle_s``) or failed; return the final stats.

        Once stopped it returns within ``drain_timeout_s`` plus `GRACE_S`, whatever the broker does. On return
        every group that was acknowledged has its prompt offset committed (per partition up to the first prompt
        not acknowledged), unless the broker did not confirm that commit by the stop's deadline; prompts not
        committed (unfinished, not published, or their commit unconfirmed) are taken again by the next owner:
        never lost, at worst generated twice (the trainer skips duplicates). Intake's thread may still be
        finishing a commit or its client's close then, which the broker did not answer in time.
        Raises:
            RollstreamError: startup failed (broker unreachable within ``startup_timeout_s``, topics
                missing, engine not loadable) or a fatal Kafka error stopped the producer.
            LifecycleError: ``run`` was called before on this producer (build a new one).
        """
        if self._loop is not None:
            raise LifecycleError("RolloutProducer.run() can run once; build a new producer to run again")
        self._loop = asyncio.get_running_loop()
        if self._stopping:
            self._stopped.set()
        parts = await open_parts(self.settings, self.kafka, self.engine, self.reward, self.metrics,
                                 producer_id=self.producer_id, on_fatal=self._on_fatal)
        self._parts = parts
        background = self._start_background(parts)
        try:
            await self._serve(parts)
        finally:
            await self._close(parts, background)
        if self._fatal is not None:
            raise self._fatal if isinstance(self._fatal, RollstreamError) else RollstreamError(
                f"producer failed: {type(self._fatal).__name__}: {self._fatal}") from self._fatal
        stats = self.stats()
        log.info("producer %s stopped (%s): %s", self.producer_id, self.exit_reason, stats.summary())
        return stats

    # -- running ---------------------------------------------------------------------------------

    async def _serve(self, parts: Parts) -> None:
        """Dispatch until a stop is requested; a prompt held while waiting for a slot or the gate is
        then simply not started (uncommitted: the next owner takes it)."""
        dispatch = asyncio.create_task(self._dispatch(parts), name="rollstream-dispatch")
        stopped = asyncio.create_task(self._stopped.wait())
        await asyncio.wait({dispatch, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if dispatch.done() and not dispatch.cancelled() and dispatch.exception() is not None:
            self._on_fatal(dispatch.exception())  # type: ignore[arg-type]  # a bug in dispatch: stop, loudly
        for task in (dispatch, stopped):
            task.cancel()
        await asyncio.gather(dispatch, stopped, return_exceptions=True)

    async def _dispatch(self, parts: Parts) -> None:
        """A slot, an open gate, then a prompt: a prompt leaves intake only when it can start, so intake
        never runs ahead of generation by more than its queue (and a held prompt never waits on the gate)."""
        slots = asyncio.Semaphore(self.settings.concurrency)
        while True:
            await slots.acquire()
            await parts.gate.wait_open()
            try:
                taken = await anext(parts.intake)
            except StopAsyncIteration:
                return
            self._spawn(parts, taken, slots)

    def _spawn(self, parts: Parts, taken: TakenPrompt, slots: asyncio.Semaphore) -> None:
        task = asyncio.create_task(self._group(parts, taken), name=f"group-{taken.partition}-{taken.offset}")
        self._in_flight.add(task)

        def done(finished: asyncio.Task[None]) -> None:
            self._in_flight.discard(finished)
            slots.release()

        task.add_done_callback(done)

    async def _group(self, parts: Parts, taken: TakenPrompt) -> None:
        """Ends in exactly one of: the group (ok, or failed with its error) acknowledged and its prompt
        acked, or a fatal stop. Never a prompt left unacknowledged while the producer runs on."""
        if not parts.intake.is_current(taken):
            return  # its partition was revoked while it waited for a slot: the new owner takes it
        try:
            await parts.pipeline.run(taken)
        except Exception as exc:  # not even a failed record went out: stop rather than leave a hole
            where = f"{self.settings.topics.prompts}[{taken.partition}]@{taken.offset}"
            log.error("group of %s could not be published, not even as failed; stopping", where, exc_info=True)
            self._on_fatal(exc)
            return
        parts.intake.ack(taken)

    def _start_background(self, parts: Parts) -> list[asyncio.Task[Any]]:
        s = self.settings
        if s.metrics_port is not None:
            self.metrics_port = self.metrics.serve(s.metrics_port)
            log.info("metrics on :%d/metrics", self.metrics_port)
        background = [asyncio.create_task(self._probe.run(), name="rollstream-loop-lag")]
        if s.summary_interval_s:
            background.append(asyncio.create_task(self._summaries(s.summary_interval_s), name="rollstream-summary"))
        if s.exit_when_idle_s:
            background.append(asyncio.create_task(self._idle_watch(parts, s.exit_when_idle_s), name="rollstream-idle"))
        return background

    async def _summaries(self, interval_s: float) -> None:
        """Log the one-line summary every `interval_s`."""
        while True:
            await asyncio.sleep(interval_s)
            log.info("producer %s: %s", self.producer_id, self.stats().summary())

    async def _idle_watch(self, parts: Parts, idle_s: float) -> None:
        """Stop once, for `idle_s`, no prompt arrived while intake was not paused, and all is committed.

        Quiet time counts only while this process runs and its partitions stay the same: a watcher that
        slept far past its tick (the process was stopped, e.g. SIGSTOP, or starved) or an assignment that
        changed starts the count again, so a producer that just woke up or just received partitions looks
        for their prompts before it may call itself idle."""
        intake, gate = parts.intake, parts.gate
        tick = min(0.1, idle_s / 4)
        quiet_since = last_tick = time.monotonic()
        owned = intake.owned()
        while not self._stopping:
            await asyncio.sleep(tick)
            now = time.monotonic()
            woke_late, last_tick = now - last_tick > tick + _IDLE_OVERSHOOT_S, now
            reassigned, owned = intake.owned() != owned, intake.owned()
            if woke_late or reassigned or not intake.joined.is_set() or not gate.is_open():
                quiet_since = now
                continue
            quiet_since = max(quiet_since, intake.last_message_at)
            if intake.buffered or self._in_flight or not intake.settled() or now - quiet_since < idle_s:
                continue
            if await parts.threads.infra.run(self._prompts_left):
                quiet_since = time.monotonic()  # prompts wait that no producer took (yet): not idle
                continue
            if intake.owned() != owned or intake.last_message_at > quiet_since or not intake.settled():
                continue  # something arrived while the lag was read: look again
            log.info("idle for %g s with everything published and committed: exiting", idle_s)
            self._request_stop(f"idle for {idle_s:g} s")
            return

    def _prompts_left(self) -> bool:
        """Whether any partition of NS.prompts holds prompts past the intake group's committed offset, read
        with a client of its own (intake's may be the one that is stuck). All partitions, not only this
        producer's: one that no producer owns right now (its owner died or left, a rebalance is under way)
        will be assigned to a producer that is still there, so none of them may leave. Blocks; off the
        loop. An unreadable lag counts as prompts left: no exit on a guess."""
        s = self.settings
        try:
            with LagReader(self.kafka) as reader:
                lag = reader.group_lag(s.effective_intake_group, s.topics.prompts, timeout=5.0)
        except RollstreamError as exc:
            log.info("idle, but the lag of %s is unreadable (%s): not exiting yet", s.effective_intake_group, exc)
            return True
        waiting = {p.partition: p.lag for p in lag.partitions if p.lag > 0}
        if waiting:
            log.info("idle for the exit, but prompts wait on %s %s that the intake group %s has not committed: "
                     "not exiting", s.topics.prompts, waiting, s.effective_intake_group)
        return bool(waiting)

    # -- stopping --------------------------------------------------------------------------------

    async def _close(self, parts: Parts, background: list[asyncio.Task[Any]]) -> None:
        """Drain, then close the parts: ``drain_timeout_s`` + `_CLOSE_S` in all (one deadline; forced: the
        drain is skipped and closing gets `_CLOSE_S`), plus the metrics server's close."""
        self._stopping = True
        parts.intake.halt()
        stop = Deadline.after(self.settings.drain_timeout_s + _CLOSE_S)
        await self._drain(stop.within(self.settings.drain_timeout_s))
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await parts.close(stop.within(_CLOSE_S) if self._force else stop)
        await in_thread(self.metrics.close, name="rollstream-metrics-close")  # waits for serve_forever's 0.5 s poll

    async def _drain(self, deadline: Deadline) -> None:
        """Let in-flight groups finish (until `deadline`); cancel what is left: their prompts stay uncommitted."""
        if not self._in_flight:
            return
        log.info("stopping: draining %d in-flight groups (up to %g s)", len(self._in_flight),
                 self.settings.drain_timeout_s)
        pending = set(self._in_flight)
        while pending and not self._force and not deadline.expired:  # re-checked: a second signal forces
            _, pending = await asyncio.wait(pending, timeout=deadline.seconds(0.1))
        for task in pending:
            task.cancel()
        if pending:
            log.warning("stopping: %d groups did not finish in time; their prompts stay uncommitted", len(pending))
            await asyncio.gather(*pending, return_exceptions=True)

    def _request_stop(self, reason: str, force: bool = False) -> None:
        if self.exit_reason is None:
            self.exit_reason = reason
        self._stopping = True
        self._force = self._force or force
        self._stopped.set()

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._stopping:
            log.warning("%s again: stopping without waiting for in-flight groups", name)
            self._request_stop(name, force=True)
        else:
            log.warning("%s: stopping intake, finishing in-flight groups (again to skip)", name)
            self._request_stop(name)

    def _on_fatal(self, exc: BaseException) -> None:
        if self._fatal is None:
            self._fatal = exc
            log.error("fatal: %s", exc)
        self._request_stop(f"fatal: {exc}")
