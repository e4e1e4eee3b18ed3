"""Prompt -> (text as sent, token ids), with the tokenizer's chat template where it has one.

Shared by the SGLang engines (which send ``input_ids``) and the transformers engine. transformers is
imported lazily, so the custom engine never pays for it. Encoding is CPU work: callers run `encode`
in a worker thread. A loaded tokenizer is read-only, so `encode` is thread-safe.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollstream.producers.engines.base import EngineError
from rollstream.schemas import ConfigError


def load_tokenizer(path: str | Path) -> Any:
    """`AutoTokenizer.from_pretrained(path)` (local files only). Blocks; raises ConfigError when unloadable."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ConfigError("a tokenizer needs transformers: pip install 'rollstream[hf]'") from exc
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {path}: {exc}") from exc


class PromptEncoder:
    """Applies the chat template (when enabled and present) and tokenizes."""

    def __init__(self, tokenizer: Any, *, chat_template: bool = True) -> None:
        self.tokenizer = tokenizer
        self._use_template = chat_template and bool(getattr(tokenizer, "chat_template", None))

    def encode(self, prompt: Mapping[str, Any]) -> tuple[str, list[int]]:
        """Return the prompt text as the model sees it and its token ids.

        Raises:
            EngineError (not retriable): chat messages but no chat template to render them.
        """
        raw = prompt["prompt"]
        if self._use_template:
            messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return text, list(ids)
        if not isinstance(raw, str):
            raise EngineError(f"prompt {prompt.get('id')!r} is a list of chat messages but the tokenizer has "
                              "no chat template; give a tokenizer with one, or plain-text prompts",
                              retriable=False)
        return raw, list(self.tokenizer(raw)["input_ids"])
