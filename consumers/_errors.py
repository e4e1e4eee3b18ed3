"""Errors of the trainer side. All derive from `schemas.RollstreamError`."""

from __future__ import annotations

from schemas import RollstreamError


class TakeTimeout(RollstreamError):
    """`take(n)` found fewer than n acceptable groups before its timeout.

    Nothing is lost and nothing is committed: every record the call looked at is put back, in order,
    at the front of the consumer's buffer, so the next `take` starts with them (and re-applies the
    filters with the policy version current then). Retrying can help (`retriable` is True).

    Attributes:
        wanted: the n that was asked for.
        gathered: acceptable groups found before the timeout (kept for the next call).
        timeout: the timeout in seconds.
    """

    retriable = True

    def __init__(self, wanted: int, gathered: int, timeout: float) -> None:
        super().__init__(
            f"take({wanted}) timed out after {timeout:g} s with {gathered} of {wanted} groups; they stay "
            "buffered for the next take. Are producers running? Check 'rollstream lag', or raise the timeout"
        )
        self.wanted = wanted
        self.gathered = gathered
        self.timeout = timeout


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
