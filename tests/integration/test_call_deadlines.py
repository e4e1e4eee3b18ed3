"""The consumer's blocking calls keep one deadline each against a broker that does not answer.

Pinned here, against a real broker that is unreachable (a closed port) or frozen (SIGSTOP, a private broker:
the session's must not freeze): `RolloutConsumer.take(n, timeout=T)` (which must first connect),
`seek_to_step(k, timeout=T)`, a lag read (`LagReader.group_lag`, `RolloutConsumer.lag`) and
``rollstream take --timeout T`` each return or raise a `RollstreamError` within T + `GRACE_S`, with a message
that says what to check. One private broker for every frozen phase.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from rollstream.consumers import RolloutConsumer, TakeTimeout, audit, replay_step
from rollstream.infra import KafkaConfig, KafkaIOError, LagReader, TopicNames, TopicPlan, create_topics
from rollstream.infra.broker import free_port
from rollstream.infra.deadline import GRACE_S
from rollstream.schemas import RollstreamError

from tests.integration._kafka import REPO_ROOT, cli_env, signal_all, until
from tests.records import publish_many

T = 3.0  # each call's timeout
GROUP = "deadline-trainer"


def _within(call: Callable[[], object], bound_s: float) -> RollstreamError:
    """The RollstreamError `call` raised, asserting it came within `bound_s`."""
    started = time.monotonic()
    with pytest.raises(RollstreamError) as info:
        call()
    took = time.monotonic() - started
    print(f"{took:.2f} s: {type(info.value).__name__}: {info.value}")  # -s shows what each call took
    assert took <= bound_s, f"{took:.2f} s > {bound_s:g} s: {info.value}"
    return info.value


def _succeeds(call: Callable[[], object]) -> bool:
    try:
        call()
    except RollstreamError:
        return False
    return True


def _take_cli(bootstrap: str, namespace: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """``rollstream take --timeout T`` and its wall time, less the interpreter's start-up and exit (the longer of
    two ``--help`` runs, before and after: this machine may be loaded)."""
    def run(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "rollstream", "take", *args], cwd=REPO_ROOT,
                              env=cli_env(bootstrap), capture_output=True, text=True, timeout=60)
        return done, time.monotonic() - started

    _, before_s = run("--help")
    done, took = run("-n", "2", "--namespace", namespace, "--group", GROUP, "--timeout", f"{T:g}")
    _, after_s = run("--help")
    print(f"rollstream take --timeout {T:g}: {took:.2f} s, start-up {before_s:.2f} / {after_s:.2f} s")
    return done, took - max(before_s, after_s)


def _assert_cli_fails_in_time(bootstrap: str, namespace: str) -> None:
    done, took = _take_cli(bootstrap, namespace)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and took <= T + GRACE_S, (took, done.stderr)
    assert len(lines) == 1 and "rollstream broker" in lines[0], done.stderr  # one line, saying what to check


def test_calls_against_an_unreachable_broker_keep_their_deadline() -> None:
    config = KafkaConfig(bootstrap_servers=f"127.0.0.1:{free_port()}")  # nothing listens there
    with RolloutConsumer(config=config, group_id=GROUP, namespace="nowhere") as consumer:
        error = _within(lambda: consumer.take(2, timeout=T), T + GRACE_S)
        assert isinstance(error, KafkaIOError) and error.retriable and "rollstream broker start" in str(error)
        _within(lambda: consumer.seek_to_step(0, timeout=T), T + GRACE_S)
        _within(lambda: consumer.lag(timeout=T), T + GRACE_S)
    _assert_cli_fails_in_time(config.bootstrap_servers, "nowhere")


@pytest.mark.timeout(240)
def test_calls_against_a_stopped_broker_keep_their_deadline(
        freezable_broker: tuple[KafkaConfig, tuple[int, ...]]) -> None:
    config, pids = freezable_broker
    names = TopicNames("deadlines")
    create_topics(TopicPlan(names=names, partitions=2), config)
    publish_many(config, names, 2)
    started = RolloutConsumer(config=config, group_id=GROUP, namespace=names.namespace, filters=(), timeout=10)
    fresh = RolloutConsumer(config=config, group_id=GROUP, namespace=names.namespace, filters=(), timeout=10)
    try:
        assert started.take(2, timeout=30).step == 0  # connected, step 0 committed: a step to seek to
        signal_all(pids, signal.SIGSTOP)
        try:
            error = _within(lambda: fresh.take(2, timeout=T), T + GRACE_S)  # connecting
            assert isinstance(error, KafkaIOError) and error.retriable and "rollstream broker" in str(error)
            # A connected consumer's take that times out. Its diagnosis describes the producers' group in the
            # background; librdkafka 2.16 aborted this very process (rd_kafka_enq_once_del_source_return,
            # librdkafka#4605) when the coordinator answered that timed-out request after the broker resumed, so
            # the read runs in a child process (infra/group_members.py): this test lives on.
            error = _within(lambda: started.take(2, timeout=T), T + GRACE_S)
            assert isinstance(error, TakeTimeout), error
            error = _within(lambda: started.seek_to_step(0, timeout=T), T + GRACE_S)
            assert isinstance(error, KafkaIOError) and error.retriable
            with LagReader(config) as reader:
                error = _within(lambda: reader.group_lag(GROUP, names.rollouts, timeout=T), T + GRACE_S)
            assert isinstance(error, KafkaIOError) and error.retriable
            _within(lambda: started.lag(timeout=T), T + GRACE_S)
            _assert_cli_fails_in_time(config.bootstrap_servers, names.namespace)
        finally:
            signal_all(pids, signal.SIGCONT)
        # The broker back (it fences itself for a while after a stall longer than its session): the same calls
        # work again, and the failed start left nothing behind.
        until(lambda: _succeeds(lambda: started.seek_to_step(0, timeout=10)), 90, "a seek after the stall")
        until(lambda: _succeeds(lambda: fresh.connect(timeout=10)), 90, "a start after the stall")
        assert fresh.next_step == 1
    finally:
        started.close()
        fresh.close()


@pytest.mark.timeout(180)
def test_a_take_whose_manifest_cannot_be_written_still_returns_its_batch(
        freezable_broker: tuple[KafkaConfig, tuple[int, ...]], caplog: pytest.LogCaptureFixture) -> None:
    """take(commit=False) of groups already fetched while the broker is frozen: the step is taken, its manifest
    cannot be written. The batch is returned all the same (raised, a caller that went on taking would commit its
    offsets with the next step without training it); commit writes the manifest first, and nothing is lost."""
    config, pids = freezable_broker
    names = TopicNames("unrecorded")
    create_topics(TopicPlan(names=names, partitions=2), config)
    groups = [g.group_id for g in publish_many(config, names, 8)]
    group = f"{GROUP}-unrecorded"
    with RolloutConsumer(config=config, group_id=group, namespace=names.namespace, filters=(), timeout=T) as trainer:
        first = trainer.take(2, timeout=30)  # connected, committed; the rest is fetched meanwhile
        time.sleep(2)  # librdkafka fetches the other 6 groups (a few hundred bytes) meanwhile
        signal_all(pids, signal.SIGSTOP)
        try:  # a stall shorter than the broker's session (9 s): it does not fence itself
            started = time.monotonic()
            unrecorded = trainer.take(2, timeout=T, commit=False)
            took = time.monotonic() - started
        finally:
            signal_all(pids, signal.SIGCONT)
        assert took <= T + GRACE_S, took
        assert "step 1 taken, its manifest not recorded yet" in caplog.text
        second = trainer.take(2, timeout=30, commit=False)
        until(lambda: _succeeds(lambda: trainer.commit(second)), 60, "the commit after the stall")
    assert (first.step, unrecorded.step, second.step) == (0, 1, 2)
    report = audit(config, names.namespace, group, timeout=30)
    assert report.ok and report.steps == (0, 1, 2), report.summary()
    assert [g.group_id for g in replay_step(config, names.namespace, group, 1).groups] == unrecorded.group_ids
    with RolloutConsumer(config=config, group_id=group, namespace=names.namespace, filters=(), timeout=30) as after:
        rest = after.take(2, timeout=30)
    assert rest.step == 3
    taken = first.group_ids + unrecorded.group_ids + second.group_ids + rest.group_ids
    assert sorted(taken) == sorted(groups)
