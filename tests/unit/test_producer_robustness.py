"""Broker-free robustness of the producer: every group task ends acknowledged or fatal (never a silent
hole in the watermark), shutdown is bounded by its timeouts, and a partly failed commit is retried."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from rollstream.infra import KafkaConfig
from rollstream.infra.deadline import GRACE_S, Deadline
from rollstream.infra.producer_state import ProducerState
from rollstream.producers import (
    CustomEngine,
    PolicyFollower,
    ProducerSettings,
    RolloutProducer,
    SamplingParams,
    SGLangHTTPEngine,
    load_reward,
)
from rollstream.producers._intake_commits import IntakeCommits
from rollstream.producers._intake_state import StateCommits
from rollstream.producers._parts import Parts
from rollstream.producers._pipeline import GroupPipeline, GroupSettings
from rollstream.producers._threads import ProducerThreads
from rollstream.producers._watermarks import Watermarks
from rollstream.producers.engines.base import Completion, EngineCapabilities, Generation
from rollstream.producers.gate import LagGate
from rollstream.producers.intake import Intake, TakenPrompt
from rollstream.producers.metrics import ProducerMetrics
from rollstream.producers.publisher import Publisher, PublishError
from rollstream.producers.service import _CLOSE_S
from rollstream.schemas import ConfigError, LifecycleError, Prompt, ScoredGroup, decode

from tests.standins.sglang_server import CharTokenizer, SGLangStandIn

# -- a group task ends acknowledged (ok or failed) or fatal ----------------------------------------------


class _Engine:
    name = "fake"
    capabilities = EngineCapabilities()

    def __init__(self, prompt_tokens: tuple[int, ...] = (1, 2), delay_s: float = 0.0) -> None:
        self.prompt_tokens = prompt_tokens
        self.delay_s = delay_s

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def generate(self, prompt: Mapping[str, Any], n: int, sampling: SamplingParams) -> Generation:
        await asyncio.sleep(self.delay_s)
        return Generation(completions=[Completion(text="a", tokens=[3])] * n, prompt_text="q",
                          prompt_tokens=self.prompt_tokens)


class _Publisher:
    """Records what is published; the first `fail` publishes raise LifecycleError like a closed publisher."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.records: list[ScoredGroup] = []
        self.timeouts: list[float] = []

    async def publish(self, key: bytes, value: bytes) -> None:
        if self.fail:
            self.fail -= 1
            raise LifecycleError("the publisher to rollouts is closed")
        self.records.append(decode(value, ScoredGroup))

    async def close(self, timeout: float | Deadline = 30.0) -> int:
        self.timeouts.append(timeout.remaining() if isinstance(timeout, Deadline) else timeout)
        return 0


class _Intake:
    """Acknowledges into real `Watermarks`, as `Intake.ack` does."""

    def __init__(self) -> None:
        self.marks = Watermarks()
        self.marks.assign([0])

    def take(self, offset: int = 5, prompt_id: str = "p1") -> TakenPrompt:
        generation = self.marks.take(0, offset)
        assert generation is not None
        return TakenPrompt(0, offset, generation, Prompt(id=prompt_id, prompt="q"), None, 0)

    def is_current(self, taken: TakenPrompt) -> bool:
        return self.marks.is_current(taken.partition, taken.generation)

    def ack(self, taken: TakenPrompt) -> bool:
        return self.marks.ack(taken.partition, taken.offset, taken.generation)

    def halt(self) -> None:
        return None

    async def close(self, timeout: float = 30.0) -> None:
        return None

    def join(self, timeout: float) -> bool:
        return True


class _Gate(LagGate):
    """A gate that never reads lag; `note_produced` may run a hook first (e.g. to inject a bug)."""

    def __init__(self, metrics: ProducerMetrics, hook: Any = None) -> None:
        super().__init__(KafkaConfig(), "g", "t.rollouts", max_lag=100, interval_s=1.0, metrics=metrics)
        self.hook = hook

    def note_produced(self) -> None:
        if self.hook is not None:
            self.hook()
        super().note_produced()


