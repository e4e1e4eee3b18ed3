"""The locally built tiny model: loads with the Auto classes, chat template works, the transformers engine
returns n sampled completions with one logprob per token, and the SGLang engine sends its token ids."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from producers.engines import HFEngine, SamplingParams, SGLangHTTPEngine, build_tiny_model  # noqa: E402
from tests.unit.test_producer_sglang import FakeSGLang  # noqa: E402

PROMPT = {"id": "p1", "prompt": "What is 2+2?", "label": "4", "metadata": {}, "epoch": 0}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_tiny_model_loads_with_auto_classes(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = tok.apply_chat_template([{"role": "user", "content": "a b\nc"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\na b\nc<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and tok.convert_ids_to_tokens(ids[0]) == "<|im_start|>"
    assert AutoModelForCausalLM.from_pretrained(tiny_model).config.vocab_size == len(tok)


def test_hf_engine_generates_groups_with_logprobs(tiny_model: Path) -> None:
    async def go() -> Any:
        engine = HFEngine(tiny_model, policy_version=3)
        await engine.start()
        try:
            return await engine.generate(PROMPT, 3, SamplingParams(max_new_tokens=12))
        finally:
            await engine.close()

    gen = asyncio.run(go())
    assert gen.prompt_text.startswith("<|im_start|>user\nWhat is 2+2?") and len(gen.prompt_tokens) > 10
    assert len(gen.completions) == 3
    for c in gen.completions:
        assert 1 <= len(c.tokens) <= 12 and c.logprobs is not None and len(c.logprobs) == len(c.tokens)
        assert all(lp <= 0.0 for lp in c.logprobs) and c.policy_version == 3
        assert c.finish_reason == ("stop" if len(c.tokens) < 12 or c.tokens[-1] == 4 else "length")


def test_sglang_http_sends_chat_templated_token_ids(tiny_model: Path) -> None:
    server = FakeSGLang()

    async def go() -> Any:
        engine = SGLangHTTPEngine([server.url], tokenizer=tiny_model)
        await engine.start()
        try:
            return await engine.generate(PROMPT, 1, SamplingParams(max_new_tokens=4))
        finally:
            await engine.close()

    try:
        gen = asyncio.run(go())
    finally:
        server.close()
    request = server.requests[0]
    assert "text" not in request and request["input_ids"] == list(gen.prompt_tokens)
    assert gen.prompt_text.endswith("<|im_start|>assistant\n")
