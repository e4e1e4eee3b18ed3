"""DESIGN guarantee 2 end to end: a SIGKILLed producer costs the trainer nothing: no loss, no duplicate.

Real processes on both sides. Two `rollstream produce` processes (static ids P1 and P2) share the prompt
partitions; N prompts go in with `rollstream prompts load`. Once P1 has published a few groups it is
SIGKILLed at a moment when it has a group *published but its prompt not yet committed* (and more
prompts in flight): P2 takes its partitions over after the session timeout, generates its unfinished
prompts again and so publishes that group a second time (same group_id). Then a trainer
(`rollstream.consumers.RolloutConsumer`, no filters) takes everything in steps of K, and we check:

- NS.rollouts holds every prompt's group, and exactly N distinct group ids; the groups P1 had published
  but not committed at the kill are there twice (predicted at the kill, so at least one duplicate);
- every prompt id is taken exactly once over the steps; every repeat of a group id the trainer looked
  at is recorded as ``duplicate`` in that step (Batch.dispositions, and the manifests on NS.steps);
  what lies past the trainer's committed offsets is only repeats;
- `rollstream audit` exits 0, and a restarted trainer of the same group gets nothing back (TakeTimeout).

Making the duplicate deterministic: P1 commits acknowledged prompt offsets every 0.2 s, so we tail
NS.rollouts, SIGSTOP P1 the moment one of its groups lands, read the intake group's committed offsets
(P1 is frozen, nobody else owns its partitions, so they are final), and SIGKILL it if one of its
published groups is at or past the committed offset of its prompt partition (else SIGCONT and wait for
the next). NS.rollouts has one partition so that a regenerated group is always followed by fresh
groups (the rest of P1's prompts), i.e. the trainer must look at it to take N: the duplicate is then
recorded in a manifest, not left behind the trainer's last step. Prompts have three partitions so the
producers share them. Producers start before the prompts are loaded and we wait until both own
partitions, so no start-up rebalance moves work mid-generation.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions
from rollstream.consumers import Batch, RolloutConsumer, TakeTimeout, audit
from rollstream.infra import KafkaConfig, LagReader, TopicNames
from rollstream.schemas import Prompt, ScoredGroup, decode

from tests.integration._kafka import REPO_ROOT, cli_env, end_offsets, read_records, run_cli, until

N = 30  # prompts, one epoch
PROMPT_PARTITIONS = 3
STEP = 7  # groups per trainer step: 7, 7, 7, 7, 2
GEN_DELAY_S = 1.0  # tests.plugins:slow, per group; with concurrency 3 several prompts are always in flight
SESSION_S = 2  # a killed producer's partitions move after this
IDLE_S = 5  # the survivor exits after this long idle: longer than the session timeout plus a rebalance
VICTIM, SURVIVOR = "P1", "P2"



def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


class Producers:
    """`rollstream produce` subprocesses with logs in files; `kill_all` kills every one still running."""

    def __init__(self, bootstrap: str, names: TopicNames, trainer_group: str, logs: Path) -> None:
        self.bootstrap, self.names, self.trainer_group, self.logs = bootstrap, names, trainer_group, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, producer_id: str, *args: str) -> subprocess.Popen[bytes]:
        with open(self.log(producer_id), "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rollstream", "produce", "-N", self.names.namespace,
                 "--generate", "tests.plugins:slow", "--reward", "tests.plugins:reward", "--n-samples", "2",
                 "--concurrency", "3", "--max-lag", "10000", "--trainer-group", self.trainer_group,
                 "--producer-id", producer_id, "--session-timeout", str(SESSION_S), "--summary-interval", "0",
                 *args],
                cwd=REPO_ROOT, env=cli_env(self.bootstrap, ROLLSTREAM_TEST_GEN_DELAY_S=str(GEN_DELAY_S)),
                stdout=log, stderr=subprocess.STDOUT)
        self.procs[producer_id] = proc
        return proc

    def log(self, producer_id: str) -> Path:
        return self.logs / f"producer-{producer_id}.log"

    def logs_text(self) -> str:
        return "".join(f"\n--- {pid} log:\n{tail(self.log(pid))}" for pid in self.procs)

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()  # also ends a SIGSTOPped process
            proc.wait(timeout=10)


def assignments(admin: AdminClient, group: str, topic: str) -> dict[str, frozenset[int]]:
    """Per member's group.instance.id, the prompt partitions it holds now."""
    description = admin.describe_consumer_groups([group], request_timeout=5)[group].result()
    return {str(m.group_instance_id): frozenset(tp.partition for tp in m.assignment.topic_partitions
                                                if tp.topic == topic)
            for m in description.members}