def _running(engine: Any, publisher: _Publisher, *, hook: Any = None, drain_timeout_s: float = 60.0,
             timeout_s: float | None = None, attempts: int = 1, reward: Any = None,
             threads: ProducerThreads | None = None) -> tuple[RolloutProducer, Parts, _Intake]:
    """A producer and parts built as `open_parts` builds them, with a fake publisher and intake."""
    producer = RolloutProducer(engine, ProducerSettings(namespace="t", drain_timeout_s=drain_timeout_s))
    metrics = producer.metrics
    gate = _Gate(metrics, hook)
    policy = PolicyFollower(engine, KafkaConfig(), "t.control", metrics=metrics, watch=False)
    intake = _Intake()
    pipeline = GroupPipeline(
        GroupSettings(n_samples=1, sampling=SamplingParams(), attempts=attempts, max_attempts=1, backoff_s=0.0,
                      timeout_s=timeout_s, producer_id="p", prompts_topic="t.prompts", max_message_bytes=1 << 20),
        engine=engine, reward=load_reward(reward), policy=policy, publisher=publisher, gate=gate,  # type: ignore[arg-type]
        metrics=metrics, threads=threads)
    parts = Parts(engine=engine, publisher=publisher, gate=gate, policy=policy, intake=intake,  # type: ignore[arg-type]
                  pipeline=pipeline, threads=pipeline.threads)
    return producer, parts, intake


def test_a_group_that_does_not_fit_the_schema_is_published_as_failed_and_acked() -> None:
    """Prompt tokens that do not fit int32 made ok_group (and failed_group with the generation) raise outside any
    handler: the prompt stayed unacknowledged for ever."""
    publisher = _Publisher()
    producer, parts, intake = _running(_Engine(prompt_tokens=(1, 2**70)), publisher)
    asyncio.run(producer._group(parts, intake.take()))
    assert [r.status for r in publisher.records] == ["failed"] and producer._fatal is None
    assert intake.marks.committable() == {0: 6}


def test_an_unexpected_error_publishes_a_failed_stand_in_and_acks() -> None:
    calls = []

    def buggy_hook() -> None:  # e.g. a bug in a metrics call, once
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("metrics bug")

    publisher = _Publisher()
    producer, parts, intake = _running(_Engine(), publisher, hook=buggy_hook)
    asyncio.run(producer._group(parts, intake.take()))
    assert len(publisher.records) == 1 and publisher.records[0].status == "failed"
    assert "internal error: ValueError: metrics bug" in (publisher.records[0].error or "")
    assert producer._fatal is None and intake.marks.committable() == {0: 6}


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_hung_generation_times_out_into_a_failed_group(kind: str) -> None:
    """A generate function that never returns (async), or blocks its thread (sync), must not hang its
    prompt forever: each attempt is bounded, and after the last one the group is published as failed."""
    async def never(prompt: dict[str, Any], n: int, sampling: dict[str, Any]) -> list[dict[str, Any]]:
        await asyncio.Event().wait()
        return []

    def blocks(prompt: dict[str, Any], n: int, sampling: dict[str, Any]) -> list[dict[str, Any]]:
        time.sleep(1.5)
        return [{"text": "late", "tokens": [1]}] * n

    publisher = _Publisher()
    engine = CustomEngine(never if kind == "async" else blocks)
    producer, parts, intake = _running(engine, publisher, timeout_s=0.2, attempts=2)

    async def timed() -> float:
        started = time.monotonic()
        await producer._group(parts, intake.take())
        return time.monotonic() - started

    assert asyncio.run(timed()) < 1.4  # two bounded attempts, not the 1.5 s of one blocked call
    assert [r.status for r in publisher.records] == ["failed"]
    assert "generation took longer than 0.2 s" in (publisher.records[0].error or "")
    assert producer._fatal is None and intake.marks.committable() == {0: 6}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logprobs_are_a_failed_group_not_an_ok_one(bad: float) -> None:
    async def gen(prompt: dict[str, Any], n: int, sampling: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"text": "a", "tokens": [1, 2], "logprobs": [-0.5, bad]}] * n

    publisher = _Publisher()
    producer, parts, intake = _running(CustomEngine(gen), publisher)
    asyncio.run(producer._group(parts, intake.take()))
    assert [r.status for r in publisher.records] == ["failed"]
    assert "logprobs are NaN or infinite" in (publisher.records[0].error or "")
    assert producer._fatal is None and intake.marks.committable() == {0: 6}


