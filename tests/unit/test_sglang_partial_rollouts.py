"""Partial rollouts and version spans with SGLang, against the stand-in server (tests/standins/sglang_server.py).

Pinned: a weight update in the middle of generation (SGLang's pause with mode abort, update, continue,
as a trainer does it) yields samples whose tokens and logprobs are exactly the old weights' then the new
weights', continued from prompt + partial output with max_new_tokens reduced, both versions in their
spans and the oldest as their policy version; ``restart`` generates them again from scratch; continuing
is bounded; SGLang's own spans (mode retract) and an older SGLang's single ``weight_version`` per
response both become spans; ``"default"`` (nothing loaded) leaves the version to the producer's fallback,
the newest version announced when the generation started.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollstream.infra import KafkaConfig
from rollstream.producers.engines import EngineError, RetryPolicy, SamplingParams, SGLangHTTPEngine
from rollstream.producers.engines._samples import join_segments
from rollstream.producers.engines._sglang_format import parse_completion
from rollstream.producers.engines.base import Completion
from rollstream.producers.metrics import ProducerMetrics
from rollstream.producers.policy import PolicyFollower
from rollstream.schemas import VersionSpan

from tests.standins.sglang_server import CharTokenizer, SGLangStandIn, logprob_at, token_at

PROMPT = {"id": "p1", "prompt": "2+2?", "label": "4", "metadata": {}, "epoch": 0}
PROMPT_IDS = [ord(ch) for ch in "2+2?"]
FAST = RetryPolicy(attempts=3, abort_attempts=2, backoff_s=0.01, max_backoff_s=0.02, max_continuations=4)
MAX_NEW = 24


@pytest.fixture
def server() -> Iterator[SGLangStandIn]:
    with SGLangStandIn(weight_version="1", token_delay_s=0.01) as standin:
        yield standin


def engine_for(server: SGLangStandIn, retry: RetryPolicy = FAST, **kwargs: Any) -> SGLangHTTPEngine:
    return SGLangHTTPEngine([server.url], tokenizer=CharTokenizer(), retry=retry, **kwargs)


async def trainer_updates(url: str, weights: Path, version: str, mode: str = "abort") -> None:
    """What a trainer that owns the servers' weights does: pause, update from disk, continue."""
    async with httpx.AsyncClient(timeout=10) as client:
        for path, body in (("pause_generation", {"mode": mode}),
                           ("update_weights_from_disk", {"model_path": str(weights), "weight_version": version}),
                           ("continue_generation", {})):
            (await client.post(f"{url}/{path}", json=body)).raise_for_status()


def generate_across_update(server: SGLangStandIn, engine: SGLangHTTPEngine, weights: Path, *, n: int = 2,
                           after_tokens: int = 8, mode: str = "abort") -> list[Completion]:
    """Generate `n` samples; once the server made `after_tokens` tokens, update it to version 2."""
    async def go() -> list[Completion]:
        await engine.start()
        try:
            task = asyncio.create_task(engine.generate(PROMPT, n, SamplingParams(max_new_tokens=MAX_NEW)))
            while server.tokens_generated < after_tokens:
                await asyncio.sleep(0.005)
            await trainer_updates(server.url, weights, "2", mode)
            return list((await task).completions)
        finally:
            await engine.close()
    return asyncio.run(go())


def expected(split: int) -> tuple[list[int], list[float]]:
    """Tokens and logprobs of a sample made by version 1 up to `split`, by version 2 from there."""
    versions = ["1" if i < split else "2" for i in range(MAX_NEW)]
    positions = [len(PROMPT_IDS) + i for i in range(MAX_NEW)]
    return ([token_at(p, v) for p, v in zip(positions, versions, strict=True)],
            [logprob_at(p, v) for p, v in zip(positions, versions, strict=True)])


def generate_bodies(server: SGLangStandIn) -> list[dict[str, Any]]:
    return [body for path, body in list(server.requests) if path == "/generate"]


def test_update_mid_generation_continues_on_the_new_weights(server: SGLangStandIn, tmp_path: Path) -> None:
    completions = generate_across_update(server, engine_for(server), tmp_path)
    bodies = generate_bodies(server)
    assert len(bodies) == 4  # two samples, each aborted once and continued once
    for c in completions:
        assert len(c.tokens) == MAX_NEW and c.finish_reason == "length"
        first, second = c.version_spans
        split = first.end
        assert 0 < split < MAX_NEW and first == VersionSpan(1, 0, split) and second == VersionSpan(2, split, MAX_NEW)
        tokens, logprobs = expected(split)
        assert list(c.tokens) == tokens and list(c.logprobs or []) == logprobs
        assert c.policy_version == 2  # the newest, as SGLang's weight_version
        continuation = next(b for b in bodies if b["input_ids"] == PROMPT_IDS + tokens[:split])
        assert continuation["sampling_params"]["max_new_tokens"] == MAX_NEW - split
    follower = PolicyFollower(engine_for(server), KafkaConfig(), "ns.control", metrics=ProducerMetrics(), watch=False)
    assert follower.stamp(completions, version_at_start=7) == [1, 1]  # staleness counts from the oldest


