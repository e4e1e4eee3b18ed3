"""Trainer runs: which trainer the producers follow, and fencing the ones that were replaced.

Each `PolicyAnnouncer` is one trainer run. A run *begins* at its first announcement (or at the first
step its `RolloutConsumer` commits through it, whichever comes first) and supersedes every earlier run
of the namespace: producers follow the newest run's versions, also when they are lower than an older
run's (a trainer resumed from its checkpoint of version 50 after announcing 60; TRL and slime count from
the start again in every run), and a superseded run's later announcements move nobody.

How runs are told apart without trusting clocks. Every announcer of namespace NS writes through a
Kafka *transactional* producer with the same ``transactional.id`` (``rollstream.NS.trainer-run``):

1. Beginning a run calls ``init_transactions``, with which the broker fences every older producer of
   that id. From then on the broker refuses the old run's writes (announcements, and the offset commits
   of a consumer bound to it, which go through the same transactions), so no window is left between a
   new run beginning and the old one being stopped: `RunSupersededError` is what the old run gets.
2. Then it reads NS.control to its end and takes the number after the highest run recorded there.
   Two runs that began at once cannot both write that number: the later ``init_transactions`` fenced
   the earlier before it wrote. Run numbers therefore grow in the order runs began, which is NS.control's
   offset order, and `run_id` (a uuid) tells the rare same-numbered pair apart (a broker without
   transactions): the first one on NS.control wins.

Group runs (`GroupRun`): a trainer consumer that announces nothing (`rollstream take`, a `RolloutConsumer`
without ``announcer=``) is a run of its consumer group, with a ``transactional.id`` of the group's own
(``rollstream.NS.group-run.GROUP``): starting one fences the group's older consumers the same way, and its
commits are transactions the broker refuses once a newer one began. It fences nothing else: trainer runs
and the consumers of other groups of the namespace go on. A group run has no number and announces nothing:
producers follow trainer runs only.

`follow_verdict` is the rule every `ControlWatcher` applies to each announcement it reads.
`announce_policy_version(config, ...)` is a run of one announcement: it supersedes the trainer that
announced before (use it to point producers at a version by hand, e.g. a rollback, with no trainer running).

Records written before runs existed decode as run 0, which any run supersedes. Upgrade order: producers
(and every other reader of NS.control) first, then trainers: an old producer cannot decode a run's
announcement and keeps its version (it logs each record it skips).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
import uuid
from collections.abc import Mapping

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition
from rollstream.infra._transactions import RunSupersededError, RunTransactions, TransactionalRun
from rollstream.infra.clients import open_consumer
from rollstream.infra.config import KafkaConfig
from rollstream.infra.kafka_errors import KafkaIOError, kafka_error
from rollstream.infra.topics import TopicNames
from rollstream.schemas import DecodeError, LifecycleError, PolicyVersion, decode, encode

log = logging.getLogger(__name__)
CONTROL_KEY = b"policy"


class Verdict(enum.Enum):
    """What a watcher does with an announcement (`follow_verdict`)."""

    FOLLOW = "follow"  # the newest run's newest word: producers move to it
    SAME = "same"  # nothing new (a repeat, or an older version of run 0)
    SUPERSEDED = "superseded"  # from a run older than the one followed: moves nobody


def follow_verdict(current: PolicyVersion | None, announced: PolicyVersion) -> Verdict:
    """The rule producers follow, for an announcement read after `current` (the one followed so far).

    - a higher run than the current one: follow, whatever the version number;
    - the same run: follow a different version (a run's announcements are in order on NS.control: its
      latest word counts, also a lower version); run 0 (records from before runs) keeps the highest;
    - a lower run, or the same number with another run id (the later of two runs that claimed one
      number): superseded.
    """
    if current is None or announced.run > current.run:
        return Verdict.FOLLOW
    if announced.run < current.run or announced.run_id != current.run_id:
        return Verdict.SUPERSEDED
    if announced.version == current.version or (announced.run == 0 and announced.version < current.version):
        return Verdict.SAME
    return Verdict.FOLLOW


def run_transactional_id(names: TopicNames) -> str:
    """The ``transactional.id`` every trainer run of `names.namespace` shares (the fencing key)."""
    return f"rollstream.{names.namespace}.trainer-run"


def group_run_transactional_id(names: TopicNames, group_id: str) -> str:
    """The ``transactional.id`` every group run of consumer group `group_id` on `names.namespace` shares."""
    return f"rollstream.{names.namespace}.group-run.{group_id}"


def newest_run(config: KafkaConfig, topic: str, *, timeout: float) -> int:
    """The highest run number announced on `topic` (NS.control; 0 when none). Reads it to its end.
    Blocks up to about `timeout` s. Raises KafkaIOError when it cannot be read in time."""
    announced, _ = announcements(config, topic, timeout=timeout)
    return max((version.run for version in announced), default=0)


@dataclasses.dataclass(frozen=True)
class Followed:
    """What NS.control says producers follow (`followed_policy`).

    Attributes:
        policy: the announcement producers follow now (None: nothing announced).
        superseded: announcements of superseded runs still on NS.control (they moved nobody).
        undecodable: records that are not a `PolicyVersion` this version of rollstream reads.
    """

    policy: PolicyVersion | None
    superseded: int
    undecodable: int


def followed_policy(config: KafkaConfig, topic: str, *, timeout: float) -> Followed:
    """Read `topic` (NS.control) to its end and apply the producers' rule (`follow_verdict`) to its
    announcements, in order. Blocks up to about `timeout` s. Raises KafkaIOError when it cannot be read."""
    announced, undecodable = announcements(config, topic, timeout=timeout)
    followed: PolicyVersion | None = None
    superseded = 0
    for version in announced:
        verdict = follow_verdict(followed, version)
        if verdict is Verdict.FOLLOW:
            followed = version
        superseded += verdict is Verdict.SUPERSEDED
    return Followed(followed, superseded, undecodable)


def announcements(config: KafkaConfig, topic: str, *, timeout: float) -> tuple[list[PolicyVersion], int]:
    """Every policy version on `topic` (NS.control) from its beginning to its end as of now, in order, and
    how many records were undecodable (logged, skipped). Blocks up to about `timeout` s. Raises
    KafkaIOError when it cannot be read in time."""
    consumer = open_consumer(config.consumer(f"rollstream-run-read-{uuid.uuid4().hex[:12]}"))
    try:
        values = read_to_end(consumer, topic, timeout=timeout)
    finally:
        consumer.close()
    decoded: list[PolicyVersion] = []
    for value in values:
        try:
            decoded.append(decode(value, PolicyVersion))
        except DecodeError as exc:
            log.warning("skipping an undecodable policy version on %s: %s", topic, exc)
    return decoded, len(values) - len(decoded)


def read_to_end(consumer: Consumer, topic: str, *, timeout: float) -> list[bytes]:
    """The values of `topic`'s ``policy`` records, from its beginning to its end as of now (committed
    transactions only). Blocks up to about `timeout` s. Raises KafkaIOError when that is not enough."""
    try:
        meta = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
        if meta is None or meta.error is not None:
            raise KafkaIOError(f"cannot read {topic}: {meta.error if meta else 'no such topic'}", topic=topic,
                               retriable=True)
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)[1]
                for p in meta.partitions}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in meta.partitions])
        values: list[bytes] = []
        deadline = time.monotonic() + timeout
        while not caught_up(consumer, topic, ends):
            if time.monotonic() > deadline:
                raise KafkaIOError(f"{topic} was not read to its end within {timeout:.0f} s", topic=topic,
                                   retriable=True)
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None and msg.key() == CONTROL_KEY:
                values.append(msg.value() or b"")
        return values
    except KafkaException as exc:
        raise kafka_error(f"cannot read {topic}", exc, topic=topic) from exc


def caught_up(consumer: Consumer, topic: str, ends: Mapping[int, int]) -> bool:
    """True when `consumer` is at or past `ends` in every partition of `topic`. Its position, not the
    last record's offset, since a transaction's commit marker takes an offset no record is read at."""
    waiting = [p for p, end in ends.items() if end > 0]
    if not waiting:
        return True
    positions = consumer.position([TopicPartition(topic, p) for p in waiting])
    return all(tp.offset >= ends[tp.partition] for tp in positions)


class PolicyAnnouncer(TransactionalRun):
    """One trainer run: writes its policy versions to NS.control (key ``policy``) and fences older runs.

    Construction does no I/O; the run begins at the first `announce` or `begin` (or the first commit of a
    `RolloutConsumer` given ``announcer=this``). A context manager; `close` is idempotent. Thread-safe
    (one transaction at a time).

    Attributes:
        run_id: this run's unique id (a uuid), set at construction.
    """

    def __init__(self, config: KafkaConfig, names: TopicNames | str) -> None:
        self.names = names if isinstance(names, TopicNames) else TopicNames(names)
        self.topic = self.names.control
        self.run_id = uuid.uuid4().hex
        self._config = config
        self._run: int | None = None
        super().__init__(RunTransactions(
            config, run_transactional_id(self.names), topic=self.topic,
            superseded=lambda what: RunSupersededError(self._run, self.names.namespace, what),
            renew="begin a new run: create a new PolicyAnnouncer (it supersedes this one)",
            may_refence=self._leads))

    def __enter__(self) -> PolicyAnnouncer:
        return self

    @property
    def run(self) -> int | None:
        """This run's number (None before it began)."""
        return self._run

    def begin(self, *, timeout: float = 30.0) -> int:
        """Begin the run if it has not begun, and return its number: fence every older run of the
        namespace, then number this one after the highest on NS.control. Blocks up to about 2 x
        `timeout`. Idempotent.

        Raises:
            KafkaIOError (retriable): the broker did not answer in time (nothing was fenced, or the
                older runs were fenced and this one is not numbered yet: call again).
            RunSupersededError: a newer run began while this one was beginning.
        """
        with self._lock:
            return self._begin(timeout)

    def announce(self, version: PolicyVersion, *, timeout: float = 30.0) -> PolicyVersion:
        """Publish `version` as this run's (its `run` and `run_id` are set here) and block until the
        broker committed it (at most about `timeout` s, more at the run's first announcement, which
        begins it). Returns what was written. When it returns, every producer that reads NS.control
        follows it, unless a newer run began since. Blocks: from an event loop, await `announce_async`.

        Raises:
            KafkaIOError (retriable): not acknowledged within `timeout`, or the broker refused it.
            RunSupersededError: a newer trainer run began; nothing was written (not retriable).
        """
        with self._lock:
            run = self._begin(timeout)
            record = dataclasses.replace(version, run=run, run_id=self.run_id)
            self._txn.transaction(f"announcing policy version {version.version}", timeout,
                                  lambda p: p.produce(self.topic, encode(record), key=CONTROL_KEY))
        log.info("announced policy %s on %s (weights %s)", record.label(), self.topic, record.weights_path)
        return record

    async def announce_async(self, version: PolicyVersion, *, timeout: float = 30.0) -> PolicyVersion:
        """`announce` in a worker thread, so the event loop never waits on the broker."""
        return await asyncio.to_thread(self.announce, version, timeout=timeout)

    def _has_begun(self) -> bool:
        return self._run is not None

    def _leads(self, timeout: float) -> bool:
        """False when NS.control shows a newer run (one that announced): this one may not fence again. Raises
        KafkaIOError when NS.control cannot be read within `timeout`."""
        return self._run is None or newest_run(self._config, self.topic, timeout=timeout) <= self._run

    def _begin(self, timeout: float) -> int:
        """Under the lock: fence the older runs (once), then number this one."""
        if self._closed:
            raise LifecycleError(f"the announcer of trainer run {self._run or '(not begun)'} on {self.names.namespace} "
                                 "is closed: a new PolicyAnnouncer begins a new run")
        if self._run is not None:
            return self._run
        self._txn.fence(timeout, "beginning a trainer run")
        self._run = newest_run(self._config, self.topic, timeout=timeout) + 1
        log.info("trainer run %d (%s) began on %s: older runs are fenced", self._run, self.run_id, self.names.namespace)
        return self._run


