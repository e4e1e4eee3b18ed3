"""The vLLM engine (`VLLMHTTPEngine`) against the vLLM stand-in (tests/standins/vllm_server.py).

What the engine and the stand-in follow, read in vllm-project/vllm on 2026-12-01:
``vllm/entrypoints/openai/completion/protocol.py`` at 002032ee2b18e1f7bd924ec47b62504ba3866063
(``CompletionRequest``, ``CompletionLogProbs``, ``CompletionResponseChoice``),
``vllm/entrypoints/openai/completion/serving.py`` at 030ea52effcb05071543c8c42b8f0145e94cee43
(``request_output_to_completion_response``, ``_create_completion_logprobs``: ``"token_id:{id}"`` tokens,
``token_ids`` / ``prompt_token_ids`` with ``return_token_ids``, vLLM >= 0.10.2, PR #22587),
``vllm/v1/engine/__init__.py`` (``FINISH_REASON_STRINGS``), ``vllm/v1/engine/parallel_sampling.py`` (child
``i`` of ``n`` seeded ``seed + i``), ``vllm/config/model.py`` (``logprobs_mode``: raw before any processor,
processed after temperature and top-k/top-p) and ``vllm/entrypoints/serve/dev/rlhf/api_router.py`` at
0100a2129224e729af1b3b8ed42a900cdfe9a452 (``/pause?mode=abort``, ``/resume``).

Pinned: the request fields (token ids as ``prompt``, ``n`` 1, ``max_tokens``, ``logprobs`` 0,
``return_token_ids``, ``return_tokens_as_token_ids``, the served model from ``/v1/models``); token ids
and logprobs round-trip into `Completion` (from ``token_ids``, and from ``"token_id:N"`` on a vLLM without
``return_token_ids``); ``n`` samples with seeds ``seed + i``; finish reasons stop and length; retries on
503, a dropped connection and a timeout, bounded; 4xx fails at once; a sample aborted with partial output
(also by ``/pause?mode=abort``) is continued from prompt + its tokens (a text prompt from the ids vLLM
returned; ``max_tokens`` reduced), or issued again with ``restart`` or on a vLLM that returns no prompt ids,
bounded, never returned; an answer aborted before its first token (vLLM 0.32 holding a request when a
pause came) is sent again, waited out within the group's deadline, never counted as an abort; round
robin; sampling whose logprobs vLLM cannot give as rollstream records them is refused; the factory's and
CLI's wiring.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from rollstream.producers.engines import (
    Completion,
    Deadline,
    EngineError,
    RetryPolicy,
    SamplingParams,
    VLLMHTTPEngine,
    make_engine,
)
from rollstream.producers.engines._vllm_format import check_logprobs_contract, finish_reason, parse_response
from rollstream.schemas import ConfigError
from typer.testing import CliRunner

from rollstream.cli import app
from tests.conftest import free_port
from tests.standins.sglang_server import CharTokenizer
from tests.standins.vllm_server import VLLMStandIn, logprob_at, piece, token_at

PROMPT = {"id": "p1", "prompt": "2+2?", "label": "4", "metadata": {}, "epoch": 0}
IDS = [ord(ch) for ch in "2+2?"]
FAST = RetryPolicy(attempts=3, abort_attempts=2, backoff_s=0.01, max_backoff_s=0.02)


@pytest.fixture
def vllm() -> Iterator[VLLMStandIn]:
    with VLLMStandIn() as server:
        yield server


def run_engine(engine: VLLMHTTPEngine, n: int = 1, prompt: dict[str, Any] = PROMPT, **sampling: Any) -> Any:
    params = SamplingParams(max_new_tokens=sampling.pop("max_new_tokens", 4), **sampling)

    async def go() -> Any:
        await engine.start()
        try:
            return await engine.generate(prompt, n, params)
        finally:
            await engine.close()
    return asyncio.run(go())


def expected_tokens(prompt_len: int, n_tokens: int) -> list[int]:
    return [token_at(prompt_len + i) for i in range(n_tokens)]


def test_request_fields_and_token_round_trip(vllm: VLLMStandIn) -> None:
    gen = run_engine(VLLMHTTPEngine([vllm.url + "/v1"], tokenizer=CharTokenizer(), retry=FAST), n=2,
                     temperature=0.7)
    assert len(gen.completions) == 2 and len(vllm.completions()) == 2
    assert vllm.requests[0] == ("/v1/models", {})  # the served model's name, read once at start
    body = vllm.completions()[0]
    assert body == {"prompt": IDS, "n": 1, "logprobs": 0, "return_token_ids": True,
                    "return_tokens_as_token_ids": True, "include_stop_str_in_output": True,
                    "return_weight_versions": True,
                    "model": "/models/base", "max_tokens": 4, "temperature": 0.7, "top_p": 1.0}
    c = gen.completions[0]
    assert list(c.tokens) == expected_tokens(4, 4) and c.finish_reason == "length"
    assert list(c.logprobs) == [logprob_at(4 + i) for i in range(4)]
    assert c.text == "".join(piece(t) for t in c.tokens) and c.policy_version is None  # NS.control stamps it
    assert list(gen.prompt_tokens) == IDS and gen.prompt_text == "2+2?"


def test_text_prompt_and_an_older_vllm_without_token_ids() -> None:
    with VLLMStandIn(old_vllm=True, stop_after=3) as old:
        gen = run_engine(VLLMHTTPEngine([old.url], model="/models/base", retry=FAST))
        body = old.completions()[0]
    assert body["prompt"] == "2+2?" and "/v1/models" not in [p for p, _ in old.requests]
    c = gen.completions[0]
    assert list(c.tokens) == expected_tokens(4, 3) and c.finish_reason == "stop"  # from "token_id:N"
    assert list(c.logprobs) == [logprob_at(4 + i) for i in range(3)]
    assert list(gen.prompt_tokens) == []  # an old vLLM does not say how it tokenized the text


def test_text_prompt_gets_the_servers_prompt_ids(vllm: VLLMStandIn) -> None:
    gen = run_engine(VLLMHTTPEngine([vllm.url], retry=FAST))
    assert list(gen.prompt_tokens) == IDS and vllm.completions()[0]["prompt"] == "2+2?"


def test_n_samples_get_seed_plus_index(vllm: VLLMStandIn) -> None:
    gen = run_engine(VLLMHTTPEngine([vllm.url], retry=FAST), n=3, extra={"seed": 7, "top_k": -1})
    assert len(gen.completions) == 3
    assert sorted(b["seed"] for b in vllm.completions()) == [7, 8, 9]
    assert all("top_k" not in b for b in vllm.completions())  # -1 (off) is not sent


def test_retries_503_dropped_connection_and_timeout(vllm: VLLMStandIn) -> None:
    vllm.fail_next, vllm.drop_next, vllm.slow_next, vllm.slow_s = 1, 1, 1, 1.0
    engine = VLLMHTTPEngine([vllm.url], retry=RetryPolicy(attempts=4, backoff_s=0.01, max_backoff_s=0.02),
                            timeout_s=0.3)
    gen = run_engine(engine)
    assert list(gen.completions[0].tokens) == expected_tokens(4, 4)
    assert len(vllm.completions()) == 4  # drop, 503, too slow, ok


def test_gives_up_after_bounded_retries(vllm: VLLMStandIn) -> None:
    vllm.fail_next = 100
    with pytest.raises(EngineError, match="failed 3 times.*HTTP 503") as err:
        run_engine(VLLMHTTPEngine([vllm.url], retry=FAST))
    assert not err.value.retriable and len(vllm.completions()) == 3


def test_an_unreachable_server_is_waited_for_within_the_deadline_not_given_up_after_the_retries() -> None:
    """A server no connection reaches (down, or restarting: a minute for vLLM) ran nothing: the sample waits for
    it as long as the group's deadline lasts, never failing for good after `attempts` tries."""
    engine = VLLMHTTPEngine([f"http://127.0.0.1:{free_port()}"], model="m", retry=FAST)

    async def go() -> None:
        await engine.start()
        try:
            await engine.generate(PROMPT, 1, SamplingParams(max_new_tokens=4), deadline=Deadline.after(0.6))
        finally:
            await engine.close()
    started = time.monotonic()
    with pytest.raises(EngineError, match="unreachable") as err:
        asyncio.run(go())
    assert err.value.retriable and time.monotonic() - started >= 0.5  # the deadline ended it, not the 3 tries


