"""One deadline per group, against the engine stand-ins (tests/standins/).

Pinned: (a) a request that hit its own (per-request) timeout is retried, and the retry runs inside the
group's deadline (the group's deadline used to equal the request timeout, so it never could); (b) a
group never takes longer than its deadline, whatever the engine's retries and request timeouts; (c) a
partial rollout aborted late in the window (after the first request took most of a request timeout) is
continued and completes. The backoff is bounded, jittered and never sleeps past the deadline.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from rollstream.infra import KafkaConfig
from rollstream.producers._pipeline import GroupPipeline, GroupSettings
from rollstream.producers.engines import (
    Backoff,
    Deadline,
    EngineError,
    RetryPolicy,
    SamplingParams,
    SGLangHTTPEngine,
    VLLMHTTPEngine,
)
from rollstream.producers.intake import TakenPrompt
from rollstream.producers.metrics import ProducerMetrics
from rollstream.producers.policy import PolicyFollower
from rollstream.schemas import ConfigError, Prompt

from tests.standins.sglang_server import CharTokenizer, SGLangStandIn
from tests.standins.vllm_server import VLLMStandIn

PROMPT = {"id": "p1", "prompt": "2+2?", "label": "4", "metadata": {}, "epoch": 0}
FAST = RetryPolicy(attempts=10, abort_attempts=2, backoff_s=0.01, max_backoff_s=0.02)
SLACK_S = 0.3  # the loop's and the stand-in's own overhead on a slow shared machine


@pytest.fixture
def vllm() -> Iterator[VLLMStandIn]:
    with VLLMStandIn() as server:
        yield server


def pipeline(engine: Any, *, timeout_s: float, n: int = 2, max_new_tokens: int = 4) -> GroupPipeline:
    metrics = ProducerMetrics()
    return GroupPipeline(
        GroupSettings(n_samples=n, sampling=SamplingParams(max_new_tokens=max_new_tokens), attempts=3,
                      max_attempts=3, backoff_s=0.01, timeout_s=timeout_s, producer_id="p",
                      prompts_topic="t.prompts", max_message_bytes=1 << 20),
        engine=engine, reward=None, metrics=metrics, publisher=None, gate=None,  # type: ignore[arg-type]
        policy=PolicyFollower(engine, KafkaConfig(), "t.control", metrics=metrics, watch=False))


def run_group(engine: Any, pipe: GroupPipeline) -> tuple[Any, float]:
    """The group's outcome (generate and score, under its deadline) and how long it took."""
    taken = TakenPrompt(0, 5, 0, Prompt(id="p1", prompt="2+2?"), None, 0)

    async def go() -> tuple[Any, float]:
        await engine.start()
        try:
            started = time.monotonic()
            outcome = await pipe.outcome(taken)
            return outcome, time.monotonic() - started
        finally:
            await engine.close()
    return asyncio.run(go())


# -- (a) a retry after a request timeout runs inside the group's deadline ---------------------------------------


def test_a_request_that_timed_out_is_retried_within_the_group_deadline(vllm: VLLMStandIn) -> None:
    vllm.slow_next, vllm.slow_s = 1, 2.0  # the first request stalls past its 0.3 s timeout
    engine = VLLMHTTPEngine([vllm.url], retry=FAST, timeout_s=0.3)
    outcome, took = run_group(engine, pipeline(engine, timeout_s=3.0))
    assert outcome.error is None and outcome.generation is not None
    assert len(outcome.generation.completions) == 2
    assert len(vllm.completions()) == 3  # two samples, one of them retried after its request timed out
    assert 0.3 <= took < 2.0  # the retry did not wait for the stalled answer


# -- (b) a group never outlasts its deadline ---------------------------------------------------------------------


@pytest.mark.parametrize("request_timeout_s", [0.3, 30.0])
def test_a_group_never_takes_longer_than_its_deadline(vllm: VLLMStandIn, request_timeout_s: float) -> None:
    """Every request stalls. With short request timeouts the engine retries until the deadline; with a
    request timeout beyond the deadline the request is cut to what is left. Either way: a failed group,
    retriable (the trainer may requeue it), within the deadline."""
    vllm.slow_next, vllm.slow_s = 1000, 5.0
    engine = VLLMHTTPEngine([vllm.url], retry=FAST, timeout_s=request_timeout_s)
    outcome, took = run_group(engine, pipeline(engine, timeout_s=1.0))
    assert took < 1.0 + SLACK_S
    assert outcome.generation is None and outcome.retriable
    assert "took longer than 1 s, the group's deadline" in (outcome.error or "")
    if request_timeout_s < 1.0:
        assert len(vllm.completions()) >= 4  # both samples were retried within the deadline


