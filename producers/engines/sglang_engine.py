"""SGLang in-process (``sglang.Engine``), for a producer that owns its GPU (``pip install 'rollstream[sglang]'``).

``sglang`` is imported lazily in `start`, so nothing else in rollstream needs it. Requests and
responses have the same shape as over HTTP (`_sglang_format`); aborted samples are re-issued.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from producers.engines._sglang_format import parse_completion, request_payload
from producers.engines._tokenize import PromptEncoder, load_tokenizer
from producers.engines.base import Completion, EngineError, Generation, SamplingParams
from producers.engines.sglang_http import gather_or_cancel
from schemas import ConfigError

log = logging.getLogger(__name__)


class SGLangEngine:
    """Runs ``sglang.Engine(model_path=..., **engine_kwargs)`` in this process.

    Args:
        model_path: a model directory SGLang can load.
        tokenizer: tokenizer directory (default: `model_path`) for chat templates and ``input_ids``.
        abort_attempts: how often an aborted sample is re-issued before the prompt fails.
        engine_kwargs: passed to ``sglang.Engine`` (``tp_size``, ``mem_fraction_static``, ...).
    """

    name = "sglang-engine"

    def __init__(self, model_path: str | Path, *, tokenizer: str | Path | None = None, chat_template: bool = True,
                 abort_attempts: int = 20, engine_kwargs: Mapping[str, Any] | None = None) -> None:
        self._model_path = str(model_path)
        self._tokenizer_path = str(tokenizer or model_path)
        self._chat_template = chat_template
        self._abort_attempts = abort_attempts
        self._kwargs = dict(engine_kwargs or {})
        self._engine: Any = None
        self._encoder: PromptEncoder | None = None

    async def start(self) -> None:
        """Import sglang and launch the engine in a worker thread (minutes for a large model). Idempotent.

        Raises:
            ConfigError: sglang is not installed.
        """
        if self._engine is not None:
            return
        try:
            sglang = await asyncio.to_thread(importlib.import_module, "sglang")  # torch and CUDA: seconds
        except ImportError as exc:
            raise ConfigError("--engine sglang without --sglang-url runs SGLang in-process and needs it "
                              "installed: pip install 'rollstream[sglang]' (GPU only)") from exc
        tokenizer = await asyncio.to_thread(load_tokenizer, self._tokenizer_path)
        self._encoder = PromptEncoder(tokenizer, chat_template=self._chat_template)
        self._engine = await asyncio.to_thread(lambda: sglang.Engine(model_path=self._model_path, **self._kwargs))

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)

    async def generate(self, prompt: Mapping[str, Any], n: int, sampling: SamplingParams) -> Generation:
        """`n` concurrent ``async_generate`` calls. Raises EngineError when one fails or keeps aborting."""
        if self._engine is None or self._encoder is None:
            raise EngineError("SGLangEngine.generate called before start()", retriable=False)
        text, ids = await asyncio.to_thread(self._encoder.encode, prompt)
        payload = request_payload(text, ids, sampling.to_dict())
        completions = await gather_or_cancel([self._sample(payload) for _ in range(n)])
        return Generation(completions=completions, prompt_text=text, prompt_tokens=ids)

    async def _sample(self, payload: Mapping[str, Any]) -> Completion:
        for _ in range(self._abort_attempts + 1):
            try:
                out = await self._engine.async_generate(input_ids=payload["input_ids"],
                                                        sampling_params=payload["sampling_params"],
                                                        return_logprob=True)
            except Exception as exc:
                raise EngineError(f"sglang.Engine.async_generate raised {type(exc).__name__}: {exc}",
                                  retriable=True) from exc
            completion = parse_completion(out)
            if completion.finish_reason != "abort":
                return completion
            log.info("in-process sglang aborted a sample; re-issuing it")
        raise EngineError(f"sample aborted {self._abort_attempts + 1} times; giving up", retriable=False)
