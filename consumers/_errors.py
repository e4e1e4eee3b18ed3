"""Errors of the trainer side. All derive from `rollstream.schemas.RollstreamError`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollstream.schemas import RollstreamError

if TYPE_CHECKING:
    from rollstream.consumers.forensics._status_report import Diagnosis


class TakeTimeout(RollstreamError):
    """`take(n)` found fewer than n acceptable groups before its timeout: a caller's deadline passed.

    A caller that waits in slices (an adapter serving its trainer in between) uses
    `RolloutConsumer.poll_batch`, which returns None instead, and raises `RolloutConsumer.timeout_error`
    when its own deadline passes.

    Nothing is lost and nothing is committed: every record the call looked at is put back, in order,
    at the front of the consumer's buffer, so the next `take` starts with them (and re-applies the
    filters with the policy version current then). Retrying can help (`retriable` is True).

    The message says why, in two lines after today's facts: what the take itself looked at (e.g.
    "looked at 40 groups: 40 filtered (stale 40)") and the likely cause from the cluster (no producer in
    the producers' group, no prompt left in the last epoch, every producer paused by backpressure, every
    group filtered). The cluster part is rate-limited, not read at every timeout: a consumer reads it in
    a background thread at most once every 30 s (bounded to 5 s) and reuses it in between, saying how old
    it is; a take waits for a read it started at most a quarter of its own timeout (at most 1 s, half of
    `rollstream.infra.deadline.GRACE_S`: a timed-out take raises within its grace), so
    ``timeout=0`` never waits, and the first timeout of a tight retry loop may say the cluster part is
    still being read. Building the diagnosis never raises: what could not be read is named instead.

    Attributes:
        wanted: the n that was asked for.
        gathered: acceptable groups found before the timeout (kept for the next call).
        timeout: the timeout in seconds.
        diagnosis: a `rollstream.consumers.Diagnosis` (``causes``, ``seen``, ``note``; ``str()`` gives the
            two lines), a plain string, or None when the raiser gave none.
    """

    retriable = True

    def __init__(self, wanted: int, gathered: int, timeout: float, diagnosis: Diagnosis | str | None = None) -> None:
        head = (f"take({wanted}) timed out after {timeout:g} s with {gathered} of {wanted} groups; they stay "
                "buffered for the next take")
        if diagnosis is None:
            tail = ". Are producers running? Check 'rollstream status', or raise the timeout"
        else:
            tail = f".\n{diagnosis}"
        super().__init__(head + tail)
        self.wanted = wanted
        self.gathered = gathered
        self.timeout = timeout
        self.diagnosis = diagnosis


class FilterError(RollstreamError):
    """A group filter raised instead of returning a reason or None. Nothing was taken or committed.

    Attributes:
        filter_name: the filter's name; partition, offset: the record it failed on.
    """

    def __init__(self, filter_name: str, partition: int, offset: int, cause: BaseException) -> None:
        super().__init__(f"group filter {filter_name} raised {type(cause).__name__}: {cause} on partition "
                         f"{partition} offset {offset}; fix the filter (return a reason string to skip a group)")
        self.filter_name = filter_name
        self.partition = partition
        self.offset = offset


class CommitError(RollstreamError):
    """A step was taken but its manifest or its offsets could not be written.

    The batch stays uncommitted in the consumer; ``consumer.commit(err.batch)`` retries (writing the
    manifest again is harmless: the later manifest of a step supersedes the earlier one).

    Attributes:
        batch: the `Batch` that was taken and is still uncommitted.
    """

    retriable = True

    def __init__(self, batch: object, message: str) -> None:
        super().__init__(message + "; the batch is still uncommitted: retry consumer.commit(err.batch)")
        self.batch = batch


class GroupConflictError(CommitError):
    """Another client committed offsets for this consumer group since this consumer last did.

    Two trainers (or a trainer and a ``rollstream take``) are using the same group id: each would take
    the same groups. Nothing of this batch was written. Give each trainer job its own group id; or, if
    the offsets were moved on purpose, start a new consumer (it reads them afresh). A consumer whose run a
    newer one superseded gets `RunSupersededError` instead, also when the newer one moved the offsets: this
    is for a peer that does not fence (``fence=False``, an older rollstream) or a consumer without a run.

    Attributes:
        batch: the `Batch` that was taken and is not committed.
        moved: partition -> (offset this consumer expected, offset found committed).
    """

    retriable = False

    def __init__(self, batch: object, group_id: str, moved: dict[int, tuple[int | None, int | None]]) -> None:
        where = ", ".join(f"partition {p} is at {found}, expected {expected}"
                          for p, (expected, found) in sorted(moved.items()))
        RollstreamError.__init__(
            self, f"group {group_id}: another client committed offsets since this consumer last did ({where}); "
                  "two trainers are sharing one group id and would take the same groups. Give each trainer job "
                  "its own --group; nothing of this step was committed")
        self.batch = batch
        self.moved = moved