def test_restart_generates_an_aborted_sample_again_from_scratch(server: SGLangStandIn, tmp_path: Path) -> None:
    completions = generate_across_update(server, engine_for(server, partial_rollouts="restart"), tmp_path, n=1)
    (c,) = completions
    assert list(c.tokens) == expected(0)[0] and c.version_spans == (VersionSpan(2, 0, MAX_NEW),)
    first, again = generate_bodies(server)
    assert again == first  # the same request: prompt ids only, the full max_new_tokens


def test_sglang_holding_the_request_reports_both_versions_itself(server: SGLangStandIn, tmp_path: Path) -> None:
    (c,) = generate_across_update(server, engine_for(server), tmp_path, n=1, mode="retract")
    assert len(generate_bodies(server)) == 1  # nothing came back aborted: SGLang continued it
    first, second = c.version_spans
    assert (first.version, second.version, second.end) == (1, 2, MAX_NEW)
    assert list(c.tokens) == expected(first.end)[0]


def test_older_sglang_without_spans_gets_one_span_per_segment(server: SGLangStandIn, tmp_path: Path) -> None:
    server.report_spans = False  # meta_info.weight_version only, as before weight_versions existed
    (c,) = generate_across_update(server, engine_for(server), tmp_path, n=1)
    first, second = c.version_spans
    assert first == VersionSpan(1, 0, first.end) and second == VersionSpan(2, first.end, MAX_NEW)
    assert list(c.tokens) == expected(first.end)[0]


def test_continuations_are_bounded(server: SGLangStandIn) -> None:
    server.abort_after_tokens = 1  # every request is aborted after one token
    engine = engine_for(server, retry=RetryPolicy(backoff_s=0.01, max_continuations=2))

    async def go() -> None:
        await engine.start()
        try:
            await engine.generate(PROMPT, 1, SamplingParams(max_new_tokens=MAX_NEW))
        finally:
            await engine.close()
    with pytest.raises(EngineError, match="more than 2 continuations") as err:
        asyncio.run(go())
    assert err.value.retriable  # the producer may try the prompt again
    bodies = generate_bodies(server)
    assert len(bodies) == 3 and [len(b["input_ids"]) for b in bodies] == [4, 5, 6]
    assert [b["sampling_params"]["max_new_tokens"] for b in bodies] == [MAX_NEW, MAX_NEW - 1, MAX_NEW - 2]


def test_default_version_leaves_the_stamp_to_the_announced_fallback(tmp_path: Path) -> None:
    with SGLangStandIn(weight_version="default", token_delay_s=0.01) as server:
        (plain,) = asyncio.run(_one_sample(engine_for(server)))
        mixed = generate_across_update(server, engine_for(server), tmp_path, n=1, after_tokens=MAX_NEW + 8)
    assert len(generate_bodies(server)) == 3  # the mixed sample was aborted and continued
    for c in (*mixed, plain):  # "default" then "2", and "default" throughout: the tokens' versions are unknown
        assert c.version_spans == () and c.policy_version is None and len(c.tokens) == MAX_NEW
    follower = PolicyFollower(engine_for(server), KafkaConfig(), "ns.control", metrics=ProducerMetrics(), watch=False)
    assert follower.stamp([plain, *mixed], version_at_start=3) == [3, 3]


async def _one_sample(engine: SGLangHTTPEngine) -> list[Completion]:
    await engine.start()
    try:
        return list((await engine.generate(PROMPT, 1, SamplingParams(max_new_tokens=MAX_NEW))).completions)
    finally:
        await engine.close()


def response(tokens: list[int], spans: list[dict[str, Any]] | None, version: str = "5",
             finish: str = "length") -> dict[str, Any]:
    meta: dict[str, Any] = {"finish_reason": {"type": finish}, "weight_version": version,
                            "output_token_logprobs": [[-0.5, t, None] for t in tokens]}
    if spans is not None:
        meta["weight_versions"] = spans
    return {"text": "x" * len(tokens), "output_ids": tokens, "meta_info": meta}


def test_parse_and_join_version_spans() -> None:
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 3}]
    c = parse_completion(response([7, 8, 9], spans))
    assert c.version_spans == (VersionSpan(3, 0, 2), VersionSpan(5, 2, 3)) and c.policy_version == 5
    empty = parse_completion(response([], [{"version": "5", "start": 0, "end": 0}], finish="abort"))
    assert empty.version_spans == () and empty.policy_version == 5
    unknown = parse_completion(response([7, 8], [{"version": "default", "start": 0, "end": 1},
                                                 {"version": "5", "start": 1, "end": 2}]))
    assert unknown.version_spans == () and unknown.policy_version is None
    with pytest.raises(EngineError, match="back to back"):
        parse_completion(response([7, 8], [{"version": "5", "start": 1, "end": 2}]))
    same = join_segments([parse_completion(response([1, 2], None, finish="abort")),
                          parse_completion(response([3], None))])
    assert same.version_spans == (VersionSpan(5, 0, 3),) and list(same.tokens) == [1, 2, 3]
    assert same.logprobs == [-0.5] * 3 and same.finish_reason == "length" and same.text == "xxx"
    joined = join_segments([c, parse_completion(response([4], None, version="default"))])
    assert joined.version_spans == () and joined.policy_version is None and len(joined.tokens) == 4