def test_client_error_fails_at_once(vllm: VLLMStandIn) -> None:
    with pytest.raises(EngineError, match="HTTP 404.*does not exist"):
        run_engine(VLLMHTTPEngine([vllm.url], model="other", retry=FAST))
    assert len(vllm.completions()) == 1


def test_aborted_sample_is_continued_or_issued_again_never_returned(vllm: VLLMStandIn) -> None:
    vllm.abort_next, vllm.abort_after_tokens = 2, 1
    gen = run_engine(VLLMHTTPEngine([vllm.url], retry=FAST))
    assert [c.finish_reason for c in gen.completions] == ["length"]
    assert list(gen.completions[0].tokens) == expected_tokens(4, 4)  # one sample, whatever the aborts
    bodies = vllm.completions()  # a text prompt, continued from the ids vLLM said it ran
    assert [(b["prompt"], b["max_tokens"]) for b in bodies] == [
        ("2+2?", 4), ([*IDS, token_at(4)], 3), ([*IDS, token_at(4), token_at(5)], 2)]
    assert list(gen.prompt_tokens) == IDS  # the prompt's ids, not a continuation's
    vllm.abort_next = 2
    gen = run_engine(VLLMHTTPEngine([vllm.url], retry=FAST, partial_rollouts="restart"))
    assert list(gen.completions[0].tokens) == expected_tokens(4, 4)
    assert [b["prompt"] for b in vllm.completions()[3:]] == ["2+2?"] * 3  # from scratch
    vllm.abort_next = 100
    with pytest.raises(EngineError, match="aborted 3 times") as err:
        run_engine(VLLMHTTPEngine([vllm.url], retry=FAST, partial_rollouts="restart"))
    assert not err.value.retriable
    with pytest.raises(EngineError, match="more than 4 continuations") as err:
        run_engine(VLLMHTTPEngine([vllm.url], retry=FAST), max_new_tokens=8)
    assert err.value.retriable


