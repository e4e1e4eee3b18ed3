"""`RolloutConsumer`'s commits: `commit` (a step's manifests, then its offsets, through the group's or the trainer's
run), and the manifest a ``take(commit=False)`` records before it returns, or leaves to `commit` when the broker
does not take it in time.

A mixin of `rollstream.consumers._consumer.RolloutConsumer`, which owns the state it uses (the progress, the
committer, the client and its replacement, the position publisher); see that module for the contract. The
writing itself is `rollstream.consumers._commit.StepCommitter`'s.
"""

from __future__ import annotations

import logging

from rollstream.consumers._batch import Batch
from rollstream.consumers._client import TrainerClient
from rollstream.consumers._commit import StepCommitter
from rollstream.consumers._errors import CommitError
from rollstream.consumers._metrics import ConsumerMetrics
from rollstream.consumers._position import PositionPublisher
from rollstream.consumers._progress import Progress
from rollstream.infra._replaceable import ClientReplacement

log = logging.getLogger("rollstream.consumers._consumer")


class Committing:
    """Commits of a `RolloutConsumer` (mixed into it). Not thread-safe."""

    group_id: str
    metrics: ConsumerMetrics
    _progress: Progress
    _committer: StepCommitter
    _replacement: ClientReplacement
    _client: TrainerClient
    _positions: PositionPublisher

    def commit(self, batch: Batch) -> None:
        """Commit `batch` and every uncommitted batch taken before it (offsets are a prefix).

        For each such batch in order, its StepManifest is written to NS.steps (acknowledged by the
        broker), then the offsets are committed under the group id: per partition, the offset of the
        next record to read after `batch`. Blocks until both are acknowledged, at most the consumer's
        timeout in all plus `rollstream.infra.deadline.GRACE_S` (one deadline: the offsets check, the
        requeues, the manifests and the commit each spend what is left of it; the commit is librdkafka's
        asynchronous one, so no call is left running inside the client when this returns or raises): a failed
        attempt is retried within it, and after `FRESH_CLIENT_AFTER` failed
        attempts in a row (also across calls) the Kafka client is replaced by a fresh one at the
        position this consumer holds (records fetched and not looked at are fetched again, in order),
        because a client can lose its group coordinator for good (confluentinc/librdkafka#5511).
        Committing a batch already committed does nothing. Not thread-safe.

        Raises:
            CommitError (retriable): the manifest or the commit still failed at the timeout, or the timeout
                passed first (the message says what was not done); the batch stays uncommitted and can be
                committed again (a manifest written twice is harmless: the later one for the same step
                supersedes the earlier). A commit that got no answer in time may still land: then the next
                start begins after this step, else it takes the same batch again; never half of it.
            GroupConflictError (a CommitError, not retriable): another client committed offsets for
                this group since this consumer last did (two trainers on one group id); nothing was written.
            RunSupersededError: a newer consumer of the group connected, or (with ``announcer``) a newer trainer
                run began; the offsets were not committed.
            RollstreamError: `batch` was not taken by this consumer, or was dropped by `seek_to`.
        """
        batches = self._progress.through(batch, self.group_id)
        if not batches:
            return  # committed already
        offsets, manifests = self._committer.commit_retrying(batches, replacement=self._replacement)
        self._progress.committed(batches, manifests)
        self.metrics.observe_commit(len(batches), self._progress.ledger.remembered)
        committed = self._committer.committed  # the producers' backpressure learns where the group is (never blocks)
        self._positions.publish(batch.step, committed, self._client.end_offsets(list(committed)))
        log.info("step %d committed: group %s offsets %s", batch.step, self.group_id, offsets)

    def _record(self, batch: Batch) -> None:
        """Write the manifest of `batch`, taken with ``commit=False`` (and of earlier uncommitted ones whose write
        failed), so that a successor takes it again as recorded. A retriable failure is logged, not raised: the
        batch is the caller's all the same (raised, a caller that went on taking would commit its offsets with the
        next step, never having trained it), and `commit(batch)` writes the manifest first. Raises what is not
        retriable (GroupConflictError, RunSupersededError)."""
        batches = self._progress.through(batch, self.group_id)
        try:
            self._committer.retrying(lambda d: self._committer.record(batches, d), replacement=self._replacement)
        except CommitError as exc:
            if not exc.retriable:
                raise
            log.warning("group %s: step %d taken, its manifest not recorded yet (%s); commit(batch) writes it first. "
                        "Until then a crash makes the next consumer take these offsets afresh, not as this step",
                        self.group_id, batch.step, " ".join(str(exc).split()))
            return
        for b in batches:
            self._progress.requeued(b)
