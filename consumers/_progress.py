"""Where a trainer's consumer stands: its position, step numbers, uncommitted batches and ledger of taken ids.

`Progress` is the one owner of that state for `RolloutConsumer` (`rollstream.consumers._consumer`), which
does the I/O around it: a take hands a batch over (`hand_over`), a commit moves the committed prefix out
(`through`, then `committed`), a start or `seek_to_step` installs what `rollstream.consumers._resume` read
(`stand`), and `seek_to` moves the position (`seek`). No I/O; not thread-safe (the consumer's thread).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rollstream.consumers._batch import Batch
from rollstream.consumers._ledger import StepLedger
from rollstream.consumers._resume import Standing
from rollstream.schemas import RollstreamError, StepManifest

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """The consumer's state (see the module docstring).

    Attributes:
        ledger: the taken ids (`rollstream.consumers._ledger`), also those of the uncommitted batches (held).
        position: per partition, the next offset a take looks at (uncommitted batches count as taken).
        next_step: the step number of the next take.
        pending: batches taken and not committed, oldest first.
        last_committed_step: the newest step committed by this consumer or found committed at a start.
    """

    ledger: StepLedger
    position: dict[int, int] = field(default_factory=dict)
    next_step: int = 0
    pending: list[Batch] = field(default_factory=list)
    last_committed_step: int | None = None

    def stand(self, standing: Standing) -> None:
        """Install where the group stands after a start or `seek_to_step`."""
        self.position.update(standing.position)
        self.ledger = standing.ledger
        self.next_step = standing.next_step

    def warn_uncommitted(self, group_id: str, *, superseded: bool = False) -> None:
        """Log the uncommitted steps a closing consumer leaves (their groups will be taken again), if any: a
        warning, or only at INFO for a `superseded` consumer (its error said so; the newer one takes them)."""
        if self.pending:
            log.log(logging.INFO if superseded else logging.WARNING,
                    "closing %s with %d uncommitted step(s) %s: their groups will be taken again", group_id,
                    len(self.pending), [b.step for b in self.pending])

    def hand_over(self, batch: Batch) -> None:
        """`batch` was taken and not committed: the position moves past it, its step number is used, and
        its group ids stay held in the ledger until it is committed."""
        self.position.update(batch.offsets)
        self.next_step = max(self.next_step, batch.step + 1)
        self.pending.append(batch)

    def requeued(self, batch: Batch) -> None:
        """`batch`'s requeues were published: the same attempt is not requeued again."""
        for r in batch.requeues:
            self.ledger.note_requeued(r.group_id, r.attempt, r.partition, r.offset)

    def through(self, batch: Batch, group_id: str) -> list[Batch]:
        """The uncommitted batches up to `batch`, oldest first: committing `batch` commits them all (offsets
        are a prefix). [] when `batch` is committed already.

        Raises:
            RollstreamError: `batch` was not taken by this consumer (of `group_id`), or was dropped by `seek_to`.
        """
        index = next((i for i, b in enumerate(self.pending) if b is batch), None)
        if index is not None:
            return self.pending[:index + 1]
        last = self.last_committed_step
        if batch.consumer_group == group_id and last is not None and batch.step <= last:
            return []
        raise RollstreamError(f"step {batch.step} is not an uncommitted batch of this consumer "
                              "(taken by another consumer, or dropped by seek_to)")

    def committed(self, batches: Sequence[Batch], manifests: Sequence[StepManifest]) -> None:
        """`batches` (the oldest pending ones) were committed with `manifests`: their ids are taken now."""
        for m, b in zip(manifests, batches, strict=True):
            self.ledger.add(m)
            self.ledger.release(b.group_ids)  # now taken in an effective step
        del self.pending[:len(batches)]
        self.last_committed_step = batches[-1].step

    def drop_uncommitted(self) -> int | None:
        """Drop the uncommitted batches (their ids are held no more); return the first one's step (None: none)."""
        first = self.pending[0].step if self.pending else None
        self.pending.clear()
        self.ledger.release()
        return first

    def seek(self, offsets: Mapping[int, int], next_step: int | None, *, topic: str) -> tuple[bool, list[int]]:
        """Move to `offsets` (partitions of `topic`, the rollouts), dropping the uncommitted batches; the next step
        is `next_step`, else the first dropped one, else unchanged. Returns whether the ledger forgot ids that
        count again from there (beyond its dedupe window: it must be read again) and the steps it dropped.

        Raises:
            RollstreamError: a partition that `topic` does not have, or a negative offset (nothing changed).
        """
        for p, o in offsets.items():
            if p not in self.position or o < 0:
                raise RollstreamError(f"cannot seek {topic} partition {p} to offset {o}: the topic "
                                      f"has partitions {sorted(self.position)} and offsets are >= 0")
        first = self.drop_uncommitted()
        self.position.update({int(p): int(o) for p, o in offsets.items()})
        forgot = self.ledger.forgot_within(self.position)
        dropped = self.ledger.rewind(self.position)
        following = next_step if next_step is not None else first
        if following is not None:
            self.next_step = following
        return forgot, dropped
