"""The Kafka transactions of one run: fencing the older runs that share its ``transactional.id``, then one
transaction at a time, each failure sorted into superseded (a newer run fenced this one), broken (this run's
producer cannot write again) or retriable (the transaction was aborted; the next may succeed).

Two kinds of run use it (`rollstream.infra.runs`): a trainer run (`PolicyAnnouncer`, one id per namespace) and a
group run (`GroupRun`, one id per trainer consumer group). Not thread-safe: its owner calls it under its own lock.

Every transaction keeps its caller's deadline. librdkafka can hold ``send_offsets_to_transaction`` past its timeout
for good once a broker stalled (its coordinator request is never timed out: librdkafka#5456, #5511), so each
transaction runs in a thread of its own (`rollstream.infra.threads.call_within`) and a caller whose time is up gets
a retriable error. A transaction that returns late is aborted, not committed. One that has still not returned by
the next transaction is given up on: the run's producer is replaced and the run fenced again (``init_transactions``,
which also fences the stuck producer), after the owner's check that no newer run is known to have begun
(`RunTransactions`' ``may_refence``).

A run that may fence again does not wait out its caller's whole deadline for a stuck transaction: one that has not
returned after ``stuck_after_s`` (`STUCK_AFTER_S`, 5 s: a healthy one takes milliseconds, and a broker failing over
answers the fresh producer as soon as it answers anyone) is given up on within the same call, and the producer
replaced, while the caller's time lasts. A SIGKILLed node that coordinated a trainer's transactions stopped its
commits for 41-43 s with a 60 s consumer timeout before (the stuck commit's share of the timeout, then half of the
next one's), ~15 s after (the ~9 s the cluster takes to move the coordinator, then 5 s).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from rollstream.infra.clients import open_producer
from rollstream.infra.config import KafkaConfig
from rollstream.infra.kafka_errors import KafkaIOError, kafka_error
from rollstream.infra.threads import call_within
from rollstream.schemas import RollstreamError

log = logging.getLogger(__name__)
_FENCED = {"_FENCED", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH", "INVALID_PRODUCER_ID_MAPPING"}
_LATE_S = 0.5  # a transaction's own timeouts run inside its call: what it may take past them before it is given up
STUCK_AFTER_S = 5.0  # a transaction not returned by then is given up on and its producer replaced (module docstring)
_SETTLE_S = 1.0  # the most a call waits for a transaction an earlier call gave up on, before replacing its producer
_RENEW_MIN_S = 1.0  # the least time a call must have left to replace a stuck producer itself rather than raise


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


@dataclasses.dataclass
class _Transaction:
    """One transaction's calls, run in a thread of its own (`RunTransactions.transaction`): begin, `write`, then
    commit, or abort when it is a probe or its caller gave up waiting (`given_up`). Never raises: what failed is
    `error`, and `unfinished` says that the transaction is still open on the broker (to abort before the next)."""

    producer: Producer
    write: Callable[[Producer], object]
    abort: bool
    timeout: float
    unfinished: bool  # the one before it was left open: abort that first
    given_up: threading.Event = dataclasses.field(default_factory=threading.Event)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: KafkaException | None = None
    started: float = dataclasses.field(default_factory=time.monotonic)

    def run(self) -> None:
        producer = self.producer
        try:
            if self.unfinished:
                producer.abort_transaction(self._left())
                self.unfinished = False
            producer.begin_transaction()
            self.write(producer)
            end = producer.abort_transaction if self.abort or self.given_up.is_set() else producer.commit_transaction
            end(self._left())
        except KafkaException as exc:
            self.error = exc
            if not _is_fatal(exc) and not _is_fenced(exc):  # within its time; else the next one aborts it first
                self.unfinished = not _aborted(producer, self._left())
        finally:
            self.done.set()

    def _left(self) -> float:
        return max(0.0, self.timeout - (time.monotonic() - self.started))


class RunTransactions:
    """One run's transactional producer (`transactional_id`). No I/O until `fence`.

    Args:
        superseded: the `RunSupersededError` to raise for an action (given its description) once fenced.
        renew: what to do once the producer failed for good (e.g. "create a new PolicyAnnouncer").
        topic: the topic the run writes, named in errors (None: offsets only).
        request_timeout_s: the most one request to the transaction coordinator may wait (librdkafka's
            ``socket.timeout.ms``; None: its 60 s). A transactional call waits for its request whatever its own
            timeout, so a caller with a deadline shorter than that (a commit) bounds the requests.
        may_refence: asked (with a timeout) before the run is fenced again around a transaction that never
            returned (see the module docstring): False when a newer run is known to have begun (this one is then
            superseded), True when none is; raises KafkaIOError when that cannot be told in time. None: the run
            is never fenced again, a stuck transaction is waited for.
        stuck_after_s: with ``may_refence``, how long a transaction may go without returning before it is given
            up on and the producer replaced within the same call (`STUCK_AFTER_S`).
    """

    def __init__(self, config: KafkaConfig, transactional_id: str, *,
                 superseded: Callable[[str], RunSupersededError], renew: str, topic: str | None = None,
                 request_timeout_s: float | None = None,
                 may_refence: Callable[[float], bool] | None = None, stuck_after_s: float = STUCK_AFTER_S) -> None:
        self.transactional_id = transactional_id
        self._stuck_after_s = stuck_after_s
        self._config = config
        self._new_superseded = superseded
        self._renew = renew
        self._topic = topic
        self._request_timeout_s = request_timeout_s
        self._may_refence = may_refence
        self._producer: Producer | None = None
        self._unfinished = False  # a transaction failed and its abort did not finish in time: abort it first
        self._stuck: _Transaction | None = None  # a transaction given up on that has not returned yet
        self._renewal: str | None = None  # why the producer is to be replaced before the next transaction
        self._refence = False  # the producer was replaced: fence again first
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
        self.fenced_older, self._refence = True, False

    def transaction(self, what: str, timeout: float, write: Callable[[Producer], object], *,
                    abort: bool = False) -> None:
        """`write` in one transaction, committed within about `timeout` (the call returns then, whatever the
        broker does: one that returns later is aborted). A transaction that has not returned after
        ``stuck_after_s`` is given up on and `write` run again in a transaction of a fresh producer, while the
        time lasts (module docstring; only for a run that may fence again). Once the producer failed for good,
        every later call raises that failure again (a run never begins twice). With `abort`, a probe: the
        transaction is aborted, so nothing is written, but the broker has still refused it to a superseded run
        (`write` must register something with the coordinator, e.g. offsets: an empty transaction never reaches it).

        Raises:
            RunSupersededError: a newer run began; nothing was written.
            KafkaIOError: not written (retriable unless the producer failed for good or the run is not fenced yet).
        """
        started = time.monotonic()

        def left() -> float:
            return max(0.0, timeout - (time.monotonic() - started))

        self._raise_if_done(what)
        self._settle_stuck(what, min(timeout / 2, _SETTLE_S))
        while True:
            txn, finished = self._try_transaction(what, left, write, abort)
            if finished:
                break
            if self._may_refence is None or left() < _RENEW_MIN_S:
                raise KafkaIOError(
                    f"{what}: the broker did not finish the transaction within {timeout:.1f} s (after a broker stall "
                    "librdkafka can wait for a coordinator for good: librdkafka#5456); nothing is committed (should "
                    "it return later, it is aborted). Retrying may help: a retry that still finds it waiting "
                    "replaces this run's producer", topic=self._topic, retriable=True)
            waited = time.monotonic() - txn.started
            self._renewal = f"a transaction has not returned for {waited:.1f} s (librdkafka#5456)"
        self._unfinished = txn.unfinished
        if txn.error is not None:
            self._raise_failure(what, txn.error)

    def _try_transaction(self, what: str, left: Callable[[], float], write: Callable[[Producer], object],
                         abort: bool) -> tuple[_Transaction, bool]:
        """One try of `transaction`: the producer replaced and the run fenced again first where that is due, then
        `write` in a transaction, waited for up to what is `left` (at most ``stuck_after_s`` when the run may fence
        again). Returns the transaction and whether it finished (if not, it was given up on: `_stuck`)."""
        self._replace_producer(what, left())
        if self._refence:
            self.fence(left(), what)
        producer = self._producer
        if producer is None or not self.fenced_older:
            raise KafkaIOError(f"{what}: the run has not begun", retriable=True)
        txn = _Transaction(producer, write, abort, left(), self._unfinished)
        patience = txn.timeout if self._may_refence is None else min(txn.timeout, self._stuck_after_s)
        finished, _ = call_within(txn.run, patience + _LATE_S, f"rollstream-txn-{self.transactional_id}")
        if not finished:
            txn.given_up.set()
            self._stuck = txn
        return txn, finished

    def send_offsets(self, consumer: Consumer, offsets: list[TopicPartition], what: str, timeout: float, *,
                     abort: bool = False) -> None:
        """`offsets` (with their metadata) for `consumer`'s group in one `transaction` (with `abort`: a probe that
        commits nothing). Raises what `transaction` raises."""
        self.transaction(what, timeout, lambda p: p.send_offsets_to_transaction(
            offsets, consumer.consumer_group_metadata(), timeout), abort=abort)

    def close(self) -> None:
        """Drop the producer (nothing is pending between transactions). Idempotent. A transaction still stuck in
        its thread keeps the producer it uses until it returns."""
        producer, self._producer = self._producer, None
        if producer is not None and self._stuck is None:
            try:
                producer.flush(1.0)
            except KafkaException as exc:  # a producer that failed for good (fenced, not authorized) says so again
                log.debug("closing the producer of %s: %s", self.transactional_id, exc)

    def _raise_if_done(self, what: str) -> None:
        if self._superseded:
            raise self._new_superseded(what)
        if self._broken is not None:
            raise KafkaIOError(f"{what}: this run can no longer write ({self._broken}); {self._renew}",
                               topic=self._topic, retriable=False)

    def _settle_stuck(self, what: str, wait_s: float) -> None:
        """Before a transaction: wait up to `wait_s` for one given up on to return (then learn from how it ended);
        if it does not, its producer is to be replaced (`_replace_producer`)."""
        stuck = self._stuck
        if stuck is None:
            return
        if stuck.done.wait(wait_s):
            self._stuck = None
            self._unfinished = stuck.unfinished
            if stuck.error is not None and (_is_fenced(stuck.error) or _is_fatal(stuck.error)):
                self._raise_failure(what, stuck.error)
            return
        waited = time.monotonic() - stuck.started
        if self._may_refence is None:
            raise KafkaIOError(f"{what}: an earlier transaction of this run has not returned for {waited:.0f} s "
                               "(librdkafka#5456); retrying may help", topic=self._topic, retriable=True)
        self._renewal = f"a transaction has not returned for {waited:.0f} s (librdkafka#5456)"

    def _replace_producer(self, what: str, timeout: float) -> None:
        """Replace the producer (stuck, or failed for good) and fence again, when the owner's `may_refence` says
        no newer run is known; else this run is superseded. A stuck producer keeps running in its thread until
        its call returns; the new one's fencing fences it."""
        reason = self._renewal
        if reason is None or self._may_refence is None:
            return
        if not self._may_refence(timeout):
            self._superseded = True
            raise self._new_superseded(what)
        log.warning("%s: %s: replacing the producer of %s and fencing again", what, reason, self.transactional_id)
        self._renewal, self._stuck, self._producer, self._unfinished = None, None, None, False
        self.fenced_older, self._refence = False, True

    def _raise_failure(self, what: str, exc: KafkaException) -> None:
        """Raise `exc` as a RollstreamError; remember a newer run, or a producer failed for good (replaced before
        the next transaction when the owner allows fencing again: the error is then retriable)."""
        error = self._failure(what, exc)
        if isinstance(error, RunSupersededError):
            self._superseded = True
        elif _is_fatal(exc) and self._may_refence is None:
            self._broken = str(error)
        elif _is_fatal(exc):
            self._renewal = f"the producer failed for good ({error})"
            raise KafkaIOError(f"{error}; the next try replaces this run's producer", topic=self._topic,
                               retriable=True) from exc
        raise error from exc

    def _failure(self, what: str, exc: KafkaException) -> RollstreamError:
        if _is_fenced(exc):
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


def _is_fenced(exc: KafkaException) -> bool:
    err = _error_of(exc)
    return err is not None and err.name() in _FENCED


def _aborted(producer: Producer, timeout: float) -> bool:
    """Abort `producer`'s open transaction within `timeout`; False when it could not (the next one aborts it)."""
    try:
        producer.abort_transaction(timeout)
    except KafkaException as exc:
        log.info("could not abort a transaction yet (the next one aborts it first): %s", exc)
        return False
    return True


__all__ = ["RunSupersededError", "RunTransactions"]
