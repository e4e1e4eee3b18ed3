"""The trainer's consumer: take exactly n groups per step, commit exactly what was taken.

Contract (each point pinned by tests/integration/test_consumer_*.py):

- `take(n)` returns exactly n accepted groups, or raises `TakeTimeout` and puts back everything it
  looked at, in order, so nothing is lost and the next take starts with it. Records are looked at in
  order per partition, a few at a time (`rollstream.consumers._fetched`).
- Every offset looked at gets one disposition (taken / filtered / duplicate / undecodable) in the
  step's manifest. The manifest is written to NS.steps before `take` returns (with ``commit=False``
  too; when the broker does not take it in time, the batch is returned all the same and `commit` writes it
  first: `_committing.py`) and *before* the offsets are committed; offsets committed are, per partition, one
  past the last offset of the step (the next record to read).
- The same batch after a crash: a restarted consumer's first takes are the steps handed over and never
  committed, each the same batch again (group ids, order, step number); `seek_to_step(k)` takes the
  steps after a checkpoint's step k again the same way. Where the group stands after a start or a seek,
  and the recorded steps taken again, are `rollstream.consumers._resume`'s.
- Partitions are assigned explicitly (no group membership, no session timeout): a trainer that does
  not call in for hours keeps its position and commits fine, under the group id.
- A group id already taken by this consumer group (also before a restart, or earlier in this step) is skipped as
  ``duplicate`` within the `DedupeWindow`; across restarts the taken ids are rebuilt from the group's manifests
  (`rollstream.consumers._ledger`). The consumer owns its `Progress` (position, ledger, step numbers, uncommitted
  batches); `_resume.Restart` only says what it is after a start or a seek.
- One consumer per group at a time, and the newest one wins: a consumer with ``fence=True`` (the default, also
  of `rollstream take`) is a run of its group (`rollstream.infra.runs.GroupRun`). When it connects, before it
  reads where the group stands, it fences every older consumer of the group (a `rollstream take`, a
  RolloutConsumer: a job restarted while the old node hangs on); the broker refuses their commits from then
  on (`RunSupersededError`, at their next take or commit). Commits go through the group run's transactions,
  or, with ``announcer=``, through the trainer run's (fenced by a newer trainer run of the namespace). Other
  groups of the namespace are not fenced. Kafka does not keep two consumers of a group apart otherwise (no
  membership), so every commit first checks that the group's committed offsets are still the ones this
  consumer left; if a newer run moved them, `RunSupersededError`, else (``fence=False``, an older rollstream)
  `GroupConflictError`.
- One deadline per call (`rollstream.infra.deadline`): a blocking call (take, poll_batch, seek_to_step, seek_to,
  position, next_step, lag) makes one `Deadline` and everything it waits on spends it: connecting on first use
  (the reachability check, the topic's size, partitions, committed offsets, watermarks, manifests), the recorded
  step taken again, the wait for groups. It returns or raises a `RollstreamError` within its bound plus
  `GRACE_S`, also against a stopped or unreachable broker. Connecting is bounded even when a take is not
  (``timeout=None``): within the consumer's `timeout`, the reachability check within `REACH_TIMEOUT_S`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from types import TracebackType

from prometheus_client import CollectorRegistry
from rollstream.consumers._batch import Batch
from rollstream.consumers._checkpoints import Checkpoints
from rollstream.consumers._client import CLOSE_TIMEOUT_S, TrainerClient
from rollstream.consumers._commit import StepCommitter
from rollstream.consumers._committing import Committing
from rollstream.consumers._errors import TakeTimeout
from rollstream.consumers._fetched import Fetched, unpublished
from rollstream.consumers._gather import Gathering, stale_now
from rollstream.consumers._ledger import DEFAULT_DEDUPE_WINDOW, DedupeWindow, StepLedger
from rollstream.consumers._metrics import ConsumerMetrics
from rollstream.consumers._position import PositionPublisher
from rollstream.consumers._progress import Progress
from rollstream.consumers._resume import Restart, Standing
from rollstream.consumers.filters import FilterContext, GroupFilter, default_filters
from rollstream.consumers.forensics._diagnose import TakeTimeouts
from rollstream.infra import DEFAULT_TRAINER_GROUP, GroupRun, KafkaConfig, PolicyAnnouncer, TopicNames
from rollstream.infra._replaceable import close_quietly
from rollstream.infra.deadline import GRACE_S, Deadline
from rollstream.infra.kafka_io import REACH_TIMEOUT_S, require_topics, time_left
from rollstream.infra.topics import sized_to_topic
from rollstream.schemas import ConfigError, LifecycleError

log = logging.getLogger(__name__)
DEFAULT_GROUP = DEFAULT_TRAINER_GROUP  # the public name of the trainer side (`rollstream.consumers.DEFAULT_GROUP`)
CLOSE_S = 11.0  # the most `RolloutConsumer.close` takes (plus GRACE_S): client 5 s, manifests 5 s, positions 1 s


class RolloutConsumer(Checkpoints, Committing):
    """Takes scored groups from NS.rollouts for a trainer, exactly n per step.

    Creating one makes no network call; it connects on first use (take, position, seek_to, lag), within that
    call's deadline and at most `timeout`: a broker that does not answer then is a `KafkaIOError` (retriable;
    the message says what to check), never a wait without end, also for ``take(n, timeout=None)``.
    Not thread-safe: use it from one thread. A context manager; `close()` is idempotent.

    Args:
        bootstrap_servers: Kafka address (default: ``ROLLSTREAM_BOOTSTRAP_SERVERS``); ignored with `config`.
        group_id: the trainer's consumer group: where offsets are committed, what manifests are keyed by.
        namespace: topic namespace (NS.rollouts, NS.steps).
        config: full client configuration (security settings); wins over `bootstrap_servers`. Its size
            limits are replaced by the rollouts topic's ``max.message.bytes`` when the consumer starts.
        filters: group filters, in order (default: `default_filters()`); pass ``()`` to take everything decodable.
        max_staleness: skip groups more than this many policy versions behind `policy_version`.
        policy_version: the trainer's current policy version (settable later).
        dedupe: skip group ids already taken (recorded as duplicate).
        manifests: write step manifests to NS.steps and rebuild dedupe and step numbers from them.
            Without manifests, dedupe only covers this process and audit/replay have nothing to read.
        dedupe_epochs: remember taken ids only for the newest this-many epochs (None: all).
        dedupe_window: how far back dedupe remembers taken ids (`DedupeWindow` says what it always catches);
            None: every id of the run, memory growing ~120 bytes per group taken.
        requeue: publish again to NS.prompts the prompt of a group skipped for a passing reason (stale, a
            retriable failure) while its attempts last (`rollstream.consumers._requeue`); False: every filter is final.
        metrics: a `ConsumerMetrics`, or a registry to create them in (default: a registry of its own).
        overrides: extra librdkafka consumer properties (e.g. fetch tuning).
        timeout: seconds to wait for the broker when connecting (all of it, also for a take without a timeout;
            an unreachable cluster is reported within `REACH_TIMEOUT_S`), committing, and for a call that takes
            no timeout of its own (`seek_to_step`, `seek_to`, `position`, `next_step`).
        announcer: the trainer run this consumer commits for (`rollstream.infra.runs`): its offsets are
            committed in the run's transactions, so once a newer trainer run began, the broker refuses
            this one's commits (`RunSupersededError`, from `take` or `commit`). None: the group's own run
            commits them (with `fence`).
        fence: True (the default, also `rollstream take`'s): this consumer is a run of its group
            (`rollstream.infra.runs.GroupRun`): when it connects it fences every older consumer of `group_id`
            (their later commits are refused with `RunSupersededError`: the newest consumer of a group wins),
            and without `announcer` its commits are transactions of the group's run, refused once a newer
            consumer of the group connected. Other groups, and trainer runs, are not fenced. Costs: a
            transaction at connect, one per commit (a few ms), and with ACLs Write, Describe on the
            transactional id ``rollstream.NS.group-run.GROUP`` (`rollstream acls` prints it). False: no fencing
            and plain commits (a cluster without transactions); two consumers of one group are then caught only
            at a commit, by the offsets check (`GroupConflictError`), whichever commits second losing.
    """

    def __init__(self, bootstrap_servers: str | None = None, group_id: str = DEFAULT_GROUP,
                 namespace: str = "rollstream", *, config: KafkaConfig | None = None,
                 filters: Sequence[GroupFilter] | None = None, max_staleness: int | None = None,
                 policy_version: int | None = None, dedupe: bool = True, manifests: bool = True,
                 dedupe_epochs: int | None = None, dedupe_window: DedupeWindow | None = DEFAULT_DEDUPE_WINDOW,
                 requeue: bool = True,
                 metrics: ConsumerMetrics | CollectorRegistry | None = None,
                 overrides: Mapping[str, object] | None = None, timeout: float = 30.0,
                 announcer: PolicyAnnouncer | None = None, fence: bool = True) -> None:
        if not group_id:
            raise ConfigError("group_id must be a non-empty consumer group id")
        if max_staleness is not None and max_staleness < 0:
            raise ConfigError(f"max_staleness={max_staleness} must be >= 0 (or None for no limit)")
        self.config = config or KafkaConfig.load(bootstrap_servers, client_id=f"rollstream-trainer-{group_id}")
        self.group_id = group_id
        self.names = TopicNames(namespace)
        self.filters: tuple[GroupFilter, ...] = default_filters() if filters is None else tuple(filters)
        self.max_staleness = max_staleness
        self.policy_version = policy_version
        self.dedupe = dedupe
        self.manifests = manifests
        self.requeue = requeue
        self.metrics = metrics if isinstance(metrics, ConsumerMetrics) else ConsumerMetrics(metrics)
        self._timeout = timeout
        self._progress = Progress(StepLedger(dedupe_epochs=dedupe_epochs, window=dedupe_window))
        self._client = TrainerClient(group_id, self.names.rollouts, dict(overrides or {}))
        self._announcer = announcer
        # Fences the group's older consumers at connect; without an announcer it commits too (`GroupRun`).
        self._group_run = (GroupRun(self.config, self.names, group_id, request_timeout_s=timeout / 4) if fence
                           else None)
        self._committer = StepCommitter(self.names, group_id, manifests=manifests, timeout=timeout,
                                        run=announcer or self._group_run)
        self._restart = Restart(self.names, group_id, manifests=manifests, dedupe_epochs=dedupe_epochs,
                                dedupe_window=dedupe_window)
        self._positions = PositionPublisher(self.names, group_id)
        self._closed = False
        self._fetched = Fetched(self._client, self._committer)
        # A client that lost its coordinator for good (librdkafka#5511) is replaced after failed commits.
        self._replacement = self._fetched.replacement(lambda: self._client.open(self.config),
                                                      lambda: self._progress.position, self.metrics.client_replacements)
        self._timeouts = TakeTimeouts(self.names, group_id)
        self._skipped_waiting = 0  # records the last poll that returned None looked at and would not take

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> RolloutConsumer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close the Kafka clients. Idempotent. Uncommitted batches are not committed: their groups
        come back to the next consumer of this group. Blocks at most `CLOSE_S` (11 s) plus
        `rollstream.infra.deadline.GRACE_S`, whatever the broker does: one deadline, of which each client gets at
        most what is left, capped (the fetching client 5 s, the commit client 5 s, the manifest producer 5 s,
        the position publisher 1 s). No call on a client is running when it is closed (none outlives its
        caller); a client whose close does not finish in time (librdkafka waits for a commit still unanswered)
        is left to the process."""
        if self._closed:
            return
        self._closed = True
        deadline = Deadline.after(CLOSE_S)
        runs = (self._announcer, self._group_run)
        self._progress.warn_uncommitted(self.group_id, superseded=any(r is not None and r.superseded for r in runs))
        self._client.close(deadline.seconds(CLOSE_TIMEOUT_S))
        self._committer.close(deadline)
        if self._group_run is not None:
            self._group_run.close()  # nothing is pending between commits: returns at once
        self._positions.close(deadline.remaining())
        self._timeouts.close()

    def connect(self, timeout: float | None = None) -> None:
        """Connect now instead of on first use: check that the cluster answers and the topics exist, size the
        clients to the topic, read where the group stands (committed offsets, watermarks, manifests) and assign
        its partitions. Does nothing once connected. Returns or raises within `timeout` s (None: the consumer's
        `timeout`; never more than that) + `GRACE_S`; an unreachable cluster is reported within
        `REACH_TIMEOUT_S`. Commits nothing. Not thread-safe.

        Raises:
            LifecycleError: the consumer is closed.
            KafkaIOError (retriable): the broker did not answer in time (stopped, unreachable: the message says
                what to check); nothing of the attempt is kept, so calling again retries it.
            MissingNamespaceError, KafkaIOError: the namespace or a topic does not exist (the message says how
                to create them); or this principal may not read them.
            ConfigError: a negative `timeout`.
        """
        self._start(Deadline.of(self._timeout if timeout is None else timeout))

    def _start(self, deadline: Deadline) -> None:
        """Connect, on first use: every read spends `deadline` (the calling method's), all of them together at most
        the consumer's timeout (`Deadline.within`). Raises LifecycleError when closed; KafkaIOError (retriable,
        ``_TIMED_OUT`` when out of time) for what did not answer; nothing is kept of a start that failed."""
        if self._closed:
            raise LifecycleError(f"the consumer of group {self.group_id} is closed: build a new RolloutConsumer")
        if self._client.opened:
            return
        start = deadline.within(self._timeout)
        # One bounded, clear error for an unreachable cluster or a missing topic, before the longer waits.
        require_topics(self.config, [self.names.rollouts] + ([self.names.steps] if self.manifests else []),
                       namespace=self.names.namespace, timeout=start.within(REACH_TIMEOUT_S))
        what = f"cannot start the consumer of group {self.group_id}"
        self.config = sized_to_topic(self.config, self.names.rollouts, timeout=time_left(start, what))
        self._fence_older(start, what)  # before reading where the group stands: no older consumer moves it after
        consumer = self._client.open(self.config)
        try:
            standing, committed = self._restart.at_start(self.config, consumer, start)
            self._committer.start(self.config, committed, standing.index, timeout=time_left(start, what))
        except BaseException:
            # Bounded (Ctrl-C, a broker that stopped): within the grace the caller's deadline allows.
            close_quietly(consumer.close, f"trainer-{self.group_id}", wait_s=min(CLOSE_TIMEOUT_S, GRACE_S / 2))
            raise
        self._stand(standing)
        self._client.use(consumer, self._progress.position)
        self._positions.start(self.config, timeout=start.seconds(REACH_TIMEOUT_S))
        log.info("group %s assigned %s at offsets %s; next step %d", self.group_id, self.names.rollouts,
                 self._progress.position, self._progress.next_step)

    def _fence_older(self, start: Deadline, what: str) -> None:
        """Begin the group's run (fencing its older consumers) within `start`, once. With an announcer the group run
        only fences: the commits go through the trainer run's transactions, so its producer is closed at once."""
        run = self._group_run
        if run is None or run.begun:
            return
        run.begin(timeout=time_left(start, what))
        if self._announcer is not None:
            run.close()

    def _stand(self, standing: Standing) -> None:
        """Install where the group stands after a start or `seek_to_step` (`rollstream.consumers._resume`)."""
        self._progress.stand(standing)
        self._restart.redo(standing)

    # -- taking ----------------------------------------------------------------------------------

    def take(self, n: int, timeout: float | None = None, commit: bool = True, *,
             policy_version: int | None = None) -> Batch:
        """Take exactly `n` groups that pass the filters and are not duplicates: one training step.

        Blocks until n groups are there, or up to `timeout` seconds (None: no limit; 0: only what is
        already fetched or arrives at once): returns or raises within `timeout` + `GRACE_S`, whatever the
        broker does. The first take connects within that one deadline too (at most the consumer's `timeout`,
        also with ``timeout=None``; an unreachable cluster is reported within `REACH_TIMEOUT_S`; with 0, call
        `connect` first). Once the n groups are there, the manifest write and the commit are `commit`'s,
        bounded by the consumer's `timeout` (a step in hand is not thrown away for want of time). The step's
        manifest is written to NS.steps before returning (with ``commit=False``, one the broker did not take in
        time is logged and written by `commit`). With ``commit=True`` its offsets are then committed
        too: per partition the offset of the next record to read, exactly past this step. With ``commit=False``
        nothing is committed; call `commit(batch)` after the optimizer step. Taking again before that continues
        *after* the uncommitted batch (the position is in memory); if the process dies first, the
        next consumer of the group takes the same batch again first (same groups, same order, same
        step number). Not thread-safe.

        A step recorded by an earlier consumer of the group and never committed (or one after the step
        `seek_to_step` went back to) is returned again exactly as recorded, filters and staleness
        included, when it took `n` groups and none of them is stale now, as the filters judge it (`older_run`: an
        older trainer run's, whatever `max_staleness`; `stale`: that, or a version past `max_staleness`, only with
        one; a filter marked ``judges_staleness``, such as `rollstream.consumers.filters.ResumedStale`); otherwise
        groups are taken afresh from there.

        Args:
            policy_version: set `policy_version` first (the staleness filter measures against it).

        Raises:
            TakeTimeout: fewer than n acceptable groups within `timeout`; what was gathered is kept
                (put back in order) for the next call. Nothing is committed.
            CommitError: with ``commit=True``, the step was taken but writing its manifest or committing failed;
                ``err.batch`` is the batch, still uncommitted: retry ``commit(err.batch)``. With ``commit=False``
                a manifest that could not be written in time is not raised (logged; `commit` writes it), so a
                taken batch is always returned.
            GroupConflictError: another client committed for this group (two trainers on one group id).
            RunSupersededError: a newer consumer of the group connected, or (with ``announcer``) a newer trainer
                run began; nothing was committed.
            FilterError: a filter raised; nothing was taken.
            ConfigError: `n` < 1 or a negative `timeout`.
            KafkaIOError (retriable): the broker did not answer in time while connecting or reading a recorded
                step again (a stopped or unreachable broker; the message says what to check; the next take
                retries, nothing is lost), or the topic does not exist.
        """
        batch = self._take(n, timeout, commit, policy_version, raising=True)
        if batch is None:  # never: a take that runs out raises
            raise TakeTimeout(n, 0, timeout or 0.0)
        return batch

    def poll_batch(self, n: int, timeout: float, commit: bool = True, *,
                   policy_version: int | None = None) -> Batch | None:
        """`take` for a caller that waits in slices (an adapter serving its trainer in between): returns None
        instead of raising `TakeTimeout` when the groups are not there yet.

        Blocks up to `timeout` s (0: only what is already fetched or arrives at once) + `GRACE_S`, plus the manifest
        write and, with ``commit=True``, the commit once n groups are there. A first call connects first, and a
        recorded step is read again, within the consumer's `timeout` from the call's start (a slice is usually shorter
        than those reads take; `connect` first to bound the connecting otherwise). A batch is returned exactly as
        `take(n, timeout, commit)` returns it: manifest written (with ``commit=False``: or, when it could not be,
        left to `commit`); offsets committed with ``commit=True``, nothing committed with ``commit=False`` (call
        `commit(batch)` after the optimizer step). None: fewer than n acceptable groups came within `timeout`; nothing
        is committed and nothing is lost (every record looked at is put back, in order, and judged again by the next
        call), requeues found are published (as by every take, before it waits for more groups), and no diagnosis is
        built (no cluster read, no thread started). When the caller's own deadline passes, raise
        `timeout_error(n, deadline_s)`. Not thread-safe.

        Raises:
            RollstreamError: what `take` raises, except TakeTimeout.
            ConfigError: also when `timeout` is None or negative (wait without a limit with `take`).
        """
        if timeout is None:
            raise ConfigError("poll_batch(timeout=None): give a timeout in seconds; take(n) waits without limit")
        return self._take(n, timeout, commit, policy_version, raising=False)

    def timeout_error(self, n: int, timeout: float) -> TakeTimeout:
        """The `TakeTimeout` for a caller whose own deadline of `timeout` s for `n` groups passed while
        `poll_batch` returned None: the groups the last such poll gathered, what it looked at, and the likely
        cause from the cluster (``diagnosis``, as a timed-out `take` gives it). Returned for the caller to raise.

        Blocks up to a quarter of `timeout` and at most ``GRACE_S / 2`` (the cluster read, at most every 30 s,
        as for `take`). Commits nothing. Never raises. Not thread-safe.
        """
        return self._timeouts.last_poll(self.config, n, timeout, max_staleness=self.max_staleness,
                                        policy_version=self.policy_version)

    def _take(self, n: int, timeout: float | None, commit: bool, policy_version: int | None, *,
              raising: bool) -> Batch | None:
        if n < 1:
            raise ConfigError(f"take(n={n}): n must be at least 1")
        if timeout is not None and timeout < 0:
            raise ConfigError(f"take(timeout={timeout}): the timeout must be >= 0 seconds, or None")
        if policy_version is not None:
            self.policy_version = policy_version
        started, deadline = time.monotonic(), Deadline.of(timeout)
        # A take connects and reads a recorded step again within its own deadline; a poll, one slice of its
        # caller's wait, within the consumer's timeout (a slice is shorter than those reads may take).
        setup = deadline if raising else Deadline.after(self._timeout)
        self._start(setup)
        batch = self._take_recorded(n, setup) if self._restart.redoing else None
        if batch is None:
            gathering = self._gather(n, deadline, raising=raising)
            if gathering is None:
                return None
            batch = gathering.batch(self._progress.next_step, self._progress.position,
                                    unpublished(gathering))  # the rest went out while it waited
            self._hand_over(batch, gathering.taken_bytes, started)
        self._timeouts.polled()
        self._skipped_waiting = 0
        if commit:
            self.commit(batch)
        elif self.manifests:
            self._record(batch)
        return batch

    def _gather(self, n: int, deadline: Deadline, *, raising: bool) -> Gathering | None:
        """n groups gathered by `deadline`, or (timed out) everything put back and TakeTimeout raised, or None."""
        run = self._announcer.run if self._announcer is not None else None
        gathering = Gathering(self.names.rollouts, self.group_id, self.filters, self._progress.ledger, self.dedupe,
                              self.policy_version, self.max_staleness, self.requeue, run)
        if self._fetched.gather(gathering, n, None if deadline.total_s is None else deadline.expires_at):
            return gathering
        if raising:
            raise self._timeouts.error(self.config, n, gathering.accepted, deadline.total_s, gathering.dispositions,
                                       max_staleness=self.max_staleness, policy_version=self.policy_version)
        self._timeouts.polled(gathering.dispositions, gathering.accepted)
        self._skipped_waiting = sum(1 for d in gathering.dispositions if d.kind != "taken")
        return None

    def _take_recorded(self, n: int, deadline: Deadline) -> Batch | None:
        """The next recorded step again, as the same batch (`Restart.take_again`, reading within `deadline` and
        the consumer's timeout); None (and no more redo) when it took other than `n` groups, its records cannot
        be read back, or a group it took is stale now, as the filters judge it (`stale_now`)."""
        started = time.monotonic()
        again = self._restart.take_again(self.config, n, self._progress.position, deadline.within(self._timeout))
        if again is None:
            return None
        batch, taken_bytes = again
        run = self._committer.run.run if self._committer.run is not None else None
        reason = stale_now(batch, self.filters, FilterContext(self.policy_version, self.max_staleness, -1, -1,
                                                              self.group_id, run))
        if reason is not None:
            log.warning("group %s: recorded step %d is not taken again as recorded (%s); taking afresh from offsets %s",
                        self.group_id, batch.step, reason, dict(self._progress.position))
            self._restart.forget()
            return None
        self._progress.ledger.hold(batch.group_ids)
        self._hand_over(batch, taken_bytes, started)
        self._fetched.reassign(self._progress.position)
        return batch

    def _hand_over(self, batch: Batch, taken_bytes: int, started: float) -> None:
        """`batch` was taken (its group ids stay held in the ledger until it is committed): count it, log it."""
        self._progress.hand_over(batch)
        seconds = time.monotonic() - started
        self.metrics.observe_step(batch, seconds, taken_bytes, self.policy_version, self.estimated_lag())
        log.info("%s", batch.summary(seconds))
