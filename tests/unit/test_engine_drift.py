"""The engines against what SGLang 0.5.23 and vLLM 0.33.0 changed (issue 26), on the stand-ins that follow them.

Pinned: the SGLang version read from ``GET /model_info`` (an older server's ``/get_weight_version`` as the
fallback), so the first announcement of the version served reloads nothing; sampling options mapped per
engine (``seed`` -> SGLang's ``sampling_seed``, ``seed + i`` per sample on both engines; SGLang's names ->
vLLM's) and an unknown one refused at startup naming the engine's options, while a server that refuses
one (SGLang's 400) is not retried; vLLM's 503 while paused waited out past the old ~7.5 s of retries, up to
the group's deadline and no further; vLLM's per-token ``weight_versions`` read into version spans;
``generate_tokens`` on both HTTP engines drives a multi-turn episode.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest
from rollstream.producers.engines import (
    EngineError,
    RetryPolicy,
    SamplingParams,
    SGLangHTTPEngine,
    SGLangSyncEngine,
    VLLMHTTPEngine,
    make_engine,
)
from rollstream.producers.engines._retry import Deadline
from rollstream.producers.engines._sampling import sglang_options, vllm_options
from rollstream.producers.multiturn import run_episodes
from rollstream.schemas import ConfigError

from tests.standins.sglang_server import SGLangStandIn
from tests.standins.vllm_server import VLLMStandIn, token_at

PROMPT = {"id": "p1", "prompt": "2+2?", "label": "4", "metadata": {}, "epoch": 0}
FAST = RetryPolicy(attempts=3, abort_attempts=2, backoff_s=0.01, max_backoff_s=0.05)


def run(coro_fn: Any) -> Any:
    return asyncio.run(coro_fn())


# -- SGLang: the serving version from /model_info --------------------------------------------------------


@pytest.mark.parametrize("legacy", [False, True])
def test_sglang_version_from_model_info_or_the_old_route(legacy: bool) -> None:
    with SGLangStandIn(weight_version="4", legacy=legacy) as server:
        engine = SGLangSyncEngine([server.url])

        async def go() -> Any:
            await engine.start()
            await engine.close()
            return engine.serving()
        assert run(go) == {server.url: 4}
        paths = server.paths()
    assert paths == (["/model_info", "/get_weight_version"] if legacy else ["/model_info"])


def test_sglang_unknown_version_when_neither_route_says() -> None:
    with SGLangStandIn() as server:  # "default": nothing loaded with a version
        engine = SGLangSyncEngine([server.url])

        async def go() -> Any:
            await engine.start()
            await engine.close()
            return engine.policy_version
        assert run(go) is None


# -- sampling options per engine -------------------------------------------------------------------------


def test_options_are_mapped_per_engine() -> None:
    sampling = SamplingParams(max_new_tokens=8, extra={"seed": 3, "min_new_tokens": 2, "no_stop_trim": True}).to_dict()
    assert sglang_options(sampling) == {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "sampling_seed": 3,
                                        "min_new_tokens": 2, "no_stop_trim": True}
    assert vllm_options(sampling) == {"max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "seed": 3, "min_tokens": 2,
                                      "include_stop_str_in_output": True}
    assert vllm_options({"sampling_seed": 5, "top_k": -1}) == {"seed": 5}


@pytest.mark.parametrize(("engine", "key", "message"), [
    ("sglang", "stop_str", r"'stop_str' is not one SGLang knows .*did you mean .*'stop'\?"),
    ("sglang", "n", "one request per sample"),
    ("vllm", "stop_regex", "'stop_regex' is not one vLLM knows"),
    ("vllm", "max_tokens", "give rollstream's name 'max_new_tokens'"),
    ("vllm", "logprobs", "set by the vLLM engine itself"),
])
def test_unknown_option_refused_at_startup_naming_the_engines_options(engine: str, key: str, message: str) -> None:
    sampling = SamplingParams(extra={key: 1})
    urls: dict[str, Any] = {"sglang_urls": ["x:1"]} if engine == "sglang" else {"vllm_urls": ["x:1"]}
    with pytest.raises(ConfigError, match=message):
        make_engine(engine, sampling=sampling, **urls)  # type: ignore[arg-type]
    if engine == "sglang":
        with pytest.raises(ConfigError, match=message):
            make_engine("sglang", model="/no/model", sampling=sampling)  # in-process: checked before it loads
        with pytest.raises(ConfigError, match=message):
            make_engine("sglang", sglang_urls=["x:1"], sglang_sync_weights=True, sampling=sampling)


def test_sglang_samples_get_sampling_seed_plus_index() -> None:
    with SGLangStandIn() as server:
        engine = SGLangHTTPEngine([server.url], retry=FAST)

        async def go() -> Any:
            await engine.start()
            try:
                return await engine.generate(PROMPT, 3, SamplingParams(max_new_tokens=2, extra={"seed": 7}))
            finally:
                await engine.close()
        run(go)
        seeds = sorted(body["sampling_params"]["sampling_seed"] for path, body in server.requests
                       if path == "/generate")
    assert seeds == [7, 8, 9]


def test_a_key_sglang_refuses_fails_at_once_not_retried() -> None:
    with SGLangStandIn() as server:
        async def go() -> Any:
            async with httpx.AsyncClient() as client:
                return await client.post(f"{server.url}/generate", json={
                    "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "seed": 1}})
        resp = run(go)
    assert resp.status_code == 400 and "unknown field `seed`" in resp.json()["error"]


# -- vLLM: a pause is waited out within the deadline ------------------------------------------------------


def _post(url: str) -> None:
    httpx.post(url, timeout=10).raise_for_status()


def test_vllm_paused_503_is_waited_out_past_the_old_retry_budget() -> None:
    with VLLMStandIn() as server:
        _post(server.url + "/pause?mode=wait")
        engine = VLLMHTTPEngine([server.url], retry=RetryPolicy(attempts=2, backoff_s=0.01, max_backoff_s=0.05))
        result: list[Any] = []

        async def go() -> None:
            await engine.start()
            try:
                result.append(await engine.generate(PROMPT, 1, SamplingParams(max_new_tokens=3),
                                                    deadline=Deadline.after(30)))
            finally:
                await engine.close()
        thread = threading.Thread(target=lambda: run(go))
        thread.start()
        server.wait_until(lambda: len(server.completions()) >= 5, "refused while paused, more than attempts")
        _post(server.url + "/resume")
        thread.join(10)
    assert [len(c.tokens) for c in result[0].completions] == [3]


def test_vllm_pause_longer_than_the_deadline_is_a_retriable_error() -> None:
    with VLLMStandIn() as server:
        _post(server.url + "/pause?mode=abort")
        engine = VLLMHTTPEngine([server.url], retry=FAST)

        async def go() -> Any:
            await engine.start()
            try:
                await engine.generate(PROMPT, 1, SamplingParams(max_new_tokens=3), deadline=Deadline.after(0.5))
            finally:
                await engine.close()
        started = time.monotonic()
        with pytest.raises(EngineError, match="deadline") as err:
            run(go)
    assert err.value.retriable and "paused" in str(err.value) and time.monotonic() - started < 5


def test_vllm_other_503s_still_count_against_attempts() -> None:
    with VLLMStandIn() as server:
        server.fail_next = 10
        engine = VLLMHTTPEngine([server.url], retry=FAST)

        async def go() -> Any:
            await engine.start()
            try:
                await engine.generate(PROMPT, 1, SamplingParams(max_new_tokens=3))
            finally:
                await engine.close()
        with pytest.raises(EngineError, match="failed 3 times"):
            run(go)


# -- vLLM: per-token weight versions ---------------------------------------------------------------------


def test_vllm_weight_versions_become_version_spans() -> None:
    with VLLMStandIn() as server:
        engine = VLLMHTTPEngine([server.url], retry=FAST)

        async def go() -> Any:
            await engine.start()
            try:
                unlabelled = await engine.generate(PROMPT, 1, SamplingParams(max_new_tokens=3))
                _post_json(server.url + "/update_weight_version", {"new_version": "5"})
                labelled = await engine.generate(PROMPT, 1, SamplingParams(max_new_tokens=3))
                return unlabelled, labelled
            finally:
                await engine.close()
        unlabelled, labelled = run(go)
    assert unlabelled.completions[0].policy_version is None and not unlabelled.completions[0].version_spans
    completion = labelled.completions[0]
    assert completion.policy_version == 5 and [(s.version, s.start, s.end) for s in completion.version_spans] == [
        (5, 0, 3)]


def _post_json(url: str, body: dict[str, Any]) -> None:
    threading.Thread(target=lambda: httpx.post(url, json=body, timeout=10).raise_for_status()).start()
    time.sleep(0.2)


# -- multi-turn on every HTTP engine ---------------------------------------------------------------------


class _Tool:
    def reply(self, turn: Any, episode: Any) -> list[int] | None:
        return [7, 7] if episode.policy_turns < 2 else None


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_generate_tokens_drives_a_multi_turn_episode(kind: str) -> None:
    standin = SGLangStandIn() if kind == "sglang" else VLLMStandIn()
    with standin as server:
        engine: Any = (SGLangHTTPEngine if kind == "sglang" else VLLMHTTPEngine)([server.url], retry=FAST)

        async def go() -> Any:
            await engine.start()
            try:
                return await run_episodes(engine.generate_tokens, _Tool, [1, 2, 3], 2,
                                          SamplingParams(max_new_tokens=2), decode=str, max_turns=3)
            finally:
                await engine.close()
        episodes = run(go)
    assert len(episodes) == 2
    for episode in episodes:
        assert episode["loss_mask"] == [1, 1, 0, 0, 1, 1] and episode["tokens"][2:4] == [7, 7]
        if kind == "vllm":  # the second turn continued prompt + response exactly: positions 3..8
            assert episode["tokens"][4:] == [token_at(7), token_at(8)]


def test_sglang_announcement_of_the_served_version_reloads_nothing(tmp_path: Any) -> None:
    from rollstream.infra import KafkaConfig
    from rollstream.producers import PolicyFollower
    from rollstream.producers.metrics import ProducerMetrics
    from rollstream.schemas import PolicyVersion

    with SGLangStandIn(weight_version="4") as server:
        engine = SGLangSyncEngine([server.url])

        async def go() -> None:
            await engine.start()
            follower = PolicyFollower(engine, KafkaConfig(), "t.control", metrics=ProducerMetrics(), watch=False)
            await follower.start(catch_up_timeout=0)
            try:
                follower.on_announced(PolicyVersion(4, weights_path=str(tmp_path)))
                await asyncio.sleep(0.2)
            finally:
                await follower.close()
                await engine.close()
        run(go)
        paths = server.paths()
    assert paths == ["/model_info"]  # no pause, no update: version 4 serves already
