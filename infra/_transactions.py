"""The Kafka transactions of one run: fencing the older runs that share its ``transactional.id``, then one
transaction at a time, each failure sorted into superseded (a newer run fenced this one), broken (this run's
producer cannot write again) or retriable (the transaction was aborted; the next may succeed).

Two kinds of run use it (`rollstream.infra.runs`): a trainer run (`PolicyAnnouncer`, one id per namespace) and a
group run (`GroupRun`, one id per trainer consumer group). Not thread-safe: its owner calls it under its own lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from rollstream.infra.clients import open_producer
from rollstream.infra.config import KafkaConfig
from rollstream.infra.kafka_errors import KafkaIOError, kafka_error
from rollstream.schemas import RollstreamError

log = logging.getLogger(__name__)
_FENCED = {"_FENCED", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH", "INVALID_PRODUCER_ID_MAPPING"}


class RunSupersededError(RollstreamError):
    """A newer run began: this one may neither announce nor commit any more. Not retriable.

    A trainer run (`PolicyAnnouncer`) is superseded by a newer one of its namespace; a group run (`GroupRun`:
    a `RolloutConsumer` or `rollstream take` that announces nothing) by a newer consumer of its group.

    Attributes: `run` (the trainer run's number; None for a group run or a run not numbered yet),
    `namespace`, and `group` (the consumer group of a group run; None for a trainer run).
    """

    def __init__(self, run: int | None, namespace: str, what: str, *, group: str | None = None) -> None:
        self.run, self.namespace, self.group = run, namespace, group
        if group is not None:
            message = (
                f"{what} refused: this consumer of group {group} (namespace {namespace}) was superseded by a newer "
                f"one, which began since (a rollstream take or RolloutConsumer of group {group} started, or a "
                "trainer run took the group over); the newer one takes over from this one's last committed step "
                "and the broker refuses this one's commits. Stop this one; if it should be the one running, "
                "restart it (it supersedes the other), or give each trainer its own group id.")
        else:
            label = f"trainer run {run}" if run else "this trainer run"
            message = (
                f"{what} refused: {label} of namespace {namespace} was superseded by a newer trainer run, which "
                f"began since (another process created a PolicyAnnouncer for {namespace} and announced or "
                "committed). The producers follow the newer run and the broker refuses this one's announcements "
                "and commits. Stop this trainer; if it should be the one running, restart it (it begins a new run "
                "that supersedes the other), or give each trainer its own namespace.")
        super().__init__(message, retriable=False)


class RunTransactions:
    """One run's transactional producer (`transactional_id`). No I/O until `fence`.

    Args:
        superseded: the `RunSupersededError` to raise for an action (given its description) once fenced.
        renew: what to do once the producer failed for good (e.g. "create a new PolicyAnnouncer").
        topic: the topic the run writes, named in errors (None: offsets only).
        request_timeout_s: the most one request to the transaction coordinator may wait (librdkafka's
            ``socket.timeout.ms``; None: its 60 s). A transactional call waits for its request whatever its own
            timeout, so a caller with a deadline shorter than that (a commit) bounds the requests.
    """

    def __init__(self, config: KafkaConfig, transactional_id: str, *,
                 superseded: Callable[[str], RunSupersededError], renew: str, topic: str | None = None,
                 request_timeout_s: float | None = None) -> None:
        self.transactional_id = transactional_id
        self._config = config
        self._new_superseded = superseded
        self._renew = renew
        self._topic = topic
        self._request_timeout_s = request_timeout_s
        self._producer: Producer | None = None
        self._unfinished = False  # a transaction failed and its abort did not finish in time: abort it first
        self.fenced_older = False  # init_transactions succeeded: the older runs of the id are fenced
        self._superseded = False  # the broker fenced this run: a newer one began
        self._broken: str | None = None  # the failure after which this run's producer cannot write

    @property
    def superseded(self) -> bool:
        """True once the broker said a newer run of the id began (this run cannot write again)."""
        return self._superseded

    def fence(self, timeout: float, what: str) -> None:
        """Fence every older producer of the id (``init_transactions``), once: a second one would fence a newer
        run. Blocks up to about `timeout`. `what` names the action in errors.

        Raises:
            KafkaIOError: the broker did not answer in time or refused (retriable ones may be called again);
                the message says what the cluster needs (a transaction coordinator, the transactional-id ACL).
            RunSupersededError: a newer run began while this one was beginning.
        """
        if self.fenced_older:
            return
        if self._producer is None:
            # retry.backoff.ms: a transaction right after another finds its markers still being written
            # (CONCURRENT_TRANSACTIONS) and is retried; librdkafka's 100 ms default made a commit's p90 114 ms.
            conf: dict[str, object] = {"linger.ms": 0, "transactional.id": self.transactional_id,
                                       "transaction.timeout.ms": 60_000, "retry.backoff.ms": 10}
            if self._request_timeout_s is not None:
                conf["socket.timeout.ms"] = max(100, int(self._request_timeout_s * 1000))
            conf = self._config.producer(conf)
            self._producer = open_producer(conf)
        try:
            self._producer.init_transactions(timeout)  # after a retriable failure it may be called again
        except KafkaException as exc:
            error = self._failure(
                f"{what} (Kafka transactions with transactional.id {self.transactional_id}: the cluster must run its "
                "transaction coordinator, i.e. transaction.state.log.replication.factor no larger than its brokers, "
                "and with ACLs grant Write, Describe on that transactional id; rollstream acls prints it)", exc)
            self._superseded = isinstance(error, RunSupersededError)
            raise error from exc
        self.fenced_older = True

    def transaction(self, what: str, timeout: float, write: Callable[[Producer], object], *,
                    abort: bool = False) -> None:
        """`write` in one transaction, committed within about `timeout`. Once the producer failed for good, every
        later call raises that failure again (a run never begins twice). With `abort`, a probe: the transaction is
        aborted, so nothing is written, but the broker has still refused it to a superseded run (`write` must
        register something with the coordinator, e.g. offsets: an empty transaction never reaches it).

        Raises:
            RunSupersededError: a newer run began; nothing was written.
            KafkaIOError: not written (retriable unless the producer failed for good or the run is not fenced yet).
        """
        if self._superseded:
            raise self._new_superseded(what)
        if self._broken is not None:
            raise KafkaIOError(f"{what}: this run can no longer write ({self._broken}); {self._renew}",
                               topic=self._topic, retriable=False)
        producer = self._producer
        if producer is None or not self.fenced_older:
            raise KafkaIOError(f"{what}: the run has not begun", retriable=True)
        started = time.monotonic()
        try:
            if self._unfinished:  # the last one failed and was not aborted yet (the broker did not answer)
                producer.abort_transaction(timeout)
                self._unfinished = False
            producer.begin_transaction()
            write(producer)
            end = producer.abort_transaction if abort else producer.commit_transaction
            end(max(0.0, timeout - (time.monotonic() - started)))
        except KafkaException as exc:
            error = self._failure(what, exc)
            if isinstance(error, RunSupersededError):
                self._superseded = True
            elif _is_fatal(exc):
                self._broken = str(error)
            else:  # within what is left of the call's time; else the next transaction aborts it first
                self._unfinished = not self._aborted(producer, max(0.0, timeout - (time.monotonic() - started)))
            raise error from exc

    def send_offsets(self, consumer: Consumer, offsets: list[TopicPartition], what: str, timeout: float, *,
                     abort: bool = False) -> None:
        """`offsets` (with their metadata) for `consumer`'s group in one `transaction` (with `abort`: a probe that
        commits nothing). Raises what `transaction` raises."""
        self.transaction(what, timeout, lambda p: p.send_offsets_to_transaction(
            offsets, consumer.consumer_group_metadata(), timeout), abort=abort)

    def close(self) -> None:
        """Drop the producer (nothing is pending between transactions). Idempotent."""
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.flush(1.0)
            except KafkaException as exc:  # a producer that failed for good (fenced, not authorized) says so again
                log.debug("closing the producer of %s: %s", self.transactional_id, exc)

    def _aborted(self, producer: Producer, timeout: float) -> bool:
        try:
            producer.abort_transaction(timeout)
        except KafkaException as exc:
            log.info("could not abort the transaction of %s yet (the next one aborts it first): %s",
                     self.transactional_id, exc)
            return False
        return True

    def _failure(self, what: str, exc: KafkaException) -> RollstreamError:
        err = _error_of(exc)
        if err is not None and err.name() in _FENCED:
            return self._new_superseded(what)
        where = f" on {self._topic}" if self._topic else ""
        return kafka_error(f"{what}{where}", exc, topic=self._topic)


class TransactionalRun:
    """What both kinds of run share (`rollstream.infra.runs`): commits and superseded checks in the run's
    transactions, one at a time under its lock, and closing. A context manager; `close` is idempotent.

    A subclass gives its `RunTransactions` to ``__init__`` and defines `_begin` (under the lock: fence the older
    runs once; raise LifecycleError once closed) and `_has_begun`.
    """

    def __init__(self, txn: RunTransactions) -> None:
        self._txn = txn
        self._closed = False
        self._lock = threading.Lock()

    def __enter__(self) -> TransactionalRun:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def superseded(self) -> bool:
        """True once the broker refused this run because a newer one began."""
        return self._txn.superseded

    def commit_offsets(self, consumer: Consumer, offsets: list[TopicPartition], *, what: str,
                       timeout: float) -> None:
        """Commit `offsets` (with their metadata) for `consumer`'s group in one of this run's transactions, so
        that the broker refuses it once a newer run began. Begins the run if it has not begun. Blocks up to
        about `timeout` (more when it begins the run). `what` names the commit in errors.

        Raises:
            KafkaIOError: not committed (retriable unless librdkafka said fatal; nothing was committed).
            RunSupersededError: a newer run began; nothing was committed.
            LifecycleError: closed.
        """
        with self._lock:
            self._begin(timeout)
            self._txn.send_offsets(consumer, offsets, what, timeout)

    def check_superseded(self, consumer: Consumer, offsets: list[TopicPartition], *, what: str,
                         timeout: float) -> None:
        """Raise `RunSupersededError` when a newer run began, committing nothing: a transaction of `offsets` (the
        group's as they stand) that is aborted, which the broker refuses to a fenced run (a transaction's round
        trips: for the rare path of a group moved under this run's consumer). Does nothing before the run began,
        or without `offsets`. Blocks up to about `timeout`. Raises KafkaIOError when the broker did not answer in
        time or refused otherwise (whether superseded is not known)."""
        with self._lock:
            if self._has_begun() and offsets:
                self._begin(timeout)  # raises LifecycleError when closed
                self._txn.send_offsets(consumer, offsets, what, timeout, abort=True)

    def close(self) -> None:
        """Drop the producer (nothing is pending between transactions). Idempotent; the run cannot write
        afterwards."""
        with self._lock:
            self._closed = True
            self._txn.close()

    def _begin(self, timeout: float) -> object:
        raise NotImplementedError

    def _has_begun(self) -> bool:
        raise NotImplementedError


def _error_of(exc: KafkaException) -> KafkaError | None:
    return exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None


def _is_fatal(exc: KafkaException) -> bool:
    err = _error_of(exc)
    return err is not None and err.fatal()


__all__ = ["RunSupersededError", "RunTransactions"]