def committed(config: KafkaConfig, group: str, topic: str) -> dict[int, int]:
    """The group's committed offset per partition (0 where it has committed nothing)."""
    with LagReader(config) as reader:
        return {p.partition: p.committed or 0 for p in reader.group_lag(group, topic).partitions}


def stable_committed(config: KafkaConfig, group: str, topic: str) -> dict[int, int]:
    """`committed`, read until two reads agree (a commit sent just before a SIGSTOP still lands)."""
    previous = committed(config, group, topic)
    while (current := committed(config, group, topic)) != previous:
        previous = current
    return current


def kill_with_a_published_uncommitted_group(
        victim: subprocess.Popen[bytes], config: KafkaConfig, names: TopicNames,
        prompt_at: dict[str, tuple[int, int]], prompt_ends: dict[int, int], timeout_s: float = 25.0) -> set[str]:
    """SIGKILL `victim` right after it published a group whose prompt it has not committed yet.

    Returns the group ids it had published and not committed at the kill: its next owner regenerates them.
    """
    admin = AdminClient(config.admin())
    intake_group = f"{names.namespace}.producers"
    reader = Consumer(config.consumer(f"tail-{uuid.uuid4().hex[:8]}", {"enable.auto.commit": False,
                                                                          "fetch.wait.max.ms": 10}))
    reader.assign([TopicPartition(names.rollouts, 0, OFFSET_BEGINNING)])
    published: list[ScoredGroup] = []  # by the victim, as seen on NS.rollouts
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            assert victim.poll() is None, f"the victim exited early with {victim.returncode}"
            msg = reader.poll(0.02)
            if msg is None or msg.error():
                continue
            group = decode(msg.value(), ScoredGroup)
            if group.producer_id != VICTIM:
                continue
            published.append(group)
            if len(published) < 2:
                continue
            victim.send_signal(signal.SIGSTOP)  # frozen: it can neither commit nor publish any more
            owned = assignments(admin, intake_group, names.prompts).get(VICTIM, frozenset())
            marks = stable_committed(config, intake_group, names.prompts)
            at_risk = [g for g in published
                       if (at := prompt_at[g.prompt_id])[0] in owned and at[1] >= marks[at[0]]]
            # At least two unfinished prompts after the last at-risk one in its partition: regenerated
            # after it, they put fresh groups behind the duplicate on NS.rollouts.
            last = {p: max(o for q, o in (prompt_at[g.prompt_id] for g in at_risk) if q == p)
                    for p in {prompt_at[g.prompt_id][0] for g in at_risk}}
            if any(prompt_ends[p] - (o + 1) >= 2 for p, o in last.items()):
                victim.send_signal(signal.SIGKILL)
                victim.wait(timeout=10)
                return {g.group_id for g in at_risk}
            victim.send_signal(signal.SIGCONT)  # its commit won the race (or too little left): next group
        raise AssertionError(f"no moment with a published, uncommitted group of {VICTIM} within {timeout_s} s "
                             f"({len(published)} of its groups seen)")
    finally:
        reader.close()


