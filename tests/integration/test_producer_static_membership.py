"""`--producer-id` is static group membership: a restarted producer takes its prompt partitions back at once.

Pinned (DESIGN guarantee 2): a real `rollstream produce --producer-id A` process with a long session timeout
(45 s) is killed with SIGKILL mid-run and started again with the same id. The broker hands the new process
(a new member id, same ``group.instance.id``) the dead one's partitions without waiting for its session to
expire, so the restarted producer publishes again well within the session timeout; it regenerates what the
killed one left unacknowledged, so in the end NS.rollouts holds every prompt's group (deduplicated by
group_id) and every prompt offset is committed.

Under the consumer protocol (KIP-848) the broker refuses the restarted member while the killed one's session
lasts: the restarted producer keeps joining and gets the partitions once that session expired, without failing.

Contrast: the same kill and restart without a producer id (dynamic membership, shorter session timeout to
keep the test short) waits for the dead member's session to expire before anyone gets the partitions.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.infra.group_protocol import broker_protocols

from tests.integration._kafka import REPO_ROOT, cli_env, count, lag, read_all, until, write_prompts

PARTITIONS = 3


def broker_serves_consumer_protocol(kafka_config: KafkaConfig) -> bool:
    return "consumer" in (broker_protocols(kafka_config, 5.0) or ())



@dataclass(frozen=True)
class Member:
    member_id: str
    instance_id: str | None
    partitions: frozenset[int]


def members(admin: AdminClient, group: str, topic: str) -> list[Member]:
    """The intake group's members as the coordinator sees them right now."""
    description = admin.describe_consumer_groups([group], request_timeout=5)[group].result()
    return [Member(m.member_id, m.group_instance_id,
                   frozenset(tp.partition for tp in m.assignment.topic_partitions if tp.topic == topic))
            for m in description.members]


def owner_of_everything(admin: AdminClient, group: str, topic: str) -> Member | None:
    """The member holding every prompt partition, if one does (a lone member, once it has joined)."""
    for member in members(admin, group, topic):
        if member.partitions == frozenset(range(PARTITIONS)):
            return member
    return None


