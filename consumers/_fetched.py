"""The records a trainer fetched and has not looked at yet, and gathering one take's groups from them.

Contract (pinned by tests/integration/test_consumer_take.py and test_poll_batch.py):

- Records are looked at in order per partition; whatever was fetched and not looked at stays buffered and
  comes first next time. Only ``n - accepted`` records are pulled from librdkafka at a time, so the
  Python-side buffer stays small; librdkafka's own fetch queue is bounded by ``queued.max.messages.kbytes``.
- A take that runs out of time (or raises) puts back everything it looked at, in order, and releases the
  group ids it held in the ledger: nothing is lost and the next take starts with it.
- Requeues (`rollstream.consumers._requeue`) are published when found, not at the deadline: each time a take
  has looked at everything fetched and must wait for more, it publishes the requeues found since it last
  did (one batch, acknowledged before it waits), since the groups it waits for may be their regenerations.
  So a take of stale candidates finishes as soon as they are regenerated, also with ``timeout=None``. The
  ledger remembers each (the step's manifest records it ``requeued`` and it is not published again).
- Every reassignment of the client (start, seek, a recorded step taken again, a replaced client) drops the
  buffer: those records are fetched again from the new position, none skipped, none twice.
- A client that lost its group coordinator for good (confluentinc/librdkafka#5511) is replaced after
  `FRESH_CLIENT_AFTER` failed commit attempts in a row (`replacement`, the one policy of
  `rollstream.infra._replaceable.ClientReplacement`): the fresh client goes on at the consumer's position for the
  fetches, and the commits go through a fresh commit client too (`swap`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping

from confluent_kafka import Consumer
from prometheus_client import Counter
from rollstream.consumers._client import TrainerClient
from rollstream.consumers._commit import FRESH_CLIENT_AFTER, StepCommitter
from rollstream.consumers._gather import Entry, Gathering
from rollstream.consumers._requeue import Requeue
from rollstream.infra._replaceable import ClientReplacement
from rollstream.schemas import RollstreamError

log = logging.getLogger(__name__)
_MAX_PULL = 1000


def unpublished(gathering: Gathering) -> list[Requeue]:
    """The requeues `gathering` found that no take published yet (the ledger knows which were)."""
    return [r for r in gathering.requeues if not gathering.ledger.requeued_from(r.partition, r.offset)]


class Fetched:
    """The records `client` fetched and no take has looked at yet, in order. Not thread-safe, like its owner."""

    def __init__(self, client: TrainerClient, committer: StepCommitter) -> None:
        self._client, self._committer = client, committer
        self._buffer: deque[Entry] = deque()

    def __len__(self) -> int:
        return len(self._buffer)

    def clear(self) -> None:
        """Drop every record fetched and not looked at: the client is being assigned elsewhere."""
        self._buffer.clear()

    def reassign(self, position: Mapping[int, int]) -> None:
        """Fetch from `position` on (partition -> next offset) with the current client; the buffer is dropped."""
        self.clear()
        self._client.use(self._client.current(), position)

    def swap(self, fresh: Consumer, position: Mapping[int, int]) -> Consumer | None:
        """Install `fresh` at `position` for the fetches (and a fresh commit client) and return the client it replaces.
        Records fetched and not looked at are dropped from the buffer and fetched again, in order: none
        skipped, none twice."""
        stale = self._client.swap(fresh, position)
        self._committer.renew()
        self.clear()
        return stale

    def replacement(self, open_client: Callable[[], Consumer], position: Callable[[], Mapping[int, int]],
                    counter: Counter) -> ClientReplacement[Consumer]:
        """The trainer's client replacement (see the module docstring): a client from `open_client` goes on at
        `position()`; each replacement is counted in `counter` and logged."""
        def replaced(cause: object) -> None:
            counter.inc()
            log.warning("group %s: replaced the Kafka client after %d failed commit attempts in a row (last: %s); "
                        "continuing at offsets %s", self._client.group_id, FRESH_CLIENT_AFTER, cause, position())

        return ClientReplacement[Consumer](
            "trainer", open_client=open_client, swap=lambda fresh: self.swap(fresh, position()),
            close_client=Consumer.close, after_failures=FRESH_CLIENT_AFTER, on_replace=replaced)

    def gather(self, gathering: Gathering, n: int, deadline: float | None) -> bool:
        """Feed records to `gathering` until it accepted `n` groups (True), or `deadline` (a `time.monotonic`
        instant; None: none) passed (False: its requeues are published and all it looked at is put back).

        Blocks until then. Whatever `gathering.evaluate` raises (FilterError) or a fetch raises (KafkaIOError)
        is raised after putting everything back.
        """
        try:
            while gathering.accepted < n:
                if not self._buffer:  # about to wait for more: what it waits for may be the requeues' answers
                    self._publish_requeues(gathering)
                entry = self._next_entry(deadline, n - gathering.accepted)
                if entry is None:
                    self._publish_requeues(gathering)
                    self.put_back(gathering)
                    return False
                gathering.evaluate(entry)
        except BaseException:
            self.put_back(gathering)
            raise
        return True

    def put_back(self, gathering: Gathering) -> None:
        """`gathering`'s records back to the front of the buffer, in order, its held group ids released."""
        gathering.ledger.release(gathering.group_ids)  # not taken after all
        self._buffer.extendleft(reversed(gathering.entries))

    def _publish_requeues(self, gathering: Gathering) -> None:
        """Publish the requeues `gathering` found and no one published yet (none: nothing to do). Remembered
        in the ledger: this step's manifest, or the next take's, records those offsets as requeued without
        publishing again. One that fails is published with the step (or by the next take). Blocks until
        acknowledged, up to the consumer's timeout."""
        ledger = gathering.ledger
        fresh = unpublished(gathering)
        if not fresh:
            return
        try:
            self._committer.publish_requeues(fresh)
        except RollstreamError as exc:
            log.warning("group %s: could not requeue %d prompts while waiting for groups (they go with the step, "
                        "or the next take tries again): %s", gathering.consumer_group, len(fresh), exc)
            return
        for r in fresh:
            ledger.note_requeued(r.group_id, r.attempt, r.partition, r.offset, early=True)

    def _next_entry(self, deadline: float | None, want: int) -> Entry | None:
        while not self._buffer:
            remaining = None if deadline is None else deadline - time.monotonic()
            # Wait in slices of at most 1 s so that Ctrl-C is seen; timeout=0 still drains what is queued.
            wait = 1.0 if remaining is None else max(0.0, min(remaining, 1.0))
            self._client.fetch_into(self._buffer, min(want, _MAX_PULL), wait)
            if not self._buffer and remaining is not None and remaining <= wait:
                return None
        return self._buffer.popleft()
