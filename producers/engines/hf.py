"""Hugging Face transformers on CPU: the embedded engine for the demo and tests (``--engine hf --model DIR``).

The `n` samples of a prompt are generated as one batch (the prompt repeated `n` times). Sampling follows
the producer's `SamplingParams` alone (temperature, top_p, top_k; temperature below 1e-6 is greedy): of the
model directory's ``generation_config`` only the EOS, pad and BOS ids are kept, so no repetition penalty
or other processor it may name changes the distribution behind the producer's back.

Logprobs are what SGLang ships (``python/sglang/srt/layers/sampler.py``, top-p independent since
sgl-project/sglang#5961): ``log_softmax(logits / T)`` of the sampled token, from the raw logits
(``generate(output_logits=True)``), before top-k/top-p truncation and renormalisation, so a trainer that
divides its logits by T recomputes them. Greedy uses T=1, as SGLang does: its ``SamplingParams`` turns a
temperature below ``_SAMPLING_EPS`` (1e-6) into temperature 1.0 with top_k 1
(``python/sglang/srt/sampling/sampling_params.py``), and its all-greedy path takes ``log_softmax(logits)``.

Generation stops on every EOS id of the generation config (``eos_token_id`` may be a list) and the
tokenizer's; the response keeps the first EOS token (with its logprob) and drops what follows it.
Generation runs in one dedicated worker thread (``rollstream-hf``): torch already uses every core for
one batch, and the event loop never waits on it. `generate_tokens` is the token-in/token-out call
multi-turn rollouts use (`rollstream.producers.multiturn`): it continues token ids as given, never re-encoding text.

Weight updates (`reload`): the new state dict is read from disk in another thread while the old
weights keep serving, then copied into the model *in the worker thread, between two generations*, so
no generation ever sees half-updated weights. Every completion is stamped with the version of the
weights that generated it: the `reload`ed version, or at start the version recorded in the model
directory (`rollstream.infra.VERSION_FILE`), else the one given to the constructor.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollstream.infra.threads import ThreadPool, in_thread
from rollstream.producers.engines._tokenize import PromptEncoder, load_tokenizer
from rollstream.producers.engines.base import Completion, EngineCapabilities, EngineError, Generation, SamplingParams
from rollstream.schemas import GREEDY_BELOW, ConfigError, logprob_temperature, read_policy_version

log = logging.getLogger(__name__)
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")  # what --engine hf honours


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
    capabilities = EngineCapabilities(reloads_weights=True)

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", chat_template: bool = True,
                 torch_threads: int | None = None, policy_version: int | None = None) -> None:
        self._model_dir = Path(model_dir)
        self._device = device
        self._chat_template = chat_template
        self._torch_threads = torch_threads
        self._policy_version = policy_version  # written only by the worker thread after start()
        self._thread: ThreadPool | None = None  # one thread: the model runs one batch at a time
        self._model: Any = None
        self._encoder: PromptEncoder | None = None
        self._eos_ids: tuple[int, ...] = ()
        self._pad_id: int | None = None

    async def start(self) -> None:
        """Load tokenizer and model in the worker thread. Idempotent.

        Raises:
            ConfigError: the directory is missing or holds no loadable model.
        """
        if self._model is not None:
            return
        if not self._model_dir.is_dir():
            raise ConfigError(f"--model {self._model_dir}: no such directory")
        self._thread = ThreadPool("rollstream-hf", 1)
        self._model, tokenizer = await self._thread.run(self._load)
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
        self._eos_ids, self._pad_id = _own_generation_config(model, tokenizer)
        if self._policy_version is None:
            self._policy_version = read_policy_version(self._model_dir)
        return model, tokenizer

    @property
    def tokenizer(self) -> Any:
        """The loaded tokenizer (read-only, so thread-safe to encode and decode with).

        Raises:
            EngineError (not retriable): read before `start`.
        """
        if self._encoder is None:
            raise EngineError("HFEngine.tokenizer read before start()", retriable=False)
        return self._encoder.tokenizer

    def encode_prompt(self, prompt: Mapping[str, Any]) -> tuple[str, list[int]]:
        """The prompt as `generate` sends it (chat template applied where the tokenizer has one) and its
        token ids. Blocks briefly (tokenising); thread-safe, so call it through ``asyncio.to_thread``.

        Raises:
            EngineError (not retriable): called before `start`, or chat messages without a chat template.
        """
        if self._encoder is None:
            raise EngineError("HFEngine.encode_prompt called before start()", retriable=False)
        return self._encoder.encode(prompt)

    async def prompt_ids(self, prompt: Mapping[str, Any]) -> tuple[str, list[int]]:
        """`encode_prompt` in the worker thread (between two generations). Never blocks the loop.

        Raises:
            EngineError (not retriable): called before `start`, or chat messages without a chat template.
        """
        return await self._running().run(self.encode_prompt, dict(prompt))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every token id that ends a generation (generation config and tokenizer); empty before `start`."""
        return self._eos_ids

    @property
    def policy_version(self) -> int | None:
        """The policy version of the weights serving now (None when unknown). Thread-safe to read."""
        return self._policy_version

    async def reload(self, weights_path: str | Path, version: int) -> bool:
        """Serve the weights saved in `weights_path` as `version` from the next generation on.

        Reads the state dict in a helper thread while the current weights keep serving, then copies
        it into the model in the worker thread between two generations (a generation in progress
        finishes with the old weights). Loads whatever `version` is (a new trainer run's may be lower than
        the one serving) and returns True. Never blocks the loop. Call from the loop that runs `generate`,
        one call at a time.

        Raises:
            EngineError (retriable): the directory holds no loadable weights for this model (missing
                or mismatched tensors); the old weights keep serving.
        """
        if self._model is None or self._thread is None:
            raise EngineError("HFEngine.reload called before start()", retriable=False)
        started = time.perf_counter()
        state = await in_thread(_read_state_dict, Path(weights_path), name="rollstream-hf-read")
        applied = await self._thread.run(self._apply_blocking, state, version)
        if applied:
            log.info("loaded policy version %d from %s in %.0f ms", version, weights_path,
                     1e3 * (time.perf_counter() - started))
        return applied

    def _apply_blocking(self, state: dict[str, Any], version: int) -> bool:
        """Copy `state` into the model (worker thread only); True."""
        import torch

        if self._model is None:
            raise EngineError("HFEngine is closed", retriable=False)
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
        thread, self._thread = self._thread, None
        self._model = None
        if thread is not None:  # what was submitted runs to its end first
            thread.retire()
            await in_thread(thread.join, None, name="rollstream-hf-close")

    async def generate(self, prompt: Mapping[str, Any], n: int, sampling: SamplingParams) -> Generation:
        """Generate `n` samples in one batch on the worker thread.

        Raises:
            EngineError: the model raised (e.g. out of memory); retriable.
        """
        return await self._running().run(self._generate_blocking, dict(prompt), n, sampling)

    async def generate_tokens(self, input_ids: Sequence[int], n: int, sampling: SamplingParams) -> list[Completion]:
        """Token in, token out: `n` completions continuing `input_ids` exactly as given (no chat template, no
        re-encoding), in one batch on the worker thread. Never blocks the loop.

        Raises:
            EngineError: `input_ids` is empty (not retriable), or the model raised (retriable).
        """
        if not input_ids:
            raise EngineError("generate_tokens needs at least one input token", retriable=False)
        return await self._running().run(self._sample_blocking, list(input_ids), n, sampling)

    def _running(self) -> ThreadPool:
        if self._model is None or self._thread is None:
            raise EngineError("HFEngine used before start()", retriable=False)
        return self._thread

    def _generate_blocking(self, prompt: dict[str, Any], n: int, sampling: SamplingParams) -> Generation:
        if self._encoder is None:
            raise EngineError("HFEngine is closed", retriable=False)
        text, ids = self._encoder.encode(prompt)
        return Generation(completions=self._sample_blocking(ids, n, sampling), prompt_text=text, prompt_tokens=ids)

    def _sample_blocking(self, ids: list[int], n: int, sampling: SamplingParams) -> list[Completion]:
        import torch

        if self._model is None or self._encoder is None:
            raise EngineError("HFEngine is closed", retriable=False)
        sent = {k: v for k, v in sampling.to_dict().items() if k in _SAMPLING_KEYS}
        inputs = torch.tensor([ids] * n, device=self._device)
        try:
            with torch.no_grad():
                out = self._model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                           **_generate_kwargs(sent, self._pad_id))
                new = out.sequences[:, len(ids):]
                logprobs = sampled_logprobs(out.logits, new, logprob_temperature(float(sent["temperature"])))
        except (RuntimeError, ValueError) as exc:
            raise EngineError(f"transformers generate failed: {type(exc).__name__}: {exc}", retriable=True) from exc
        return [self._completion(new[i].tolist(), logprobs[i].tolist()) for i in range(n)]

    def _completion(self, tokens: list[int], logprobs: list[float]) -> Completion:
        finish = "length"
        cut = next((i for i, t in enumerate(tokens) if t in self._eos_ids), None)
        if cut is not None:
            tokens, logprobs, finish = tokens[:cut + 1], logprobs[:cut + 1], "stop"
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return Completion(text=text, tokens=tokens, logprobs=logprobs, finish_reason=finish,
                          policy_version=self._policy_version)


