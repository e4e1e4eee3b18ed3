"""The locally built tiny model: loads with the Auto classes, chat template works, the transformers engine
returns n sampled completions with one logprob per token, and the SGLang engine sends its token ids.

The transformers engine is faithful (pinned here): its logprobs are ``log_softmax(logits / T)`` of the
sampled token as a full forward pass over prompt + response recomputes them (T=0.7, top_p=0.9, within
1e-4), not the top-p-renormalised scores; greedy logprobs are at T=1; it stops on every EOS id of the
generation config; `generate_tokens` continues token ids as given.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from rollstream.producers.engines import HFEngine, SamplingParams, SGLangHTTPEngine, build_tiny_model  # noqa: E402

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


def _generate(model_dir: Path, n: int, sampling: SamplingParams, prompt: dict[str, Any] = PROMPT) -> Any:
    async def go() -> Any:
        engine = HFEngine(model_dir)
        await engine.start()
        try:
            return await engine.generate(prompt, n, sampling)
        finally:
            await engine.close()

    return asyncio.run(go())


def _recomputed(model_dir: Path, prompt: Sequence[int], tokens: Sequence[int], temperature: float) -> Any:
    """log_softmax(logits / T) of each response token by one full forward pass over prompt + response."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt, *tokens]])).logits[0, len(prompt) - 1:-1].float()
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1), logits


def test_hf_logprobs_are_log_softmax_over_temperature_of_raw_logits(tiny_model: Path) -> None:
    import torch

    torch.manual_seed(0)
    gen = _generate(tiny_model, 4, SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9))
    renormalised_gap = 0.0
    for c in gen.completions:
        expected, logits = _recomputed(tiny_model, gen.prompt_tokens, c.tokens, 0.7)
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4), (c.logprobs, expected)
        # What the engine shipped before: the log of the top-p-truncated, renormalised distribution.
        probs, order = (logits / 0.7).softmax(-1).sort(-1, descending=True)
        kept = (probs.cumsum(-1) - probs) < 0.9
        mass = (probs * kept).sum(-1)
        renormalised = (expected.exp() / mass).log()
        renormalised_gap = max(renormalised_gap, float((renormalised - expected).abs().max()))
    assert renormalised_gap > 1e-2  # the test tells the two apart


def test_hf_greedy_logprobs_are_at_temperature_one_and_every_eos_id_stops(tiny_model: Path, tmp_path: Path) -> None:
    import torch

    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    first = _generate(tiny_model, 2, greedy).completions[0]
    expected, _ = _recomputed(tiny_model, _generate(tiny_model, 1, greedy).prompt_tokens, first.tokens, 1.0)
    assert torch.allclose(torch.tensor(first.logprobs), expected, atol=1e-4)
    assert first.finish_reason == "length" and len(first.tokens) == 6  # the random model never says <|im_end|>

    # A second EOS id in the generation config (a list, as Llama-3 and Qwen configs have): the greedy
    # response now ends at its first token, which is that id.
    two_eos = Path(shutil.copytree(tiny_model, tmp_path / "two-eos"))
    config_path = two_eos / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [config["eos_token_id"], int(first.tokens[0])]
    config_path.write_text(json.dumps(config))
    stopped = _generate(two_eos, 1, greedy).completions[0]
    assert stopped.tokens == [first.tokens[0]] and stopped.finish_reason == "stop"


def test_generate_tokens_continues_token_ids_as_given(tiny_model: Path) -> None:
    async def go() -> Any:
        engine = HFEngine(tiny_model)
        await engine.start()
        try:
            text, ids = engine.encode_prompt(PROMPT)
            whole = await engine.generate(PROMPT, 1, SamplingParams(max_new_tokens=4, temperature=0.0))
            continued = await engine.generate_tokens(ids, 1, SamplingParams(max_new_tokens=4, temperature=0.0))
            return text, ids, whole, continued, engine.eos_token_ids
        finally:
            await engine.close()

    text, ids, whole, continued, eos = asyncio.run(go())
    assert text == whole.prompt_text and ids == list(whole.prompt_tokens) and eos == (4,)
    assert list(continued[0].tokens) == list(whole.completions[0].tokens)
    assert continued[0].logprobs == pytest.approx(whole.completions[0].logprobs, abs=1e-6)
