"""Prompt intake: NS.prompts read as a consumer group by one named thread, handed to the event loop.

Contract:
- Any number of producers share the prompts (one consumer group: cooperative-sticky assignment under the
  classic protocol, the broker's incremental assignment under the consumer protocol, KIP-848); with a
  ``group.instance.id`` (``--producer-id``, static membership) a restarted producer gets its
  partitions back at once, and a dead one's move to the living after the session timeout.
- A prompt's offset is committed only when the event loop acknowledged its group (`Watermarks`): per
  partition the contiguous prefix of acknowledged prompts, never past an unacknowledged one.
- The loop takes prompts with ``async for taken in intake`` and acknowledges each with `ack(taken)` once
  its group is durably written. At most `prefetch` prompts wait in the hand-over queue; the loop starts
  one only while the lag gate is open (backpressure), so while it is closed the queue fills and intake
  waits with the fetch state kept, then (after `_FULL_WAIT_S`) pauses the partitions; when intake is
  halting they are paused at once. The thread keeps polling, so the group membership stays alive
  however long generation or backpressure lasts. Not pausing at every gate close matters: a
  pause/resume cycle costs a refetch, and the gate opens and closes at every trainer step.
- A prompt is *started* when `__anext__` hands it to the loop (`Watermarks.start`: atomic with the check
  that its partition is owned and not draining); before that it is only queued.
- On revocation (cooperative: only the partitions that move) the rebalance callback drains them first:
  no prompt of theirs starts any more (queued ones stay uncommitted for the next owner), and it waits
  up to `drain_on_revoke_s` until each started one is acknowledged (on a condition `ack` signals: the
  loop never waits), then commits what is contiguous and drops the bookkeeping. So a clean scale-up
  or scale-down generates nothing twice. Blocking there is what the protocol allows: the others keep
  their partitions, heartbeats go on from librdkafka's thread, and the second rebalance (which hands
  the partitions on) waits for this member to rejoin, within ``max.poll.interval.ms`` (300 s by
  default). A drain that times out is a revocation as before: groups still in flight are published but
  no longer move the watermark, and the next owner regenerates them with the same group_id
  (duplicates, never a loss). Once intake is stopping (`close`) nothing more can be acknowledged, so a
  drain returns at once; lost partitions (session expired) are not drained: they are someone else's.
- Every commit carries this producer's state (`rollstream.infra.producer_state.ProducerState`), and a lag gate change is
  committed within about a second (`_intake_state.StateCommits`).
- Commits are asynchronous (`_intake_commits`): the thread never waits on the group coordinator, except in a
  revocation (the synchronous commit a rebalance asks for) and for a bounded moment at close.
- A client that stopped serving its partitions while prompts wait there, that is cut off from its coordinator
  while assigned nothing, or whose commit got no answer for the stall time, is replaced (`_intake_stall`): its
  partitions are dropped as lost (duplicates at worst, never a loss), and a fresh client joins the group.
  Only a spell in which intake wanted prompts counts: never one in which every slot was busy.
- Under the classic protocol a producer starved that long also looks for prompt partitions that the stable group
  assigns to no member (a cooperative rebalance left half done by a static member restarted between its two
  rounds, `_intake_orphans`): once they stay so past a drain and a session, the member owning the fewest
  partitions leaves the group and joins again, and the rebalance that follows assigns them.
- Under the consumer protocol a static member restarted after a crash is refused (``UNRELEASED_INSTANCE_ID``,
  fatal for that client) until the crashed member's session expires: intake then joins again with a fresh
  client every `_UNRELEASED_RETRY_S`, so the restarted producer gets its partitions once the session ended
  (the classic protocol hands them over at once instead).
- The watermarks and the credits are this object's own; every librdkafka call (poll, pause, commit,
  close) happens on its thread, never on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message
from rollstream.infra import KafkaConfig
from rollstream.infra.deadline import Deadline
from rollstream.infra.group_protocol import Resolved, group_conf
from rollstream.infra.kafka_errors import kafka_error
from rollstream.infra.kafka_io import position_of
from rollstream.infra.producer_state import ProducerState
from rollstream.infra.threads import WorkerThread
from rollstream.producers._intake_commits import IntakeCommits
from rollstream.producers._intake_orphans import OrphanWatch
from rollstream.producers._intake_rebalance import Rebalancing
from rollstream.producers._intake_stall import IntakeClient, stall_seconds
from rollstream.producers._intake_state import StateCommits
from rollstream.producers._watermarks import Watermarks
from rollstream.producers.gate import LagGate
from rollstream.producers.metrics import ProducerMetrics
from rollstream.schemas import ConfigError, DecodeError, Prompt, decode, now_ms

log = logging.getLogger(__name__)
_POLL_S = 0.1
_MAX_BATCH = 500
_FULL_WAIT_S = 1.0
DEFAULT_DRAIN_ON_REVOKE_S = 30.0
_MAX_POLL_INTERVAL_MS = 300_000  # librdkafka's default; a revocation drain runs inside one poll
_FINAL_COMMIT_S = 5.0  # how long closing waits for the answer to the last commit


_UNRELEASED_RETRY_S = 2.0  # between joins of a static member whose previous member has not left (consumer protocol)
# How far librdkafka reads NS.prompts ahead: it fetches again once fewer than queued.min.messages prompts of a
# partition are left, at most _PARTITION_FETCH_BYTES of a partition at a time (a larger prompt still comes whole).
# The clients' defaults are sized for 64 MiB rollouts: 4 MiB fetches of short prompts, a few hundred thousand at
# once, made `make soak`'s producer jump by 200 MiB (docs/benchmarks.md, producer memory).
_QUEUED_MIN_PROMPTS = 1000
_PARTITION_FETCH_BYTES = 64 * 1024


class _InstanceNotReleased(Exception):
    """The consumer protocol fenced this (joining) static member: another member holds its group.instance.id."""


def _unreleased(err: KafkaError) -> bool:
    # librdkafka raises it as a fatal error event (code _FATAL) whose text carries the broker's message.
    return (err.code() == KafkaError.UNRELEASED_INSTANCE_ID or "UNRELEASED_INSTANCE_ID" in err.str()
            or "instance ID is still used" in err.str())


@dataclass(frozen=True)
class TakenPrompt:
    """A prompt handed to the loop; `prompt` is None (and `error` set) when its bytes did not decode.
    `value` is the prompt record as read (what a requeue republishes)."""

    partition: int
    offset: int
    generation: int
    prompt: Prompt | None
    error: str | None
    taken_at_ms: int
    value: bytes = b""


class Intake(Rebalancing, WorkerThread):
    """Owns the prompt consumer on thread ``rollstream-intake``; an async iterator of `TakenPrompt`.

    `start`, iteration, `ack`, `halt` and `close` belong to the loop given to `start`; `settled`,
    `buffered`, `joined` and `last_message_at` may be read from any thread.

    Args:
        producer_id: this producer's id in the state it commits (default: `instance_id`, else ``host-pid``).
        group_protocol: the group's rebalance protocol (`rollstream.infra.group_protocol`; resolved, never
            ``auto``): ``classic`` (cooperative-sticky, a `session_timeout_s` session) or ``consumer`` (KIP-848:
            the broker assigns, and the group's session is the broker's or the group's config).
        drain_on_revoke_s: how long a revocation waits for the started prompts of the revoked
            partitions to be acknowledged before giving them up (0: not at all). Keep it well below
            ``max.poll.interval.ms`` (300 s unless overridden).
    Raises:
        ConfigError: `drain_on_revoke_s` is negative, or not below ``max.poll.interval.ms``.
    """

    def __init__(self, config: KafkaConfig, topic: str, group_id: str, *, gate: LagGate, metrics: ProducerMetrics,
                 prefetch: int, instance_id: str | None = None, session_timeout_s: float = 10.0,
                 commit_interval_s: float = 0.2, producer_id: str | None = None,
                 drain_on_revoke_s: float = DEFAULT_DRAIN_ON_REVOKE_S,
                 overrides: Mapping[str, Any] | None = None, group_protocol: Resolved = "classic") -> None:
        super().__init__()
        conf = group_conf(group_protocol, {"fetch.wait.max.ms": 100, "queued.min.messages": _QUEUED_MIN_PROMPTS,
                                           "max.partition.fetch.bytes": _PARTITION_FETCH_BYTES,
                                           **dict(overrides or {})}, session_timeout_s)
        poll_interval_s = int(conf.get("max.poll.interval.ms", _MAX_POLL_INTERVAL_MS)) / 1000
        if not 0 <= drain_on_revoke_s < poll_interval_s:
            raise ConfigError(f"drain_on_revoke_s={drain_on_revoke_s} must be >= 0 (0: give revoked partitions up at "
                              f"once) and below max.poll.interval.ms ({poll_interval_s:g} s): a longer drain would "
                              "get this producer thrown out of its group")
        if instance_id:
            conf["group.instance.id"] = instance_id
        self.topic, self.group_id = topic, group_id
        self._metrics = metrics
        self._marks = Watermarks()
        self.producer_id = producer_id or instance_id or f"{socket.gethostname()}-{os.getpid()}"
        self._state = StateCommits(self.producer_id, gate)
        self._gate = gate
        self._drain_on_revoke_s = drain_on_revoke_s
        self._commits = IntakeCommits(topic, group_id, self._marks, self._state, interval_s=commit_interval_s,
                                      answer_s=stall_seconds(session_timeout_s))
        client_conf = config.consumer(group_id, {**conf, **self._commits.conf()})
        if group_protocol == "consumer":  # also without what a --kafka-config file gave every client
            client_conf = group_conf("consumer", client_conf, session_timeout_s)
        self._client = IntakeClient(client_conf, topic, group_id, self._marks, metrics, session_timeout_s)
        self._orphans = (OrphanWatch(config, topic, group_id, grace_s=drain_on_revoke_s + session_timeout_s)
                         if group_protocol == "classic" else None)
        self._lock = threading.Lock()
        self._credits = prefetch  # prompts the thread may still hand over before the loop takes some
        # Bounded: the credits keep at most `prefetch` prompts in it; the extra slot is for the halt marker.
        self._queue: asyncio.Queue[TakenPrompt | None] = asyncio.Queue(maxsize=prefetch + 1)
        self._halting = threading.Event()
        self._paused = False  # the intake thread's own view of the partitions' pause state
        self._room = threading.Event()
        self._full_since: float | None = None
        self._done: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_fatal: Callable[[BaseException], None] = lambda exc: None
        self.joined = threading.Event()
        self.last_message_at = time.monotonic()

    @property
    def client_replacements(self) -> int:
        """Clients replaced because they were stuck (see `_stuck`)."""
        return self._client.replacements

    # -- called from the event loop -------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, on_fatal: Callable[[BaseException], None]) -> None:
        """Start the thread; `on_fatal` is called on `loop` if it dies. Call once."""
        self._loop, self._on_fatal = loop, on_fatal
        self._done = loop.create_future()
        self._launch(self._run, "rollstream-intake")

    def __aiter__(self) -> Intake:
        return self

    async def __anext__(self) -> TakenPrompt:
        """The next prompt still owned by this producer; ends once `halt` was called."""
        while True:
            taken = await self._queue.get()
            if taken is None:
                self._queue.put_nowait(None)  # every later call ends too
                raise StopAsyncIteration
            with self._lock:
                self._credits += 1
            self._room.set()
            if self._marks.start(taken.partition, taken.offset, taken.generation):
                return taken
            log.debug("%s[%d]@%d: partition revoked (or being revoked) while queued; the new owner takes it",
                      self.topic, taken.partition, taken.offset)

    def _hand_over(self, batch: list[TakenPrompt]) -> None:
        for taken in batch:
            self._queue.put_nowait(taken)  # never full: the thread holds a credit for it
        self._metrics.count_prompt(len(batch))

    def is_current(self, taken: TakenPrompt) -> bool:
        """Whether `taken`'s partition is still owned under the assignment it was taken in."""
        return self._marks.is_current(taken.partition, taken.generation)

    def ack(self, taken: TakenPrompt) -> bool:
        """`taken`'s group is durably written: its offset may be committed. False when no longer owned."""
        return self._marks.ack(taken.partition, taken.offset, taken.generation)

    @property
    def buffered(self) -> int:
        """Prompts handed over and not taken by the loop yet."""
        return self._queue.qsize()

    def owned(self) -> list[int]:
        """The prompt partitions assigned to this producer now. Thread-safe."""
        return self._marks.owned()

    def settled(self) -> bool:
        """Nothing taken is unacknowledged and every watermark is committed."""
        return self._marks.settled()

    def state(self) -> ProducerState:
        """This producer's state as the intake thread last saw the gate (what the next commit carries)."""
        return self._state.state()

    def halt(self) -> None:
        """Stop handing out prompts for good (shutdown); keep polling and committing until `close`.

        Queued prompts are dropped (left uncommitted for the next owner). Idempotent."""
        if self._halting.is_set():
            return
        self._halting.set()
        dropped = 0
        while not self._queue.empty():
            dropped += self._queue.get_nowait() is not None
        self._queue.put_nowait(None)
        if dropped:
            log.info("stopping: %d queued prompts not started (left uncommitted for the next owner)", dropped)

    def stop(self) -> None:
        """Ask the thread to end; a revocation drain waiting on it returns at once. Never blocks."""
        super().stop()
        self._marks.wake()

    async def close(self, deadline: Deadline) -> None:
        """Ask the thread to commit the final watermarks and close the consumer (leave the group unless static);
        wait for it until `deadline`.

        Blocks the caller's coroutine (not the loop) until then, plus a wake-up. The thread alone calls its
        client: a commit or close the broker does not answer (librdkafka's consumer close has no timeout) goes on
        in it after `deadline`, and it closes the client itself once its last call returned.
        Raises:
            TimeoutError: the thread did not finish by `deadline` (the last commit may not have landed yet: what
                it does not commit, the next owner takes again).
        """
        self.halt()
        self.stop()
        if self._done is not None:
            await asyncio.wait_for(asyncio.shield(self._done), deadline.timeout())

    # -- the intake thread ------------------------------------------------------------------------

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            consumer = self._client.open()
            while self._serve(consumer) and self._client.current is not None:
                # Stuck: a fresh client is installed, which joins the group again; the old one closes in the
                # background (a group member without a coordinator may block its close).
                self._commits.forget()
                consumer = self._client.current
            self._client.close(consumer)
        except BaseException as exc:  # noqa: BLE001 - reported to the loop, which decides
            error = exc
        finally:
            self._finish(error)

    def _serve(self, consumer: Consumer) -> bool:
        """Take, hand over and commit with `consumer` until `close` (False) or until it is stuck (True)."""
        self._client.current = consumer
        self._subscribe(consumer)
        while not self._stop.is_set():
            try:
                self._hand_over_all([taken for msg in self._step(consumer) if (taken := self._handle(msg))])
            except _InstanceNotReleased as exc:
                # A fatal error of this client only: a fresh one joins once the old member is gone.
                self._stop.wait(_UNRELEASED_RETRY_S)
                if self._stop.is_set():
                    return False
                self._client.rejoin(f"the consumer protocol refused its group.instance.id ({exc}): its previous "
                                    "member has not left (a crashed producer's session has not expired yet)")
                return True
            self._state.watch()
            if not self._commits.tick(consumer):
                self._client.give_up("its commits get no answer from the group coordinator")
                return True
            if self._stuck(consumer):
                return True
            self._rejoin_if_orphaned(consumer)
        self._commits.final(consumer, _FINAL_COMMIT_S)
        return False

    def _subscribe(self, consumer: Consumer) -> None:
        consumer.subscribe([self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                           on_lost=self._on_lost)

    def _rejoin_if_orphaned(self, consumer: Consumer) -> None:
        """Leave the group and join again when, starved, this member should ask for prompt partitions the stable
        group assigns to no member (`_intake_orphans`). Its own partitions, if any, are revoked as in any
        rebalance (drained, committed) before it joins again."""
        if self._orphans is None:
            return
        why = self._orphans.check(consumer, self._client.starved(self.last_message_at))
        if why is None:
            return
        log.warning("prompt consumer of group %s: %s: leaving the group and joining again so they are assigned",
                    self.group_id, why)
        self._metrics.orphan_rejoins.inc()
        consumer.unsubscribe()
        self._subscribe(consumer)

    def _stuck(self, consumer: Consumer) -> bool:
        """Whether this client stopped serving its partitions while prompts wait there (`IntakeClient.stuck`,
        which replaces it if so): only a spell in which intake wanted prompts all along counts (joined, not
        paused, room in the queue), never one in which every slot was busy and the queue full."""
        with self._lock:
            has_room = self._credits > 0
        wanting = has_room and not self._paused and self.joined.is_set()
        return self._client.stuck(consumer, self.last_message_at, wanting)

    def _finish(self, error: BaseException | None) -> None:
        def done() -> None:
            if self._done is not None and not self._done.done():
                self._done.set_result(None)
            if error is not None:
                self._on_fatal(error)
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(done)
        except RuntimeError:
            pass  # the loop is gone: nobody is left to tell

    def _step(self, consumer: Consumer) -> list[Message]:
        """One turn of the thread: fetch what the loop has room for, or wait without losing the group."""
        with self._lock:
            credits = self._credits
        if self._halting.is_set():
            self._set_paused(consumer, True)
        elif credits > 0:
            self._full_since = None
            self._set_paused(consumer, False)
            messages = consumer.consume(num_messages=min(credits, _MAX_BATCH), timeout=0)
            if messages:
                return messages
            one = consumer.poll(_POLL_S)  # returns as soon as one prompt arrives
            return [one] if one is not None else []
        else:
            # The buffer is full: generation is the bottleneck. Wait for room without touching the
            # fetch state (a pause/resume cycle costs a refetch, up to ~1 s); past _FULL_WAIT_S pause
            # and poll, so rebalances are served however long generation takes.
            now = time.monotonic()
            self._full_since = self._full_since or now
            if not self._paused and now - self._full_since < _FULL_WAIT_S:
                self._room.wait(_POLL_S)
                self._room.clear()
                return []
            self._set_paused(consumer, True)
        one = consumer.poll(_POLL_S)  # paused: serves rebalances and errors; a message is still taken
        return [one] if one is not None else []

    def _set_paused(self, consumer: Consumer, paused: bool) -> None:
        if paused == self._paused:
            return
        assignment = consumer.assignment()
        if assignment:
            (consumer.pause if paused else consumer.resume)(assignment)
        self._paused = paused

    def _hand_over_all(self, batch: list[TakenPrompt]) -> None:
        """Intake thread: hand a fetched batch to the loop in one call (one wake-up of the loop per batch)."""
        if batch and self._loop is not None:
            self._loop.call_soon_threadsafe(self._hand_over, batch)

    def _handle(self, msg: Message) -> TakenPrompt | None:
        """The prompt of `msg`, taken (its credit spent), or None: an error event, or a partition lost."""
        err = msg.error()
        if err is not None:
            if (err.fatal() or err.code() == KafkaError._FATAL) and _unreleased(err):  # fatal events come as _FATAL
                raise _InstanceNotReleased(err.str())
            if err.fatal():
                raise kafka_error(f"prompt consumer of group {self.group_id}", err, topic=self.topic)
            if err.code() != KafkaError._PARTITION_EOF:
                log.warning("prompt consumer %s: %s", self.group_id, err.str())
            return None
        partition, offset = position_of(msg)
        generation = self._marks.take(partition, offset)
        if generation is None:
            log.debug("message %s[%d]@%d from a partition no longer owned; skipped", self.topic, partition, offset)
            return None
        prompt, error = None, None
        try:
            prompt = decode(msg.value() or b"", Prompt)
        except DecodeError as exc:
            error = str(exc.located(self.topic, partition, offset))
            log.error("undecodable prompt: %s", error)
        with self._lock:
            self._credits -= 1
        self.last_message_at = time.monotonic()
        return TakenPrompt(partition, offset, generation, prompt, error, now_ms(), msg.value() or b"")