def test_a_poison_prompt_whose_metadata_alone_exceeds_the_limit_is_accounted_bare() -> None:
    """Even the stripped failed record carries the prompt's metadata: beyond the limit it would stop the
    partition for good (the producer died on it at every restart). The bare record drops it."""
    publisher = _Publisher()
    producer, parts, intake = _running(_Engine(), publisher)
    taken = intake.take()
    poison = TakenPrompt(taken.partition, taken.offset, taken.generation,
                         Prompt(id="poison", prompt="q", metadata={"blob": "x" * (2 << 20)}), None, 0)
    asyncio.run(producer._group(parts, poison))
    assert [r.status for r in publisher.records] == ["failed"] and publisher.records[0].metadata == {}
    assert "exceeds max_message_bytes" in (publisher.records[0].error or "")
    assert producer._fatal is None and intake.marks.committable() == {0: 6}


def test_a_hung_reward_function_times_out_into_a_failed_group() -> None:
    async def verifier(prompt: dict[str, Any], completion: dict[str, Any]) -> float:
        await asyncio.Event().wait()
        return 1.0

    publisher = _Publisher()
    producer, parts, intake = _running(_Engine(), publisher, timeout_s=0.2, reward=verifier)
    asyncio.run(producer._group(parts, intake.take()))
    assert [r.status for r in publisher.records] == ["failed"] and len(publisher.records[0].samples) == 1
    assert "took longer than 0.2 s" in (publisher.records[0].error or "")
    assert producer._fatal is None and intake.marks.committable() == {0: 6}


def test_a_hung_user_function_holds_only_its_own_thread() -> None:
    """Sync generate and reward functions that hang for good in some calls (3 hung, 4 user threads): every
    other group still generates, scores and publishes (in the one thread left), the hung ones end failed
    (retriable) at their deadline, an HTTP engine still tokenizes in its own threads once every user thread
    hangs, and the producer closes within its bound, waiting for no hung thread."""
    release = threading.Event()  # set at the end, so the daemon threads end with the test

    def generate(prompt: dict[str, Any], n: int, sampling: dict[str, Any]) -> list[dict[str, Any]]:
        if prompt["id"].startswith("hang-g"):
            release.wait()
        return [{"text": "a", "tokens": [1]}] * n

    def reward(prompt: dict[str, Any], completion: dict[str, Any]) -> float:
        if prompt["id"].startswith("hang-r"):
            release.wait()
        return 1.0

    threads = ProducerThreads(4)
    engine = CustomEngine(generate)
    engine.use_threads(threads.user)
    publisher = _Publisher()
    producer, parts, intake = _running(engine, publisher, timeout_s=1.0, reward=reward, threads=threads,
                                       drain_timeout_s=5.0)
    ids = ["hang-g1", "hang-g2", "hang-r1", *(f"ok-{i}" for i in range(6))]

    async def scenario() -> float:
        slots = asyncio.Semaphore(len(ids))
        for offset, prompt_id in enumerate(ids):
            producer._spawn(parts, intake.take(offset, prompt_id), slots)
        await asyncio.wait(set(producer._in_flight), timeout=4.0)
        # Every user thread taken now: one more hung call fills the fourth.
        filler = asyncio.ensure_future(threads.user.run(release.wait))
        with SGLangStandIn(weight_version="1", token_delay_s=0.0) as server:
            http = SGLangHTTPEngine([server.url], tokenizer=CharTokenizer())
            await http.start()
            try:
                generation = await asyncio.wait_for(
                    http.generate({"id": "t", "prompt": "2+2?"}, 1, SamplingParams(max_new_tokens=2)), 5.0)
            finally:
                await http.close()
        assert list(generation.prompt_tokens) == [ord(ch) for ch in "2+2?"]  # tokenized in its own threads
        started = time.monotonic()
        await producer._close(parts, [])
        filler.cancel()
        return time.monotonic() - started

    try:
        closed_in = asyncio.run(asyncio.wait_for(scenario(), 20.0))
    finally:
        release.set()
    assert closed_in < 2.0
    by_id = {r.prompt_id: r for r in publisher.records}
    assert sorted(by_id) == sorted(ids)
    assert all(by_id[f"ok-{i}"].status == "ok" and by_id[f"ok-{i}"].rewards == [1.0] for i in range(6))
    for prompt_id in ("hang-g1", "hang-g2", "hang-r1"):
        assert by_id[prompt_id].status == "failed" and by_id[prompt_id].retriable
        assert "took longer than 1 s" in (by_id[prompt_id].error or "")
    assert producer._fatal is None and intake.marks.committable() == {0: len(ids)}