@contextmanager
def producers(bootstrap: str, logs: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start `rollstream produce` processes (logs to files); every one still running is killed on exit."""
    started: list[subprocess.Popen[bytes]] = []

    def start(names: TopicNames, *args: str, delay_s: float) -> subprocess.Popen[bytes]:
        log = open(logs / f"producer-{len(started)}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollstream", "produce", "-N", names.namespace, "--generate", "tests.plugins:slow",
             "--n-samples", "2", "--concurrency", "3", "--max-lag", "10000", "--summary-interval", "0", *args],
            cwd=REPO_ROOT, env=cli_env(bootstrap, ROLLSTREAM_TEST_GEN_DELAY_S=str(delay_s)),
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


@dataclass(frozen=True)
class Restart:
    assigned_s: float  # SIGKILL -> the new process holds every partition
    resumed_s: float  # SIGKILL -> the first group published after the restart
    victim_member: str
    new_member: Member
    restarted: subprocess.Popen[bytes]


def kill_and_restart(start: Callable[..., subprocess.Popen[bytes]], kafka_config: KafkaConfig, names: TopicNames,
                     identity: list[str], session_timeout_s: float, resume_within_s: float,
                     restart_args: tuple[str, ...] = ()) -> Restart:
    """Run a producer until it owns the prompts and has published, SIGKILL it, start it again; time the restart."""
    group = f"{names.namespace}.producers"
    admin = AdminClient(kafka_config.admin())
    args = [*identity, "--session-timeout", f"{session_timeout_s:g}"]
    victim = start(names, *args, delay_s=1.0)
    owner = until(lambda: victim.poll() is not None or owner_of_everything(admin, group, names.prompts), 30,
                  "the producer to own every prompt partition")
    assert victim.poll() is None, f"producer exited early with {victim.returncode}"
    assert isinstance(owner, Member)
    until(lambda: count(kafka_config, names.rollouts) >= 3, 20, "the producer to publish")

    victim.send_signal(signal.SIGKILL)  # mid-run: it has groups in flight
    victim.wait(timeout=10)
    killed_at = time.monotonic()
    published = count(kafka_config, names.rollouts)
    restarted = start(names, *args, *restart_args, delay_s=1.0)

    def new_owner() -> Member | None:
        member = owner_of_everything(admin, group, names.prompts)
        return member if member is not None and member.member_id != owner.member_id else None

    new = until(new_owner, resume_within_s, "the restarted producer to get the prompt partitions", interval_s=0.05)
    assigned_s = time.monotonic() - killed_at
    until(lambda: count(kafka_config, names.rollouts) > published, resume_within_s - assigned_s,
          "the restarted producer to publish", interval_s=0.05)
    return Restart(assigned_s, time.monotonic() - killed_at, owner.member_id, new, restarted)


def test_restarted_static_producer_takes_its_partitions_back_at_once(
        kafka_config: KafkaConfig, bootstrap_servers: str, namespace_factory, tmp_path: Path) -> None:
    names = namespace_factory(partitions=PARTITIONS)
    ids = [f"m{i:02d}" for i in range(24)]
    write_prompts(kafka_config, names, ids)
    session_timeout_s = 45.0
    with producers(bootstrap_servers, tmp_path) as start:
        try:
            # The classic protocol's guarantee (auto picks it for static members: docs/operations.md).
            restart = kill_and_restart(start, kafka_config, names, ["--producer-id", "A", "--group-protocol", "auto"],
                                       session_timeout_s, resume_within_s=15.0,
                                       restart_args=("--exit-when-idle", "1.5"))
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- restarted producer log:\n{tail(tmp_path / 'producer-1.log')}") from exc
        print(f"static restart: partitions back {restart.assigned_s:.2f} s, publishing {restart.resumed_s:.2f} s "
              f"after SIGKILL (session timeout {session_timeout_s:g} s)")
        assert restart.new_member.instance_id == "A"
        assert restart.resumed_s < 15.0 < session_timeout_s
        # It regenerates what the killed one left unacknowledged and exits once all is committed.
        assert restart.restarted.wait(timeout=30) == 0, tail(tmp_path / "producer-1.log")
    groups = read_all(kafka_config, names.rollouts)
    assert {g.group_id for g in groups} == {f"{i}#0" for i in ids}  # every prompt's group, deduplicated
    assert {g.producer_id for g in groups} == {"A"}
    assert all(g.status == "ok" for g in groups)
    assert lag(kafka_config, f"{names.namespace}.producers", names.prompts) == 0


def test_restarted_dynamic_producer_waits_for_the_session_timeout(
        kafka_config: KafkaConfig, bootstrap_servers: str, namespace_factory, tmp_path: Path) -> None:
    names = namespace_factory(partitions=PARTITIONS)
    write_prompts(kafka_config, names, [f"d{i:02d}" for i in range(60)])
    session_timeout_s = 8.0
    with producers(bootstrap_servers, tmp_path) as start:
        restart = kill_and_restart(start, kafka_config, names, [], session_timeout_s, resume_within_s=25.0)
        print(f"dynamic restart: partitions back {restart.assigned_s:.2f} s, publishing {restart.resumed_s:.2f} s "
              f"after SIGKILL (session timeout {session_timeout_s:g} s)")
        assert restart.new_member.instance_id is None
        # The dead member's session ends session_timeout after its last heartbeat (every session_timeout/4).
        assert restart.assigned_s > session_timeout_s * 0.5


def test_restarted_static_producer_under_the_consumer_protocol_waits_for_the_session(
        kafka_config: KafkaConfig, bootstrap_servers: str, namespace_factory, tmp_path: Path) -> None:
    """KIP-848 refuses a second member with the same group.instance.id (UNRELEASED_INSTANCE_ID, fatal for that
    client) while the first one is in the group: the restarted producer joins again until the crashed one's
    session expired, then takes the partitions, instead of failing."""
    if not broker_serves_consumer_protocol(kafka_config):
        pytest.skip("this broker does not serve the consumer group protocol (KIP-848: Kafka >= 4.0)")
    names = namespace_factory(partitions=PARTITIONS)
    write_prompts(kafka_config, names, [f"c{i:02d}" for i in range(60)])
    session_timeout_s = 6.0
    with producers(bootstrap_servers, tmp_path) as start:
        try:
            restart = kill_and_restart(start, kafka_config, names,
                                       ["--producer-id", "A", "--group-protocol", "consumer"], session_timeout_s,
                                       resume_within_s=25.0)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- restarted producer log:\n{tail(tmp_path / 'producer-1.log')}") from exc
        print(f"static restart (consumer protocol): partitions back {restart.assigned_s:.2f} s, publishing "
              f"{restart.resumed_s:.2f} s after SIGKILL (session timeout {session_timeout_s:g} s)")
        assert restart.new_member.instance_id == "A"
        assert restart.restarted.poll() is None, tail(tmp_path / "producer-1.log")
        assert restart.assigned_s > session_timeout_s * 0.5
    assert "joining again with a fresh client" in (tmp_path / "producer-1.log").read_text(errors="replace")
