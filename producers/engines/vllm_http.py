"""vLLM over HTTP: its OpenAI-compatible ``/v1/completions`` (``vllm serve``; wire format in `_vllm_format`).

One or many server URLs, round robin (a retry moves to the next one). Each sample is its own request
(``n`` = 1, ``seed + i`` when a seed is set), run by the HTTP engines' one per-sample loop
(`_samples.run_sample`): retried with exponential backoff and jitter on connection errors, timeouts,
HTTP 408/429/5xx and malformed bodies, up to `RetryPolicy.attempts`, all within the group's `Deadline`;
any other 4xx (a prompt or parameter the server refuses) fails at once.

Weight updates. A server paused with mode ``abort`` or ``wait`` (``POST /pause``) refuses new requests
HTTP 503 until ``/resume`` (vLLM 0.33) or queues them (0.32); a request it held when the pause came comes
back aborted (finish reason ``abort``). One aborted before its first token was not run at all
(`_vllm_format.is_not_run`): like a 503 "paused", it is sent again after a backoff for as long as the
group's `Deadline` lasts, however long the update takes, and counts against nothing. One aborted with
partial output is never returned as a finished sample: with ``partial_rollouts="continue"`` (the default)
the next request continues it from prompt + its tokens on the new weights (``prompt`` as token ids,
``max_tokens`` reduced: `_vllm_format.continue_body`), at most `RetryPolicy.max_continuations` times, and
the segments are joined with a version span each (`_samples.PartialRollout`, the one SGLang uses); with
``"restart"`` it is issued again from scratch, at most `RetryPolicy.abort_attempts` times. Continuing needs
the prompt's token ids: the ones sent (with a tokenizer), else the ``prompt_token_ids`` vLLM returns with
every answer (``return_token_ids``), aborted ones included: exactly the ids it ran, so a text prompt is
continued too. Only a vLLM that returns none (before 0.10.2) restarts such samples.

Sampling options are sent under vLLM's names (`_sampling.vllm_options`); one vLLM has no name for is refused
at startup (`check_sampling`), never dropped silently as vLLM itself would (``extra="allow"``).

Logprobs: vLLM's are what rollstream records only for some ``--logprobs-mode`` and sampling combinations
(`_vllm_format.check_logprobs_contract`); the engine refuses the others before sending anything.

Whose job the weights are: by default the trainer's. vLLM's RL weight sync (``VLLM_SERVER_DEV_MODE=1``:
``/pause``, ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, ``/resume``) streams tensors from the trainer over NCCL or CUDA IPC, so the
trainer drives it and this engine only stamps versions: each request asks for ``return_weight_versions``
(vLLM >= 0.33), and a choice's ``weight_versions`` spans become the sample's version spans when their
labels are numbers (the trainer labels its updates with ``/finish_weight_update``'s ``weight_version`` or
``/update_weight_version``). Without them (an older vLLM, labels that are not numbers) each sample gets the
newest version announced on NS.control when its generation started (`rollstream.producers.policy`), never a
newer one than generated a token. `VLLMSyncEngine` (``rollstream produce --vllm-sync-weights``) is a
`ReloadableEngine`: the producer updates every server to each newer version announced on NS.control with
a ``weights_path``, from disk.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from rollstream.producers.engines._http import HTTPSession, RoundRobin, TokenizedSession, base_urls
from rollstream.producers.engines._resume import StreamSaver, checkpointed
from rollstream.producers.engines._retry import Deadline, RetryPolicy
from rollstream.producers.engines._samples import (
    PARTIAL_ROLLOUTS,
    Endpoint,
    PartialRollout,
    PartialRollouts,
    gather_or_cancel,
    run_sample,
)
from rollstream.producers.engines._vllm_format import (
    LOGPROBS_MODES,
    VLLM_MAX_TOKENS_DEFAULT,
    LogprobsMode,
    StreamedChoice,
    check_logprobs_contract,
    continue_body,
    is_not_run,
    is_paused_answer,
    parse_response,
    request_body,
    seeded,
)
from rollstream.producers.engines._weight_sync import FleetEngine, ServerFleet, control, read_version
from rollstream.producers.engines.base import (
    DEFAULT_REQUEST_TIMEOUT_S,
    Completion,
    EngineCapabilities,
    EngineError,
    Generation,
    SamplingParams,
)
from rollstream.producers.engines.progress import Progress
from rollstream.schemas import ConfigError

__all__ = ["LOGPROBS_MODES", "LogprobsMode", "VLLMHTTPEngine", "VLLMSyncEngine", "normalize_vllm_url"]

log = logging.getLogger(__name__)
_COMPLETIONS = "/v1/completions"
_SUFFIXES = (_COMPLETIONS, "/v1")  # what a --vllm-url may end in
_MODELS_TIMEOUT = httpx.Timeout(10.0)  # a name lookup at startup: never the generation's minutes
Ticket = Callable[[str], Awaitable[Callable[[Completion], Completion]]]


def normalize_vllm_url(url: str) -> str:
    """``host:port``, ``http://host:port/``, ``.../v1`` or ``.../v1/completions`` -> ``http://host:port``."""
    return base_urls(url, suffixes=_SUFFIXES, option="--vllm-url")[0]