class GroupRun(TransactionalRun):
    """The run of one trainer consumer group: fences the group's older consumers and commits its offsets in
    transactions the broker refuses once a newer one began. What a `RolloutConsumer` (and so `rollstream
    take`) is when it announces nothing (see the module docstring). `request_timeout_s` bounds each request to
    the transaction coordinator (a commit's deadline shorter than librdkafka's 60 s: a quarter of it).

    Runs of other groups, and trainer runs (`PolicyAnnouncer`), are not fenced by it: its ``transactional.id``
    is the group's (`group_run_transactional_id`). Construction does no I/O; `begin` fences. A context manager;
    `close` is idempotent. Thread-safe (one transaction at a time).

    A commit whose transaction never returns (librdkafka#5456, after a broker stall) is given up at its deadline;
    the next commit replaces the producer and fences again. What guards that: every commit first checks that
    the group's offsets are where this consumer left them, so a newer consumer that committed is found
    (`RunSupersededError`). One that began but has not committed yet is fenced in turn, and told so at its
    first commit: the rare case (a commit stuck and a newer consumer started within one step) where the
    older one goes on.
    """

    def __init__(self, config: KafkaConfig, names: TopicNames | str, group_id: str, *,
                 request_timeout_s: float | None = None) -> None:
        self.names = names if isinstance(names, TopicNames) else TopicNames(names)
        self.group_id = group_id
        super().__init__(RunTransactions(
            config, group_run_transactional_id(self.names, group_id),
            superseded=lambda what: RunSupersededError(None, self.names.namespace, what, group=group_id),
            renew="start a new consumer of the group (it supersedes this one)", request_timeout_s=request_timeout_s,
            may_refence=lambda _timeout: True))  # its commits check the group's offsets first: see the class

    def __enter__(self) -> GroupRun:
        return self

    @property
    def run(self) -> None:
        """A group run has no number: producers do not follow it (they follow trainer runs)."""
        return None

    @property
    def begun(self) -> bool:
        """True once `begin` fenced the group's older consumers."""
        return self._txn.fenced_older

    def begin(self, *, timeout: float = 30.0) -> None:
        """Fence every older run of the group, if not done yet: from now on the broker refuses their commits.
        Blocks up to about `timeout`. Idempotent.

        Raises:
            KafkaIOError: the broker did not answer in time (retriable: call again) or refused (the transactional
                id's ACL, no transaction coordinator: the message says what to grant or set).
            RunSupersededError: a newer consumer of the group began while this one was beginning.
            LifecycleError: closed.
        """
        with self._lock:
            self._begin(timeout)

    def _has_begun(self) -> bool:
        return self._txn.fenced_older

    def _begin(self, timeout: float) -> None:
        if self._closed:
            raise LifecycleError(f"the run of group {self.group_id} on {self.names.namespace} is closed: a new "
                                 "consumer of the group begins a new one")
        if not self._txn.fenced_older:
            self._txn.fence(timeout, f"beginning a run of group {self.group_id}")
            log.info("group %s on %s: a new run began, older consumers of the group are fenced", self.group_id,
                     self.names.namespace)


def announce_policy_version(config: KafkaConfig, names: TopicNames | str, version: PolicyVersion, *,
                            timeout: float = 30.0) -> PolicyVersion:
    """Announce `version` as a trainer run of its own (one announcement long) and return what was written.

    It supersedes the run that announced before: producers follow it, and that trainer can neither
    announce nor commit afterwards. Meant for scripts and tests, and to point producers at a version by
    hand (a rollback) while no trainer runs; a trainer keeps one `PolicyAnnouncer` for its whole run.
    Blocks up to about 3 x `timeout`.

    Raises:
        KafkaIOError (retriable): not acknowledged within `timeout`, or the broker refused it.
    """
    with PolicyAnnouncer(config, names) as announcer:
        return announcer.announce(version, timeout=timeout)


__all__ = ["CONTROL_KEY", "Followed", "GroupRun", "PolicyAnnouncer", "RunSupersededError", "Verdict",
           "announce_policy_version", "announcements", "caught_up", "follow_verdict", "followed_policy",
           "group_run_transactional_id", "newest_run", "read_to_end", "run_transactional_id"]