def test_an_older_vllm_without_prompt_ids_restarts_a_text_prompt() -> None:
    with VLLMStandIn(old_vllm=True, abort_after_tokens=2) as old:
        old.abort_next = 1
        gen = run_engine(VLLMHTTPEngine([old.url], model="/models/base", retry=FAST))
        assert [b["prompt"] for b in old.completions()] == ["2+2?", "2+2?"]  # its ids are not known here
    assert list(gen.completions[0].tokens) == expected_tokens(4, 4)


def test_pause_abort_in_flight_is_continued_after_resume() -> None:
    with VLLMStandIn(token_delay_s=0.01) as server:
        result: list[Any] = []
        thread = threading.Thread(target=lambda: result.append(
            run_engine(VLLMHTTPEngine([server.url], tokenizer=CharTokenizer(), retry=FAST), max_new_tokens=30)))
        thread.start()
        server.wait_until(lambda: server.in_flight() == 1, "a request in flight")
        paused = threading.Thread(target=lambda: asyncio.run(_post(server.url + "/pause?mode=abort")))
        paused.start()
        server.wait_until(lambda: len(server.completions()) >= 3, "the continuation refused while paused")
        asyncio.run(_post(server.url + "/resume"))
        thread.join(10)
        paused.join(10)
    (c,) = result[0].completions
    assert c.finish_reason == "length" and list(c.tokens) == expected_tokens(4, 30)
    first, *again = server.completions()
    split = len(again[-1]["prompt"]) - 4
    assert 0 < split < 30 and again[-1]["max_tokens"] == 30 - split and again[-1]["prompt"][:4] == IDS
    assert ("/pause", {"mode": "abort"}) in server.requests


def test_aborts_before_the_first_token_are_waited_out_within_the_deadline() -> None:
    with VLLMStandIn(version="0.32", abort_after_tokens=0) as server:
        server.abort_next = 30  # what a pause answers the requests it held before they ran: no tokens
        engine = VLLMHTTPEngine([server.url], retry=FAST)  # abort_attempts=2

        async def go(deadline_s: float) -> list[Completion]:
            await engine.start()
            try:
                generation = await engine.generate(PROMPT, 1, SamplingParams(max_new_tokens=3),
                                                   deadline=Deadline.after(deadline_s))
                return list(generation.completions)
            finally:
                await engine.close()

        (c,) = asyncio.run(go(30))
        assert c.finish_reason == "length" and len(c.tokens) == 3
        assert [b["prompt"] for b in server.completions()] == ["2+2?"] * 31  # the same request: nothing ran
        server.abort_next = 10**6
        with pytest.raises(EngineError, match="deadline.*abort before the first token") as err:
            asyncio.run(go(0.5))
    assert err.value.retriable


async def _post(url: str) -> None:
    import httpx

    async with httpx.AsyncClient() as client:
        (await client.post(url)).raise_for_status()