def test_a_group_that_cannot_be_published_at_all_stops_the_producer() -> None:
    publisher = _Publisher(fail=2)  # the group and its failed stand-in: "publisher closed"
    producer, parts, intake = _running(_Engine(), publisher)
    asyncio.run(producer._group(parts, intake.take()))
    assert isinstance(producer._fatal, LifecycleError) and producer._stopping
    assert (producer.exit_reason or "").startswith("fatal") and intake.marks.committable() == {0: 5}


# -- shutdown is bounded --------------------------------------------------------------------------------


def test_close_passes_the_publisher_the_time_left_after_the_drain() -> None:
    publisher = _Publisher()
    producer, parts, intake = _running(_Engine(delay_s=0.6), publisher, drain_timeout_s=6.0)

    async def scenario() -> None:
        producer._spawn(parts, intake.take(), asyncio.Semaphore(1))  # a group that takes 0.6 s
        await producer._close(parts, [])
        assert [r.status for r in publisher.records] == ["ok"]

    asyncio.run(scenario())
    assert publisher.timeouts and publisher.timeouts[0] <= 6.0 + _CLOSE_S - 0.6  # the stop's deadline, less the drain


def test_publisher_close_is_bounded_while_a_produce_waits_for_queue_room() -> None:
    """No broker: the queue (2 records) is full and a third produce waits in the worker thread. Records
    would time out only after message.timeout.ms (60 s); close(0.5) must not wait for that."""
    config = KafkaConfig(bootstrap_servers="127.0.0.1:1", extra={"log_level": 0})
    publisher = Publisher(config, "t", overrides={"queue.buffering.max.messages": 2, "message.timeout.ms": 60_000})

    async def scenario() -> tuple[float, int, list[Any]]:
        publisher.start(asyncio.get_running_loop())
        sends = [asyncio.create_task(publisher.publish(b"k", b"v")) for _ in range(3)]
        await asyncio.sleep(0.3)
        started = time.monotonic()
        left = await asyncio.wait_for(publisher.close(timeout=0.5), 10)
        elapsed = time.monotonic() - started
        await asyncio.sleep(0.2)
        for task in sends:
            task.cancel()
        return elapsed, left, await asyncio.gather(*sends, return_exceptions=True)

    elapsed, left, results = asyncio.run(scenario())
    assert elapsed < 0.5 + GRACE_S and left == 2
    assert isinstance(results[2], PublishError) and results[2].code == "_DESTROY"


# -- intake commits: a partition the broker refused is retried -------------------------------------------


class _Consumer:
    """Intake's client as its commits see it: an asynchronous commit, answered (through `on_commit`) in a poll."""

    def __init__(self, on_commit: Any, refuse: set[int]) -> None:
        self.on_commit, self.refuse = on_commit, refuse
        self.commits: list[dict[int, int]] = []
        self.answered = True  # False: the coordinator never answers (librdkafka#5511)
        self._unanswered: list[list[Any]] = []

    def commit(self, offsets: list[Any], asynchronous: bool) -> None:
        assert asynchronous, "a synchronous commit has no deadline"
        self.commits.append({tp.partition: tp.offset for tp in offsets})
        self._unanswered.append(offsets)

    def poll(self, timeout: float) -> None:
        while self.answered and self._unanswered:
            offsets = self._unanswered.pop(0)
            self.on_commit(None, [SimpleNamespace(topic=tp.topic, partition=tp.partition, offset=tp.offset,
                                                  error=KafkaError(KafkaError.REBALANCE_IN_PROGRESS)
                                                  if tp.partition in self.refuse else None) for tp in offsets])


