"""Multi-turn rollouts (`rollstream.producers.multiturn`) and the calculator example (`rollstream.examples.calculator`).

Pinned here:

1. an `Episode` masks tool tokens (loss mask 0, logprob 0.0), gives them the version of the turn they
   answer, and reports spans when the weights changed between turns; its dict passes the contract;
2. the calculator's episodes on the demo's model are token-exact: every tool segment is the calculator's
   answer to the policy turn before it, and a full forward pass over prompt + response recomputes the
   policy turns' logprobs (no re-tokenisation drift);
3. the Sample the producer pipeline builds from them keeps the prompt, the loss mask and the sampling
   parameters, and ``to_tensors``' loss mask excludes exactly the tool tokens.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollstream.consumers._batch import tensors_of  # noqa: E402
from rollstream.producers import Completion, CustomEngine, SamplingParams  # noqa: E402
from rollstream.producers._groups import Outcome, record_of, sampling_of  # noqa: E402
from rollstream.producers.engines.custom import completion_from_dict  # noqa: E402
from rollstream.producers.intake import TakenPrompt  # noqa: E402
from rollstream.producers.multiturn import Episode, version_spans  # noqa: E402
from rollstream.schemas import Prompt, Sampling, VersionSpan, now_ms  # noqa: E402

from rollstream.demo.task import build_demo_model, make_prompts  # noqa: E402
from rollstream.demo.trainer import GRPOLearner  # noqa: E402
from rollstream.examples.calculator import CalculatorAgent, encode_exactly, final_turn, reward  # noqa: E402

SAMPLING = SamplingParams(max_new_tokens=3, temperature=1.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo-model"), seed=0)


def test_episode_masks_tool_tokens_and_spans_versions() -> None:
    episode = Episode(prompt_tokens=(1, 2))
    episode.add_policy_turn(Completion(text="a", tokens=[5, 6], logprobs=[-0.5, -1.5], policy_version=3))
    episode.add_tool_turn([9, 9, 9])
    assert episode.context() == [1, 2, 5, 6, 9, 9, 9]
    episode.add_policy_turn(Completion(text="b", tokens=[7], logprobs=[-0.25], finish_reason="length",
                                       policy_version=4))
    out = episode.to_dict(lambda ids: "".join(map(str, ids)), prompt_text="q")
    assert out["tokens"] == [5, 6, 9, 9, 9, 7] and out["loss_mask"] == [1, 1, 0, 0, 0, 1]
    assert out["logprobs"] == [-0.5, -1.5, 0.0, 0.0, 0.0, -0.25] and out["finish_reason"] == "length"
    assert out["weight_versions"] == [{"version": 3, "start": 0, "end": 5}, {"version": 4, "start": 5, "end": 6}]
    c = completion_from_dict(out, "episode", 0)
    assert c.version_spans == (VersionSpan(3, 0, 5), VersionSpan(4, 5, 6)) and c.policy_version == 4
    assert version_spans([3, None]) == [] and version_spans([2, 2]) == [{"version": 2, "start": 0, "end": 2}]

    unversioned = Episode(prompt_tokens=(1,))
    unversioned.add_policy_turn(Completion(text="a", tokens=[5], logprobs=None))
    unversioned.add_tool_turn([9])
    assert unversioned.logprobs is None and "weight_version" not in unversioned.to_dict(str)


def _episodes(model_dir: Path, prompts: list[dict[str, Any]], n: int) -> list[list[dict[str, Any]]]:
    async def go() -> list[list[dict[str, Any]]]:
        agent = CalculatorAgent(model_dir)
        await agent.start()
        try:
            return [await agent(p, n, SAMPLING.to_dict()) for p in prompts]
        finally:
            await agent.close()

    torch.manual_seed(0)
    return asyncio.run(go())


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(mask value, start, end) runs of `mask`."""
    runs: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1], i + 1)
        else:
            runs.append((m, i, i + 1))
    return runs


