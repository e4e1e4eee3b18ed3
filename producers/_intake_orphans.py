"""Prompt partitions that no member of the producers' group owns while the group is stable, and the rejoin that
hands them out again.

Under the classic protocol a cooperative rebalance takes two rounds: in the first the leader takes the moving
partitions from their owner, which drains them (`rollstream.producers._intake_rebalance`) and then joins again;
that join starts the second round, which gives them to their new owner. A static member (``--producer-id``)
killed between the two rounds and restarted within its session is handed its stored assignment by the
coordinator without a rebalance, and nobody asks for the second round: the group stays stable with the moved
partitions assigned to no member, and their prompts wait for the next change of membership, possibly for ever
(seen in ``python -m tests.chaos.inflight``: a producer assigned nothing for 10 minutes while 8 prompts waited;
reproduced with two bare librdkafka consumers). A member that leaves and joins again (unsubscribe, subscribe)
starts a rebalance whose assignment covers every partition.

`OrphanWatch.check` looks only while its producer is starved (it wanted prompts and got none for the stall time,
`rollstream.producers._intake_stall`), at most every `grace_s / 2`, and only at partitions that hold prompts: first
the partitions this member does not own whose end is past the group's committed offset (its own client's reads, as
the stall probe makes them); only if there are some, the coordinator's description of the group's members and their
assignments (in a child process, `rollstream.infra.group_members`), so an idle fleet starts no process. Such
partitions assigned to nobody while the group is stable, the same ones for `grace_s` (longer than a first round's
drain plus a session), are orphaned. Then the member owning the fewest of the topic's partitions (the one a second
round would have served; on a tie, the lowest member id) rejoins; any starved member does once they have been
orphaned for twice as long, in case that one is not starved and so not looking. The consumer protocol (KIP-848) has
no such gap: its coordinator assigns every partition itself, and the watch is not used there.

Belongs to the intake thread; `check` blocks up to the description's timeout (plus a child's start).
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import Consumer
from rollstream.infra import KafkaConfig, KafkaIOError
from rollstream.infra.deadline import Deadline
from rollstream.infra.group_members import GroupDescription, describe_group
from rollstream.infra.kafka_io import committed_offsets, partitions_of, watermarks

log = logging.getLogger(__name__)
_DESCRIBE_S = 5.0


class OrphanWatch:
    """Finds prompt partitions a stable group assigns to no member, and says when this member should rejoin."""

    def __init__(self, config: KafkaConfig, topic: str, group_id: str, *, grace_s: float) -> None:
        self._config, self._topic, self._group_id, self.grace_s = config, topic, group_id, grace_s
        self._next_look = 0.0
        self._orphans: frozenset[int] = frozenset()
        self._orphaned_since = 0.0

    def check(self, consumer: Consumer, starved: bool) -> str | None:
        """Why `consumer` should leave the group and join again (partitions orphaned for `grace_s`, and it is
        the member to ask for them), or None. `starved`: intake wanted prompts and got none for the stall time;
        otherwise nothing is read. Blocks while it reads (see the module docstring)."""
        now = time.monotonic()
        if not starved:
            self._forget()
            return None
        if now < self._next_look:
            return None
        self._next_look = now + self.grace_s / 2
        orphans, group = self._orphaned(consumer)
        if not orphans or group is None:
            self._forget()
            return None
        if not orphans & self._orphans:
            self._orphans, self._orphaned_since = orphans, now
            return None
        self._orphans &= orphans
        orphaned_s = now - self._orphaned_since
        if orphaned_s < self.grace_s or not (orphaned_s >= 2 * self.grace_s or self._asks_first(consumer, group)):
            return None
        self._forget()
        return (f"partitions {sorted(orphans)} of {self._topic} have been assigned to no member of the stable group "
                f"for {orphaned_s:.0f} s (a cooperative rebalance left half done: a member restarted between its "
                "two rounds)")

    def _forget(self) -> None:
        self._orphans, self._orphaned_since = frozenset(), 0.0

    def _orphaned(self, consumer: Consumer) -> tuple[frozenset[int], GroupDescription | None]:
        """The topic's partitions holding prompts that no member of the stable group is assigned, with the
        description; nothing when none holds prompts elsewhere, the group is not stable (a rebalance is under
        way), or the reads fail now."""
        try:
            waiting = self._waiting_elsewhere(consumer)
            group = describe_group(self._config, self._group_id, _DESCRIBE_S) if waiting else None
        except KafkaIOError as exc:
            log.debug("cannot look for orphaned partitions of %s in group %s: %s", self._topic, self._group_id, exc)
            return frozenset(), None
        if group is None or group.state != "STABLE":
            return frozenset(), None
        assigned = {p for m in group.members for t, p in m.assignment if t == self._topic}
        return frozenset(waiting - assigned), group

    def _waiting_elsewhere(self, consumer: Consumer) -> set[int]:
        """Partitions this member does not own that end past the group's committed offset (prompts wait there)."""
        deadline = Deadline.after(_DESCRIBE_S)
        owned = {tp.partition for tp in consumer.assignment()}
        others = [p for p in partitions_of(consumer, self._topic, timeout=deadline) if p not in owned]
        committed = committed_offsets(consumer, self._topic, others, timeout=deadline) if others else {}
        return {p for p, offset in committed.items()
                if watermarks(consumer, self._topic, p, timeout=deadline)[1] > (offset or 0)}

    def _asks_first(self, consumer: Consumer, group: GroupDescription) -> bool:
        """Whether this member owns the fewest of the topic's partitions (on a tie, has the lowest member id)."""
        me = consumer.memberid()
        ranked = sorted((sum(t == self._topic for t, _ in m.assignment), m.member_id) for m in group.members)
        return bool(ranked) and ranked[0][1] == me
