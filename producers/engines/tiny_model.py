"""Build a tiny causal LM locally: nothing is downloaded (tests, the demo, CPU smoke runs).

A character-level tokenizer made with the `tokenizers` library (printable ASCII plus newline and a
few special tokens, with a ChatML-style chat template) and a randomly initialised Llama model of a
few hundred thousand parameters, saved with ``save_pretrained`` so that ``AutoTokenizer`` and
``AutoModelForCausalLM.from_pretrained(dir)`` load them like any hub model. Its outputs are
gibberish but have the real shapes: token ids, logprobs, EOS, chat template.
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _vocab() -> dict[str, int]:
    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))
    tokens = list(SPECIAL_TOKENS) + chars
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer(out_dir: str | Path) -> Path:
    """Write a char-level fast tokenizer to `out_dir` (``tokenizer.json`` + config). Blocks briefly."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = _vocab()
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                  eos_token="<|im_end|>", bos_token=None)
    tok.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return out


def build_tiny_model(out_dir: str | Path, *, hidden_size: int = 64, layers: int = 2, heads: int = 4,
                     seed: int = 0) -> Path:
    """Create tokenizer + random-init Llama model in `out_dir` and return it. Blocks ~1 s on a CPU.

    Idempotent in effect: the same `seed` writes the same weights. Raises ImportError without the
    ``hf`` extra (torch, transformers, tokenizers).
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = build_tokenizer(out_dir)
    vocab = _vocab()
    eos, pad = vocab["<|im_end|>"], vocab["<pad>"]
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    # Llama, not Qwen2: transformers 5 swaps in its own Qwen2 tokenizer class for qwen2 checkpoints,
    # which would re-normalise our char-level vocabulary; for llama it honours tokenizer_config.json.
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=True)
    model.save_pretrained(str(out))
    return out