class _Sample:
    """One sample's first request and its prompt's token ids: the ids sent, or the ``prompt_token_ids`` of
    its first answer (a text prompt, as vLLM tokenized it); the continuation of its partial output."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        self.body = body
        prompt = body["prompt"]
        self.prompt_ids: list[int] | None = [int(t) for t in prompt] if isinstance(prompt, list) else None

    def parse(self, out: Any) -> tuple[Completion, str]:
        completion, prompt_ids = parse_response(out)
        self.learn(prompt_ids)
        return completion, ""

    def learn(self, prompt_ids: Sequence[int] | None) -> None:
        """The prompt's token ids, from an answer or a checkpoint, unless known already."""
        if self.prompt_ids is None and prompt_ids is not None:
            self.prompt_ids = [int(t) for t in prompt_ids]

    def continued(self, prefix: Sequence[int]) -> dict[str, Any] | None:
        return None if self.prompt_ids is None else continue_body(self.body, self.prompt_ids, prefix)


class VLLMHTTPEngine(TokenizedSession):
    """Generates through vLLM servers (``vllm serve``). Use on one event loop; `start` before `generate`.

    Args:
        urls: server base URLs (``http://host:8000``; a trailing ``/v1`` is fine), or comma-separated lists.
        model: the served model name (``--served-model-name``); None: the first of the first server's
            ``GET /v1/models`` at `start`, or none sent (vLLM then uses its only model).
        tokenizer: a tokenizer directory (or loaded tokenizer) to send token ids (chat template applied
            when it has one); None sends the prompt text and vLLM tokenizes it (and returns its ids).
        timeout_s: per-request timeout (a long generation is legitimately slow), cut to what is left of
            the group's deadline.
        logprobs_mode: the ``--logprobs-mode`` the servers run with (see `check_logprobs_contract`).
        partial_rollouts: ``continue`` a sample aborted with partial output, or ``restart`` it.
        sampling: the producer's sampling parameters, checked against `logprobs_mode` here (so a producer
            fails at startup instead of failing every group); `generate` checks what it gets anyway.

    Raises:
        ConfigError: no URL, an unknown `logprobs_mode` or `partial_rollouts`, or `sampling` that mode
            cannot give logprobs for.
    """

    name = "vllm"
    capabilities = EngineCapabilities(takes_deadline=True, checks_sampling=True, saves_progress=True)

    def __init__(self, urls: Sequence[str], *, model: str | None = None, tokenizer: str | Path | Any | None = None,
                 chat_template: bool = True, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 connect_timeout_s: float = 10.0, retry: RetryPolicy | None = None,
                 logprobs_mode: LogprobsMode = "processed_logprobs", partial_rollouts: PartialRollouts = "continue",
                 max_connections: int = 512, seed: int | None = None, sampling: SamplingParams | None = None) -> None:
        self._servers = RoundRobin(base_urls(urls, suffixes=_SUFFIXES, option="--vllm-url"))
        if logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"--vllm-logprobs-mode {logprobs_mode!r}: use {' or '.join(LOGPROBS_MODES)}")
        if partial_rollouts not in PARTIAL_ROLLOUTS:
            raise ConfigError(f"--partial-rollouts {partial_rollouts!r}: use continue or restart")
        self._model = model
        self._http = HTTPSession(tokenizer, chat_template=chat_template, timeout_s=timeout_s,
                                 connect_timeout_s=connect_timeout_s, max_connections=max_connections)
        self._retry = retry or RetryPolicy()
        self._logprobs_mode: LogprobsMode = logprobs_mode
        self._partial: PartialRollouts = partial_rollouts
        self._ticket: Ticket | None = None  # VLLMSyncEngine's: stamps the version each server served
        self._rng = random.Random(seed)
        if sampling is not None:
            self.check_sampling(sampling)

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Raise ConfigError (naming the fix) for a sampling option vLLM has no name for, or when vLLM's
        logprobs under `sampling` are not what rollstream records (`check_logprobs_contract`). No I/O."""
        try:
            check_logprobs_contract(self._logprobs_mode, request_body("", (), sampling.to_dict(), model=None))
        except EngineError as exc:
            raise ConfigError(str(exc)) from exc

    @property
    def urls(self) -> list[str]:
        return list(self._servers.urls)

    @property
    def model(self) -> str | None:
        """The model name sent with every request (None: none sent)."""
        return self._model

    async def start(self) -> None:
        """Load the tokenizer (in a thread), open the HTTP client and, without `model`, read the served
        model's name (best effort: a server that does not answer yet is not an error). Idempotent."""
        if await self._http.start() and self._model is None:
            self._model = await self._served_model(self._servers.urls[0])

    async def close(self) -> None:
        await self._http.close()

    async def generate(self, prompt: Mapping[str, Any], n: int, sampling: SamplingParams, *,
                       deadline: Deadline | None = None, progress: Progress | None = None) -> Generation:
        """`n` concurrent requests for `prompt`, all within `deadline` (None: each request's own timeout
        only); if one gives up, the others are cancelled. With `progress` (checkpoints), a sample with a
        checkpoint continues from it, and each request streams, its state saved every `Progress.interval_s`
        seconds and once finished (`_resume`).

        Raises:
            EngineError: sampling whose logprobs vLLM cannot give as rollstream records them, or a chat
                prompt without a tokenizer (not retriable); a sample failed after its retries or kept
                being aborted (not retriable: the engine already retried); aborted with partial output
                more than ``max_continuations`` times, or the deadline ran out (retriable).
        """
        deadline = deadline or Deadline.after(None)
        text, ids = await self._http.prompt_input(prompt)
        completions, served_ids = await self._samples(text, ids, n, sampling, deadline, progress)
        prompt_tokens = ids if ids is not None else (served_ids or ())
        return Generation(completions=completions, prompt_text=text, prompt_tokens=prompt_tokens)

    async def generate_tokens(self, input_ids: Sequence[int], n: int, sampling: SamplingParams, *,
                              deadline: Deadline | None = None) -> list[Completion]:
        """`n` completions continuing `input_ids` exactly as given (no template, no re-tokenisation): the
        token-in/token-out policy of `rollstream.producers.multiturn`. Raises EngineError as `generate`."""
        ids = [int(t) for t in input_ids]
        return (await self._samples("", ids, n, sampling, deadline or Deadline.after(None)))[0]

    async def _samples(self, text: str, ids: Sequence[int] | None, n: int, sampling: SamplingParams,
                       deadline: Deadline, progress: Progress | None = None
                       ) -> tuple[list[Completion], list[int] | None]:
        """The completions, and the prompt's token ids as vLLM ran them (None when it did not say)."""
        if self._http.client is None:
            raise EngineError("VLLMHTTPEngine used before start()", retriable=False)
        body = request_body(text, ids, sampling.to_dict(), model=self._model)
        check_logprobs_contract(self._logprobs_mode, body)
        if progress is not None and progress.interval_s > 0:
            body["stream"] = True  # the state is saved as it streams
        samples = [_Sample(seeded(body, i)) for i in range(n)]
        completions = await gather_or_cancel([self._sample(s, deadline, i, progress) for i, s in enumerate(samples)])
        return completions, next((s.prompt_ids for s in samples if s.prompt_ids is not None), None)

    async def _sample(self, sample: _Sample, deadline: Deadline, index: int = 0,
                      progress: Progress | None = None) -> Completion:
        """One sample, retried, waited out, continued or re-issued as the module docstring says; resumed from
        its checkpoint and saved as it streams, with `progress`."""
        r = self._retry
        rollout = PartialRollout(sample.body, continued=sample.continued, mode=self._partial,
                                 max_new=int(sample.body.get("max_tokens", VLLM_MAX_TOKENS_DEFAULT)),
                                 max_continuations=r.max_continuations, abort_attempts=r.abort_attempts)
        # a text prompt's token ids come with its first answer, or with the checkpoint of a producer that had it
        return await checkpointed(progress, index, rollout, prompt_ids=lambda: sample.prompt_ids, learn=sample.learn,
                                  run=lambda saver: self._run(sample, rollout, deadline, saver))

    async def _run(self, sample: _Sample, rollout: PartialRollout, deadline: Deadline,
                   saver: StreamSaver | None) -> Completion:
        """The requests of `rollout` (`run_sample`), streamed into `saver` when the body asks to stream (learning a
        text prompt's token ids from its first chunk)."""
        streams = saver is not None and bool(sample.body.get("stream"))

        def on_tokens(chunks: StreamedChoice) -> None:
            if sample.prompt_ids is None:  # once: not a copy of the prompt's ids per token
                sample.learn(chunks.prompt_ids())
            if saver is not None:
                saver(chunks)

        endpoint = Endpoint(label=f"vllm {_COMPLETIONS}", path=_COMPLETIONS, parse=sample.parse,
                            paused=is_paused_answer, not_run=is_not_run, ticket=self._ticket,
                            stream=(lambda: StreamedChoice(on_tokens)) if streams else None)
        return await run_sample(self._http, self._servers, endpoint, rollout, retry=self._retry, deadline=deadline,
                                rng=self._rng)

    async def _served_model(self, url: str) -> str | None:
        if self._http.client is None:
            return None
        try:
            resp = await self._http.client.get(f"{url}/v1/models", timeout=_MODELS_TIMEOUT)
            resp.raise_for_status()
            return str(resp.json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            log.warning("could not read the served model of %s (%s): requests name no model", url, exc)
            return None


_DEV_MODE = ("start vLLM with VLLM_SERVER_DEV_MODE=1: --vllm-sync-weights needs its development routes "
             "(/pause, /collective_rpc, /update_weight_version, /resume, /weight_info)")


class VLLMSyncEngine(FleetEngine, VLLMHTTPEngine):
    """vLLM servers whose weights this producer updates (``--vllm-sync-weights``): a `ReloadableEngine`.

    Give the servers' own URLs, each started with ``VLLM_SERVER_DEV_MODE=1`` and able to read every
    ``weights_path`` (a shared file system). For each version to load, each server in turn of its own
    (concurrently) gets ``POST /pause?mode=abort`` (the samples it runs come back with their partial output
    and are continued on the new weights), ``POST /collective_rpc`` ``reload_weights`` with the
    ``weights_path`` (the worker's ``reload_weights(weights_path=...)``, in place, vllm/v1/worker/
    gpu_model_runner.py, 0.32.0), ``POST /update_weight_version`` with the version (so ``GET /weight_info``
    and vLLM 0.33's per-token spans say it), and ``POST /resume``, whatever failed before it
    (`_weight_sync.ServerFleet`, shared with `SGLangSyncEngine`). The version each server serves is read at
    `start` from ``GET /weight_info`` (``"default"`` or another non-number: unknown). vLLM 0.32 reports no
    per-token versions; each segment of a sample is then stamped with the version its server served while
    it ran, which the engine knows from when it was sent and answered (`ServerFleet.ticket`, which says why).
    Spans vLLM reports (0.33) win. Arguments as `VLLMHTTPEngine`, and the timeouts of the control calls
    and of a reload.

    Raises:
        ConfigError: as `VLLMHTTPEngine`, or (at `start`) a server without the development routes.
    """

    capabilities = EngineCapabilities(takes_deadline=True, checks_sampling=True, reloads_weights=True,
                                      saves_progress=True)

    def __init__(self, urls: Sequence[str], *, model: str | None = None, tokenizer: str | Path | Any | None = None,
                 chat_template: bool = True, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 connect_timeout_s: float = 10.0, retry: RetryPolicy | None = None,
                 logprobs_mode: LogprobsMode = "processed_logprobs", partial_rollouts: PartialRollouts = "continue",
                 max_connections: int = 512, seed: int | None = None, sampling: SamplingParams | None = None,
                 control_timeout_s: float = 30.0, update_timeout_s: float = 600.0) -> None:
        super().__init__(urls, model=model, tokenizer=tokenizer, chat_template=chat_template, timeout_s=timeout_s,
                         connect_timeout_s=connect_timeout_s, retry=retry, logprobs_mode=logprobs_mode,
                         partial_rollouts=partial_rollouts, max_connections=max_connections, seed=seed,
                         sampling=sampling)
        if not (control_timeout_s > 0 and update_timeout_s > 0):
            raise ConfigError(f"weight sync timeouts must be > 0: {control_timeout_s}, {update_timeout_s}")
        self._control_timeout_s = control_timeout_s
        self._fleet = ServerFleet(self.urls)
        self._ticket = self._fleet.ticket
        self._steps = _VLLMSteps(self._http, control_timeout_s, update_timeout_s)

    async def _read_version(self, url: str) -> int | None:
        """``weight_version`` of ``GET /weight_info`` (``"default"`` or another non-number: None). Raises
        ConfigError for a server without the development routes (404)."""
        found, version = await read_version(self._http.client, url, "/weight_info",
                                            timeout_s=self._control_timeout_s,
                                            connect_timeout_s=self._http.connect_timeout_s)
        if not found:
            raise ConfigError(f"{url}/weight_info: HTTP 404: {_DEV_MODE}")
        return version


class _VLLMSteps:
    """vLLM's steps of one server's update (`_weight_sync.UpdateSteps`)."""

    label = "vLLM"

    def __init__(self, http: HTTPSession, control_timeout_s: float, update_timeout_s: float) -> None:
        self._http = http
        self._control_timeout_s = control_timeout_s
        self._update_timeout_s = update_timeout_s

    async def pause(self, url: str) -> None:
        await self._post(url, "/pause?mode=abort", None)

    async def load(self, url: str, weights_path: str, version: int) -> None:
        # collective_rpc passes string kwargs only (vllm/entrypoints/serve/dev/rpc/api_router.py)
        await self._post(url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": weights_path}},
                         self._update_timeout_s)

    async def label_version(self, url: str, version: int) -> None:
        await self._post(url, "/update_weight_version", {"new_version": str(version)})

    async def resume(self, url: str) -> None:
        await self._post(url, "/resume", None)

    async def _post(self, url: str, path: str, body: Mapping[str, Any] | None, timeout_s: float | None = None) -> None:
        await control(self._http.client, url, path, body, timeout_s=timeout_s or self._control_timeout_s,
                      connect_timeout_s=self._http.connect_timeout_s, not_found=_DEV_MODE)
