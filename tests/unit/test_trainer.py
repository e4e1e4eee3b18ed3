"""`GRPOLearner` at the rollout's temperature and under a loss mask (`rollstream.demo.trainer`). Pinned here:

1. `logprob_temperatures` gives each row its group's recorded temperature (1.0 when none was recorded,
   and for greedy groups);
2. on fresh samples of the transformers engine at T=0.7, top_p=0.9, the trainer's logprobs at that
   temperature are the engine's (gap < 1e-4, ratio 1, nothing clipped); at T=1 they are not;
3. tokens outside ``loss_mask`` (a multi-turn sample's tool tokens) neither count nor move the loss.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollstream.consumers import TensorBatch  # noqa: E402
from rollstream.consumers._batch import tensors_of  # noqa: E402
from rollstream.producers import HFEngine, SamplingParams  # noqa: E402
from rollstream.schemas import Sample, Sampling, ScoredGroup  # noqa: E402

from rollstream.demo.task import build_demo_model, make_prompts  # noqa: E402
from rollstream.demo.trainer import GRPOLearner, LearnerConfig, logprob_temperatures  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo-model"), seed=0)


def _group(i: int, samples: list[Sample], sampling: Sampling | None, prompt: Any = (1, 5, 22, 6, 23)) -> ScoredGroup:
    return ScoredGroup(group_id=f"g{i}", prompt_id=f"p{i}", epoch=0, prompt_tokens=np.array(prompt),
                       samples=tuple(samples), started_at_ms=0, finished_at_ms=0, sampling=sampling)


def test_each_row_gets_its_groups_temperature() -> None:
    two = [Sample(tokens=np.array([3]), reward=0.0), Sample(tokens=np.array([4]), reward=1.0)]
    groups = [_group(0, two, None), _group(1, two[:1], Sampling(temperature=0.0)),
              _group(2, two, Sampling(temperature=0.7, top_p=0.9))]
    assert logprob_temperatures(groups) == [1.0, 1.0, 1.0, 0.7, 0.7]


def _engine_groups(model_dir: Path, sampling: SamplingParams, n_prompts: int = 4) -> list[ScoredGroup]:
    """Groups of 4 fresh samples from the transformers engine, rewarded 1 for the first sample of each."""
    async def go() -> list[Any]:
        engine = HFEngine(model_dir)
        await engine.start()
        try:
            return [await engine.generate(p, 4, sampling) for p in make_prompts(n_prompts, seed=3)]
        finally:
            await engine.close()

    recorded = Sampling(sampling.temperature, sampling.top_p, sampling.top_k)
    return [_group(i, [Sample(tokens=np.array(c.tokens), logprobs=np.array(c.logprobs), reward=float(j == 0))
                       for j, c in enumerate(g.completions)], recorded, g.prompt_tokens)
            for i, g in enumerate(asyncio.run(go()))]


def test_trainer_logprobs_at_the_rollout_temperature_are_the_engines(model_dir: Path) -> None:
    torch.manual_seed(1)
    groups = _engine_groups(model_dir, SamplingParams(max_new_tokens=2, temperature=0.7, top_p=0.9))
    tensors = tensors_of(groups)
    at_rollout = GRPOLearner(model_dir, LearnerConfig()).step(tensors, temperature=logprob_temperatures(groups))
    assert at_rollout["rollout_logprob_gap"] < 1e-4 and at_rollout["clip_fraction"] == 0.0
    assert at_rollout["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    at_one = GRPOLearner(model_dir, LearnerConfig()).step(tensors)  # T=1: the ratio is no longer 1
    assert at_one["rollout_logprob_gap"] > 1e-2


def _masked(tensors: TensorBatch, keep: torch.Tensor) -> TensorBatch:
    return dataclasses.replace(tensors, loss_mask=tensors.loss_mask * keep)


def test_tokens_outside_the_loss_mask_neither_count_nor_move_the_loss(model_dir: Path) -> None:
    torch.manual_seed(2)
    groups = _engine_groups(model_dir, SamplingParams(max_new_tokens=2), n_prompts=2)
    tensors = tensors_of(groups)
    # Mask each row's first response token, as a tool token (its rollout logprob 0.0, as the contract says).
    keep = torch.ones_like(tensors.loss_mask)
    keep[torch.arange(len(keep)), tensors.prompt_lengths] = 0
    masked = _masked(tensors, keep)
    tool_free = dataclasses.replace(masked, rollout_logprobs=tensors.rollout_logprobs * keep)
    # The same batch with junk rollout logprobs on the masked tokens: were they trained, the ratio would move.
    garbage = dataclasses.replace(masked, rollout_logprobs=tensors.rollout_logprobs * keep - 5.0 * (1 - keep))
    first, second = (GRPOLearner(model_dir, LearnerConfig()).step(b) for b in (tool_free, garbage))
    assert first["tokens"] == float(masked.loss_mask.sum()) == float(tensors.loss_mask.sum()) - len(keep)
    assert first["loss"] == pytest.approx(second["loss"], abs=1e-7)
    assert first["grad_norm"] == pytest.approx(second["grad_norm"], rel=1e-6)
    with pytest.raises(ValueError, match="no token to train"):
        GRPOLearner(model_dir, LearnerConfig()).step(_masked(tensors, torch.zeros_like(keep)))
