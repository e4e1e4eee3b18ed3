"""SGLang in-process (``sglang.Engine``), for a producer that owns its GPU (``pip install 'rollstream[sglang]'``).

``sglang`` is imported lazily in `start`, so nothing else in rollstream needs it. Requests and
responses have the same shape as over HTTP (`_sglang_format`); aborted samples are continued from their
partial output (or restarted, ``partial_rollouts="restart"``). With in-flight checkpoints (a `Progress`),
each request streams (``async_generate(..., stream=True)``: the chunks the HTTP server sends, joined by
`_sglang_format.StreamedGenerate`), its output so far saved every `Progress.interval_s` seconds and once it
finishes, and a restored sample is continued from prompt + its tokens (`_resume`), as over HTTP.

Nobody but this producer can reach an in-process engine, so it is a `ReloadableEngine`: each newer
version announced on NS.control with a ``weights_path`` is loaded the way SGLang's server does it
around a weight update (http_server.py ``/pause_generation``, ``/update_weights_from_disk``,
``/continue_generation``): the engine's tokenizer manager pauses generation (mode ``abort``: samples in
flight return their partial output and are continued once the new weights serve), loads the weights
with ``weight_version`` set, and continues. Those are the coroutines that ``sglang.Engine``'s own sync
``update_weights_from_disk(model_path, load_format=None)`` wraps (python/sglang/srt/entrypoints/engine.py
at sgl-project/sglang 001067ff): that method runs its own event loop, cannot be called from the loop the
generations run on, and takes no weight version, so the coroutines are awaited here directly.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollstream.infra.threads import ThreadPool, in_thread
from rollstream.producers.engines._resume import StreamSaver, checkpointed
from rollstream.producers.engines._samples import PARTIAL_ROLLOUTS, PartialRollout, PartialRollouts
from rollstream.producers.engines._sampling import sglang_options
from rollstream.producers.engines._sglang_format import (
    StreamedGenerate,
    parse_completion,
    partial_rollout,
    refused,
    request_payload,
    seeded,
)
from rollstream.producers.engines._tokenize import PromptEncoder, load_tokenizer
from rollstream.producers.engines.base import Completion, EngineCapabilities, EngineError, Generation, SamplingParams
from rollstream.producers.engines.progress import Progress
from rollstream.producers.engines.sglang_http import gather_or_cancel
from rollstream.schemas import ConfigError, read_policy_version

_TOKENIZE_THREADS = 4

log = logging.getLogger(__name__)
_IO_STRUCT = "sglang.srt.managers.io_struct"


class SGLangEngine:
    """Runs ``sglang.Engine(model_path=..., **engine_kwargs)`` in this process.

    Args:
        model_path: a model directory SGLang can load.
        tokenizer: tokenizer directory (default: `model_path`) for chat templates and ``input_ids``.
        abort_attempts: how often an aborted sample without output is re-issued before the prompt fails.
        max_continuations: how often an aborted sample is continued from its partial output.
        partial_rollouts: ``continue`` an aborted sample from its partial output, or ``restart`` it.
        policy_version: the version of the weights in `model_path` (None: the version recorded in the
            directory, if any); passed to SGLang as its ``weight_version``.
        update_timeout_s: how long loading new weights may take.
        engine_kwargs: passed to ``sglang.Engine`` (``tp_size``, ``mem_fraction_static``, ...).
        sampling: the producer's sampling parameters, checked here (`check_sampling`).

    Raises:
        ConfigError: an unknown `partial_rollouts`, or a `sampling` option SGLang has no name for.
    """

    name = "sglang-engine"
    capabilities = EngineCapabilities(checks_sampling=True, reloads_weights=True, saves_progress=True)

    def __init__(self, model_path: str | Path, *, tokenizer: str | Path | None = None, chat_template: bool = True,
                 abort_attempts: int = 20, max_continuations: int = 4, partial_rollouts: PartialRollouts = "continue",
                 policy_version: int | None = None, update_timeout_s: float = 600.0,
                 engine_kwargs: Mapping[str, Any] | None = None, sampling: SamplingParams | None = None) -> None:
        if sampling is not None:
            self.check_sampling(sampling)
        if partial_rollouts not in PARTIAL_ROLLOUTS:
            raise ConfigError(f"--partial-rollouts {partial_rollouts!r}: use continue or restart")
        self._model_path = str(model_path)
        self._tokenizer_path = str(tokenizer or model_path)
        self._chat_template = chat_template
        self._abort_attempts = abort_attempts
        self._max_continuations = max_continuations
        self._partial: PartialRollouts = partial_rollouts
        self._version = policy_version
        self._update_timeout_s = update_timeout_s
        self._kwargs = dict(engine_kwargs or {})
        self._engine: Any = None
        self._encoder: PromptEncoder | None = None
        self._threads: ThreadPool | None = None  # tokenization: its own threads, never behind user code

    @staticmethod
    def check_sampling(sampling: SamplingParams) -> None:
        """Raise ConfigError (naming SGLang's options) for a sampling option SGLang has no name for (its
        ``SamplingParams`` would raise TypeError on every sample). No I/O."""
        try:
            sglang_options(sampling.to_dict())
        except EngineError as exc:
            raise ConfigError(str(exc)) from exc

    async def start(self) -> None:
        """Import sglang and launch the engine in a worker thread (minutes for a large model). Idempotent.

        Raises:
            ConfigError: sglang is not installed.
        """
        if self._engine is not None:
            return
        try:
            # torch and CUDA: seconds
            sglang = await in_thread(importlib.import_module, "sglang", name="rollstream-sglang-start")
        except ImportError as exc:
            raise ConfigError("--engine sglang without --sglang-url runs SGLang in-process and needs it "
                              "installed: pip install 'rollstream[sglang]' (GPU only)") from exc
        tokenizer = await in_thread(load_tokenizer, self._tokenizer_path, name="rollstream-sglang-start")
        self._encoder = PromptEncoder(tokenizer, chat_template=self._chat_template)
        if self._version is None:
            self._version = read_policy_version(self._model_path)
        kwargs = dict(self._kwargs)
        if self._version is not None:
            kwargs.setdefault("weight_version", str(self._version))  # SGLang then reports it per sample
        self._engine = await in_thread(lambda: sglang.Engine(model_path=self._model_path, **kwargs),
                                       name="rollstream-sglang-start")
        self._threads = ThreadPool("rollstream-tokenize", _TOKENIZE_THREADS)

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.close()
        if engine is not None:
            await in_thread(engine.shutdown, name="rollstream-sglang-close")

    @property
    def policy_version(self) -> int | None:
        """The policy version of the weights serving now (None when unknown)."""
        return self._version

    async def generate(self, prompt: Mapping[str, Any], n: int, sampling: SamplingParams, *,
                       progress: Progress | None = None) -> Generation:
        """`n` concurrent ``async_generate`` calls; with `progress` (checkpoints), streamed and saved as they go,
        each sample resumed from its checkpoint (the module docstring). Raises EngineError when one fails or
        keeps aborting."""
        if self._engine is None or self._encoder is None or self._threads is None:
            raise EngineError("SGLangEngine.generate called before start()", retriable=False)
        text, ids = await self._threads.run(self._encoder.encode, prompt)
        payload = request_payload(text, ids, sampling.to_dict())
        if progress is not None and progress.interval_s > 0:
            payload["stream"] = True  # the state is saved as it streams
        completions = await self._samples(payload, n, progress)
        return Generation(completions=completions, prompt_text=text, prompt_tokens=ids)

    @property
    def tokenizer(self) -> Any:
        """The loaded tokenizer (read-only). Raises EngineError (not retriable) before `start`."""
        if self._encoder is None:
            raise EngineError("SGLangEngine.tokenizer read before start()", retriable=False)
        return self._encoder.tokenizer

    async def prompt_ids(self, prompt: Mapping[str, Any]) -> tuple[str, list[int]]:
        """The prompt as `generate` sends it (chat template applied) and its token ids, encoded in a tokenizer
        thread. Raises EngineError (not retriable) before `start`."""
        if self._encoder is None or self._threads is None:
            raise EngineError("SGLangEngine.prompt_ids called before start()", retriable=False)
        return await self._threads.run(self._encoder.encode, prompt)

    async def generate_tokens(self, input_ids: Sequence[int], n: int, sampling: SamplingParams) -> list[Completion]:
        """`n` completions continuing `input_ids` exactly as given (no template, no re-tokenisation): the
        token-in/token-out policy of `rollstream.producers.multiturn`. Raises EngineError as `generate`."""
        if self._engine is None:
            raise EngineError("SGLangEngine.generate_tokens called before start()", retriable=False)
        return await self._samples(request_payload("", [int(t) for t in input_ids], sampling.to_dict()), n)

    async def _samples(self, payload: Mapping[str, Any], n: int, progress: Progress | None = None) -> list[Completion]:
        return await gather_or_cancel([self._sample(seeded(payload, i), i, progress) for i in range(n)])

    async def _sample(self, payload: Mapping[str, Any], index: int = 0, progress: Progress | None = None) -> Completion:
        rollout = partial_rollout(payload, mode=self._partial, max_continuations=self._max_continuations,
                                 abort_attempts=self._abort_attempts)
        return await checkpointed(progress, index, rollout, prompt_ids=lambda: payload["input_ids"],
                                  run=lambda saver: self._run(rollout, saver))

    async def _run(self, rollout: PartialRollout, saver: StreamSaver | None) -> Completion:
        """The requests of `rollout` until one finishes it, streamed into `saver` when the body asks to stream."""
        while True:
            request = rollout.payload()
            try:
                out = await self._answer(request, saver if request.get("stream") else None)
            except (TypeError, ValueError) as exc:  # a request SGLang refuses: it will refuse it again
                raise EngineError(f"sglang.Engine.async_generate refused the request: {type(exc).__name__}: {exc}",
                                  retriable=False) from exc
            except EngineError:
                raise
            except Exception as exc:
                raise EngineError(f"sglang.Engine.async_generate raised {type(exc).__name__}: {exc}",
                                  retriable=True) from exc
            done = rollout.add(parse_completion(out), " by in-process sglang")
            if done is not None:
                return done
            log.info("in-process sglang aborted a sample; issuing it again (%d continuations so far)",
                     rollout.continuations)

    async def _answer(self, request: Mapping[str, Any], saver: StreamSaver | None) -> Any:
        """One ``async_generate`` answer; with `saver`, streamed (its chunks joined, `saver` told of each).
        Raises what ``async_generate`` raises, and EngineError for a stream that ended refused."""
        kwargs = {"input_ids": request["input_ids"], "sampling_params": request["sampling_params"],
                  "return_logprob": True}
        if saver is None:
            return await self._engine.async_generate(**kwargs)
        joined = StreamedGenerate(saver)
        async for chunk in await self._engine.async_generate(**kwargs, stream=True):
            joined.add(chunk)
        out = joined.result()
        if (failure := refused(out)) is not None:
            raise failure
        return out

    async def reload(self, weights_path: str, version: int) -> bool:
        """Load `weights_path` as `version`: pause (samples in flight are aborted and continued afterwards),
        update with ``weight_version=str(version)``, continue. The old weights keep serving if it fails.

        Loads whatever `version` is (a new trainer run's may be lower than the one serving) and returns
        True. One reload at a time (the producer's `PolicyFollower` calls it so).
        Raises:
            EngineError: the engine is not started, this SGLang has no pause/continue, or the update failed
                or took longer than `update_timeout_s` (SGLang's message).
        """
        if self._engine is None:
            raise EngineError("SGLangEngine.reload called before start()", retriable=False)
        io = await in_thread(importlib.import_module, _IO_STRUCT, name="rollstream-sglang-reload")
        manager = self._engine.tokenizer_manager
        if not hasattr(io, "PauseGenerationReqInput"):
            raise EngineError("this SGLang has no PauseGenerationReqInput: upgrade SGLang to reload weights "
                              "in-process", retriable=False)
        await manager.pause_generation(io.PauseGenerationReqInput(mode="abort"))
        try:
            request = io.UpdateWeightFromDiskReqInput(model_path=str(weights_path), weight_version=str(version))
            result = await asyncio.wait_for(manager.update_weights_from_disk(request, None), self._update_timeout_s)
        except TimeoutError:
            raise EngineError(f"loading {weights_path} took longer than {self._update_timeout_s:g} s",
                              retriable=True) from None
        finally:
            await manager.continue_generation(io.ContinueGenerationReqInput())
        success, message = bool(result[0]), str(result[1])  # (success, message[, num_paused_requests])
        if not success:
            raise EngineError(f"sglang could not load {weights_path} as version {version}: {message}",
                              retriable=True)
        self._version = version
        log.info("in-process sglang serves policy version %d from %s", version, weights_path)
        return True
