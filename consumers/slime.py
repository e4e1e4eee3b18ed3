"""Use rollstream as the rollout source of slime (THUDM's RL framework), in either of its training loops.

Point slime at it with::

    --rollout-function-path rollstream.consumers.slime.generate_rollout
    --data-source-path rollstream.consumers.slime.RollstreamDataSource     # checkpoint save/load of the Kafka position
    --num-rollout N                                             # a stream has no length to derive it from

and tell the adapter which loop calls it: ``args.rollstream_slime_loop`` / ``ROLLSTREAM_SLIME_LOOP`` =
``sync`` (slime's ``train.py``) or ``async`` (``train_async.py``). Each rollout call takes exactly
``args.rollout_batch_size`` groups from NS.rollouts (one rollstream step) and returns them as slime
``Sample`` groups, in slime's ``RolloutFnTrainOutput`` with rollstream's metrics when slime is importable.

When a batch is committed (read at slime 624b824, 2026-08; file:line there):

- ``train.py`` generates rollout k (train.py:53), trains it (:69), saves a checkpoint (:71-80), updates the
  weights (:85), and only then asks for rollout k+1: with ``sync``, batch k is committed when k+1 is asked for.
- ``train_async.py`` asks for rollout k+1 right after it received k (:39-40), *before* it trains k (:53):
  committing k then would lose it if the trainer died in step k. With ``async``, batch k is committed when
  rollout k+2 is asked for (train k has returned by then).
- In both loops slime checkpoints after training k (``RolloutManager.save(k)``, train.py:79-80,
  train_async.py:63-64): `RollstreamDataSource.save` commits through batch k there and stores its step number.
- Unset, the adapter commits as with ``async``, which never commits a batch before it was trained in either
  loop (under ``train.py`` it commits one call later than needed). When the calls contradict the setting
  (a save or an eval of k arriving after rollout k+1 was handed over is ``train_async.py``'s order, one
  arriving before it is ``train.py``'s), `generate_rollout` / `RollstreamDataSource.save` raise.

Resume: slime restores checkpoint k and calls ``data_source.load(k)`` (ray/placement_group.py:221-222);
`RollstreamDataSource.load` moves the consumer to the end of k's step (`RolloutConsumer.seek_to_step`), so
the next rollout continues exactly after it, whatever was committed later, with the same batches as before.
Each slime job is one trainer run (`rollstream.infra.runs`), begun at its first rollout or load: from then on
the broker refuses the announcements and commits of the job it replaced (a hung job that comes back gets
`RunSupersededError`). At each rollout whose weight version (below) moved it announces that version on
NS.control, without weights (slime moves them to its engines itself), before it commits or takes: producers
follow a restarted job down to its lower count and stamp its run on the groups they generate. A group
generated under an older run (the dead job's backlog) is skipped as stale and requeued (`filters.older_run`,
also without ``rollstream_max_staleness``); a step recorded after a restored checkpoint is taken again as
recorded, as above, unless it holds such a group: then its records are judged afresh.

Staleness (``rollstream_max_staleness``) is measured against the weight version slime's engines serve, which
counts ``update_weights`` calls, not rollouts: slime's weight updater starts at 0 and adds 1 before each push
(backends/megatron_utils/update_weight/update_weight_from_distributed.py:47, :108), the first push being
before the loop (train.py:27, train_async.py:26), and starts over after a resume. So for rollout r of a run
that started at ``args.start_rollout_id`` S: ``1 + (r - S)`` under ``train.py``; under ``train_async.py``
(and when unset) 1 plus the updates done after steps S..r-2 (every ``args.update_weights_interval``-th).
Producers on SGLang stamp each sample with the ``weight_version`` the engine reports, so both count alike.

Eval calls (``evaluation=True``; slime's ``--eval-function-path`` defaults to the rollout function,
utils/arguments.py:1968-1969) are delegated to ``rollstream_eval_function_path`` /
``ROLLSTREAM_EVAL_FUNCTION_PATH`` (default slime's own ``slime.rollout.sglang_rollout.generate_rollout``, which
evaluates ``--eval-prompt-data`` on slime's engines); rollstream serves training rollouts only.

Other settings, from ``args`` attributes, else environment variables: ``rollstream_bootstrap_servers`` /
``ROLLSTREAM_BOOTSTRAP_SERVERS``, ``rollstream_namespace`` / ``ROLLSTREAM_NAMESPACE``, ``rollstream_group`` /
``ROLLSTREAM_TRAINER_GROUP``, ``rollstream_take_timeout`` / ``ROLLSTREAM_TAKE_TIMEOUT`` (seconds, default:
wait), ``rollstream_max_staleness`` / ``ROLLSTREAM_MAX_STALENESS``, ``rollstream_dynamic_sampling`` /
``ROLLSTREAM_DYNAMIC_SAMPLING`` (default on), ``rollstream_kafka_config`` / ``ROLLSTREAM_KAFKA_CONFIG`` (a
librdkafka properties file, as ``--kafka-config``: SASL, TLS). Groups whose size differs from
``args.n_samples_per_prompt`` are skipped (reason ``group_size``): slime reshapes rewards by that number.

Samples are slime's ``slime.utils.types.Sample``: ``tokens`` = prompt then response token ids,
``response_length``, ``loss_mask`` (one per response token: the sample's loss mask, 0 on the tool and
environment tokens of a multi-turn rollout, as slime's examples/search-r1/generate_with_search.py marks its
observations; ``[1] * response_length`` when it has none), ``rollout_log_probs`` (one per response token,
None when the engine returned none), ``reward``, ``status`` (COMPLETED / TRUNCATED / ABORTED from the finish
reason, FAILED for a failed group), ``weight_versions`` (strings, as SGLang reports them: one per distinct
policy version that generated the sample, oldest first, so a partial rollout continued on new weights lists
both), ``prompt``, ``response``, ``label`` (``metadata["label"]``), ``group_index``, ``index``, and
``metadata`` with group_id, prompt_id, epoch, partition, offset, producer_id.

What slime decides from a batch (read at slime's 2026-08 HEAD): with ``--rollout-top-p`` != 1.0 it asserts
top-p replay data (``rollout_top_p_token_ids`` / ``_offsets``) on every sample, which rollstream does not
carry, so the adapter refuses that setting at its first call (`check_top_p`, naming the fix); and it takes
``rollout_log_probs`` for the whole batch from its first sample, so a batch whose samples disagree (producers
on engines with and without logprobs) goes without them, with a warning (`uniform_logprobs`), or fails
when slime is told to use them.

The adapter's state (the consumer, the batches handed over) lives on ``args`` (one per slime rollout
manager, which calls it from one thread); nothing is kept in module state.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollstream.consumers._adapters import StepMetrics, group_size_filter
from rollstream.consumers._batch import Batch
from rollstream.consumers._consumer import RolloutConsumer
from rollstream.consumers._slime_samples import (
    check_top_p,
    sample_class,
    to_slime_group,
    train_output_class,
    uniform_logprobs,
)
from rollstream.consumers._slime_settings import SlimeSettings
from rollstream.consumers.filters import default_filters, older_run
from rollstream.infra import KafkaConfig, PolicyAnnouncer, TopicNames
from rollstream.schemas import ConfigError, PolicyVersion, RollstreamError

log = logging.getLogger(__name__)
_STATE_ATTR = "_rollstream_slime_rollout"


class SlimeRollout:
    """The consumer of one slime rollout manager and the batches it handed over, by rollout id.

    Not thread-safe (slime's RolloutManager calls it from one thread). See the module docstring for
    the commit rule and the weight versions.
    """

    def __init__(self, args: Any, settings: SlimeSettings, consumer: RolloutConsumer | None = None) -> None:
        self.settings = settings
        n_samples = getattr(args, "n_samples_per_prompt", None)
        filters = (*default_filters(dynamic_sampling=settings.dynamic_sampling),
                   group_size_filter(int(n_samples) if n_samples else None, trainer="slime",
                                     setting="n_samples_per_prompt"), older_run)
        self.run: PolicyAnnouncer | None = None
        self.announced: int | None = None  # the weight version this run announced last
        if consumer is None:
            # One trainer run (rollstream.infra.runs): a replaced slime job can neither announce nor commit. It
            # announces slime's weight-update count (no weights: slime moves them to its engines itself), so that
            # producers follow a resumed job down to its count and stamp its run on what they generate.
            config = KafkaConfig.load(settings.bootstrap_servers,
                                      Path(settings.kafka_config_file) if settings.kafka_config_file else None,
                                      client_id=f"rollstream-trainer-{settings.group}")
            self.run = PolicyAnnouncer(config, TopicNames(settings.namespace))
            consumer = RolloutConsumer(config=config, group_id=settings.group, namespace=settings.namespace,
                                       filters=filters, max_staleness=settings.max_staleness, announcer=self.run)
        self.consumer = consumer
        self.start: int | None = getattr(args, "start_rollout_id", None)
        self.update_interval = int(getattr(args, "update_weights_interval", None) or 1)
        self.every_step = bool(getattr(args, "release_train", False))
        self.num_rollout: int | None = getattr(args, "num_rollout", None)
        self.handed: dict[int, Batch] = {}  # rollout id -> batch handed over and not committed, oldest first
        self.steps: dict[int, int] = {}  # rollout id -> its rollstream step number
        self.last: int | None = None  # the newest rollout id handed over

    # -- rollouts --------------------------------------------------------------------------------

    def rollout(self, rollout_id: int, n: int) -> tuple[Batch, int]:
        """Commit what slime has trained by now, then take rollout `rollout_id`'s batch; return it and the
        weight version it was measured against. Blocks until n groups are there (or the take timeout)."""
        if self.last is not None and rollout_id <= self.last:
            raise RollstreamError(f"slime asked for rollout {rollout_id} after rollout {self.last}: rollout ids "
                                  "must increase (is a second trainer using this args object?)")
        if self.start is None:
            self.start = rollout_id
        self.begin_run()
        version = self.weight_version(rollout_id)
        self.announce(version)
        self.commit_through(rollout_id - (1 if self.settings.loop == "sync" else 2))
        batch = self.consumer.take(n, timeout=self.settings.take_timeout, commit=False, policy_version=version)
        self.handed[rollout_id] = batch
        self.steps[rollout_id] = batch.step
        self.last = rollout_id
        return batch, version

    def begin_run(self) -> None:
        """Begin this job's trainer run before its first take or seek (idempotent): from then on the broker
        refuses the commits of the slime job this one replaced (`RunSupersededError` there)."""
        if self.run is not None:
            self.run.begin()

    def announce(self, version: int) -> None:
        """Announce `version` on NS.control as this run's, unless it was the last announced. Blocks until the
        broker committed it. Raises RunSupersededError when a newer slime job began, KafkaIOError (retriable)."""
        if self.run is None or version == self.announced:
            return
        self.run.announce(PolicyVersion(version, metadata={"trainer": "slime"}))
        self.announced = version

    def weight_version(self, rollout_id: int) -> int:
        """The weight version slime's engines serve when rollout `rollout_id` is asked for."""
        start = self.start if self.start is not None else rollout_id
        if self.settings.loop == "sync":
            return 1 + max(0, rollout_id - start)
        trained = range(start, rollout_id - 1)  # steps whose weight update is done when rollout_id is asked for
        return 1 + sum(1 for k in trained if self.every_step or (k + 1) % self.update_interval == 0)

    def commit_through(self, rollout_id: int) -> None:
        """Commit the batches of rollouts up to `rollout_id` (trained by now). Blocks until committed.
        Raises CommitError (retriable) when the broker does not acknowledge in time."""
        done = [r for r in self.handed if r <= rollout_id]
        if not done:
            return
        self.consumer.commit(self.handed[max(done)])  # a prefix: every earlier batch too
        for r in done:
            del self.handed[r]

    def check_order(self, what: str, rollout_id: int) -> None:
        """A save or an eval of `rollout_id` came: raise when its place in the calls contradicts the loop."""
        if self.last is None or (self.num_rollout is not None and rollout_id + 1 >= self.num_rollout):
            return
        seen = "async" if self.last > rollout_id else "sync" if self.last == rollout_id else None
        if seen is None or self.settings.loop in (None, seen):
            if self.settings.loop is None and seen is not None:
                log.debug("slime's calls follow %s", "train_async.py" if seen == "async" else "train.py")
            return
        if seen == "async":
            order = (f"slime's {what} of rollout {rollout_id} came after rollout {self.last} was handed over, which is "
                     "train_async.py's order (it asks for rollout k+1 before it trains k)")
        else:
            order = (f"slime's {what} of rollout {rollout_id} came before rollout {rollout_id + 1} was asked for, "
                     "which is train.py's order")
        raise ConfigError(f"{order}, but rollstream_slime_loop={self.settings.loop}; set rollstream_slime_loop="
                          f"{seen} (ROLLSTREAM_SLIME_LOOP) so that a batch is committed only after it was trained")

    # -- checkpoints -----------------------------------------------------------------------------

    def trained(self, rollout_id: int) -> int:
        """slime saved a checkpoint after training `rollout_id`: commit through it; return its step number."""
        self.check_order("checkpoint save", rollout_id)
        step = self.steps.get(rollout_id)
        if step is None:
            raise RollstreamError(f"slime saved a checkpoint of rollout {rollout_id}, which this rollout source did "
                                  f"not hand over (it handed {sorted(self.steps) or 'none'})")
        self.commit_through(rollout_id)
        return step

    def resume(self, rollout_id: int, step: int) -> None:
        """slime restored the checkpoint of `rollout_id` (rollstream `step`): continue exactly after it."""
        self.begin_run()
        self.consumer.seek_to_step(step)
        self.handed.clear()
        self.steps = {rollout_id: step}
        self.last = rollout_id

    def close(self) -> None:
        self.consumer.close()
        if self.run is not None:
            self.run.close()


def _state(args: Any) -> SlimeRollout:
    state: SlimeRollout | None = getattr(args, _STATE_ATTR, None)
    if state is None:
        check_top_p(args)
        state = SlimeRollout(args, SlimeSettings.from_args(args))
        setattr(args, _STATE_ATTR, state)
    return state


def _metrics(batch: Batch, version: int, consumer: RolloutConsumer) -> dict[str, float]:
    m = StepMetrics.of(batch, version, consumer.estimated_lag())
    return {"rollstream/step": m.step, "rollstream/weight_version": m.weight_version, "rollstream/lag": m.lag,
            **{f"rollstream/{kind}": m.counts[kind] for kind in ("filtered", "requeued", "duplicate", "undecodable")},
            "rollstream/staleness_mean": m.staleness_mean, "rollstream/staleness_max": m.staleness_max}


def _load_function(path: str) -> Callable[..., Any]:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"cannot load the eval function {path!r} ({exc}); rollstream serves training rollouts "
                          "only: point rollstream_eval_function_path (ROLLSTREAM_EVAL_FUNCTION_PATH) or slime's "
                          "--eval-function-path at an eval rollout function") from exc


