"""The demo's task and trainer, without a broker. Pinned here:

1. prompts are valid prompt-file lines with uniformly spread answers, and the reward is exact (1.0), half
   credit for the answer followed by more tokens (0.5), else 0.0;
2. `build_demo_model` writes a directory the Auto classes load, with numbers as whole tokens;
3. `GRPOLearner.step` on a fixed batch (built by the consumer's `to_tensors` path) raises the logprob of
   positively-advantaged responses and lowers the others', clipping cuts the gradient of samples whose
   ratio to the rollout already left the trust region, and `save` writes weights that load back identically.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollstream.consumers import TensorBatch  # noqa: E402
from rollstream.consumers._batch import tensors_of  # noqa: E402
from rollstream.schemas import VERSION_FILE, Sample, ScoredGroup  # noqa: E402

from rollstream.demo.task import EOS_ID, build_demo_model, make_prompts, reward, write_prompts  # noqa: E402
from rollstream.demo.trainer import GRPOLearner, LearnerConfig  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo-model"), seed=0)


def test_prompts_are_valid_lines_with_uniform_answers(tmp_path: Path) -> None:
    from rollstream.producers.prompts import read_prompts

    prompts = make_prompts(1900, seed=7)
    assert prompts == make_prompts(1900, seed=7) and prompts != make_prompts(1900, seed=8)
    assert len({p["id"] for p in prompts}) == 1900
    for p in prompts:
        a, b = p["prompt"].rstrip("=").split("+")
        assert p["label"] == str(int(a) + int(b)) and 0 <= int(a) <= 9 and 0 <= int(b) <= 9
        assert p["metadata"] == {"task": "add", "a": a, "b": b}
    counts = Counter(p["label"] for p in prompts)
    assert set(counts) == {str(s) for s in range(19)}
    assert max(counts.values()) < 2 * min(counts.values())  # ~100 each, not the triangle of uniform pairs
    loaded = read_prompts(write_prompts(tmp_path / "p.jsonl", prompts[:5]))
    assert [(q.id, q.prompt, q.label) for q in loaded] == [(p["id"], p["prompt"], p["label"]) for p in prompts[:5]]


@pytest.mark.parametrize(("label", "text", "finish", "expected"), [
    ("9", "9", "stop", 1.0), ("9", " 9 ", "stop", 1.0), ("13", "13", "stop", 1.0), ("9", "9", None, 1.0),
    ("9", "9", "length", 0.5), ("9", "9 7", "length", 0.5), ("9", "9+", "stop", 0.5), ("13", "13 13", "stop", 0.5),
    ("9", "97", "stop", 0.0), ("1", "13", "stop", 0.0), ("13", "1 3", "stop", 0.0), ("9", "", "stop", 0.0),
    ("9", "+9", "stop", 0.0), ("0", "8", "stop", 0.0),
])
def test_reward_is_exact_with_half_credit_for_not_stopping(label: str, text: str, finish: str | None,
                                                          expected: float) -> None:
    completion = {"text": text, "tokens": []} | ({"finish_reason": finish} if finish else {})
    assert reward({"id": "x", "prompt": "?", "label": label}, completion) == expected


def test_reward_without_label_is_an_error() -> None:
    with pytest.raises(ValueError, match="no label"):
        reward({"id": "x", "prompt": "1+1="}, {"text": "2"})


def test_build_demo_model_loads_with_auto_classes(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok("13+5=")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "13", "+", "5", "="]
    assert tok.decode([tok.convert_tokens_to_ids("13"), EOS_ID], skip_special_tokens=True) == "13"
    assert tok.eos_token_id == EOS_ID and model.config.vocab_size == len(tok) == 24
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 200_000
    state = torch.random.get_rng_state()
    again = AutoModelForCausalLM.from_pretrained(build_demo_model(tmp_path / "again", seed=0))
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is left alone
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))
    out = model.generate(torch.tensor([ids] * 4))  # the saved generation config samples <= 2 new tokens
    assert out.shape[0] == 4 and out.shape[1] <= len(ids) + 2


def _fixed_batch(trainer: GRPOLearner, tok: Any, *, logprob_shift: float = 0.0) -> TensorBatch:
    """4 prompts x 4 samples: the right answer (reward 1) and three wrong ones (0), rollout logprobs from
    the trainer's own policy (minus `logprob_shift`), through the consumer's tensors_of."""
    groups = []
    for i, (a, b) in enumerate([(1, 2), (4, 5), (7, 8), (9, 9)]):
        prompt = tok(f"{a}+{b}=")["input_ids"]
        answers = [a + b, (a + b + 1) % 19, (a + b + 5) % 19, (a + b + 11) % 19]
        samples = []
        for j, ans in enumerate(answers):
            tokens = [tok.convert_tokens_to_ids(str(ans)), EOS_ID]
            with torch.no_grad():
                lp = trainer.token_logprobs(torch.tensor([prompt + tokens]), torch.ones(1, len(prompt) + 2))
            samples.append(Sample(tokens=np.array(tokens), text=str(ans), reward=float(j == 0),
                                  logprobs=lp[0, -2:].numpy() - logprob_shift))
        groups.append(ScoredGroup(group_id=f"g{i}", prompt_id=f"p{i}", epoch=0, prompt_tokens=np.array(prompt),
                                  samples=tuple(samples), started_at_ms=0, finished_at_ms=0))
    return tensors_of(groups)


def _response_logprob(trainer: GRPOLearner, batch: TensorBatch) -> Any:
    with torch.no_grad():
        lp = trainer.token_logprobs(batch.input_ids, batch.attention_mask)
    return (lp * batch.loss_mask[:, 1:]).sum(-1)


@pytest.mark.parametrize("clip_eps", [None, 0.2])
def test_grpo_steps_raise_logprob_of_positive_advantages(model_dir: Path, tmp_path: Path,
                                                         clip_eps: float | None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOLearner(model_dir, LearnerConfig(lr=3e-3, clip_eps=clip_eps))
    batch = _fixed_batch(trainer, tok)
    positive = batch.advantages > 0
    assert positive.sum() == 4 and torch.allclose(batch.advantages[positive], torch.tensor(1.5))
    before = _response_logprob(trainer, batch)
    stats = [trainer.step(batch) for _ in range(5)]
    after = _response_logprob(trainer, batch)
    assert bool((after[positive] > before[positive] + 0.05).all()), (before, after)
    assert bool((after[~positive] < before[~positive]).all()), (before, after)
    assert stats[-1]["loss"] < stats[0]["loss"] and trainer.version == 5
    assert stats[0]["rollout_logprob_gap"] < 1e-4 and stats[0]["clip_fraction"] == 0.0  # fresh samples: ratio 1
    assert stats[0]["reward_mean"] == 0.25 and stats[0]["tokens"] == 32 and stats[0]["grad_norm"] > 0

    saved = trainer.save(tmp_path / "v5")
    assert (saved / VERSION_FILE).read_text() == '{"version": 5}' and (saved / "tokenizer.json").exists()
    assert not list(tmp_path.glob(".v5.tmp-*"))
    reloaded = AutoModelForCausalLM.from_pretrained(saved)
    with torch.no_grad():
        logits = reloaded(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        mine = trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert torch.allclose(logits, mine, atol=1e-5)
    assert AutoTokenizer.from_pretrained(saved)("4+5=")["input_ids"] == tok("4+5=")["input_ids"]


def test_clipping_stops_the_push_on_samples_already_past_the_trust_region(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOLearner(model_dir, LearnerConfig(clip_eps=0.2))
    # The rollout policy gave every response token half the probability the trainer gives it now (ratio 2
    # per token): positive advantages are clipped (no gradient); negative ones still push down.
    batch = _fixed_batch(trainer, tok, logprob_shift=float(np.log(2.0)))
    stats = trainer.step(batch)
    assert stats["clip_fraction"] == pytest.approx(0.25)  # the 8 tokens of the 4 right answers, of 32
    assert stats["ratio_mean"] == pytest.approx(2.0, rel=1e-4)
    assert stats["rollout_logprob_gap"] == pytest.approx(np.log(2.0), rel=1e-4)
