"""`RolloutConsumer`'s position, checkpoints and lag: where the next take looks, moving it (`seek_to`, a checkpoint's
offsets; `seek_to_step`, the step a checkpoint was saved after), the group's committed lag, the estimated lag and
what of it no step will train (`skipped_waiting`).

A mixin of `rollstream.consumers._consumer.RolloutConsumer`, which owns the state it reads (the progress, the
fetched records, the committer, the restart) and connects on first use; see that module for the contract.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rollstream.consumers._batch import Batch
from rollstream.consumers._client import TrainerClient
from rollstream.consumers._commit import StepCommitter
from rollstream.consumers._fetched import Fetched
from rollstream.consumers._progress import Progress
from rollstream.consumers._resume import Restart, Standing
from rollstream.infra import GroupLag, KafkaConfig, LagReader, TopicNames
from rollstream.infra._replaceable import ClientReplacement
from rollstream.infra.deadline import Deadline

log = logging.getLogger("rollstream.consumers._consumer")


class Checkpoints:
    """Position, checkpoints and lag of a `RolloutConsumer` (mixed into it). Not thread-safe."""

    config: KafkaConfig
    names: TopicNames
    group_id: str
    manifests: bool
    _timeout: float
    _progress: Progress
    _fetched: Fetched
    _committer: StepCommitter
    _restart: Restart
    _replacement: ClientReplacement
    _client: TrainerClient
    _skipped_waiting: int

    if TYPE_CHECKING:  # RolloutConsumer's
        def connect(self, timeout: float | None = None) -> None: ...
        def _start(self, deadline: Deadline) -> None: ...
        def _stand(self, standing: Standing) -> None: ...

    def position(self) -> dict[int, int]:
        """The trainer's position: per partition, the next offset a take will look at.

        Includes uncommitted batches (it is the in-memory position). Store it in a trainer checkpoint
        (or `Batch.offsets`, the same after that batch) and restore it with `seek_to`. Does not block once the
        consumer is connected; the first call connects, returning or raising within the consumer's `timeout`
        + `GRACE_S`.

        Raises:
            KafkaIOError (retriable): connecting failed (the broker did not answer in time, or no topic).
        """
        self.connect()
        return dict(self._progress.position)

    @property
    def next_step(self) -> int:
        """The step number the next take will get. Connects first, as `position` does (and raises as it does)."""
        self.connect()
        return self._progress.next_step

    def pending(self) -> list[Batch]:
        """Batches taken with ``commit=False`` and not committed yet, oldest first."""
        return list(self._progress.pending)

    def buffered(self) -> int:
        """Records fetched into this process and not looked at yet (they come first next take)."""
        return len(self._fetched)

    def seek_to(self, offsets: Mapping[int, int], *, next_step: int | None = None) -> None:
        """Move the position to `offsets` (per partition, the next offset to look at), e.g. a checkpoint's.

        Partitions not in `offsets` keep their position. Uncommitted batches and buffered records are
        dropped. Steps whose offsets go past the new position are forgotten for dedupe (their groups
        can be taken again), and their manifests are superseded by the next ones. `next_step` sets the
        next step number (default: the first dropped uncommitted step, else unchanged). Nothing is
        committed until the next commit. Blocks briefly (reassignment); going back further than the dedupe
        window, also until the manifests are read again (the ids it forgot count again); connecting first if
        not yet. Returns or raises within the consumer's `timeout` + `GRACE_S`.

        Raises:
            RollstreamError: a partition that the rollouts topic does not have, or a negative offset; or (a
                seek beyond the dedupe window) what reading the manifests raises.
            KafkaIOError (retriable): the broker did not answer in time (connecting, reading the manifests).
        """
        deadline = Deadline.after(self._timeout)
        self._start(deadline)
        progress = self._progress
        forgot, dropped = progress.seek(offsets, next_step, topic=self.names.rollouts)  # checks them first
        self._forget_uncommitted()
        if forgot and self.manifests:  # back further than the dedupe window: what it forgot counts again
            progress.ledger = self._restart.ledger_at(self.config, progress.position, self._committer.committed,
                                                      self._committer.index, deadline)
        self._fetched.reassign(progress.position)
        log.info("group %s moved to offsets %s (next step %d; forgot steps %s)", self.group_id, progress.position,
                 progress.next_step, dropped)

    def _forget_uncommitted(self) -> None:
        """What the committer, the fetched records and the restart kept of the uncommitted batches goes."""
        self._committer.forget_recorded()
        self._fetched.clear()
        self._restart.forget()

    def seek_to_step(self, step: int, timeout: float | None = None) -> None:
        """Continue exactly after step `step`: the resume point of a trainer checkpoint saved after it.

        Reads the group's manifests from NS.steps, moves the position to where step `step` ended (on
        every partition), rebuilds dedupe from the steps up to it (the groups taken after it can be
        taken again), and commits that position at once, so lag and producers' backpressure see it.
        The next takes are then the steps that followed `step` again, each the same batch as before
        (same groups, same order, same step number), as long as they chain and take the same n; then
        new groups. Their old manifests are superseded by the new ones, so the audit stays green.
        Uncommitted batches and buffered records are dropped. Blocks until the manifests are read
        and the position is committed: connecting first if not yet, and reading the manifests, within
        `timeout` s (None: the consumer's `timeout`), then committing the position as `commit` does (within
        the consumer's `timeout`); returns or raises within the two + `GRACE_S`. Not thread-safe.

        Raises:
            RollstreamError: the consumer has no manifests (``manifests=False``), or the group has no step
                `step` (the message names the steps it has).
            CommitError: the position could not be committed (retriable: call again).
            GroupConflictError: another client committed for this group.
            RunSupersededError: a newer consumer of the group connected, or (with ``announcer``) a newer trainer
                run began; nothing was committed.
            KafkaIOError (retriable): the broker did not answer within `timeout` (connecting, reading the
                manifests); nothing changed.
        """
        deadline = Deadline.of(self._timeout if timeout is None else timeout)
        self._start(deadline)
        standing = self._restart.after_step(self.config, step, self._progress.position, self._committer.index,
                                            deadline)
        self._committer.use_index(standing.index)
        self._committer.retrying(lambda d: self._committer.rewind(standing.position, d),
                                 replacement=self._replacement)
        self._forget_uncommitted()
        self._progress.drop_uncommitted()
        self._stand(standing)
        self._progress.last_committed_step = step
        self._fetched.reassign(self._progress.position)
        log.info("group %s resumed after step %d at offsets %s; taking steps %s again first, as recorded",
                 self.group_id, step, self._progress.position, [m.step for m in standing.redo])

    def lag(self, timeout: float = 10.0) -> GroupLag:
        """The group's committed lag on NS.rollouts (`rollstream.infra.LagReader`). Returns or raises within
        `timeout` s + `GRACE_S` (one deadline for all its reads). Makes no other network call: it does not
        connect the consumer.

        Raises:
            KafkaIOError (retriable): the broker did not answer in time.
        """
        with LagReader(self.config) as reader:
            return reader.group_lag(self.group_id, self.names.rollouts, timeout=timeout)

    @property
    def skipped_waiting(self) -> int:
        """Records the last `poll_batch` that returned None looked at and would not take (filtered, requeued,
        duplicate, undecodable): part of the group's lag that no step will train. 0 once a take returned a batch.
        Does not block. Not thread-safe."""
        return self._skipped_waiting

    def estimated_lag(self) -> int:
        """Records on NS.rollouts after this consumer's position (uncommitted batches count as taken),
        from the end offsets librdkafka saw on its last fetch: no network call, does not block. 0 before
        the consumer has started. Not thread-safe. For the group's committed lag, see `lag`."""
        return self._client.records_after(self._progress.position)