def test_an_engine_given_a_deadline_keeps_it_without_the_pipeline(vllm: VLLMStandIn) -> None:
    vllm.slow_next, vllm.slow_s = 1000, 5.0
    engine = VLLMHTTPEngine([vllm.url], retry=FAST, timeout_s=0.2)

    async def go() -> float:
        await engine.start()
        started = time.monotonic()
        try:
            with pytest.raises(EngineError, match="took longer than 0.8 s.*; last: .*timed out") as err:
                await engine.generate(PROMPT, 1, SamplingParams(max_new_tokens=4), deadline=Deadline.after(0.8))
            assert err.value.retriable
            return time.monotonic() - started
        finally:
            await engine.close()

    assert asyncio.run(go()) < 0.8 + SLACK_S


# -- (c) a partial rollout continued late in the window completes ----------------------------------------------


def test_a_partial_rollout_continued_late_in_the_window_completes() -> None:
    """The first request runs 1.5 s of a 2 s request timeout, then a weight update aborts it with 30 tokens;
    the continuation (10 tokens) starts late and the group ends after more than one request timeout, inside
    its 6 s deadline. With the old single timeout (request = attempt = 2 s) it was thrown away."""
    with SGLangStandIn(weight_version="1", token_delay_s=0.05, abort_after_tokens=30) as server:
        engine = SGLangHTTPEngine([server.url], tokenizer=CharTokenizer(), retry=FAST, timeout_s=2.0)
        outcome, took = run_group(engine, pipeline(engine, timeout_s=6.0, n=1, max_new_tokens=40))
        bodies = [body for path, body in server.requests if path == "/generate"]
    assert outcome.error is None and outcome.generation is not None
    (completion,) = outcome.generation.completions
    assert len(completion.tokens) == 40 and completion.finish_reason == "length"
    assert [b["sampling_params"]["max_new_tokens"] for b in bodies] == [40, 10]  # continued, not restarted
    assert 2.0 <= took < 6.0  # longer than one request may take, inside the group's deadline


# -- the deadline and the backoff themselves --------------------------------------------------------------------


def test_deadline_and_backoff() -> None:
    unbounded = Deadline.after(None)
    assert unbounded.timeout() is None and unbounded.timeout(3.0) == 3.0 and not unbounded.expired
    deadline = Deadline.after(0.5)
    assert 0.4 < deadline.remaining() <= 0.5 and deadline.timeout(10.0) <= 0.5 and deadline.timeout(0.1) == 0.1
    with pytest.raises(ConfigError):
        Deadline.after(0)
    rng = random.Random(1)
    backoff = Backoff(first_s=0.1, max_s=0.4)
    delays = [backoff.delay_s(k, rng) for k in range(1, 8)]
    assert all(0.05 <= d < 0.4 for d in delays) and max(delays[3:]) >= 0.2  # doubles, capped, jittered

    async def sleeps_within() -> float:
        started = time.monotonic()
        await Backoff(first_s=5.0, max_s=5.0).sleep(1, rng, Deadline.after(0.2))
        return time.monotonic() - started

    assert asyncio.run(sleeps_within()) < 0.2 + SLACK_S


# -- the flags -------------------------------------------------------------------------------------------------


def test_group_timeout_is_the_deadline_and_request_timeout_one_request(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from rollstream.cli import app

    seen: dict[str, Any] = {}

    class Recorder:
        def __init__(self, engine: Any, settings: Any, **kwargs: Any) -> None:
            seen.update(engine=engine, settings=settings)

        def run_sync(self, **kwargs: Any) -> None:
            pass

    monkeypatch.setattr("rollstream.cli._produce.RolloutProducer", Recorder)
    args = ["produce", "--engine", "vllm", "--vllm-url", "h:1", "--bootstrap-servers", "127.0.0.1:1",
            "--request-timeout", "20"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen["engine"]._http.timeout_s == 20 and seen["settings"].generate_timeout_s == 60  # 3 x by default
    assert CliRunner().invoke(app, [*args, "--group-timeout", "45"]).exit_code == 0
    assert seen["engine"]._http.timeout_s == 20 and seen["settings"].generate_timeout_s == 45
