"""A multi-turn rollout through the real CLI and broker: ``rollstream produce --generate
rollstream.examples.calculator:CalculatorAgent`` on the demo's model, taken by a `RolloutConsumer`.

Pinned: every group arrives ok with its prompt tokens and sampling parameters; each sample's loss mask
survives the wire; ``to_tensors``' loss mask is 1 exactly on the policy's response tokens (0 on the
prompt, the calculator's tokens and padding), and its tool tokens are the calculator's answers.
Needs schema v4 on the wire (loss_mask, sampling).
"""

from __future__ import annotations

import torch
from rollstream.consumers import RolloutConsumer
from rollstream.infra import KafkaConfig
from rollstream.producers.prompts import publish_prompts
from rollstream.schemas import Prompt, Sampling

from rollstream.demo_task import build_demo_model, make_prompts
from rollstream.examples.calculator import MODEL_ENV
from tests.integration._kafka import run_cli

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
