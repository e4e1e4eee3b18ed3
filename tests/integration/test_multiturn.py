"""Multi-turn rollouts through the real CLI and broker, taken by a `RolloutConsumer`:

- ``rollstream produce --generate rollstream.examples.calculator:CalculatorAgent`` on the demo's model;
- ``rollstream produce --engine vllm|sglang --tokenizer DIR --environment
  rollstream.examples.calculator:CalculatorEnvironment`` against the vLLM and SGLang stand-ins
  (tests/standins), the engine as the policy.

Pinned: every group arrives ok with its prompt tokens and sampling parameters; each sample's loss mask
survives the wire; ``to_tensors``' loss mask is 1 exactly on the policy's response tokens (0 on the
prompt, the calculator's tokens and padding), and its tool tokens are the calculator's answers. With an
engine: the prompt is the tokenizer's (chat template applied), each sample is the policy turns and the
calculator's replies concatenated, every turn continuing prompt + response as token ids, the policy's
logprobs are the server's and the replies' 0.0. `assert_calculator_episode` holds for any server (the lead's
real vLLM fixture may reuse it); the stand-ins' deterministic tokens pin the rest exactly.
Needs schema v4 on the wire (loss_mask, sampling).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from rollstream.consumers import RolloutConsumer
from rollstream.infra import KafkaConfig
from rollstream.producers import Completion
from rollstream.producers.engines._tokenize import PromptEncoder, load_tokenizer
from rollstream.producers.engines.environment import EXAMPLE_ENVIRONMENT
from rollstream.producers.engines.tiny_model import build_tokenizer
from rollstream.producers.multiturn import Episode
from rollstream.producers.prompts import publish_prompts
from rollstream.schemas import Prompt, Sample, Sampling

from rollstream.demo.task import build_demo_model, make_prompts
from rollstream.examples.calculator import MODEL_ENV, CalculatorEnvironment
from tests.integration._kafka import run_cli, write_prompts
from tests.standins import sglang_server, vllm_server

GROUPS, SAMPLES = 6, 4


def test_calculator_rollouts_mask_exactly_the_tool_tokens(kafka_config: KafkaConfig, namespace_factory, group_id,
                                                          bootstrap_servers: str, tmp_path) -> None:
    names = namespace_factory(partitions=2)
    publish_prompts([Prompt(**p) for p in make_prompts(GROUPS, seed=11)], kafka_config, names.prompts)
    model = build_demo_model(tmp_path / "model")
    produced = run_cli(bootstrap_servers, "produce", "--namespace", names.namespace,
                       "--generate", "rollstream.examples.calculator:CalculatorAgent",
                       "--reward", "rollstream.examples.calculator:reward", "--n-samples", str(SAMPLES),
                       "--max-new-tokens", "3", "--concurrency", "2", "--max-lag", "100",
                       "--trainer-group", group_id, "--exit-when-idle", "2", "--summary-interval", "0",
                       timeout_s=180, **{MODEL_ENV: str(model)})
    assert produced.returncode == 0, produced.stdout + produced.stderr

    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace, filters=()) as trainer:
        batch = trainer.take(GROUPS, timeout=30)
        tensors = batch.to_tensors(pad_id=0)
        trainer.commit(batch)
    assert all(g.status == "ok" and len(g.samples) == SAMPLES for g in batch.groups)
    assert all(g.sampling == Sampling(temperature=1.0, top_p=1.0, top_k=-1) for g in batch.groups)
    rows = [(g, s) for g in batch.groups for s in g.samples]
    tool = total = 0
    for b, (group, sample) in enumerate(rows):
        p, r = len(group.prompt_tokens), len(sample.tokens)
        assert p == 5 and sample.loss_mask is not None and len(sample.loss_mask) == r  # <bos> a + b =
        expected = torch.zeros(tensors.loss_mask.shape[1])
        expected[p:p + r] = torch.from_numpy(sample.loss_mask.astype("float32"))
        assert torch.equal(tensors.loss_mask[b], expected)
        assert torch.equal(tensors.input_ids[b, p:p + r], torch.from_numpy(sample.tokens.astype("int64")))
        masked = sample.tokens[sample.loss_mask == 0]
        assert masked.size == 0 or masked[0] == 23  # every tool answer begins with "="
        assert (sample.logprobs[sample.loss_mask == 0] == 0.0).all()
        tool, total = tool + int(masked.size), total + r
    assert 0 < tool < total  # the seeded random policy calls the calculator (about a quarter of the tokens)


def _runs(mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """(mask value, start, end) of each run of equal values in `mask`."""
    runs: list[tuple[int, int, int]] = []
    for i, m in enumerate(int(x) for x in mask):
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1], i + 1)
        else:
            runs.append((m, i, i + 1))
    return runs


def assert_calculator_episode(sample: Sample, tokenizer: Any, text_of: Callable[[list[int]], str],
                              max_turns: int) -> int:
    """What holds for a `CalculatorEnvironment` episode on any policy server: policy runs (mask 1) and tool
    runs (mask 0) alternate, starting and ending with the policy, at most `max_turns` policy runs; each tool
    run is exactly the calculator's reply to the text (`text_of` its tokens, as the server decoded them) of
    the policy run before it, with logprob 0.0. Returns the number of tool tokens."""
    tokens = [int(t) for t in sample.tokens]
    assert sample.loss_mask is not None and sample.logprobs is not None and len(sample.loss_mask) == len(tokens)
    runs = _runs(sample.loss_mask)
    assert [m for m, _, _ in runs] == [1, 0] * (len(runs) // 2) + [1] and len(runs) <= 2 * max_turns - 1
    tool = 0
    for (_, p0, p1), (_, t0, t1) in zip(runs[::2], runs[1::2], strict=False):
        turn = Completion(text=text_of(tokens[p0:p1]), tokens=tokens[p0:p1])
        assert tokens[t0:t1] == CalculatorEnvironment(tokenizer).reply(turn, Episode(prompt_tokens=()))
        assert (np.asarray(sample.logprobs[t0:t1]) == 0.0).all()
        tool += t1 - t0
    return tool


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_an_engine_with_the_calculator_environment_masks_exactly_the_tool_tokens(
        kind: str, kafka_config: KafkaConfig, namespace_factory, group_id, bootstrap_servers: str, tmp_path) -> None:
    prompts, samples, turn_tokens, max_turns = 3, 2, 3, 3
    names = namespace_factory(partitions=2)
    write_prompts(kafka_config, names, [f"p{i}" for i in range(prompts)])
    tokenizer_dir = build_tokenizer(tmp_path / "tokenizer")  # character-level: it writes "=1032"
    standin: Any = vllm_server if kind == "vllm" else sglang_server
    server_cls = standin.VLLMStandIn if kind == "vllm" else standin.SGLangStandIn
    with server_cls() as server:
        produced = run_cli(bootstrap_servers, "produce", "--namespace", names.namespace, "--engine", kind,
                           f"--{kind}-url", server.url, "--tokenizer", str(tokenizer_dir),
                           "--environment", EXAMPLE_ENVIRONMENT, "--max-turns", str(max_turns),
                           "--reward", "tests.plugins:reward",
                           "--n-samples", str(samples), "--max-new-tokens", str(turn_tokens), "--concurrency", "2",
                           "--max-lag", "100", "--trainer-group", group_id, "--exit-when-idle", "1.5",
                           "--summary-interval", "0", timeout_s=120)
        requests = len(server.completions() if kind == "vllm" else [b for p, b in server.requests if p == "/generate"])
    assert produced.returncode == 0, produced.stdout + produced.stderr
    assert requests == prompts * samples * max_turns  # one per policy turn, none retried

    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace, filters=()) as trainer:
        batch = trainer.take(prompts, timeout=30)
        tensors = batch.to_tensors(pad_id=0)
        trainer.commit(batch)
    tokenizer = load_tokenizer(tokenizer_dir)
    version = {} if kind == "vllm" else {"version": "default"}
    rows = 0
    for group in batch.groups:
        assert group.status == "ok" and len(group.samples) == samples, group.error
        assert group.sampling == Sampling(temperature=1.0, top_p=1.0, top_k=-1)
        prompt = {"id": group.prompt_id, "prompt": f"question {group.prompt_id}"}
        assert list(group.prompt_tokens) == PromptEncoder(tokenizer).encode(prompt)[1]  # chat template, encoded once
        for sample in group.samples:
            def pieces(ids: list[int]) -> str:
                return "".join(f"<{t}>" for t in ids)  # how both stand-ins decode their tokens

            assert assert_calculator_episode(sample, tokenizer, pieces, max_turns) > 0
            # the stand-ins' tokens: token_at(p) at absolute position p, so each turn continued prompt + response
            positions = len(group.prompt_tokens) + np.flatnonzero(sample.loss_mask == 1)
            assert list(sample.tokens[sample.loss_mask == 1]) == [standin.token_at(int(p), **version)
                                                                   for p in positions]
            assert sample.logprobs[sample.loss_mask == 1].tolist() == pytest.approx(
                [standin.logprob_at(int(p), **version) for p in positions], abs=1e-6)
            assert int(sample.loss_mask.sum()) == max_turns * turn_tokens  # the calculator answered every turn
            p, r = len(group.prompt_tokens), len(sample.tokens)
            expected = torch.zeros(tensors.loss_mask.shape[1])
            expected[p:p + r] = torch.from_numpy(sample.loss_mask.astype("float32"))
            assert torch.equal(tensors.loss_mask[rows], expected)
            rows += 1
