"""A consumer group as its coordinator describes it (members, their assignments, the group's state), read in a
child process of its own.

librdkafka aborts the whole process (``rdkafka_queue.h:1086: rd_kafka_enq_once_del_source_return: Assertion
'eonce->refcnt > 0' failed``, SIGABRT: confluentinc/librdkafka#4605, #3663) when an admin request routed to a
group coordinator (DescribeConsumerGroups) times out and its answer arrives later while the admin client
lives: a broker that froze past the read's timeout and then answers. `rollstream status` makes that read, and
so does a trainer's `TakeTimeout` diagnosis, `rollstream take`'s waiting notice and a starved producer looking
for prompt partitions that no member owns (`rollstream.producers._intake_orphans`), inside processes that must
not die of it. So the read runs in a child (``python -m`` this module), killed at its deadline: an abort there
costs the read, which is reported as unavailable, never the caller. rollstream makes no other
coordinator-routed admin request (``python -m tests.chaos.abandon --level status`` drives the sequence).

The child gets the `KafkaConfig` pickled on its stdin and answers one JSON object on stdout.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from dataclasses import dataclass

from rollstream.infra import KafkaConfig, KafkaIOError
from rollstream.infra.deadline import Deadline

_START_S = 5.0  # what starting the child's interpreter and importing confluent-kafka may add to the timeout


@dataclass(frozen=True)
class Member:
    """One member of the group, as the coordinator knows it."""

    member_id: str
    client_id: str
    host: str
    group_instance_id: str | None
    assignment: tuple[tuple[str, int], ...]  # (topic, partition)


@dataclass(frozen=True)
class GroupDescription:
    state: str  # STABLE, EMPTY, DEAD, PREPARING_REBALANCE, ...
    members: tuple[Member, ...]


def describe_group(config: KafkaConfig, group: str, timeout: float) -> GroupDescription:
    """The coordinator's description of `group`. Blocks up to `timeout` s plus the child's start (at most
    `_START_S`); reads only, commits nothing.

    Raises:
        KafkaIOError: the coordinator did not answer in time or refused (retriable when waiting may help), or
            the child died (its exit status and the end of its stderr in the message).
    """
    deadline = Deadline.after(timeout + _START_S)
    request = pickle.dumps((config, group, timeout))
    try:
        done = subprocess.run([sys.executable, "-m", __name__], input=request, capture_output=True,
                              timeout=deadline.remaining())
    except subprocess.TimeoutExpired:  # run() killed it
        raise KafkaIOError(f"describing consumer group {group} took longer than {timeout:g} s; is the broker up "
                           "(rollstream broker status)?", code="_TIMED_OUT", retriable=True) from None
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip()[-500:]
        raise KafkaIOError(f"describing consumer group {group}: the reading process exited with status "
                           f"{done.returncode}: {tail}", retriable=True)
    answer = json.loads(done.stdout)
    if "error" in answer:
        raise KafkaIOError(answer["error"], code=answer.get("code"), retriable=answer.get("retriable", False))
    return GroupDescription(answer["state"], tuple(
        Member(m["member_id"], m["client_id"], m["host"], m["group_instance_id"],
               tuple((t, p) for t, p in m["assignment"])) for m in answer["members"]))


def _describe_here(config: KafkaConfig, group: str, timeout: float) -> dict[str, object]:
    from confluent_kafka import KafkaException
    from rollstream.infra.clients import open_admin
    from rollstream.infra.kafka_errors import kafka_error

    admin = open_admin(config.admin())
    try:
        desc = admin.describe_consumer_groups([group], request_timeout=timeout)[group].result(timeout=timeout + 1.0)
    except KafkaException as exc:
        error = kafka_error(f"cannot describe the consumer group {group}", exc)
        return {"error": str(error), "code": error.code, "retriable": error.retriable}
    return {"state": getattr(desc.state, "name", str(desc.state)), "members": [
        {"member_id": m.member_id, "client_id": m.client_id, "host": m.host,
         "group_instance_id": m.group_instance_id,
         "assignment": [[tp.topic, tp.partition] for tp in (m.assignment.topic_partitions if m.assignment else [])]}
        for m in desc.members]}


if __name__ == "__main__":
    config, group, timeout = pickle.load(sys.stdin.buffer)
    print(json.dumps(_describe_here(config, group, timeout)))