def sampled_logprobs(step_logits: Sequence[Any], tokens: Any, temperature: float) -> Any:
    """[n, steps]: ``log_softmax(logits / temperature)`` of each sampled token, one step at a time (never a
    [n, steps, vocab] tensor). `step_logits` are ``generate(output_logits=True)``'s raw logits, [n, vocab]
    per step; `tokens` [n, steps] the tokens sampled."""
    import torch

    return torch.stack([(logits.float() / temperature).log_softmax(-1).gather(-1, tokens[:, t:t + 1]).squeeze(-1)
                        for t, logits in enumerate(step_logits)], dim=1)


def _own_generation_config(model: Any, tokenizer: Any) -> tuple[tuple[int, ...], int | None]:
    """Keep only the EOS, pad and BOS ids of the model's generation config (see the module docstring);
    returns (every EOS id, the pad id)."""
    from transformers import GenerationConfig

    config = model.generation_config
    configured = config.eos_token_id
    eos = [*(configured if isinstance(configured, list) else [configured]), tokenizer.eos_token_id]
    eos_ids = tuple(dict.fromkeys(int(t) for t in eos if t is not None))
    pad = next((t for t in (tokenizer.pad_token_id, config.pad_token_id, *eos_ids) if t is not None), None)
    ignored = sorted(set(config.to_diff_dict()) - {"eos_token_id", "pad_token_id", "bos_token_id",
                                                   "transformers_version", "do_sample", *_SAMPLING_KEYS})
    if ignored:
        log.info("generation_config settings %s ignored: --engine hf samples with the producer's sampling "
                 "parameters only", ", ".join(ignored))
    model.generation_config = GenerationConfig(eos_token_id=list(eos_ids) or None, pad_token_id=pad,
                                               bos_token_id=config.bos_token_id)
    return eos_ids, pad


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


def _generate_kwargs(sent: Mapping[str, Any], pad_id: int | None) -> dict[str, Any]:
    """``generate`` arguments for the sampling parameters `sent` (SamplingParams.to_dict's, so an ``extra``
    override counts as it does for SGLang)."""
    greedy = float(sent["temperature"]) < GREEDY_BELOW
    top_k = int(sent.get("top_k", -1))
    kwargs: dict[str, Any] = {"max_new_tokens": int(sent["max_new_tokens"]), "do_sample": not greedy,
                              "output_logits": True, "return_dict_in_generate": True, "pad_token_id": pad_id}
    if not greedy:
        kwargs.update(temperature=float(sent["temperature"]), top_p=float(sent["top_p"]),
                      top_k=0 if top_k == -1 else top_k)  # transformers: top_k 0 is off
    return kwargs