def test_intake_commits_mark_only_accepted_partitions_and_never_wait(caplog: pytest.LogCaptureFixture,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Intake's commits are sent without waiting and answered in its polls: a partition the broker refused is sent
    again; a commit that gets no answer within its bound asks for a fresh client instead of holding intake."""
    import rollstream.producers._intake_commits as commits_module

    clock = [time.monotonic()]
    monkeypatch.setattr(commits_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    marks = Watermarks()
    marks.assign([0, 1])
    for p in (0, 1):
        generation = marks.take(p, 7)
        assert generation is not None and marks.ack(p, 7, generation)
    metrics = ProducerMetrics()
    commits = IntakeCommits("t.prompts", "g", marks, StateCommits("p", _Gate(metrics)), interval_s=0.2,
                            answer_s=20.0)
    consumer = _Consumer(commits.conf()["on_commit"], refuse={1})
    assert commits.tick(consumer) and consumer.commits[-1] == {0: 8, 1: 8}  # type: ignore[arg-type]
    assert commits.tick(consumer) and len(consumer.commits) == 1  # type: ignore[arg-type]  # one in flight
    consumer.poll(0)  # the answer: partition 1 refused
    clock[0] += 1.0
    assert commits.tick(consumer)  # type: ignore[arg-type]
    assert "t.prompts[1]@8" in caplog.text and marks.committable() == {1: 8} and not marks.settled()
    assert consumer.commits[-1] == {1: 8}  # sent again
    consumer.refuse.clear()
    consumer.poll(0)
    clock[0] += 1.0
    assert commits.tick(consumer) and marks.settled()  # type: ignore[arg-type]
    generation = marks.take(0, 8)
    assert generation is not None and marks.ack(0, 8, generation)
    consumer.answered = False  # the coordinator is gone for good
    assert commits.tick(consumer) and consumer.commits[-1] == {0: 9}  # type: ignore[arg-type]
    clock[0] += 19.0
    assert commits.tick(consumer)  # type: ignore[arg-type]  # not yet past its bound
    clock[0] += 2.0
    assert not commits.tick(consumer)  # type: ignore[arg-type]  # no answer in 20 s: replace the client
    assert "got no answer" in caplog.text and marks.committable() == {0: 9}


# -- intake: a client that stopped serving its partitions is replaced -------------------------------------


class _GroupConsumer:
    """A stand-in for intake's consumer: committed offsets (or a timeout), end offsets, an assignment."""

    def __init__(self, committed: dict[int, int], ends: dict[int, int], fail: bool = False,
                 assigned: bool = True) -> None:
        self.committed_at, self.ends, self.fail, self.assigned = committed, ends, fail, assigned

    def assignment(self) -> list[Any]:
        return [SimpleNamespace(topic="t.prompts", partition=p, offset=-1001) for p in sorted(self.ends)
                if self.assigned]

    def list_topics(self, topic: str, timeout: float) -> Any:
        return SimpleNamespace(topics={topic: SimpleNamespace(partitions={p: None for p in self.ends})})

    def committed(self, partitions: list[Any], timeout: float) -> list[Any]:
        if self.fail:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT))
        return [SimpleNamespace(topic=tp.topic, partition=tp.partition, offset=self.committed_at.get(tp.partition,
                                -1001)) for tp in partitions]

    def get_watermark_offsets(self, tp: Any, timeout: float, cached: bool) -> tuple[int, int]:
        return 0, self.ends[tp.partition]

    def incremental_assign(self, partitions: list[Any]) -> None:
        pass

    def resume(self, partitions: list[Any]) -> None:
        pass

    def close(self) -> None:  # a replaced client is closed in the background
        self.closed = True


@pytest.mark.parametrize("case,stuck", [("nothing-left", False), ("in-flight", False), ("prompts-wait", True),
                                        ("coordinator-gone", True), ("unassigned", False),
                                        ("unassigned-coordinator-gone", True)])
