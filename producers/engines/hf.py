"""Hugging Face transformers on CPU: the embedded engine for the demo and tests (``--engine hf --model DIR``).

The `n` samples of a prompt are generated as one batch (the prompt repeated `n` times) with sampling,
and per-token logprobs come from ``compute_transition_scores`` over the scores of the sampling
distribution. Generation runs in one dedicated worker thread (``rollstream-hf``): torch already uses
every core for one batch, and the event loop never waits on it. The response keeps the EOS token
(with its logprob) and drops the padding after it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from producers.engines._tokenize import PromptEncoder, load_tokenizer
from producers.engines.base import Completion, EngineError, Generation, SamplingParams
from schemas import ConfigError


class HFEngine:
    """transformers ``generate`` on a local model directory.

    Args:
        model_dir: a directory ``AutoModelForCausalLM.from_pretrained`` loads (e.g. `build_tiny_model`'s).
        device: torch device (``cpu`` by default).
        torch_threads: cap torch's intra-op threads (None leaves torch's default).
        weight_version: the version stamped on samples (None: the producer's current version).
    """

    name = "hf"

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", chat_template: bool = True,
                 torch_threads: int | None = None, weight_version: int | None = None) -> None:
        self._model_dir = Path(model_dir)
        self._device = device
        self._chat_template = chat_template
        self._torch_threads = torch_threads
        self._weight_version = weight_version
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._model: Any = None
        self._encoder: PromptEncoder | None = None

    async def start(self) -> None:
        """Load tokenizer and model in the worker thread. Idempotent.

        Raises:
            ConfigError: the directory is missing or holds no loadable model.
        """
        if self._model is not None:
            return
        if not self._model_dir.is_dir():
            raise ConfigError(f"--model {self._model_dir}: no such directory")
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollstream-hf")
        loop = asyncio.get_running_loop()
        self._model, tokenizer = await loop.run_in_executor(self._executor, self._load)
        self._encoder = PromptEncoder(tokenizer, chat_template=self._chat_template)

    def _load(self) -> tuple[Any, Any]:
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError as exc:
            raise ConfigError("--engine hf needs torch and transformers: pip install 'rollstream[hf]'") from exc
        if self._torch_threads:
            torch.set_num_threads(self._torch_threads)
        tokenizer = load_tokenizer(self._model_dir)
        try:
            model = AutoModelForCausalLM.from_pretrained(str(self._model_dir), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--model {self._model_dir}: cannot load a causal LM: {exc}") from exc
        model.to(self._device).eval()
        return model, tokenizer

    async def close(self) -> None:
        executor, self._executor = self._executor, None
        self._model = None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, wait=True)

    async def generate(self, prompt: Mapping[str, Any], n: int, sampling: SamplingParams) -> Generation:
        """Generate `n` samples in one batch on the worker thread.

        Raises:
            EngineError: the model raised (e.g. out of memory); retriable.
        """
        if self._model is None or self._executor is None:
            raise EngineError("HFEngine.generate called before start()", retriable=False)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._generate_blocking, dict(prompt), n, sampling)

    def _generate_blocking(self, prompt: dict[str, Any], n: int, sampling: SamplingParams) -> Generation:
        import torch

        if self._encoder is None:
            raise EngineError("HFEngine is closed", retriable=False)
        text, ids = self._encoder.encode(prompt)
        tokenizer = self._encoder.tokenizer
        inputs = torch.tensor([ids] * n, device=self._device)
        try:
            with torch.no_grad():
                out = self._model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                           **_generate_kwargs(sampling, tokenizer))
                scores = self._model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        except (RuntimeError, ValueError) as exc:
            raise EngineError(f"transformers generate failed: {type(exc).__name__}: {exc}", retriable=True) from exc
        completions = [self._completion(out.sequences[i, len(ids):].tolist(), scores[i].tolist(), tokenizer)
                       for i in range(n)]
        return Generation(completions=completions, prompt_text=text, prompt_tokens=ids)

    def _completion(self, tokens: list[int], logprobs: list[float], tokenizer: Any) -> Completion:
        eos = tokenizer.eos_token_id
        finish = "length"
        if eos is not None and eos in tokens:
            cut = tokens.index(eos) + 1
            tokens, logprobs, finish = tokens[:cut], logprobs[:cut], "stop"
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        return Completion(text=text, tokens=tokens, logprobs=logprobs, finish_reason=finish,
                          weight_version=self._weight_version)


def _generate_kwargs(sampling: SamplingParams, tokenizer: Any) -> dict[str, Any]:
    greedy = sampling.temperature == 0
    kwargs: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens, "do_sample": not greedy, "top_k": 0,
        "output_scores": True, "return_dict_in_generate": True,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    }
    if not greedy:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p)
    return kwargs
