"""The runs' rule (`rollstream.infra.runs.follow_verdict`): which announcement producers follow."""

from __future__ import annotations

import pytest
from rollstream.infra.runs import RunSupersededError, Verdict, follow_verdict
from rollstream.schemas import InvalidRecordError, PolicyVersion, decode, encode
from rollstream.schemas._upgrade import policy_version_v1


def _v(version: int, run: int = 0, run_id: str | None = None) -> PolicyVersion:
    return PolicyVersion(version, run=run, run_id=run_id if run_id is not None or not run else f"id{run}")


def test_the_first_announcement_is_followed() -> None:
    assert follow_verdict(None, _v(60, 1)) is Verdict.FOLLOW
    assert follow_verdict(None, _v(3)) is Verdict.FOLLOW


def test_a_newer_run_is_followed_down_and_an_older_one_moves_nobody() -> None:
    assert follow_verdict(_v(60, 1), _v(51, 2)) is Verdict.FOLLOW  # resumed from the checkpoint of 50
    assert follow_verdict(_v(51, 2), _v(61, 1)) is Verdict.SUPERSEDED  # the replaced trainer still announces
    assert follow_verdict(_v(51, 2), _v(99)) is Verdict.SUPERSEDED  # a pre-runs announcer: run 0
    assert follow_verdict(_v(99), _v(1, 1)) is Verdict.FOLLOW  # any run supersedes run 0


def test_within_a_run_its_latest_word_counts_and_run_zero_keeps_the_highest() -> None:
    assert follow_verdict(_v(5, 2), _v(6, 2)) is Verdict.FOLLOW
    assert follow_verdict(_v(6, 2), _v(6, 2)) is Verdict.SAME
    assert follow_verdict(_v(6, 2), _v(4, 2)) is Verdict.FOLLOW  # the run went back: it says so
    assert follow_verdict(_v(6), _v(4)) is Verdict.SAME  # before runs, lower numbers were ignored
    assert follow_verdict(_v(6), _v(7)) is Verdict.FOLLOW


def test_two_runs_claiming_one_number_the_first_wins() -> None:
    first, second = _v(1, 3, "first"), _v(1, 3, "second")
    assert follow_verdict(first, second) is Verdict.SUPERSEDED


def test_policy_versions_carry_their_run_and_old_records_decode_as_run_zero() -> None:
    record = PolicyVersion(7, weights_path="/w/7", run=4, run_id="abc")
    back = decode(encode(record), PolicyVersion)
    assert (back.run, back.run_id, back.label()) == (4, "abc", "version 7 of run 4")
    old = policy_version_v1({"version": 3, "weights_path": None, "created_at_ms": 1, "metadata": {}})
    assert (old["run"], old["run_id"]) == (0, None)
    assert PolicyVersion(**old).label() == "version 3"
    with pytest.raises(InvalidRecordError, match="run"):
        PolicyVersion(1, run=-1)


def test_the_superseded_error_says_what_happened_and_what_to_do() -> None:
    err = RunSupersededError(4, "exp42", "committing step 7")
    text = str(err)
    assert "trainer run 4 of namespace exp42 was superseded" in text and "Stop this trainer" in text
    assert err.retriable is False


def test_a_closed_announcer_cannot_begin_or_announce() -> None:
    from rollstream.infra import KafkaConfig, PolicyAnnouncer
    from rollstream.schemas import LifecycleError

    announcer = PolicyAnnouncer(KafkaConfig(bootstrap_servers="127.0.0.1:1"), "exp42")  # never connects
    announcer.close()
    with pytest.raises(LifecycleError, match="closed: a new PolicyAnnouncer begins a new run"):
        announcer.announce(PolicyVersion(1))
    announcer.close()  # idempotent


def test_the_trainer_is_granted_both_transactional_ids_and_group_runs_fence_only_their_group() -> None:
    """`rollstream acls` names the trainer run's id (per namespace) and the group run's (per trainer group)."""
    from rollstream.infra import TopicNames, plan_acls
    from rollstream.infra.runs import group_run_transactional_id, run_transactional_id

    names = TopicNames("exp")
    rules = plan_acls("exp", "p", "t", trainer_group="g1")
    ids = {(r.name, r.operation) for r in rules if r.resource == "TRANSACTIONAL_ID"}
    assert ids == {(i, op) for i in ("rollstream.exp.trainer-run", "rollstream.exp.group-run.g1")
                   for op in ("WRITE", "DESCRIBE")}
    assert run_transactional_id(names) == "rollstream.exp.trainer-run"
    assert group_run_transactional_id(names, "g1") != group_run_transactional_id(names, "g2")