def test_sigkilled_producer_then_restarted_trainer_deliver_every_prompt_exactly_once(
        bootstrap_servers: str, kafka_config: KafkaConfig, namespace_factory, group_id: str,
        tmp_path: Path) -> None:
    t0 = time.monotonic()
    names: TopicNames = namespace_factory(partitions=1)  # NS.rollouts: one partition (see the module doc)
    admin = AdminClient(kafka_config.admin())
    admin.create_partitions([NewPartitions(names.prompts, PROMPT_PARTITIONS)])[names.prompts].result(timeout=15)
    until(lambda: len(end_offsets(kafka_config, names.prompts)) == PROMPT_PARTITIONS, 10, "the prompt partitions")
    ids = [f"e{i:02d}" for i in range(N)]
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": i, "prompt": f"question {i}", "label": "42"}) + "\n"
                                   for i in ids))
    intake_group = f"{names.namespace}.producers"
    producers = Producers(bootstrap_servers, names, group_id, tmp_path)
    timings: dict[str, float] = {}
    try:
        victim = producers.start(VICTIM)
        survivor = producers.start(SURVIVOR, "--exit-when-idle", str(IDLE_S))
        owners = until(lambda: (a := assignments(admin, intake_group, names.prompts)).get(VICTIM)
                       and a.get(SURVIVOR) and a, 30, "both producers to own prompt partitions")
        timings["producers joined"] = time.monotonic() - t0

        loaded = run_cli(bootstrap_servers, "prompts", "load", str(prompt_file), "--namespace", names.namespace)
        assert loaded.returncode == 0, loaded.stderr
        prompts = read_records(kafka_config, names.prompts, Prompt)
        assert sorted(p.id for _, _, p in prompts) == ids
        prompt_at = {p.id: (part, off) for part, off, p in prompts}
        prompt_ends = end_offsets(kafka_config, names.prompts)
        timings["prompts loaded"] = time.monotonic() - t0

        try:
            predicted = kill_with_a_published_uncommitted_group(victim, kafka_config, names, prompt_at, prompt_ends)
        except AssertionError as exc:
            raise AssertionError(f"{exc}{producers.logs_text()}") from exc
        timings["victim killed"] = time.monotonic() - t0
        assert victim.returncode == -signal.SIGKILL
        assert survivor.wait(timeout=40) == 0, producers.logs_text()
        timings["survivor done"] = time.monotonic() - t0
    finally:
        producers.kill_all()
    with LagReader(kafka_config) as reader:
        assert reader.group_lag(intake_group, names.prompts).total == 0, "prompts left uncommitted"

    # -- NS.rollouts, read with a plain consumer ---------------------------------------------------
    records = read_records(kafka_config, names.rollouts, ScoredGroup)
    seen: set[str] = set()
    repeats: dict[tuple[int, int], str] = {}  # (partition, offset) of each second-or-later copy
    for part, off, g in records:
        assert g.status == "ok", g.error
        if g.group_id in seen:
            repeats[(part, off)] = g.group_id
        seen.add(g.group_id)
    assert seen == {f"{i}#0" for i in ids}  # every prompt's group, nothing else
    assert len(records) - len(repeats) == N
    assert predicted, "the kill left no published, uncommitted group"
    assert predicted <= set(repeats.values()), (predicted, repeats)  # regenerated after the kill...
    producers_of = {gid: {g.producer_id for _, _, g in records if g.group_id == gid} for gid in predicted}
    assert all(p == {VICTIM, SURVIVOR} for p in producers_of.values()), producers_of  # ...by the survivor

    # -- the trainer takes everything, in steps ----------------------------------------------------
    batches: list[Batch] = []
    with RolloutConsumer(bootstrap_servers, group_id=group_id, namespace=names.namespace, filters=()) as trainer:
        taken = 0
        while taken < N:
            want = min(STEP, N - taken)
            batch = trainer.take(want, timeout=15)  # all is published: a timeout here is a lost group
            assert len(batch.groups) == want
            batches.append(batch)
            taken += want
    timings["trainer done"] = time.monotonic() - t0

    taken_ids = Counter(g.prompt_id for b in batches for g in b.groups)
    assert taken_ids == Counter(ids), "every prompt taken exactly once over the steps"
    assert [b.step for b in batches] == list(range(len(batches)))
    dispositions = [d for b in batches for d in b.dispositions]
    totals: Counter[str] = Counter()
    for b in batches:
        totals.update(b.counts())
    assert totals["filtered"] == totals["undecodable"] == 0, totals
    assert totals["taken"] == N
    recorded = {(d.partition, d.offset): d.group_id for d in dispositions if d.kind == "duplicate"}
    assert totals["duplicate"] == len(recorded)
    end = batches[-1].offsets[0]  # the trainer's committed position on the one rollouts partition
    # Exactly the repeats the trainer looked at are recorded as duplicates; what lies beyond is only repeats.
    assert recorded == {at: gid for at, gid in repeats.items() if at[1] < end}, (recorded, repeats, end)
    assert all((0, off) in repeats for off in range(end, len(records))), "a group left behind the trainer"
    assert predicted <= set(recorded.values()), "the regenerated group was not recorded as duplicate"
    assert len({(d.partition, d.offset) for d in dispositions}) == len(dispositions) == end  # each offset once

    # -- the manifests on NS.steps say the same, and the audit passes ------------------------------
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
    assert report.counts.get("duplicate", 0) == len(recorded), report.summary()
    cli = run_cli(bootstrap_servers, "audit", "--namespace", names.namespace, "--group", group_id)
    assert cli.returncode == 0, cli.stdout + cli.stderr

    # -- a restarted trainer of the same group gets nothing back -----------------------------------
    with RolloutConsumer(bootstrap_servers, group_id=group_id, namespace=names.namespace, filters=()) as again:
        assert again.next_step == len(batches)
        with pytest.raises(TakeTimeout):
            again.take(1, timeout=2)
        assert again.lag().total == len(records) - end  # only the trailing repeats, never committed
    timings["restart checked"] = time.monotonic() - t0
    print(f"\ne2e recovery: owners {dict(owners)}; {len(records)} records on {names.rollouts}, "
          f"{len(repeats)} duplicate(s) {sorted(set(repeats.values()))}, predicted at the kill {sorted(predicted)}, "
          f"recorded in manifests {len(recorded)}, trailing {len(records) - end}; steps "
          f"{[b.counts()['taken'] for b in batches]} duplicates/step {[b.counts()['duplicate'] for b in batches]}; "
          + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