def generate_rollout(args: Any, rollout_id: int, data_source: Any = None, evaluation: bool = False) -> Any:
    """slime's rollout function: exactly ``args.rollout_batch_size`` groups of slime Samples.

    Blocks until that many groups passed the filters (or ``rollstream_take_timeout`` s). First commits
    the batches slime has trained by now (see the module docstring); this batch is committed later.
    Returns slime's ``RolloutFnTrainOutput(samples, metrics)`` when importable, else the list of groups.
    ``evaluation=True`` calls the eval function (``rollstream_eval_function_path``) and returns its
    output. `data_source` is not read: prompts reach the producers through NS.prompts.

    Raises:
        TakeTimeout: not enough groups in time (nothing lost; the next call continues).
        CommitError: an earlier batch could not be committed (retriable; nothing lost).
        RollstreamError: a setting is invalid, or the calls contradict ``rollstream_slime_loop``.
    """
    state = _state(args)
    if evaluation:
        state.check_order("eval", rollout_id)
        return _load_function(state.settings.eval_function_path)(args, rollout_id, data_source, evaluation=True)
    batch, version = state.rollout(rollout_id, int(args.rollout_batch_size))
    cls = sample_class()
    first = rollout_id * len(batch.groups)
    samples = [to_slime_group(g, first + i, pos, cls)
               for i, (g, pos) in enumerate(zip(batch.groups, batch.positions, strict=True))]
    uniform_logprobs(samples, args)
    output = train_output_class()
    return samples if output is None else output(samples=samples, metrics=_metrics(batch, version, state.consumer))


