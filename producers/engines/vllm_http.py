"""vLLM over HTTP: its OpenAI-compatible ``/v1/completions`` (``vllm serve``; wire format in `_vllm_format`).

One or many server URLs, round robin (a retry moves to the next one). Each sample is its own request
(``n`` = 1, ``seed + i`` when a seed is set), run by the HTTP engines' one per-sample loop
(`_samples.run_sample`): retried with exponential backoff and jitter on connection errors, timeouts,
HTTP 408/429/5xx and malformed bodies, up to `RetryPolicy.attempts`, all within the group's `Deadline`;
any other 4xx (a prompt or parameter the server refuses) fails at once. A sample vLLM aborted (finish
reason ``abort``: ``POST /pause?mode=abort`` around a weight update, a server shutting down) is never
returned as a finished sample: it is issued again from scratch (`_samples.Reissue`), at most
`RetryPolicy.abort_attempts` times, whatever ``--partial-rollouts`` says (continuing a partial output is
SGLang's; here a restarted sample is simply generated on whatever weights serve then). A server paused
with mode ``abort`` or ``wait`` answers new requests HTTP 503 until ``/resume`` (vLLM 0.33): the engine
waits that out for as long as the group's `Deadline` lasts, however long the weight update takes.

Sampling options are sent under vLLM's names (`_sampling.vllm_options`); one vLLM has no name for is refused
at startup (`check_sampling`), never dropped silently as vLLM itself would (``extra="allow"``).

Logprobs: vLLM's are what rollstream records only for some ``--logprobs-mode`` and sampling combinations
(`_vllm_format.check_logprobs_contract`); the engine refuses the others before sending anything.

Weights: vLLM has no stable HTTP endpoint that loads a checkpoint from a path. Its RL weight sync
(``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, ``/resume``) streams tensors from the trainer over
NCCL or CUDA IPC, so the trainer drives it, not the producer; this engine only stamps versions: each
request asks for ``return_weight_versions`` (vLLM >= 0.33), and a choice's ``weight_versions`` spans become
the sample's version spans when their labels are numbers (the trainer labels its updates with
``/finish_weight_update``'s ``weight_version`` or ``/update_weight_version``). Without them (an older vLLM,
labels that are not numbers) each sample gets the newest version announced on NS.control when its
generation started (`rollstream.producers.policy`), never a newer one than generated a token.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from rollstream.producers.engines._http import HTTPSession, RoundRobin, TokenizedSession, base_urls
from rollstream.producers.engines._retry import Deadline, RetryPolicy
from rollstream.producers.engines._samples import Endpoint, Reissue, gather_or_cancel, run_sample
from rollstream.producers.engines._vllm_format import (
    LOGPROBS_MODES,
    LogprobsMode,
    check_logprobs_contract,
    is_paused_answer,
    parse_response,
    request_body,
    seeded,
)
from rollstream.producers.engines.base import (
    DEFAULT_REQUEST_TIMEOUT_S,
    Completion,
    EngineError,
    Generation,
    SamplingParams,
)
from rollstream.schemas import ConfigError

__all__ = ["LOGPROBS_MODES", "LogprobsMode", "VLLMHTTPEngine", "normalize_vllm_url"]

log = logging.getLogger(__name__)
_COMPLETIONS = "/v1/completions"
_SUFFIXES = (_COMPLETIONS, "/v1")  # what a --vllm-url may end in
_MODELS_TIMEOUT = httpx.Timeout(10.0)  # a name lookup at startup: never the generation's minutes


def normalize_vllm_url(url: str) -> str:
    """``host:port``, ``http://host:port/``, ``.../v1`` or ``.../v1/completions`` -> ``http://host:port``."""
    return base_urls(url, suffixes=_SUFFIXES, option="--vllm-url")[0]


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
        sampling: the producer's sampling parameters, checked against `logprobs_mode` here (so a producer
            fails at startup instead of failing every group); `generate` checks what it gets anyway.

    Raises:
        ConfigError: no URL, an unknown `logprobs_mode`, or `sampling` that mode cannot give logprobs for.
    """

    name = "vllm"

    def __init__(self, urls: Sequence[str], *, model: str | None = None, tokenizer: str | Path | Any | None = None,
                 chat_template: bool = True, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 connect_timeout_s: float = 10.0, retry: RetryPolicy | None = None,
                 logprobs_mode: LogprobsMode = "processed_logprobs", max_connections: int = 512,
                 seed: int | None = None, sampling: SamplingParams | None = None) -> None:
        self._servers = RoundRobin(base_urls(urls, suffixes=_SUFFIXES, option="--vllm-url"))
        if logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"--vllm-logprobs-mode {logprobs_mode!r}: use {' or '.join(LOGPROBS_MODES)}")
        self._model = model
        self._http = HTTPSession(tokenizer, chat_template=chat_template, timeout_s=timeout_s,
                                 connect_timeout_s=connect_timeout_s, max_connections=max_connections)
        self._retry = retry or RetryPolicy()
        self._logprobs_mode: LogprobsMode = logprobs_mode
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
                       deadline: Deadline | None = None) -> Generation:
        """`n` concurrent requests for `prompt`, all within `deadline` (None: each request's own timeout
        only); if one gives up, the others are cancelled.

        Raises:
            EngineError: sampling whose logprobs vLLM cannot give as rollstream records them, or a chat
                prompt without a tokenizer (not retriable); a sample failed after its retries or kept
                being aborted (not retriable: the engine already retried); the deadline ran out (retriable).
        """
        deadline = deadline or Deadline.after(None)
        text, ids = await self._http.prompt_input(prompt)
        served_ids: list[list[int]] = []  # the prompt's ids as vLLM tokenized it, when it says
        completions = await self._samples(text, ids, n, sampling, served_ids, deadline)
        prompt_tokens = ids if ids is not None else (served_ids[0] if served_ids else ())
        return Generation(completions=completions, prompt_text=text, prompt_tokens=prompt_tokens)

    async def generate_tokens(self, input_ids: Sequence[int], n: int, sampling: SamplingParams, *,
                              deadline: Deadline | None = None) -> list[Completion]:
        """`n` completions continuing `input_ids` exactly as given (no template, no re-tokenisation): the
        token-in/token-out policy of `rollstream.producers.multiturn`. Raises EngineError as `generate`."""
        return await self._samples("", [int(t) for t in input_ids], n, sampling, [], deadline or Deadline.after(None))

    async def _samples(self, text: str, ids: Sequence[int] | None, n: int, sampling: SamplingParams,
                       served_ids: list[list[int]], deadline: Deadline) -> list[Completion]:
        if self._http.client is None:
            raise EngineError("VLLMHTTPEngine used before start()", retriable=False)
        body = request_body(text, ids, sampling.to_dict(), model=self._model)
        check_logprobs_contract(self._logprobs_mode, body)
        return await gather_or_cancel([self._sample(seeded(body, i), served_ids, deadline) for i in range(n)])

    async def _sample(self, body: Mapping[str, Any], served_ids: list[list[int]], deadline: Deadline) -> Completion:
        """One sample, retried and re-issued as the module docstring says; appends the prompt token ids
        vLLM returns to `served_ids`."""
        def parse(out: Any) -> tuple[Completion, str]:
            completion, prompt_ids = parse_response(out)
            if prompt_ids is not None:
                served_ids.append(prompt_ids)
            return completion, ""

        endpoint = Endpoint(label=f"vllm {_COMPLETIONS}", path=_COMPLETIONS, parse=parse, paused=is_paused_answer)
        return await run_sample(self._http, self._servers, endpoint, Reissue(body, self._retry.abort_attempts),
                                retry=self._retry, deadline=deadline, rng=self._rng)

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

