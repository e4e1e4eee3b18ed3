"""The demo's bundled task: single-digit addition with a checkable answer, and the model that learns it.

Three pieces, each usable alone:

- `make_prompts(n, seed)`: prompts ``"a+b="`` (a, b in 0..9) as JSONL-able dicts with ``id``, ``prompt``,
  ``label`` (the sum as a string) and ``metadata``. The sum is drawn uniformly from 0..18 and then a pair
  with that sum, so every answer is equally likely: a policy that always writes the same number scores
  1/19, not the 10% that "9" would get under uniform pairs. Without this, RL from random init tends to
  collapse onto the most frequent answer before it learns to read the digits.
- `reward(prompt, completion)`: ``1.0`` when the completion is exactly the answer (the answer, then end
  of sequence); ``0.5`` when it starts with the answer but goes on (or hits the token limit); ``0.0``
  otherwise. The half credit teaches the model to stop without hiding anything: a printed mean reward
  of 0.9 means at least 80% of the samples were exactly right.
- `build_demo_model(dir, seed)`: a randomly initialised Llama-style model (2 layers, hidden 64, ~133k
  parameters) and a word-level tokenizer written with the `tokenizers` library, saved so that
  ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained(dir)`` load it. Nothing is downloaded, and
  there is no supervised warm-up: the policy starts at chance (mean reward ~0.05).

The tokenizer has one token per number 0..18 (as Llama-3 and GPT-4 tokenizers have one per number up
to 999), plus ``+``, ``=``, ``<pad>``, ``<bos>``, ``<eos>``: 24 tokens. A prompt is 5 tokens
(``<bos> a + b =``), and a correct response is 2 (``sum <eos>``), so one sample is a random guess among
~24 tokens at first, and learning is visible within a few hundred GRPO steps on one CPU core.
`DEMO_RECIPE` holds the sampling and training settings measured to make the reward rise.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_OPERAND = 9
NUMBER_TOKENS = tuple(str(i) for i in range(2 * MAX_OPERAND + 1))
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
VOCAB = SPECIAL_TOKENS + NUMBER_TOKENS + ("+", "=")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_FIRST_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class DemoRecipe:
    """Settings measured to make the demo's mean reward rise within a few minutes on 2 CPU cores.

    `groups_per_step` groups of `samples_per_prompt` samples are taken per step; `lr` is Adam's;
    `clip_eps` clips the ratio of the trainer's policy to the rollout's (stale samples); the model is
    `hidden_size` wide and `layers` deep, with `heads` attention heads, its output layer the input embedding
    (`tie_embeddings`) or a matrix of its own.
    """

    groups_per_step: int = 32
    samples_per_prompt: int = 16
    max_new_tokens: int = 2
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 2e-3
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    hidden_size: int = 64
    layers: int = 2
    heads: int = 4
    tie_embeddings: bool = True


DEMO_RECIPE = DemoRecipe()


def make_prompts(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` addition prompts with uniformly distributed answers; the same `seed` gives the same list.

    Each dict is one line of a prompt file (``rollstream prompts load``): ``id`` (``add-000000``, unique
    in the list), ``prompt`` (``"4+5="``), ``label`` (``"9"``), ``metadata`` (``task``, ``a``, ``b``,
    all strings). Pure; raises ValueError when `n` < 1.
    """
    if n < 1:
        raise ValueError(f"make_prompts needs n >= 1, got {n}")
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        total = rng.randint(0, 2 * MAX_OPERAND)
        a = rng.randint(max(0, total - MAX_OPERAND), min(MAX_OPERAND, total))
        b = total - a
        prompts.append({"id": f"add-{i:06d}", "prompt": f"{a}+{b}=", "label": str(total),
                        "metadata": {"task": "add", "a": str(a), "b": str(b)}})
    return prompts


def write_prompts(path: str | Path, prompts: Iterable[Mapping[str, Any]]) -> Path:
    """Write prompts as JSON lines (the format ``rollstream prompts load`` reads). Blocks on file I/O."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(dict(p), sort_keys=True) + "\n")
    return path


def reward(prompt: Mapping[str, Any], completion: Mapping[str, Any]) -> float:
    """1.0 for exactly the answer then end of sequence, 0.5 for the answer followed by anything else, else 0.0.

    `prompt` needs ``label`` (the sum as a string); `completion` needs ``text`` (decoded without
    special tokens, so ``"9"`` for the tokens ``9 <eos>`` and ``"9 7"`` for ``9 7``) and, optionally,
    ``finish_reason`` (``stop`` when missing). Full credit needs ``stop``: ``<bos> 9`` cut at the token
    limit decodes to ``"9"`` too, but did not stop. The first number is compared whole: ``"13"`` does
    not match the label ``"1"``. Pure and thread-safe.

    Raises:
        ValueError: the prompt has no label.
    """
    label = prompt.get("label")
    if label is None:
        raise ValueError(f"prompt {prompt.get('id')!r} has no label; the demo task needs the sum as its label")
    label = str(label).strip()
    text = str(completion.get("text") or "").strip()
    if text == label and completion.get("finish_reason", "stop") == "stop":
        return 1.0
    first = _FIRST_NUMBER.match(text)
    if first is not None and first.group(0) == label:
        return 0.5
    return 0.0


def build_tokenizer(out_dir: str | Path) -> Path:
    """Write the word-level tokenizer (``tokenizer.json`` + config) to `out_dir`. Blocks briefly."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    # Numbers are whole tokens ("13" is one token); every other non-space character is its own token.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"\d+|[^\d\s]"), behavior="isolated")
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS_ID)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", padding_side="left")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return out


def build_demo_model(out_dir: str | Path, seed: int = 0, *, recipe: DemoRecipe = DEMO_RECIPE) -> Path:
    """Write tokenizer + randomly initialised model to `out_dir` and return it. Blocks ~1 s on a CPU.

    The same `seed` writes the same weights; torch's global random state is left as it was. Its
    ``generation_config`` samples with the recipe's temperature and max_new_tokens. Raises ImportError
    without the ``hf`` extra (torch, transformers, tokenizers).
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = build_tokenizer(out_dir)
    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=recipe.hidden_size,
                         intermediate_size=4 * recipe.hidden_size, num_hidden_layers=recipe.layers,
                         num_attention_heads=recipe.heads, num_key_value_heads=recipe.heads,
                         max_position_embeddings=64, tie_word_embeddings=recipe.tie_embeddings,
                         pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    # Llama, not Qwen2: transformers 5 swaps its own byte-level tokenizer class in for qwen2 checkpoints,
    # which would re-tokenize our numbers; for llama it honours tokenizer_config.json.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=recipe.temperature, top_k=0, top_p=recipe.top_p,
        max_new_tokens=recipe.max_new_tokens, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    model.save_pretrained(str(out))
    return out