def test_round_robin_and_dead_server_failover(vllm: VLLMStandIn) -> None:
    with VLLMStandIn() as other:
        engine = VLLMHTTPEngine([vllm.url, f"{other.url},http://127.0.0.1:1"], model="/models/base", retry=FAST)
        gen = run_engine(engine, n=6)
        assert len(gen.completions) == 6
        assert len(vllm.completions()) >= 2 and len(other.completions()) >= 2


@pytest.mark.parametrize(("mode", "sampling", "refused"), [
    ("processed_logprobs", {"temperature": 0.7, "top_p": 1.0}, None),
    ("processed_logprobs", {"temperature": 1.0, "top_p": 0.9}, "top_p=0.9 truncated"),
    ("processed_logprobs", {"temperature": 0.7, "top_k": 20}, "top_k=20 truncated"),
    ("raw_logprobs", {"temperature": 1.0, "top_p": 0.9, "top_k": 5}, None),
    ("raw_logprobs", {"temperature": 0.7}, "ignore the temperature"),
    ("raw_logprobs", {"temperature": 0.0, "top_p": 0.5}, None),  # greedy: log_softmax(logits) in both modes
    ("processed_logprobs", {"temperature": 5e-6}, "greedily below 1e-5"),
])
def test_logprobs_contract(mode: Any, sampling: dict[str, Any], refused: str | None) -> None:
    if refused is None:
        check_logprobs_contract(mode, sampling)
        return
    with pytest.raises(EngineError, match=refused) as err:
        check_logprobs_contract(mode, sampling)
    assert not err.value.retriable


def test_refused_sampling_sends_nothing(vllm: VLLMStandIn) -> None:
    with pytest.raises(EngineError, match="--logprobs-mode raw_logprobs"):
        run_engine(VLLMHTTPEngine([vllm.url], retry=FAST), top_p=0.9)
    assert vllm.completions() == []


def test_parse_finish_reasons_and_foreign_shapes() -> None:
    assert [finish_reason(r) for r in ("stop", "length", "abort", "repetition")] == ["stop", "length", "abort",
                                                                                      "stop"]
    with pytest.raises(EngineError, match="not stop, length"):
        finish_reason("weird")
    with pytest.raises(EngineError, match="one choice"):
        parse_response({"text": "x"})
    with pytest.raises(EngineError, match="disagree"):
        parse_response({"choices": [{"text": "", "finish_reason": "stop", "token_ids": [1, 2],
                                     "logprobs": {"tokens": ["token_id:1", "token_id:3"],
                                                  "token_logprobs": [-1.0, -2.0]}}]})
    with pytest.raises(EngineError, match="neither token_ids nor logprobs"):
        parse_response({"choices": [{"text": "x", "finish_reason": "stop"}]})


def test_factory_wiring() -> None:
    engine = make_engine("vllm", vllm_urls=["gpu1:8000,gpu2:8000/v1/completions"], vllm_model="m")
    assert isinstance(engine, VLLMHTTPEngine) and engine.urls == ["http://gpu1:8000", "http://gpu2:8000"]
    assert engine.model == "m"
    with pytest.raises(ConfigError, match="needs --vllm-url"):
        make_engine("vllm")
    with pytest.raises(ConfigError, match="--vllm-url is for --engine vllm"):
        make_engine("sglang", sglang_urls=["x:1"], vllm_urls=["y:2"])
    with pytest.raises(ConfigError, match="--sglang-url is for --engine sglang"):
        make_engine("vllm", sglang_urls=["x:1"], vllm_urls=["y:2"])


def test_cli_knows_the_vllm_options() -> None:
    result = CliRunner().invoke(app, ["produce", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in ("--vllm-url", "--vllm-model", "--vllm-logprobs-mode", "vllm"):
        assert option in result.output


def test_refused_sampling_fails_at_startup_not_per_group() -> None:
    with pytest.raises(ConfigError, match="top_p=0.9 truncated"):
        make_engine("vllm", vllm_urls=["x:1"], sampling=SamplingParams(top_p=0.9))
    make_engine("vllm", vllm_urls=["x:1"], vllm_logprobs_mode="raw_logprobs", sampling=SamplingParams(top_p=0.9))
    result = CliRunner().invoke(app, ["produce", "--engine", "vllm", "--vllm-url", "127.0.0.1:1", "--temperature",
                                      "0.7", "--vllm-logprobs-mode", "raw_logprobs", "--bootstrap-servers",
                                      "127.0.0.1:1"])
    assert result.exit_code != 0 and isinstance(result.exception, ConfigError)
    assert "ignore the temperature" in str(result.exception)  # before any broker or server is contacted
