"""A consumer is a run of its group: the newest `rollstream take` (or RolloutConsumer) of a group wins (issue 35).

Pinned:

- the scheduler's scenario: `rollstream take -n 4 --steps 0` runs while a publisher keeps feeding; a second one on
  the same group starts (the job restarted while the old node hung on). The first exits 3 within a bound with one
  line on stderr saying a newer run took over, no traceback; the second keeps taking (more steps after the first
  exited); every group is taken exactly once over both (the first's committed steps, then the second's), and the
  audit is green;
- in the library: a newer `RolloutConsumer` of a group supersedes the older one at its next commit
  (`RunSupersededError` naming the group), and the newer one takes the step the older could not commit; a
  consumer of another group of the namespace is not fenced; a trainer run's consumer (``announcer=``) on the group
  supersedes a group run too;
- in either order: a superseded consumer that takes or commits after the newer one already committed (the group's
  offsets moved under it) gets `RunSupersededError` too, not `GroupConflictError`, and `rollstream take` its
  one-line superseded exit; a consumer with ``fence=False`` that moves them is a real conflict
  (`GroupConflictError`), and finding that out commits nothing.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from rollstream.consumers import GroupConflictError, RolloutConsumer, audit
from rollstream.infra import KafkaConfig, PolicyAnnouncer, RunSupersededError, TopicNames

from tests.integration._kafka import start_cli, until
from tests.records import make_group, publish, publish_many

N = 4  # groups per step
EXIT_BOUND_S = 20.0  # the superseded take stops at its next take or commit: a step's time, with producers feeding


def _steps(path: Path) -> list[tuple[int, list[str]]]:
    """The steps `rollstream take --out` wrote, in order: (step, group ids)."""
    steps: list[tuple[int, list[str]]] = []
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        if not steps or steps[-1][0] != row["step"]:
            steps.append((row["step"], []))
        steps[-1][1].append(row["group_id"])
    return steps


class _Feeder:
    """Publishes groups of 4 distinct acceptable groups every 50 ms until stopped, in a named thread."""

    def __init__(self, config: KafkaConfig, names: TopicNames) -> None:
        self.published: list[str] = []
        self._config, self._names, self._stop = config, names, threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-feeder", daemon=True)

    def __enter__(self) -> _Feeder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            groups = [make_group(f"q{len(self.published) + j}") for j in range(N)]
            publish(self._config, self._names, groups)
            self.published.extend(g.group_id for g in groups)
            self._stop.wait(0.05)


def test_a_restarted_take_supersedes_the_running_one(kafka_config: KafkaConfig, bootstrap_servers: str,
                                                     namespace_factory, group_id: str, tmp_path: Path) -> None:
    names = namespace_factory(partitions=2)
    old_out, new_out = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    take = ("take", "-n", str(N), "--steps", "0", "--namespace", names.namespace, "--group", group_id, "--out")
    with _Feeder(kafka_config, names) as feeder:
        old = start_cli(bootstrap_servers, *take, str(old_out))
        new = None
        try:
            until(lambda: len(_steps(old_out)) >= 3 or old.poll() is not None, 30, "the first take to take 3 steps")
            assert old.poll() is None, old.communicate()[1]
            new = start_cli(bootstrap_servers, *take, str(new_out))
            started = time.monotonic()
            try:
                _, stderr = old.communicate(timeout=EXIT_BOUND_S + 15)  # the newer one starts a Python first
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the superseded take did not exit within {EXIT_BOUND_S + 15:g} s") from None
            exited_after = time.monotonic() - started
            lines = [line for line in stderr.splitlines() if line.strip()]
            assert old.returncode == 3 and len(lines) == 1, (old.returncode, stderr[-3000:])
            assert lines[0].startswith("error: superseded: take of group") and group_id in lines[0], lines[0]
            assert "a newer run of the group took over" in lines[0], lines[0]  # also when the newer one committed first
            match = re.search(r"stopped after (\d+) steps? committed", lines[0])
            assert match is not None, lines[0]
            committed_by_old = int(match.group(1))
            at_exit = len(_steps(new_out))
            until(lambda: len(_steps(new_out)) >= at_exit + 3 or new.poll() is not None, 30,
                  "the newer take to go on taking after the first exited")
            assert new.poll() is None, new.communicate()[1]
            feeder.stop()
            published = set(feeder.published)
            # Every group taken once over both: the first's committed steps, then every step of the second.
            old_steps = _steps(old_out)[:committed_by_old]
            assert [s for s, _ in old_steps] == list(range(committed_by_old))

            def both() -> list[str]:
                return [g for _, ids in old_steps + _steps(new_out) for g in ids]

            until(lambda: len(both()) >= len(published), 30, "the newer take to take every published group")
        finally:
            for proc in (old, new):
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.communicate(timeout=20)
    assert _steps(new_out)[0][0] == committed_by_old  # it took over exactly where the first had committed
    taken = both()
    assert len(taken) == len(set(taken)) and set(taken) == published
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
    assert report.counts["taken"] == len(published)
    print(f"superseded take exited {exited_after:.1f} s after the newer one started; {len(published)} groups, "
          f"{committed_by_old} steps by the first, {len(_steps(new_out))} by the second")


def test_the_newest_consumer_of_a_group_wins_and_other_groups_go_on(kafka_config: KafkaConfig, namespace_factory,
                                                                     group_id: str) -> None:
    names = namespace_factory(partitions=1)
    groups = [g.group_id for g in publish_many(kafka_config, names, 8)]

    def consumer(group: str, **kw: object) -> RolloutConsumer:
        return _consumer(kafka_config, names, group, **kw)

    with consumer(group_id) as old, consumer(f"{group_id}-replay") as other:
        assert old.take(2, timeout=30).group_ids == groups[:2]
        assert other.take(2, timeout=30).group_ids == groups[:2]
        with consumer(group_id) as new:
            new.connect()  # the restarted job: from now on the broker refuses the old one's commits
            with pytest.raises(RunSupersededError, match=f"consumer of group {group_id} .* superseded by a newer one"):
                old.take(2, timeout=30)
            again = new.take(2, timeout=30)  # the step the old one could not commit: nothing lost
            assert (again.step, again.group_ids) == (1, groups[2:4])
            assert other.take(2, timeout=30).group_ids == groups[2:4]  # another group of the namespace goes on
            with PolicyAnnouncer(kafka_config, names) as run, consumer(group_id, announcer=run) as trainer:
                trainer.connect()  # a trainer run on the group supersedes the group run too
                with pytest.raises(RunSupersededError, match=f"group {group_id}"):
                    new.take(2, timeout=30)
                assert trainer.take(2, timeout=30).group_ids == groups[4:6]
    for group, taken in ((group_id, 6), (f"{group_id}-replay", 4)):
        report = audit(kafka_config, names.namespace, group)
        assert report.ok and report.counts["taken"] == taken, report.summary()


def _consumer(config: KafkaConfig, names: TopicNames, group: str, **kw: object) -> RolloutConsumer:
    """A fenced consumer of `group` (as `rollstream take`'s), unless ``fence=False`` is passed."""
    return RolloutConsumer(config=config, group_id=group, namespace=names.namespace, filters=(),
                           **{"fence": True, **kw})


def test_a_superseded_consumer_that_commits_after_the_newer_one_is_told_it_was_superseded(
        kafka_config: KafkaConfig, namespace_factory, group_id: str) -> None:
    names = namespace_factory(partitions=1)
    groups = [g.group_id for g in publish_many(kafka_config, names, 10)]
    with _consumer(kafka_config, names, group_id) as first:
        assert first.take(2, timeout=30).group_ids == groups[:2]
        with _consumer(kafka_config, names, group_id) as second, _consumer(kafka_config, names, group_id) as new:
            second.connect()  # supersedes the first ...
            assert new.take(2, timeout=30).group_ids == groups[2:4]  # ... this both, and moves the group under them
            with pytest.raises(RunSupersededError, match=f"committing step 1 of group {group_id} refused: this "
                                                         "consumer .* superseded by a newer one"):
                first.take(2, timeout=30)  # its commit of the groups the newer one committed
            with pytest.raises(RunSupersededError, match=f"recording step 1 of group {group_id} refused"):
                second.take(2, timeout=30, commit=False)  # its record, before the manifest
            assert new.take(2, timeout=30).group_ids == groups[4:6]
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok and report.counts["taken"] == 6, report.summary()


def test_a_consumer_without_fencing_that_moves_the_group_is_a_real_conflict(
        kafka_config: KafkaConfig, namespace_factory, group_id: str) -> None:
    names = namespace_factory(partitions=1)
    groups = [g.group_id for g in publish_many(kafka_config, names, 8)]
    with _consumer(kafka_config, names, group_id) as run, _consumer(kafka_config, names, group_id,
                                                                       fence=False) as unfenced:
        assert run.take(2, timeout=30).group_ids == groups[:2]
        unfenced.connect()  # fences nobody: the run still leads
        assert unfenced.take(2, timeout=30).group_ids == groups[2:4]
        with pytest.raises(GroupConflictError, match="partition 0 is at 4, expected 2"):
            run.take(2, timeout=30)  # its run was not superseded: the probe said so and committed nothing
        assert unfenced.take(2, timeout=30).group_ids == groups[4:6]  # no transaction of the probe left pending
    with _consumer(kafka_config, names, group_id) as after:
        assert after.take(2, timeout=30).group_ids == groups[6:8]
    assert audit(kafka_config, names.namespace, group_id).ok


def test_a_superseded_take_exits_with_its_one_line_also_after_the_newer_one_committed(
        kafka_config: KafkaConfig, bootstrap_servers: str, namespace_factory, group_id: str, tmp_path: Path) -> None:
    names = namespace_factory(partitions=1)
    out = tmp_path / "old.jsonl"
    publish(kafka_config, names, [make_group(f"a{i}") for i in range(N)])
    old = start_cli(bootstrap_servers, "take", "-n", str(N), "--steps", "2", "--timeout", "60", "--namespace",
                    names.namespace, "--group", group_id, "--out", str(out))
    try:
        until(lambda: len(_steps(out)) == 1 or old.poll() is not None, 30, "the take to take its step 0")
        # Groups only the newer consumer accepts (all rewards equal: the take skips them) let it commit first.
        publish(kafka_config, names, [make_group(f"e{i}", rewards=(1.0, 1.0)) for i in range(N)])
        with _consumer(kafka_config, names, group_id) as new:
            assert new.take(N, timeout=30).group_ids == [f"e{i}#0" for i in range(N)]
            publish(kafka_config, names, [make_group(f"b{i}") for i in range(N)])  # the old take's step 1
            _, stderr = old.communicate(timeout=EXIT_BOUND_S)
    finally:
        if old.poll() is None:
            old.send_signal(signal.SIGTERM)
            old.communicate(timeout=20)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert old.returncode == 3 and len(lines) == 1, (old.returncode, stderr[-3000:])
    assert "stopped after 1 step committed: a newer run of the group took over" in lines[0], lines[0]