class RollstreamDataSource:
    """slime's data source (``--data-source-path rollstream.consumers.slime.RollstreamDataSource``): checkpoints the
    Kafka position with slime's checkpoints. slime calls ``save(k)`` after training rollout k and ``load(k)``
    when it restores checkpoint k (both only with slime's default ``rollout_global_dataset``).

    The state file is ``{args.save}/rollout/rollstream_state_{k}.json``: the rollstream step of rollout k,
    the consumer group and the namespace.
    """

    def __init__(self, args: Any) -> None:
        self.args = args

    def save(self, rollout_id: int) -> None:
        """Commit through rollout `rollout_id`'s batch, then write the state file (fsynced) when
        ``args.save`` is set. Blocks until both are done.

        Raises:
            CommitError: the commit was not acknowledged in time (retriable).
            RollstreamError: the calls contradict ``rollstream_slime_loop``, or `rollout_id` was not handed over.
        """
        state = _state(self.args)
        step = state.trained(rollout_id)
        if getattr(self.args, "save", None) is None:
            return
        path = self._path(self.args.save, rollout_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"rollout_id": rollout_id, "step": step, "group": state.settings.group,
                       "namespace": state.settings.namespace}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        log.info("rollout %d (rollstream step %d) checkpointed in %s", rollout_id, step, path)

    def load(self, rollout_id: int | None = None) -> None:
        """Continue exactly after rollout `rollout_id`'s step, read from its state file under ``args.load``.

        Does nothing without ``args.load`` or the file (a fresh start: slime calls ``load(-1)``); then the
        consumer continues from the group's committed position. Blocks until the position is committed.

        Raises:
            RollstreamError: the file names another consumer group or namespace than this adapter's.
        """
        load = getattr(self.args, "load", None)
        if load is None or rollout_id is None:
            return
        path = self._path(load, rollout_id)
        if not path.exists():
            log.info("no rollstream state for rollout %d at %s: continuing from the group's committed offsets",
                     rollout_id, path)
            return
        saved = json.loads(path.read_text(encoding="utf-8"))
        state = _state(self.args)
        mine = (state.settings.group, state.settings.namespace)
        if (saved["group"], saved["namespace"]) != mine:
            raise ConfigError(f"{path} was saved by group {saved['group']} in namespace {saved['namespace']}, "
                              f"but this run uses group {mine[0]} in namespace {mine[1]}: set rollstream_group "
                              "and rollstream_namespace as in the run that saved it")
        state.resume(rollout_id, int(saved["step"]))

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        raise ConfigError("RollstreamDataSource feeds rollstream.consumers.slime.generate_rollout only; set "
                          "--rollout-function-path rollstream.consumers.slime.generate_rollout")

    def add_samples(self, samples: list[list[Any]]) -> None:
        raise RollstreamError("RollstreamDataSource takes no samples back: aborted or partial groups are requeued "
                              "by the producers, not by slime")

    def __len__(self) -> int:
        raise ConfigError("rollstream is a stream and has no length: pass --num-rollout to slime")

    @staticmethod
    def _path(root: str, rollout_id: int) -> Path:
        return Path(root) / "rollout" / f"rollstream_state_{rollout_id}.json"


def close(args: Any) -> None:
    """Close the consumer kept on `args` (uncommitted batches come back to the next run)."""
    state: SlimeRollout | None = getattr(args, _STATE_ATTR, None)
    if state is not None:
        state.close()
        setattr(args, _STATE_ATTR, None)
