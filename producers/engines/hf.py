"""Hugging Face transformers on CPU: the embedded engine for the demo and tests (``--engine hf --model DIR``).

The `n` samples of a prompt are generated as one batch (the prompt repeated `n` times) with sampling,
and per-token logprobs come from ``compute_transition_scores`` over the scores of the sampling
distribution. Generation runs in one dedicated worker thread (``rollstream-hf``): torch already uses
every core for one batch, and the event loop never waits on it. The response keeps the EOS token
(with its logprob) and drops the padding after it.

Weight updates (`reload`): the new state dict is read from disk in another thread while the old
weights keep serving, then copied into the model *in the worker thread, between two generations*, so
no generation ever sees half-updated weights. Every completion is stamped with the version of the
weights that generated it: the `reload`ed version, or at start the version recorded in the model
directory (`infra.VERSION_FILE`), else the one given to the constructor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from producers.engines._tokenize import PromptEncoder, load_tokenizer
from producers.engines.base import Completion, EngineError, Generation, SamplingParams
from schemas import ConfigError, read_policy_version

log = logging.getLogger(__name__)


class HFEngine:
    """transformers ``generate`` on a local model directory.

    Args:
        model_dir: a directory ``AutoModelForCausalLM.from_pretrained`` loads (e.g. `build_tiny_model`'s).
        device: torch device (``cpu`` by default).
        torch_threads: cap torch's intra-op threads (None leaves torch's default).
        policy_version: the policy version of the weights in `model_dir`, stamped on samples until a `reload`
            (None: the version recorded in the directory, if any, else the producer's current version).
    """

    name = "hf"

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", chat_template: bool = True,
                 torch_threads: int | None = None, policy_version: int | None = None) -> None:
        self._model_dir = Path(model_dir)
        self._device = device
        self._chat_template = chat_template
        self._torch_threads = torch_threads
        self._policy_version = policy_version  # written only by the worker thread after start()
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
            model: Any = AutoModelForCausalLM.from_pretrained(str(self._model_dir), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--model {self._model_dir}: cannot load a causal LM: {exc}") from exc
        model.to(self._device).eval()
        if self._policy_version is None:
            self._policy_version = read_policy_version(self._model_dir)
        return model, tokenizer

    @property
    def policy_version(self) -> int | None:
        """The policy version of the weights serving now (None when unknown). Thread-safe to read."""
        return self._policy_version

    async def reload(self, weights_path: str | Path, version: int) -> bool:
        """Serve the weights saved in `weights_path` as `version` from the next generation on.

        Reads the state dict in a helper thread while the current weights keep serving, then copies
        it into the model in the worker thread between two generations (a generation in progress
        finishes with the old weights). Returns False, loading nothing, when `version` is not newer
        than the version serving now. Never blocks the loop. Call from the loop that runs `generate`.

        Raises:
            EngineError (retriable): the directory holds no loadable weights for this model (missing
                or mismatched tensors); the old weights keep serving.
        """
        if self._model is None or self._executor is None:
            raise EngineError("HFEngine.reload called before start()", retriable=False)
        current = self._policy_version
        if current is not None and version <= current:
            return False
        started = time.perf_counter()
        state = await asyncio.to_thread(_read_state_dict, Path(weights_path))
        loop = asyncio.get_running_loop()
        applied = await loop.run_in_executor(self._executor, self._apply_blocking, state, version)
        if applied:
            log.info("loaded policy version %d from %s in %.0f ms", version, weights_path,
                     1e3 * (time.perf_counter() - started))
        return applied

    def _apply_blocking(self, state: dict[str, Any], version: int) -> bool:
        """Copy `state` into the model (worker thread only). False when a newer version got there first."""
        import torch

        if self._model is None:
            raise EngineError("HFEngine is closed", retriable=False)
        if self._policy_version is not None and version <= self._policy_version:
            return False
        current = self._model.state_dict()
        unexpected = sorted(set(state) - set(current))
        loaded_ptrs = {t.data_ptr() for k, t in current.items() if k in state}
        # Tied weights (lm_head = embed_tokens) are saved once: missing is fine if it shares storage.
        missing = sorted(k for k, t in current.items() if k not in state and t.data_ptr() not in loaded_ptrs)
        shapes = sorted(k for k in state if k in current and tuple(state[k].shape) != tuple(current[k].shape))
        if unexpected or missing or shapes:
            raise EngineError(f"weights of version {version} do not fit the model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}, wrong shape {shapes[:3]}", retriable=True)
        with torch.no_grad():
            self._model.load_state_dict(state, strict=False)
        self._policy_version = version
        return True

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
                          policy_version=self._policy_version)


def _read_state_dict(weights_path: Path) -> dict[str, Any]:
    """Read the safetensors weights of a saved model directory (one file or an indexed set of shards)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    single, index = weights_path / "model.safetensors", weights_path / "model.safetensors.index.json"
    try:
        if single.is_file():
            return load_file(str(single))
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, Any] = {}
        for shard in shards:
            state.update(load_file(str(weights_path / shard)))
        return state
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise EngineError(f"cannot read weights from {weights_path} (expected model.safetensors or "
                          f"model.safetensors.index.json): {exc}", retriable=True) from exc


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
