"""Committing steps for one consumer group: each step's manifest on NS.steps first, then the offsets.

A step's manifest is written once, at the latest when the step is committed: `record` writes it as
soon as the step is taken (so that a restarted consumer can take the same batch again, see
`rollstream.consumers._resume`), and `commit` then writes only the manifests not recorded yet, before the offsets.
The prompts a step requeues (`rollstream.consumers._requeue`) are published to NS.prompts and acknowledged before
its manifest is written, so a manifest never records a requeue that did not happen.

`StepCommitter` owns the manifest producer, what the consumer knows of the group's committed
offsets, and the group's `ManifestIndex` (where its manifests are on NS.steps), which every commit
carries in its metadata so that the next start reads only those (`rollstream.consumers._manifests`).
Before each commit it checks those offsets did not move under it: one trainer per group id is the
contract (partitions are assigned, not subscribed, so Kafka does not keep two consumers of a group
apart); a second one is caught at its first commit, at the cost of one offset fetch per commit. When the
offsets moved under a consumer of a run (`run`), it first finds out whether the run was superseded (a newer run
moved them; the broker would refuse this commit): `RunSupersededError` then, `GroupConflictError` only for a real
conflict (a consumer with ``fence=False`` on the group).

One deadline per call (`rollstream.infra.deadline.Deadline`): a commit (`retrying`) makes one of the committer's
timeout, and each attempt, and in it each wait in turn (the offsets check, each step's requeues, the manifests,
the commit), spends what is left of it: no wait gets a fresh timeout or a floor past it. Every wait keeps its
deadline with librdkafka's own timeouts and the asynchronous commit (`rollstream.infra.commits`), so when a call
returns or raises, none of its calls is still inside librdkafka, and the client can be replaced or closed at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from rollstream.consumers._batch import Batch
from rollstream.consumers._errors import CommitError, GroupConflictError
from rollstream.consumers._manifests import ManifestIndex
from rollstream.consumers._requeue import Requeue
from rollstream.infra import GroupRun, KafkaConfig, KafkaIOError, PolicyAnnouncer, TopicNames
from rollstream.infra._replaceable import ClientReplacement
from rollstream.infra.clients import open_producer
from rollstream.infra.commits import CommitClient
from rollstream.infra.deadline import Deadline
from rollstream.infra.kafka_errors import CommitFailed, kafka_error
from rollstream.infra.kafka_io import committed_offsets, produce_and_wait
from rollstream.schemas import LifecycleError, StepManifest, encode

log = logging.getLogger(__name__)
_RETRY_PAUSE_S = 0.2
_T = TypeVar("_T")


FRESH_CLIENT_AFTER = 2  # failed commit attempts in a row after which the Kafka client is replaced
CLOSE_FLUSH_S = 5.0  # the most `close` waits for the manifest producer
CLOSE_CLIENT_S = 5.0  # the most `close` waits for the commit client (a commit still unanswered holds it)


class StepCommitter:
    """Writes manifests and commits offsets for `group_id` on `names`. Not thread-safe; no I/O until `start`.

    Args:
        manifests: write step manifests (else only offsets are committed).
        timeout: seconds one commit (`retrying`) may take in all, every wait in it included.
        run: commit through this run's transactions (`rollstream.infra.runs`: a trainer run, or the group's own
            run), which the broker refuses once a newer run began; None: plain commits.

    The offsets check and the commits go through a client of their own (`rollstream.infra.commits.CommitClient`,
    assigned nothing), never the client that fetches: waiting for an asynchronous commit's answer polls it.
    """

    def __init__(self, names: TopicNames, group_id: str, *, manifests: bool, timeout: float,
                 run: PolicyAnnouncer | GroupRun | None = None) -> None:
        self.names = names
        self.run = run
        self.group_id = group_id
        self.manifests = manifests
        self._timeout = timeout
        self._config: KafkaConfig | None = None
        self._client: CommitClient | None = None
        self._producer: Producer | None = None
        # What this consumer knows to be the group's committed offsets, and offsets it tried to commit since
        # (a commit that failed on the client may still have landed): anything else means another client.
        self._committed: dict[int, int | None] = {}
        self._tried: dict[int, set[int]] = {}
        self._recorded: set[int] = set()  # id() of the uncommitted batches whose manifest is on NS.steps
        self._requeued: set[int] = set()  # id() of the uncommitted batches whose requeues are on NS.prompts
        # Where the group's manifests are on NS.steps; None: unknown (commits carry no index). Not updated
        # after a write that failed: that manifest may have landed at an offset no delivery report gave.
        self._index: ManifestIndex | None = None
        self._index_sure = False

    def start(self, config: KafkaConfig, committed: Mapping[int, int | None],
              index: ManifestIndex | None = None, *, timeout: float | None = None) -> None:
        """Remember the group's committed offsets as read at start and where its manifests are (`index`,
        complete up to the end of NS.steps as read at start; None: unknown), and open the manifest producer
        now (with NS.steps' metadata fetched, so that the first commit does not wait for it). Blocks up to
        `timeout` (None: the committer's). Raises KafkaIOError when NS.steps' metadata cannot be read."""
        self._config = config
        if self._client is None:
            self._client = CommitClient(config, self.group_id)
        self._committed = dict(committed)
        self.use_index(index)
        if self.manifests and self._producer is None:
            self._producer = self._manifest_producer(config, timeout)

    def use_index(self, index: ManifestIndex | None) -> None:
        """Go on with `index`, read from NS.steps just now (complete up to its end): the commits carry it."""
        self._index, self._index_sure = index, index is not None

    @property
    def index(self) -> ManifestIndex | None:
        """Where the group's manifests are on NS.steps, as far as this consumer knows (None: unknown)."""
        return self._index

    @property
    def committed(self) -> dict[int, int | None]:
        """The group's committed offsets as this consumer knows them (what it read at start and committed since)."""
        return dict(self._committed)

    def renew(self) -> None:
        """Go on with a fresh commit client (in place of one that kept failing; the old one is closed in the
        background); what is known of the group's committed offsets, and of the commits tried since, is kept."""
        if self._client is not None:
            self._client.renew()

    def close(self, deadline: Deadline) -> None:
        """Close the commit client (at most `CLOSE_CLIENT_S`: librdkafka waits for a commit still unanswered) and
        deliver what the manifest producer still holds (at most `CLOSE_FLUSH_S`), both within `deadline`.
        Idempotent. What is left is only a manifest or requeue whose write already failed (every
        write waits for its acknowledgement), so a shutdown does not wait on a broker that does not answer."""
        if self._client is not None:
            self._client.close(deadline.seconds(CLOSE_CLIENT_S))
        producer, self._producer = self._producer, None
        if producer is not None:
            left = producer.flush(deadline.seconds(CLOSE_FLUSH_S))
            if left:
                log.warning("group %s: closing with %d records for %s/%s undelivered (writes that already failed)",
                            self.group_id, left, self.names.steps, self.names.prompts)

    def record(self, batches: Sequence[Batch], deadline: Deadline) -> None:
        """Write the manifest of the last of `batches` (the uncommitted ones up to it, oldest first) to NS.steps
        (acknowledged), after checking the group's offsets and publishing its requeues; also those of the earlier
        ones not recorded yet (`_to_write`). Does nothing without manifests. Blocks until `deadline` at most.

        Raises:
            CommitError (retriable): the offsets check or the write failed, or `deadline` passed first.
            GroupConflictError: another client committed for this group; nothing was written.
            RunSupersededError: a newer run committed for this group (the broker fenced this one); nothing written.
        """
        if not self.manifests:
            return
        batch, to_write = batches[-1], self._to_write(batches)
        self._check_sole_committer(batch, deadline, "recording")
        self._publish_requeues(to_write, deadline)
        self._publish([b.manifest() for b in to_write], batch, deadline)
        self._recorded.update(id(b) for b in to_write)

    def _to_write(self, batches: Sequence[Batch]) -> Sequence[Batch]:
        """The batches whose manifests are to be written, oldest first: from the first not recorded yet on, those
        recorded after it again too (an older step's manifest written after a newer one's reads as a rewind to it,
        superseding the newer; written again, the newer supersedes its own first copy)."""
        first = next((i for i, b in enumerate(batches) if id(b) not in self._recorded), len(batches))
        return batches[first:]

    def forget_recorded(self) -> None:
        """The uncommitted batches were dropped (`seek_to`): their manifests are superseded by the next."""
        self._recorded.clear()
        self._requeued.clear()

    def commit(self, batches: Sequence[Batch], deadline: Deadline) -> tuple[dict[int, int], list[StepManifest]]:
        """Commit `batches` (oldest first; the last is the one asked for): check the group's offsets,
        publish the requeues not published yet and write each manifest not `record`ed yet (each
        acknowledged), then commit, per partition, one past the last offset.

        Blocks until each is acknowledged, each wait spending what is left of `deadline` (none past it).
        Returns the offsets committed and the batches' manifests (written to NS.steps only with
        ``manifests=True``).

        Raises:
            CommitError (retriable): the offsets check, a manifest or the commit failed, or `deadline` passed
                first (the message says which was not done); nothing is known committed (a retry is safe: a
                manifest written twice supersedes itself).
            GroupConflictError: another client committed for this group; nothing was written.
            RunSupersededError: a newer run began (the broker fenced this one), also when it already committed for
                this group; nothing was committed.
        """
        batch = batches[-1]
        self._check_sole_committer(batch, deadline)
        manifests = [b.manifest() for b in batches]
        unwritten = manifests[len(batches) - len(self._to_write(batches)):]
        self._publish_requeues(batches, deadline)
        if self.manifests and unwritten:
            self._publish(unwritten, batch, deadline)
        offsets: dict[int, int] = {}
        for b in batches:
            offsets.update({r.partition: r.end for r in b.ranges})
        self._commit_tracked(offsets, batch, deadline)
        for b in batches:
            self._recorded.discard(id(b))
            self._requeued.discard(id(b))
        return offsets, manifests

    def rewind(self, offsets: Mapping[int, int], deadline: Deadline) -> None:
        """Commit `offsets` (a position the trainer went back to) without a manifest, after checking
        the group's offsets. Blocks until `deadline` at most. Raises what `commit` raises (``err.batch`` is None)."""
        self._check_sole_committer(None, deadline)
        self._commit_tracked(offsets, None, deadline)

    def _commit_tracked(self, offsets: Mapping[int, int], batch: Batch | None, deadline: Deadline) -> None:
        for p, o in offsets.items():
            self._tried.setdefault(p, set()).add(o)
        self._commit_offsets(offsets, batch, deadline)
        self._committed.update(offsets)
        self._tried.clear()

    def commit_retrying(self, batches: Sequence[Batch], *, replacement: ClientReplacement[Consumer]
                        ) -> tuple[dict[int, int], list[StepManifest]]:
        """`commit` retried within one deadline of the committer's timeout (each attempt gets at most a
        `FRESH_CLIENT_AFTER` + 1-th of it, and never more than is left); after `FRESH_CLIENT_AFTER` failed
        attempts in a row, also across calls, `replacement` replaces the client
        (`rollstream.infra._replaceable.ClientReplacement`, see `RolloutConsumer.commit`). Blocks at most the timeout
        plus `rollstream.infra.deadline.GRACE_S`. Raises what `commit` raises once the time is up;
        `GroupConflictError` and `RunSupersededError` at once."""
        return self.retrying(lambda d: self.commit(batches, d), replacement=replacement)

    def retrying(self, attempt: Callable[[Deadline], _T], *, replacement: ClientReplacement[Consumer]) -> _T:
        """`attempt(deadline)` (a `record`, `commit` or `rewind`) retried as `commit_retrying` describes."""
        deadline = Deadline.after(self._timeout)
        share = self._timeout / (FRESH_CLIENT_AFTER + 1)  # time for a fresh client to try within the deadline
        while True:
            try:
                result = attempt(deadline.within(share))
            except GroupConflictError:
                raise
            except CommitError as exc:
                log.info("group %s: commit attempt failed (%d in a row): %s", self.group_id,
                         replacement.failures + 1, exc)
                replacement.failed(exc)  # every FRESH_CLIENT_AFTER-th in a row: a fresh client
                if not exc.retriable or deadline.remaining() <= _RETRY_PAUSE_S:
                    raise
                time.sleep(_RETRY_PAUSE_S)
                continue
            replacement.succeeded()
            return result

    def _started(self) -> tuple[KafkaConfig, CommitClient]:
        if self._config is None or self._client is None:
            raise LifecycleError(f"the committer of group {self.group_id} was not started: call start() first")
        return self._config, self._client

    def _left(self, deadline: Deadline, batch: Batch | None, what: str) -> float:
        """The seconds left of `deadline` for `what`; CommitError (retriable) naming it when none are."""
        left = deadline.remaining()
        if left <= 0:
            step = "the rewound position" if batch is None else f"step {batch.step}"
            raise CommitError(batch, f"out of time before {what} for {step} of group {self.group_id} (the consumer's "
                                     f"timeout is {self._timeout:g} s): the broker answered too slowly or not at "
                                     "all; nothing more was written")
        return left

    def _check_sole_committer(self, batch: Batch | None, deadline: Deadline, action: str = "committing") -> None:
        """Raise GroupConflictError when the group's committed offsets moved under this consumer; RunSupersededError
        when a newer run moved them (`_check_superseded`). `action` names what was refused in the latter."""
        topic = self.names.rollouts
        left = self._left(deadline, batch, "checking the group's committed offsets")
        try:
            found = committed_offsets(self._started()[1].consumer, topic, sorted(self._committed), timeout=left)
        except KafkaIOError as exc:
            raise CommitError(batch, f"cannot read the committed offsets of group {self.group_id}: {exc}") from exc
        moved = {p: (self._committed.get(p), o) for p, o in found.items()
                 if o != self._committed.get(p) and o not in self._tried.get(p, ())}
        if moved:
            self._check_superseded(batch, found, deadline, action)
            raise GroupConflictError(batch, self.group_id, moved)

    def _check_superseded(self, batch: Batch | None, found: Mapping[int, int | None], deadline: Deadline,
                          action: str) -> None:
        """The group's offsets moved under this consumer (now `found`): raise RunSupersededError when its run was
        superseded, since then the newer run moved them, and the broker would refuse this commit (checked before
        it, the offsets would say GroupConflictError instead). A probe transaction of `found`, aborted, which the
        broker refuses to a fenced run (`check_superseded`); only on this rare path. Returns without a run, or when
        the run leads (a consumer with ``fence=False`` moved them: a real conflict). Raises CommitError (retriable
        unless the run's producer failed for good) when the broker did not tell in time."""
        if self.run is None:
            return
        what = "the rewound position" if batch is None else f"step {batch.step}"
        left = self._left(deadline, batch, "finding out whether a newer run superseded this consumer")
        offsets = [TopicPartition(self.names.rollouts, p, o) for p, o in sorted(found.items())
                   if o is not None and o >= 0]
        try:
            self.run.check_superseded(self._started()[1].consumer, offsets, timeout=left,
                                      what=f"{action} {what} of group {self.group_id}")
        except KafkaIOError as exc:
            error = CommitError(batch, f"the committed offsets of group {self.group_id} moved under this consumer, "
                                       f"and whether a newer run superseded it could not be told: {exc}")
            error.retriable = exc.retriable
            raise error from exc

    def publish_requeues(self, requeues: Sequence[Requeue], *, timeout: float | None = None) -> None:
        """Publish `requeues` to NS.prompts and wait until the broker acknowledged every one. Blocks up to
        `timeout` (None: the committer's). Raises KafkaIOError when they were not all acknowledged."""
        if self._producer is None:
            self._producer = open_producer(self._started()[0].manifest_producer())
        produce_and_wait(self._producer, self.names.prompts, [(r.key, r.value) for r in requeues],
                         timeout=self._timeout if timeout is None else timeout)
        log.info("requeued %d prompts on %s: %s", len(requeues), self.names.prompts,
                 ", ".join(f"{r.group_id} as attempt {r.attempt}" for r in requeues[:5])
                 + (" ..." if len(requeues) > 5 else ""))

    def _publish_requeues(self, batches: Sequence[Batch], deadline: Deadline) -> None:
        """`publish_requeues` of each of `batches` not published yet, within `deadline`. Raises CommitError
        (retriable) naming the step whose requeues were not acknowledged."""
        for b in batches:
            if not b.requeues or id(b) in self._requeued:
                continue
            left = self._left(deadline, b, f"publishing the {len(b.requeues)} prompts it requeues")
            try:
                self.publish_requeues(b.requeues, timeout=left)
            except KafkaIOError as exc:
                raise CommitError(b, f"the {len(b.requeues)} prompts step {b.step} requeues were not written to "
                                     f"{self.names.prompts}: {exc}") from exc
            self._requeued.add(id(b))

    def _publish(self, manifests: list[StepManifest], batch: Batch, deadline: Deadline) -> None:
        what = f"writing {len(manifests)} manifest(s) to {self.names.steps}"
        if self._producer is None:
            self._producer = self._manifest_producer(self._started()[0], self._left(deadline, batch, what))
        key = self.group_id.encode()
        written: list[tuple[int, int]] = []
        try:
            produce_and_wait(self._producer, self.names.steps, [(key, encode(m)) for m in manifests],
                             timeout=self._left(deadline, batch, what), on_acked=lambda p, o: written.append((p, o)))
        except KafkaIOError as exc:
            self._index_sure = False  # some may have landed where no delivery report says: keep the index as is
            raise CommitError(batch, f"the manifest of step {batch.step} was not written to {self.names.steps}: "
                                     f"{exc}") from exc
        if self._index is not None and self._index_sure:
            for p, o in written:
                self._index = self._index.added(p, o)

    def _manifest_producer(self, config: KafkaConfig, timeout: float | None = None) -> Producer:
        producer = open_producer(config.manifest_producer())
        try:
            producer.list_topics(self.names.steps, timeout=self._timeout if timeout is None else timeout)
        except KafkaException as exc:
            raise kafka_error(f"cannot read metadata of {self.names.steps}", exc, topic=self.names.steps) from exc
        return producer

    def _metadata(self) -> str | None:
        """The commit metadata: the group's manifest index (None without manifests, or when unknown)."""
        if not self.manifests or self._index is None:
            return None
        return self._index.to_metadata()

    def _commit_offsets(self, offsets: Mapping[int, int], batch: Batch | None, deadline: Deadline) -> None:
        what = "the rewound position" if batch is None else f"step {batch.step}"
        left = self._left(deadline, batch, f"committing offsets {dict(offsets)}")
        if self.run is not None:
            self._commit_in_run(self.run, offsets, batch, what, left)
            return
        try:
            self._started()[1].commit(self.names.rollouts, offsets, deadline=deadline, metadata=self._metadata())
        except CommitFailed as exc:
            raise CommitError(batch, f"cannot commit offsets {dict(offsets)} of {what} for group "
                                     f"{self.group_id}: {exc}") from exc

    def _commit_in_run(self, run: PolicyAnnouncer | GroupRun, offsets: Mapping[int, int], batch: Batch | None,
                       what: str, timeout: float) -> None:
        """Commit through the run's transactions (a trainer run's, or the group's own): refused by the broker once
        a newer run began (`RunSupersededError`, raised as it is: not retriable)."""
        metadata = self._metadata()
        tps = [TopicPartition(self.names.rollouts, p, o) if metadata is None
               else TopicPartition(self.names.rollouts, p, o, metadata) for p, o in sorted(offsets.items())]
        try:
            run.commit_offsets(self._started()[1].consumer, tps, what=f"committing {what} of group {self.group_id}",
                               timeout=timeout)
        except KafkaIOError as exc:
            error = CommitError(batch, f"cannot commit offsets {dict(offsets)} of {what} for group "
                                       f"{self.group_id}: {exc}")
            error.retriable = exc.retriable  # a run whose producer failed for good cannot commit again
            raise error from exc


def commit_until_committed(commit: Callable[[Batch], object], batch: Batch,
                           on_retry: Callable[[CommitError], None]) -> None:
    """`commit(batch)` (a `RolloutConsumer.commit`), again after each retriable failure (a broker restart or stall
    outlasting the consumer's timeout), until `batch` is committed: for a trainer that keeps its step in hand
    meanwhile (as `rollstream take` does). Blocks until then, with no bound; `on_retry` hears each failure before
    the next try.

    Raises what `commit` raises that is not retriable (GroupConflictError, RunSupersededError, ...)."""
    while True:
        try:
            commit(batch)
            return
        except CommitError as exc:
            if not exc.retriable:
                raise
            on_retry(exc)
