"""rollstream as the rollout worker of TRL's experimental `AsyncGRPOTrainer` (TRL 1.16).

    worker = RollstreamRolloutWorker(args, TRLWorkerSettings(namespace="rollstream", group="trl-run-1"))
    trainer = AsyncGRPOTrainer(model=..., args=args, train_dataset=..., rollout_worker=worker,
                               weight_transfer=..., callbacks=[worker.commit_callback()])

Contract (pinned by tests/integration/test_trl_worker.py; paths under TRL's ``experimental/async_grpo/``):

- **One step's groups per step.** With ``token_budget <= 0`` TRL batches a fixed count (async_grpo_trainer.py
  :1443-1448): a micro-batch is ``per_device_train_batch_size x num_processes`` samples and a step is
  ``gradient_accumulation_steps`` of them (transformers 5.24 trainer.py:1878-1881), the ``samples_per_step``
  of :1248-1252. The worker takes
  ``samples_per_step / num_generations`` groups per step; a token budget (a variable count) is refused.
- **Commit after the optimizer step.** TRL reads the queue in order, so its step k trains the k-th batch
  handed over. `commit_callback()` commits it in ``on_step_end`` (after ``optimizer.step()``) and waits for
  the acknowledgement: a checkpoint saved after step k has it committed, and a crash before that gives the
  step's groups (same ids, same order) to the next run.
- **Nothing dropped silently.** Groups TRL cannot train are skipped at take time with a recorded reason:
  wrong size (``group_size``), no logprobs (``logprobs_missing``: TRL's loss needs one per trained token,
  async_rollout_worker.py:152-153), an empty response (``empty_response``: TRL trains only rows with a trained
  token, :194; a response whose loss mask is all 0 has none either), and rollstream's default filters. TRL
  itself drops samples over ``max_staleness`` versions old as it reads them (async_grpo_trainer.py:366-372),
  which would shorten a step and shift every later commit: so staleness is filtered at take time
  ``prefetch_steps`` versions tighter (a batch is read at most that many versions after its take), and a step
  is not committed if TRL dropped a sample anyway.

Threading: one thread, ``rollstream-trl``, owns the `RolloutConsumer` (not thread-safe) and the
`PolicyAnnouncer`. It keeps ``prefetch_steps`` batches handed over ahead (at least 2: accelerate's
`DataLoaderDispatcher` reads the first micro-batch of step k+1 before step k trains, accelerate 1.15
data_loader.py:919) and waits for groups in slices of ``poll_interval_s`` (`RolloutConsumer.poll_batch`, which
returns None when a slice ends: no error, no cluster read) so it serves the trainer in between; only
``take_timeout_s`` passing raises a `TakeTimeout`, diagnosed then (`RolloutConsumer.timeout_error`). The
trainer's thread only enqueues requests: a commit carries a future the callback waits on (bounded);
`update_model_version` an announcement. The thread's state is `_trl_pipeline.Pipeline`'s; the buffer TRL
reads is `_trl_pipeline.HandOver`; groups become TRL samples in `_trl_samples`.

Runs: the worker is one trainer run (`rollstream.infra.runs`, its `PolicyAnnouncer`), begun at TRL's first weight
sync (or first commit). A restarted trainer's worker supersedes this one: producers follow the new run's versions
(TRL counts from 1 again), and this worker's next commit or announcement raises `RunSupersededError`, which ends
the worker thread (one log line) and reaches the trainer through `commit_step` and `check_health`.

What it does not do: move weights. Versions are announced on NS.control; producers load weights
themselves (a policy directory, ``weights_path``, or their engine's own sync).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.consumers._consumer import DEFAULT_GROUP
from rollstream.consumers._trl_pipeline import HandOver, Metrics, Pipeline
from rollstream.consumers._trl_samples import to_rollout_samples, trl_group_id
from rollstream.infra import KafkaConfig, RunSupersededError
from rollstream.infra.threads import WorkerThread
from rollstream.schemas import ConfigError, LifecycleError, RollstreamError

if TYPE_CHECKING:
    from transformers import TrainerCallback
else:
    try:
        from transformers import TrainerCallback
    except ImportError:  # `import rollstream.consumers.trl` works without TRL; commit_callback() says what is missing
        TrainerCallback = object

__all__ = ["RollstreamCommitCallback", "RollstreamRolloutWorker", "StepShape", "TRLWorkerSettings", "step_shape",
           "to_rollout_samples", "trl_group_id"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TRLWorkerSettings:
    """Where the worker takes groups and how long it waits.

    Attributes:
        bootstrap_servers: Kafka address (None: ``ROLLSTREAM_BOOTSTRAP_SERVERS``, else 127.0.0.1:9092).
        namespace: topic namespace (NS.rollouts, NS.steps, NS.control).
        group: the trainer's consumer group (offsets, step manifests, the producers' lag gate).
        take_timeout_s: fail with a `TakeTimeout` saying why when one step's groups do not arrive within this
            time (None: wait;
            TRL's ``heartbeat_stale_after_s`` still aborts a trainer left waiting, via `check_health`).
        max_staleness: skip groups more than this many versions old at take time (None: TRL's
            ``max_staleness`` minus `prefetch_steps`, the most that TRL never drops).
        prefetch_steps: batches handed to TRL ahead of its optimizer steps (>= 2, see the module doc).
        dynamic_sampling: skip groups whose rewards are all equal (zero advantage), as rollstream does.
        weights_path: announced with each version, ``{version}`` filled in (None: announce no path).
        commit_timeout_s: how long the commit callback waits for the commit acknowledgement.
        kafka_timeout_s: the consumer's broker timeout (start, commit retries).
        poll_interval_s: the longest the worker thread is busy before it serves the trainer again.
        kafka_config_file: librdkafka properties for its clients (security.protocol, sasl.*, ssl.*), as
            ``--kafka-config`` (None: none; a ``kafka=`` KafkaConfig given to the worker wins).
    """

    bootstrap_servers: str | None = None
    namespace: str = "rollstream"
    group: str = DEFAULT_GROUP
    take_timeout_s: float | None = None
    max_staleness: int | None = None
    prefetch_steps: int = 2
    dynamic_sampling: bool = True
    weights_path: str | None = None
    commit_timeout_s: float = 120.0
    kafka_timeout_s: float = 30.0
    poll_interval_s: float = 0.5
    kafka_config_file: str | None = None

    def __post_init__(self) -> None:
        if not self.namespace or not self.group:
            raise ConfigError(f"namespace={self.namespace!r} and group={self.group!r} must be non-empty")
        if self.prefetch_steps < 2:
            raise ConfigError(f"prefetch_steps={self.prefetch_steps}: use 2 or more; TRL reads the first "
                              "micro-batch of the next step before it trains the current one")
        for name in ("take_timeout_s", "commit_timeout_s", "kafka_timeout_s", "poll_interval_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name}={value}: give a positive number of seconds")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"max_staleness={self.max_staleness} must be >= 0 (or None)")


@dataclass(frozen=True)
class StepShape:
    """What one TRL optimizer step drains, derived from its `AsyncGRPOConfig` (see the module doc)."""

    samples_per_step: int
    num_generations: int
    max_staleness: int  # rollstream's limit at take time
    trl_max_staleness: int  # TRL's, past which it drops a sample it reads

    @property
    def groups_per_step(self) -> int:
        return self.samples_per_step // self.num_generations


def step_shape(args: Any, settings: TRLWorkerSettings) -> StepShape:
    """The step shape of TRL config `args`. Raises ConfigError for a config rollstream cannot serve."""
    budget = args.token_budget
    if budget is None or budget > 0:
        raise ConfigError(f"AsyncGRPOConfig(token_budget={budget}): set token_budget=0. rollstream hands TRL "
                          "exactly the groups of one step, which needs TRL's fixed-count batching")
    samples = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    n = args.num_generations
    if samples % n:
        raise ConfigError(f"a TRL step drains per_device_train_batch_size x gradient_accumulation_steps x "
                          f"world_size = {samples} samples, not a multiple of num_generations={n}; make it one")
    bound = args.max_staleness - settings.prefetch_steps
    if bound < 0 or (settings.max_staleness is not None and settings.max_staleness > bound):
        raise ConfigError(f"TRL drops samples more than max_staleness={args.max_staleness} versions old and "
                          f"reads a batch up to prefetch_steps={settings.prefetch_steps} versions after it was "
                          f"taken: rollstream's max_staleness must be <= {max(bound, 0)} (got "
                          f"{settings.max_staleness}); raise TRL's max_staleness or lower rollstream's")
    chosen = bound if settings.max_staleness is None else settings.max_staleness
    return StepShape(samples, n, chosen, args.max_staleness)




@dataclass(frozen=True)
class _Commit:
    trl_step: int
    done: Future[int]


class RollstreamRolloutWorker(WorkerThread):
    """TRL's `RolloutWorkerProtocol` (async_grpo_trainer.py:115-152) fed by rollstream.

    Creating one makes no network call. The trainer calls `start` on train begin, reads
    `rollout_buffer`, calls `update_model_version` after each weight sync, `check_health` while it
    waits, and `stop` at the end. Add `commit_callback()` to the trainer's callbacks, or nothing is
    ever committed. Use it on the main process only (TRL calls it there). See the module docstring.

    Args:
        args: the trainer's `AsyncGRPOConfig` (batch sizes, num_generations, token_budget, max_staleness).
        settings: where to take groups (default `TRLWorkerSettings()`).
        kafka: full client configuration (security settings); wins over ``settings.bootstrap_servers``.

    Raises:
        RollstreamError: a TRL config rollstream cannot serve (see `step_shape`).
    """

    def __init__(self, args: Any, settings: TRLWorkerSettings | None = None, *,
                 kafka: KafkaConfig | None = None) -> None:
        super().__init__()
        self.settings = settings or TRLWorkerSettings()
        self.shape = step_shape(args, self.settings)
        config_file = self.settings.kafka_config_file
        self.kafka = kafka or KafkaConfig.load(self.settings.bootstrap_servers,
                                               Path(config_file) if config_file else None,
                                               client_id=f"rollstream-trl-{self.settings.group}")
        self._version = 0  # TRL's model version; written by the trainer's thread only
        self.rollout_buffer = HandOver(lambda: self._version, self.shape.trl_max_staleness)
        self.metrics_queue: queue.Queue[Metrics] = queue.Queue(maxsize=4096)
        self._commands: queue.Queue[_Commit | int] = queue.Queue()  # int: a version to announce
        self._lock = threading.Lock()  # orders "enqueue a commit" against "the thread has ended"
        self._ended = False
        self._error: BaseException | None = None
        self._full = False
        self._last_progress = time.monotonic()

    # -- RolloutWorkerProtocol (called by the trainer's thread) ----------------------------------

    def start(self) -> None:
        """Start the worker thread, which connects and begins taking groups. Returns at once."""
        if self.started:
            log.warning("RollstreamRolloutWorker.start() called twice; ignoring")
            return
        self._last_progress = time.monotonic()
        self._launch(self._run, "rollstream-trl")

    def stop(self) -> None:
        """Stop the thread: announce what is queued, close the consumer. Batches handed over and not
        committed are not committed (the next run takes them again first). Blocks up to
        ``commit_timeout_s``. Idempotent."""
        super().stop()
        if not self.join(self.settings.commit_timeout_s):
            log.warning("the rollstream-trl thread did not end within %.0f s", self.settings.commit_timeout_s)

    def update_model_version(self, model_version: int) -> None:
        """Remember TRL's policy version (staleness is measured against it) and have the worker thread
        announce it on NS.control, so producers stamp it. Never blocks. Does not move weights:
        producers load them themselves (``settings.weights_path`` is announced with the version)."""
        self._version = int(model_version)
        self._commands.put(int(model_version))

    def check_health(self, stale_after_s: float) -> None:
        """Raise the worker thread's error if it died; raise RollstreamError if it is not running, or
        handed nothing over for `stale_after_s` s, or every handed-over sample was read but TRL has
        not finished a step (its steps are not the size rollstream gives). Never blocks."""
        if self._error is not None:
            raise self._error
        if not self.running:
            raise LifecycleError("the rollstream worker thread is not running (start() not called, or stopped): call "
                                 "start() first, or build a new worker after stop()")
        if self._full and self.rollout_buffer.qsize() == 0:
            raise RollstreamError(f"TRL read all {self.settings.prefetch_steps} batches handed over without finishing "
                                  f"a step; a step should drain {self.shape.samples_per_step} samples")
        idle = time.monotonic() - self._last_progress
        if idle > stale_after_s:
            raise RollstreamError(f"rollstream handed TRL nothing for {idle:.0f} s (> {stale_after_s:g} s) while "
                                  f"waiting for {self.shape.groups_per_step} groups in namespace "
                                  f"{self.settings.namespace}; are producers running? `rollstream lag --group "
                                  f"{self.settings.group}`")

    # -- commits ----------------------------------------------------------------------------------

    def commit_callback(self) -> TrainerCallback:
        """A `transformers.TrainerCallback` that commits each step's groups in ``on_step_end``."""
        if TrainerCallback is object:
            raise RollstreamError("the TRL worker needs transformers and TRL: pip install 'trl>=1.16'")
        return RollstreamCommitCallback(self)

    def commit_step(self, trl_step: int) -> int:
        """Commit the oldest batch handed to TRL (what its optimizer step `trl_step` trained); return its
        rollstream step. Blocks until the step's manifest and offsets are acknowledged, at most
        ``commit_timeout_s``. Thread-safe (the worker thread does the commit).

        Raises:
            RollstreamError: the worker failed or stopped (its error, e.g. CommitError), or no answer in time.
        """
        done: Future[int] = Future()
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._ended or not self.started:
                raise RollstreamError(f"cannot commit TRL step {trl_step}: the rollstream worker is not running")
            self._commands.put(_Commit(trl_step, done))
        try:
            return done.result(self.settings.commit_timeout_s)
        except FutureTimeout:
            raise RollstreamError(f"TRL step {trl_step} was not committed within {self.settings.commit_timeout_s:g} "
                                  "s; its groups come back to the next run") from None

    # -- the worker thread ------------------------------------------------------------------------

    def _run(self) -> None:
        pipeline: Pipeline | None = None
        try:
            pipeline = Pipeline(self.settings, self.shape, self.kafka, self.rollout_buffer, self._push)
            while not self._stop.is_set():
                self._full = pipeline.full
                if self._serve(pipeline, wait=self._full) or self._full:
                    continue
                if pipeline.take_slice(self._version):
                    self._last_progress = time.monotonic()
            self._serve(pipeline, wait=False)  # the last announcements
        except RunSupersededError as exc:  # expected when the job was restarted elsewhere: one line, no traceback
            log.error("the rollstream TRL worker stopped: %s", exc)
            self._error = exc
        except BaseException as exc:
            log.exception("the rollstream TRL worker failed")
            self._error = exc
        finally:
            self._end()
            if pipeline is not None:
                pipeline.close()

    def _serve(self, pipeline: Pipeline, *, wait: bool) -> bool:
        """Handle the trainer's queued requests (waiting up to a poll interval when `wait`); True if any."""
        try:
            command = self._commands.get(timeout=self.settings.poll_interval_s) if wait else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            if isinstance(command, _Commit):
                try:
                    command.done.set_result(pipeline.commit_oldest(command.trl_step))
                except BaseException as exc:
                    self._error = exc  # before the trainer's thread sees the commit fail: check_health raises it too
                    command.done.set_exception(exc)
                    raise
                self._last_progress = time.monotonic()
            else:
                pipeline.announce(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _end(self) -> None:
        with self._lock:
            self._ended = True
        error = self._error or RollstreamError("the rollstream worker stopped before committing this step")
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Commit):
                command.done.set_exception(error)

    def _push(self, metrics: Metrics) -> None:
        try:
            self.metrics_queue.put_nowait(metrics)
        except queue.Full:
            pass  # TRL drains it in log(); never block the worker on a trainer that does not log


class RollstreamCommitCallback(TrainerCallback):
    """Commits the step TRL just trained, in ``on_step_end`` (after ``optimizer.step()``), on the main
    process only. Put it before callbacks that save checkpoints. Raises what `commit_step` raises,
    which stops training: the step's groups then come back to the next run. On train begin it checks
    that the trainer's own config has the step shape the worker was built for (else RollstreamError)."""

    def __init__(self, worker: RollstreamRolloutWorker) -> None:
        self._worker = worker

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        shape = step_shape(args, self._worker.settings)
        if shape != self._worker.shape:
            raise ConfigError(f"the trainer's config gives {shape}, but its rollstream worker was built for "
                              f"{self._worker.shape}: build RollstreamRolloutWorker with the trainer's args")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self._worker.commit_step(state.global_step)
