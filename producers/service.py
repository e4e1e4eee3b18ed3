"""`RolloutProducer`: take prompts, generate a group per prompt, score it, publish it, commit the prompt.

Three behaviours are pinned by tests against a real broker (tests/integration/test_producer_*.py):
1. Nothing is lost: a prompt's offset is committed only after its group was acknowledged by the
   broker (acks=all), as a contiguous watermark per partition; a group that cannot be generated,
   scored or fit in a record is published as a failed record with its error, so it is accounted.
2. Backpressure: no new prompt starts while the trainer's lag on NS.rollouts exceeds max_lag; the
   prompt partitions are paused (and still polled) meanwhile. In-flight groups always finish and
   publish, so lag stays within max_lag + concurrency.
3. The event loop never blocks: polling, committing, lag reads, a full producer queue, flushing and
   any sync user code run in named threads or executors; delivery reports only schedule callbacks.

Lifecycle: `run` until `stop` (SIGTERM/SIGINT with `run_sync`), ``exit_when_idle_s``, or a fatal error.
Stopping halts intake, lets in-flight groups finish and publish up to ``drain_timeout_s``, flushes,
commits the final watermarks and returns.

Policy versions: samples are stamped with the latest version announced on NS.control, unless the engine
reports its own. An engine that owns its weights (`ReloadableEngine`, e.g. `HFEngine`) loads each newer
announced version that names a ``weights_path`` (`producers._reload`) and stamps the version it served.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from infra import KafkaConfig, sized_to_topic
from infra.control import ControlWatcher
from producers._pipeline import GroupPipeline
from producers._reload import WeightFollower
from producers._startup import check_cluster
from producers._watermarks import Watermarks
from producers.engines.base import Engine, ReloadableEngine
from producers.engines.custom import CustomEngine
from producers.gate import LagGate
from producers.intake import Intake, TakenPrompt
from producers.metrics import LoopLagProbe, ProducerMetrics, ProducerStats
from producers.publisher import Publisher, PublishError
from producers.rewards import Reward, RewardFn, load_reward
from producers.settings import ProducerSettings
from schemas import RollstreamError

log = logging.getLogger(__name__)
_JOIN_TIMEOUT_S = 5.0


class RolloutProducer:
    """One producer process's worth of work, runnable in-process.

    Args:
        engine: an `Engine`, or a custom generate function (``async def f(prompt, n, sampling_params)``).
        settings: see `ProducerSettings`.
        kafka: how to reach Kafka (default: ``ROLLSTREAM_BOOTSTRAP_SERVERS``). Size limits follow the
            rollouts topic's ``max.message.bytes``, read at start.
        reward: a built-in name (``math``, ``exact``), ``MODULE:FUNC``, a function, or None (no reward).

    Construction does no I/O. `run` owns every thread and client and releases them when it returns.
    `stop` and `stats` are thread-safe; everything else belongs to the loop running `run`.
    """

    def __init__(self, engine: Engine | Callable[..., Awaitable[Any]], settings: ProducerSettings | None = None, *,
                 kafka: KafkaConfig | None = None, reward: str | RewardFn | Reward | None = None) -> None:
        self.settings = settings or ProducerSettings()
        self.engine: Engine = engine if isinstance(engine, Engine) else CustomEngine(engine)
        self.reward = load_reward(reward)
        self.kafka = (kafka or KafkaConfig()).with_client_id(f"rollstream-producer-{self.settings.namespace}")
        self.producer_id = self.settings.effective_producer_id
        self.metrics = ProducerMetrics()
        self._sampling = self.settings.sampling()
        self._marks = Watermarks()
        self._buffer: collections.deque[TakenPrompt] = collections.deque()
        self._in_flight: set[asyncio.Task[None]] = set()
        self._produced = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stopping = False
        self._force = False
        self._fatal: BaseException | None = None
        self._probe = LoopLagProbe(self.metrics.loop_lag)
        self._gate: LagGate | None = None
        self._intake: Intake | None = None
        self._publisher: Publisher | None = None
        self._control: ControlWatcher | None = None
        self._weights: WeightFollower | None = None
        self._pipeline: GroupPipeline | None = None
        self.metrics_port: int | None = None
        self.exit_reason: str | None = None

    # -- public, thread-safe ---------------------------------------------------------------------

    def stop(self, *, force: bool = False) -> None:
        """Ask `run` to stop: halt intake, drain in-flight groups (skip the drain with `force`), commit.

        Thread-safe and idempotent; returns at once.
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
    def current_weight_version(self) -> int:
        """The policy version stamped on samples whose engine reports none: NS.control's latest, else 0.

        An engine that loads announced weights (`ReloadableEngine`, e.g. `HFEngine`) reports the version
        it served each sample with, so its samples never claim a version that was not loaded yet."""
        control = self._control
        version = control.current_weight_version if control is not None else None
        return 0 if version is None else version

    @property
    def registry(self) -> Any:
        """This producer's Prometheus registry."""
        return self.metrics.registry

    def stats(self) -> ProducerStats:
        """A snapshot of the counters. Thread-safe (values may be a moment apart)."""
        m = self.metrics
        return ProducerStats(
            prompts_taken=int(m.count("rollstream_producer_prompts_taken_total")),
            groups_ok=int(m.count("rollstream_producer_groups_published_total", status="ok")),
            groups_failed=int(m.count("rollstream_producer_groups_published_total", status="failed")),
            bytes_published=int(m.count("rollstream_producer_published_bytes_total")),
            in_flight=len(self._in_flight), buffered=len(self._buffer),
            paused=self._gate is not None and not self._gate.opened.is_set(),
            lag_estimate=self._gate.estimate if self._gate is not None else 0,
            loop_lag_p99_ms=self._probe.percentile_ms(0.99), loop_lag_max_ms=self._probe.max_ms(),
            queue_full_waits=int(m.count("rollstream_producer_queue_full_waits_total")))

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

        On return every group that was acknowledged has its prompt offset committed (per partition up
        to the first prompt not acknowledged); unfinished prompts stay uncommitted for the next owner.
        Raises:
            RollstreamError: startup failed (broker unreachable within ``startup_timeout_s``, topics
                missing, engine not loadable) or a fatal Kafka error stopped the producer.
        """
        if self._loop is not None:
            raise RuntimeError("RolloutProducer.run() can run once; build a new producer to run again")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        background: list[asyncio.Task[Any]] = []
        try:
            await self._open(background)
            await self._dispatch()
        finally:
            await self._close(background)
        if self._fatal is not None:
            raise self._fatal if isinstance(self._fatal, RollstreamError) else RollstreamError(
                f"producer failed: {type(self._fatal).__name__}: {self._fatal}") from self._fatal
        stats = self.stats()
        log.info("producer %s stopped (%s): %s", self.producer_id, self.exit_reason, stats.summary())
        return stats

    # -- startup and shutdown ----------------------------------------------------------------------

    async def _open(self, background: list[asyncio.Task[Any]]) -> None:
        s, names = self.settings, self.settings.topics
        await asyncio.to_thread(check_cluster, self.kafka, [names.prompts, names.rollouts], s.namespace,
                                timeout_s=s.startup_timeout_s)
        self.kafka = await asyncio.to_thread(sized_to_topic, self.kafka, names.rollouts,
                                             timeout=s.startup_timeout_s)
        await self.engine.start()
        if isinstance(self.engine, ReloadableEngine) and self.engine.weight_version is not None:
            self.metrics.weight_version.set(self.engine.weight_version)
        loop = asyncio.get_running_loop()
        self._publisher = Publisher(self.kafka, names.rollouts, overrides=s.producer_overrides,
                                    on_fatal=self._on_fatal, on_queue_full=self.metrics.queue_full.inc)
        self._publisher.start(loop)
        self._gate = LagGate(self.kafka, s.trainer_group, names.rollouts, max_lag=s.effective_max_lag,
                             interval_s=s.lag_interval_s, produced=lambda: self._produced,
                             on_change=self._on_gate_change)
        await self._gate.start(timeout_s=s.startup_timeout_s)
        self._on_gate_change(self._gate.opened.is_set())
        if s.watch_control:
            if isinstance(self.engine, ReloadableEngine):  # it owns its weights: follow announced versions
                self._weights = WeightFollower(self.engine, loop, self.metrics)
            self._control = ControlWatcher(self.kafka, names.control,
                                           on_version=self._weights.on_version if self._weights else None)
            self._control.start()
            if not await asyncio.to_thread(self._control.wait_caught_up, min(5.0, s.startup_timeout_s)):
                log.warning("%s not read to its end in time: early samples may carry an older policy version",
                            names.control)
        self._intake = Intake(self.kafka, names.prompts, s.effective_intake_group, watermarks=self._marks,
                              prefetch=s.concurrency, instance_id=s.producer_id,
                              session_timeout_s=s.session_timeout_s, commit_interval_s=s.commit_interval_s,
                              overrides=s.intake_overrides)
        self._intake.set_gated(not self._gate.opened.is_set())
        self._pipeline = GroupPipeline(
            engine=self.engine, reward=self.reward, sampling=self._sampling, n_samples=s.n_samples,
            attempts=s.generate_attempts, backoff_s=s.retry_backoff_s, producer_id=self.producer_id,
            prompts_topic=names.prompts, max_message_bytes=self.kafka.max_message_bytes, publisher=self._publisher,
            gate=self._gate, metrics=self.metrics, weight_version=lambda: self.current_weight_version,
            on_produce=self._on_produce)
        self._intake.start(loop, self._on_prompt, self._on_fatal)
        if s.metrics_port is not None:
            self.metrics_port = self.metrics.serve(s.metrics_port)
            log.info("metrics on :%d/metrics", self.metrics_port)
        background.append(asyncio.create_task(self._probe.run(), name="rollstream-loop-lag"))
        background.append(asyncio.create_task(self._summaries(s.summary_interval_s), name="rollstream-summary"))
        if s.exit_when_idle_s:
            background.append(asyncio.create_task(self._idle_watch(s.exit_when_idle_s), name="rollstream-idle"))
        log.info("producer %s: %s -> %s, group %s, n=%d, concurrency=%d, max_lag=%d (trainer group %s)",
                 self.producer_id, names.prompts, names.rollouts, s.effective_intake_group, s.n_samples,
                 s.concurrency, s.effective_max_lag, s.trainer_group)

    async def _close(self, background: list[asyncio.Task[Any]]) -> None:
        self._stopping = True
        if self._intake is not None:
            self._intake.halt()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.drain_timeout_s
        await self._drain(deadline)
        remaining = 0.0 if self._force else deadline - loop.time()
        if self._publisher is not None:
            await self._publisher.close(timeout_s=max(remaining, 5.0))
        if self._intake is not None:
            await self._close_intake()
        for stopper in (self._gate, self._control):
            if stopper is not None:
                stopper.stop()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await self._join_threads(_JOIN_TIMEOUT_S)
        if self._weights is not None:
            await self._weights.close()
        await self.engine.close()
        await asyncio.to_thread(self.metrics.close)  # server.shutdown() waits for serve_forever's 0.5 s poll

    async def _join_threads(self, timeout_s: float) -> None:
        """Join the lag and control threads, each up to `timeout_s` (a lag read may be under way)."""
        workers = {"rollstream-lag": self._gate, "rollstream-control": self._control}
        running = {name: w for name, w in workers.items() if w is not None}
        ended = await asyncio.gather(*(asyncio.to_thread(w.join, timeout_s) for w in running.values()))
        for name, done in zip(running, ended, strict=True):
            if not done:
                log.warning("thread %s did not stop within %g s; left running (daemon)", name, timeout_s)

    async def _close_intake(self) -> None:
        assert self._intake is not None
        try:
            await self._intake.close()
        except TimeoutError:
            log.error("prompt consumer did not close in time; its last commit may be missing")

    async def _drain(self, deadline: float) -> None:
        """Let in-flight groups finish (up to the drain deadline); cancel what is left."""
        dropped = len(self._buffer)
        self._buffer.clear()
        if dropped:
            log.info("stopping: %d buffered prompts not started (left uncommitted for the next owner)", dropped)
        if not self._in_flight:
            return
        loop = asyncio.get_running_loop()
        log.info("stopping: draining %d in-flight groups (up to %g s)", len(self._in_flight),
                 self.settings.drain_timeout_s)
        pending = set(self._in_flight)
        while pending and not self._force and loop.time() < deadline:  # re-checked: a second signal forces
            _, pending = await asyncio.wait(pending, timeout=min(0.1, max(0.0, deadline - loop.time())))
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
        if self._intake is not None:
            self._intake.halt()
        if self._wake is not None:
            self._wake.set()

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

    # -- intake -> dispatch --------------------------------------------------------------------------

    def _on_prompt(self, taken: TakenPrompt) -> None:
        self._buffer.append(taken)
        self.metrics.prompts.inc()
        self.metrics.buffered.set(len(self._buffer))
        assert self._wake is not None
        self._wake.set()

    def _on_produce(self) -> None:
        """Count a group about to be produced and let the gate close at once if that is one too many."""
        self._produced += 1
        if self._gate is not None:
            self._gate.evaluate()

    def _on_gate_change(self, is_open: bool) -> None:
        self.metrics.paused.set(0 if is_open else 1)
        if self._intake is not None:
            self._intake.set_gated(not is_open)
        if is_open and self._wake is not None:
            self._wake.set()

    async def _dispatch(self) -> None:
        """Start a group whenever a prompt is buffered, a slot is free and the lag gate is open."""
        assert self._wake is not None and self._gate is not None and self._intake is not None
        while not self._stopping:
            if self._buffer and len(self._in_flight) < self.settings.concurrency and self._gate.is_open():
                taken = self._buffer.popleft()
                self._intake.release_credit()
                self.metrics.buffered.set(len(self._buffer))
                if not self._marks.is_current(taken.partition, taken.generation):
                    continue  # its partition was revoked: the new owner takes it
                task = asyncio.create_task(self._process(taken), name=f"group-{taken.partition}-{taken.offset}")
                self._in_flight.add(task)
                self.metrics.in_flight.set(len(self._in_flight))
                continue
            self._wake.clear()
            await self._wake.wait()

    # -- one group -----------------------------------------------------------------------------------

    async def _process(self, taken: TakenPrompt) -> None:
        """Ends in exactly one of: the group (ok, or failed with its error) acknowledged and its prompt
        acked, or a fatal stop. Never a prompt left unacknowledged while the producer runs on."""
        assert self._pipeline is not None
        where = f"{self.settings.topics.prompts}[{taken.partition}]@{taken.offset}"
        try:
            try:
                await self._pipeline.run(taken)
            except PublishError:
                raise
            except Exception as exc:  # a bug or an unforeseen error: account the prompt as a failed group
                log.exception("group of %s failed unexpectedly; publishing it as failed", where)
                error = f"internal error: {type(exc).__name__}: {exc}"
                await self._pipeline.publish(self._pipeline.failed_stand_in(taken, error))
            self._marks.ack(taken.partition, taken.offset, taken.generation)
        except PublishError as exc:
            self._on_fatal(exc)
        except Exception as exc:  # not even the failed stand-in went out: stop rather than leave a hole
            log.error("group of %s could not be published, not even as failed; stopping", where, exc_info=True)
            self._on_fatal(exc)
        finally:
            task = asyncio.current_task()
            if task is not None:
                self._in_flight.discard(task)  # type: ignore[arg-type]
            self.metrics.in_flight.set(len(self._in_flight))
            if self._wake is not None:
                self._wake.set()

    # -- background ------------------------------------------------------------------------------

    async def _summaries(self, interval_s: float) -> None:
        """Refresh the lag gauge every second; log the one-line summary every `interval_s` (0: never)."""
        last_log = time.monotonic()
        while True:
            await asyncio.sleep(min(1.0, interval_s or 1.0))
            if self._gate is not None:
                self.metrics.lag.set(self._gate.estimate)
            if interval_s and time.monotonic() - last_log >= interval_s:
                last_log = time.monotonic()
                log.info("producer %s: %s", self.producer_id, self.stats().summary())

    async def _idle_watch(self, idle_s: float) -> None:
        """Stop once, for `idle_s`, no prompt arrived while intake was not paused, and all is committed."""
        assert self._intake is not None and self._gate is not None
        quiet_since = time.monotonic()
        while not self._stopping:
            await asyncio.sleep(min(0.1, idle_s / 4))
            now = time.monotonic()
            if not self._intake.joined.is_set() or not self._gate.opened.is_set():
                quiet_since = now
                continue
            quiet_since = max(quiet_since, self._intake.last_message_at)
            if self._buffer or self._in_flight or not self._marks.settled():
                continue
            if now - quiet_since >= idle_s:
                log.info("idle for %g s with everything published and committed: exiting", idle_s)
                self._request_stop(f"idle for {idle_s:g} s")
                return