def test_calculator_episodes_are_token_exact(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    learner = GRPOLearner(model_dir)
    dicts = [d for group in _episodes(model_dir, make_prompts(4, seed=5), 4) for d in group]
    tool_tokens = 0
    for d in dicts:
        runs = _segments(d["loss_mask"])
        assert runs[0][0] == 1 and runs[-1][0] == 1 and len(runs) in (1, 3)  # policy [, tool, policy]
        for (m, start, end), before in zip(runs[1:], runs, strict=False):
            if m == 0:  # the calculator's answer to the policy turn before it, as its token ids
                turn = tok.decode(d["tokens"][before[1]:before[2]], skip_special_tokens=True)
                value = sum(int(x) for x in re.findall(r"\d+(?:\s*\+\s*\d+)*", turn)[-1].split("+"))
                assert d["tokens"][start:end] == encode_exactly(tok, f"={value}")
                assert d["logprobs"][start:end] == [0.0] * (end - start)
                tool_tokens += end - start
        ids = torch.tensor([d["prompt_tokens"] + d["tokens"]])
        with torch.no_grad():
            recomputed = learner.token_logprobs(ids, torch.ones_like(ids))[0, len(d["prompt_tokens"]) - 1:]
        policy = torch.tensor(d["loss_mask"]).bool()
        assert torch.allclose(recomputed[policy], torch.tensor(d["logprobs"])[policy], atol=1e-4)
    assert tool_tokens > 0  # the random policy calls the calculator in most episodes (seeded)


def _record(prompt: Prompt, dicts: list[dict[str, Any]]) -> Any:
    """The record the producer pipeline builds from a generate function returning `dicts`."""
    async def replay(p: dict[str, Any], n: int, sp: dict[str, Any]) -> list[dict[str, Any]]:
        return dicts

    generation = asyncio.run(CustomEngine(replay).generate(prompt.to_dict(), len(dicts), SAMPLING))
    rewards = [reward(prompt.to_dict(), d) for d in dicts]
    return record_of(TakenPrompt(0, 0, 1, prompt, None, now_ms()),
                     Outcome(generation=generation, rewards=rewards, versions=[0] * len(dicts)), "full",
                     producer_id="t", prompts_topic="t.prompts", sampling=sampling_of(SAMPLING))


def test_pipeline_sample_keeps_prompt_mask_and_sampling(model_dir: Path) -> None:
    prompt = Prompt(**make_prompts(1, seed=6)[0])
    [dicts] = _episodes(model_dir, [prompt.to_dict()], 4)
    group = _record(prompt, dicts)
    assert group.status == "ok" and group.sampling == Sampling(temperature=1.0, top_p=1.0, top_k=-1)
    assert list(group.prompt_tokens) == dicts[0]["prompt_tokens"] and group.prompt == prompt.prompt
    for sample, d in zip(group.samples, dicts, strict=True):
        np.testing.assert_array_equal(sample.loss_mask, d["loss_mask"])
        np.testing.assert_array_equal(sample.tokens, d["tokens"])


def test_calculator_reward_reads_the_last_policy_turn_only() -> None:
    label = {"id": "p", "prompt": "4+5=", "label": "9"}
    nine, eos, eq, plus, four, five = 12, 2, 23, 22, 7, 8
    called = {"tokens": [four, plus, five, eq, nine, nine, eos], "loss_mask": [1, 1, 1, 0, 0, 1, 1]}
    assert final_turn(called["tokens"], called["loss_mask"]) == [nine, eos] and reward(label, called) == 1.0
    copied_the_tool = {"tokens": [four, plus, five, eq, nine, four], "loss_mask": [1, 1, 1, 0, 0, 1]}
    assert reward(label, copied_the_tool) == 0.0  # the calculator's "9" is not the policy's answer
    assert reward(label, {"tokens": [nine, four], "finish_reason": "length"}) == 0.5  # no mask: all of it


def test_tensors_loss_mask_excludes_exactly_the_tool_tokens(model_dir: Path) -> None:
    """Waits on consumers/_batch.py applying the sample loss mask inside the response mask."""
    prompt = Prompt(**make_prompts(1, seed=6)[0])
    [dicts] = _episodes(model_dir, [prompt.to_dict()], 4)
    group = _record(prompt, dicts)
    tensors = tensors_of([group])
    p = len(group.prompt_tokens)
    for row, d in enumerate(dicts):
        expected = torch.zeros(tensors.loss_mask.shape[1])
        expected[p:p + len(d["tokens"])] = torch.tensor(d["loss_mask"], dtype=torch.float32)
        assert torch.equal(tensors.loss_mask[row], expected), (row, d["loss_mask"])