def test_intake_replaces_a_client_that_stopped_serving_its_partitions(
        case: str, stuck: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a broker stall a client can lose its coordinator for good (librdkafka#5511) and never fetch
    again: prompts wait, nothing arrives. Intake must then drop its partitions as lost and rejoin; but a
    quiet client with nothing left, or with everything taken and in flight, is healthy. A client assigned nothing
    (its partitions lost in a stall) is cut off when its coordinator cannot be asked for the group's offsets: it
    would never be assigned any again; one that can (more producers than partitions) is healthy."""
    import rollstream.producers._intake_stall as stall_module

    metrics = ProducerMetrics()
    intake = Intake(KafkaConfig(bootstrap_servers="127.0.0.1:1"), "t.prompts", "g", gate=_Gate(metrics),
                    metrics=metrics, prefetch=4, session_timeout_s=1.0)
    consumer = {"nothing-left": _GroupConsumer({0: 10}, {0: 10}), "in-flight": _GroupConsumer({0: 4}, {0: 10}),
                "prompts-wait": _GroupConsumer({0: 4}, {0: 10}),
                "coordinator-gone": _GroupConsumer({0: 10}, {0: 10}, fail=True),
                "unassigned": _GroupConsumer({0: 4}, {0: 10}, assigned=False),
                "unassigned-coordinator-gone": _GroupConsumer({0: 4}, {0: 10}, fail=True, assigned=False)}[case]
    intake._client.current = consumer  # type: ignore[assignment]  # the client `_serve` would run
    intake._on_assign(consumer, consumer.assignment())  # type: ignore[arg-type]
    owning = not case.startswith("unassigned")
    assert _partition_metrics(metrics) == (int(owning), int(owning), 0)  # (owned, assigned, lost)
    if case == "in-flight":  # taken up to the end, not acknowledged yet: nothing waits
        for offset in range(4, 10):
            assert intake._marks.take(0, offset) is not None
    assert not intake._stuck(consumer)  # type: ignore[arg-type]  # not quiet long enough yet
    later = time.monotonic() + 60.0
    monkeypatch.setattr(stall_module, "time", SimpleNamespace(monotonic=lambda: later))
    assert intake._stuck(consumer) is stuck  # type: ignore[arg-type]
    assert (intake.owned() == []) is (stuck or case.startswith("unassigned"))
    assert intake.client_replacements == int(stuck)
    # a fresh client is installed, and counted by role; the stuck one closes in the background
    assert (intake._client.current is not consumer) is stuck
    assert metrics.registry.get_sample_value("rollstream_producer_client_replacements_total",
                                             {"role": "intake"}) == int(stuck)
    # a replaced client's partitions are dropped as lost: one change, and none owned (nothing to drop: no change)
    assert _partition_metrics(metrics) == (int(owning and not stuck), int(owning), int(owning and stuck))
    if stuck:
        intake._client.current.close()  # type: ignore[union-attr]  # the fresh one, never subscribed


def _partition_metrics(metrics: ProducerMetrics) -> tuple[float | None, ...]:
    """The prompt partitions owned now, and the assignments and losses counted so far."""
    sample = metrics.registry.get_sample_value
    return (sample("rollstream_producer_assigned_partitions"),
            *(sample("rollstream_producer_rebalances_total", {"change": c}) for c in ("assigned", "lost")))


def test_intake_whose_slots_are_all_busy_is_not_stalled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40: every generation slot busy (the hand-over queue full, the partitions paused) is no quiet time,
    however long the engine takes (a weight update pausing the server): once a slot frees, the client gets a
    whole stall time to deliver before a probe may replace it (and its prompts in flight be generated twice).
    A client that then still delivers nothing while prompts wait is replaced as before."""
    import rollstream.producers._intake_stall as stall_module

    clock = [time.monotonic()]
    monkeypatch.setattr(stall_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    metrics = ProducerMetrics()
    intake = Intake(KafkaConfig(bootstrap_servers="127.0.0.1:1"), "t.prompts", "g", gate=_Gate(metrics),
                    metrics=metrics, prefetch=2, session_timeout_s=1.0)
    consumer = _GroupConsumer({0: 4}, {0: 10})  # prompts wait beyond what is committed and taken
    intake._client.current = consumer  # type: ignore[assignment]
    intake._on_assign(consumer, consumer.assignment())  # type: ignore[arg-type]
    stall_s = intake._client.stall_s

    def stuck_after(seconds: float) -> bool:
        clock[0] += seconds
        return intake._stuck(consumer)  # type: ignore[arg-type]

    intake.last_message_at = clock[0]  # two prompts taken: both slots generate, the queue fills
    intake._credits, intake._paused = 0, True  # (`_FULL_WAIT_S` later the partitions pause)
    assert not stuck_after(10 * stall_s)  # the engine paused far past the stall time: busy, not quiet
    intake._credits, intake._paused = 1, False  # a slot freed: the loop took a queued prompt, intake resumes
    assert not stuck_after(0.5)  # the fetch after the resume has its whole stall time
    assert not stuck_after(stall_s - 1.0) and intake.client_replacements == 0
    assert stuck_after(1.0) and intake.client_replacements == 1  # wanted prompts all along, got none: stuck
    intake._client.current.close()  # type: ignore[union-attr]  # the fresh one, never subscribed


# -- a revocation drains what started and leaves what only waits ------------------------------------------


def _taken(marks: Watermarks, partition: int, *offsets: int, start: bool = True) -> int:
    generation = None
    for offset in offsets:
        generation = marks.take(partition, offset)
        assert generation is not None
        assert not start or marks.start(partition, offset, generation)
    assert generation is not None
    return generation


def test_a_drain_waits_for_started_prompts_of_its_partitions_only_and_abandons_queued_ones() -> None:
    marks = Watermarks()
    marks.assign([0, 1])
    g0 = _taken(marks, 0, 10, 11)
    _taken(marks, 0, 12, start=False)  # queued for the loop, not started
    g1 = _taken(marks, 1, 5)  # started in a partition that stays: the drain must not wait for it
    acks = threading.Timer(0.2, lambda: (marks.ack(0, 11, g0), marks.ack(0, 10, g0)))  # the loop, later
    acks.start()
    drain = marks.drain([0], timeout_s=5.0, stopping=lambda: False)
    acks.join()
    assert (drain.finished, drain.unfinished, drain.abandoned) == (2, 0, 1)
    assert 0.15 <= drain.waited_s < 2.0  # woken by the last ack, not by its timeout
    assert not marks.start(0, 12, g0)  # a queued prompt of a draining partition never starts
    assert marks.is_current(0, g0)  # still owned until revoked: the started ones could still ack
    assert marks.revoke([0]) == {0: 12}  # the finished ones committed; the abandoned one is the next owner's
    assert marks.ack(1, 5, g1) and marks.committable() == {1: 6}


@pytest.mark.parametrize("how", ["timeout", "stopping"])
def test_a_drain_gives_up_at_its_timeout_or_when_intake_stops(how: str) -> None:
    marks = Watermarks()
    marks.assign([0])
    generation = _taken(marks, 0, 3, 4)
    assert marks.ack(0, 4, generation)
    stop = threading.Event()
    def close() -> None:  # what `Intake.stop` does
        stop.set()
        marks.wake()

    if how == "stopping":
        threading.Timer(0.1, close).start()
    drain = marks.drain([0], timeout_s=0.3 if how == "timeout" else 30.0, stopping=stop.is_set)
    assert (drain.finished, drain.unfinished, drain.abandoned) == (0, 1, 0) and drain.waited_s < 1.0
    assert marks.revoke([0]) == {0: 3}  # never past the unfinished prompt: its next owner regenerates it
    assert not marks.ack(0, 3, generation)  # a late acknowledgement no longer moves anything


def test_intake_never_hands_the_loop_a_queued_prompt_of_a_draining_partition() -> None:
    metrics = ProducerMetrics()
    intake = Intake(KafkaConfig(bootstrap_servers="127.0.0.1:1"), "t.prompts", "g", gate=_Gate(metrics),
                    metrics=metrics, prefetch=4, instance_id="p-1")
    intake._marks.assign([0, 1])

    async def scenario() -> tuple[TakenPrompt, int]:
        for partition, offset in [(0, 7), (1, 3)]:
            generation = intake._marks.take(partition, offset)
            assert generation is not None
            intake._hand_over([TakenPrompt(partition, offset, generation, Prompt(id=f"p{partition}", prompt="q"),
                                           None, 0)])
        drain = intake._marks.drain([0], timeout_s=0.0, stopping=lambda: False)  # a revocation of partition 0
        return await anext(intake), drain.abandoned

    first, abandoned = asyncio.run(scenario())
    assert (first.partition, first.offset, abandoned) == (1, 3, 1)
    assert intake.producer_id == "p-1" and intake._credits == 6  # both hand-overs gave their credit back


def test_intake_commits_its_state_with_the_gate_it_saw() -> None:
    metrics = ProducerMetrics()
    gate = _Gate(metrics)
    intake = Intake(KafkaConfig(bootstrap_servers="127.0.0.1:1"), "t.prompts", "g", gate=gate, metrics=metrics,
                    prefetch=2, producer_id="p-7")
    intake._state.watch()
    running = intake.state()
    gate._measured = gate.max_lag + 1  # the trainer fell behind: the gate closes
    intake._state.watch()
    paused = ProducerState.from_metadata(intake._state.metadata())
    assert not running.paused and paused is not None and paused.paused
    assert paused.producer_id == "p-7" and paused.max_lag == gate.max_lag
    assert running.since_ms <= paused.since_ms <= paused.updated_at_ms and intake._state.due()
    for bad, overrides in [(-1.0, {}), (30.0, {"max.poll.interval.ms": 20_000})]:
        with pytest.raises(ConfigError, match="drain_on_revoke_s"):
            Intake(KafkaConfig(), "t.prompts", "g", gate=gate, metrics=metrics, prefetch=2, drain_on_revoke_s=bad,
                   overrides=overrides)
