"""SGLang over HTTP: the production engine (native ``/generate``; see `_sglang_format` for the wire format).

One or many server URLs (round robin, a retry moves to the next one) or one sglang-router URL. Each
sample is its own request, run by the HTTP engines' one per-sample loop (`_samples.run_sample`): retried
with exponential backoff and jitter on connection errors, timeouts, HTTP 408/429/5xx and malformed
bodies, up to `RetryPolicy.attempts`, all within the group's `Deadline` (each request waits at most
``min(timeout_s, what is left)``). Any other 4xx (a prompt the server refuses) fails at once. An aborted
request (finish_reason ``abort``, e.g. a weight update) is never returned as a finished sample: with
``partial_rollouts="continue"`` (the default) its tokens are kept and a new request continues it from
prompt + tokens on the new weights, at most `RetryPolicy.max_continuations` times; with ``"restart"`` it
is issued again from scratch, at most `RetryPolicy.abort_attempts` times (see `_samples.PartialRollout`).

In-flight checkpoints (a `Progress`, ``--checkpoint-interval``): each request streams (``"stream": true``,
joined by `_sglang_format.StreamedGenerate` into the answer a request that does not stream gets) and the
sample's output so far is saved every `Progress.interval_s` seconds and once it finishes; a sample restored
from a checkpoint is continued from prompt + its tokens as an aborted one is, a finished one kept (`_resume`).

Whose job the weights are: by default the trainer updates the servers itself (SGLang's
``/update_weights_from_disk`` or its NCCL path) and the producer only reads the versions SGLang reports.
`SGLangSyncEngine` (``rollstream produce --sglang-sync-weights``) is a `ReloadableEngine`: the producer
updates every server to each newer version announced on NS.control with a ``weights_path``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

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
from rollstream.producers.engines._sampling import sglang_options
from rollstream.producers.engines._sglang_format import (
    StreamedGenerate,
    abort_message,
    parse_completion,
    partial_rollout,
    refused,
    request_payload,
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

__all__ = ["PARTIAL_ROLLOUTS", "PartialRollouts", "RetryPolicy", "SGLangHTTPEngine", "SGLangSyncEngine", "WeightSync",
           "gather_or_cancel", "normalize_url"]

log = logging.getLogger(__name__)


def normalize_url(url: str) -> str:
    """``host:port``, ``http://host:port/`` or ``.../generate`` -> ``http://host:port``."""
    return base_urls(url, suffixes=("/generate",), option="--sglang-url")[0]


def parse_answer(out: Any) -> tuple[Completion, str]:
    """One ``/generate`` answer (SGLang may wrap it in a list of one) -> (completion, why it was aborted).

    Raises:
        EngineError: not of SGLang's shape (not retriable), or a streamed answer that ended refused
            (`_sglang_format.refused`: retriable as its HTTP status would be).
    """
    if isinstance(out, list) and len(out) == 1:
        out = out[0]
    if (failure := refused(out)) is not None:
        raise failure
    completion = parse_completion(out)
    return completion, abort_message(out["meta_info"]) if completion.finish_reason == "abort" else ""


_GENERATE = Endpoint(label="sglang /generate", path="/generate", parse=parse_answer)


class SGLangHTTPEngine(TokenizedSession):
    """Generates through SGLang servers. Use on one event loop; `start` before `generate`.

    Args:
        urls: server or router base URLs.
        tokenizer: a tokenizer directory (or loaded tokenizer) to send ``input_ids`` (chat template
            applied when it has one); None sends the prompt text and lets the server tokenize (an
            aborted sample is then restarted, not continued: its prompt's token ids are not known here).
        timeout_s: per-request timeout (a long generation is legitimately slow), cut to what is left of
            the group's deadline.
        partial_rollouts: ``continue`` an aborted sample from its partial output, or ``restart`` it.
    """

    name = "sglang"
    capabilities = EngineCapabilities(takes_deadline=True, checks_sampling=True, saves_progress=True)

    def __init__(self, urls: Sequence[str], *, tokenizer: str | Path | Any | None = None, chat_template: bool = True,
                 timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, connect_timeout_s: float = 10.0,
                 retry: RetryPolicy | None = None, partial_rollouts: PartialRollouts = "continue",
                 max_connections: int = 512, seed: int | None = None, sampling: SamplingParams | None = None) -> None:
        self._servers = RoundRobin(base_urls(urls, suffixes=("/generate",), option="--sglang-url"))
        if partial_rollouts not in PARTIAL_ROLLOUTS:
            raise ConfigError(f"--partial-rollouts {partial_rollouts!r}: use continue or restart")
        self._http = HTTPSession(tokenizer, chat_template=chat_template, timeout_s=timeout_s,
                                 connect_timeout_s=connect_timeout_s, max_connections=max_connections)
        self._retry = retry or RetryPolicy()
        self._partial: PartialRollouts = partial_rollouts
        self._rng = random.Random(seed)
        if sampling is not None:
            self.check_sampling(sampling)

    @staticmethod
    def check_sampling(sampling: SamplingParams) -> None:
        """Raise ConfigError (naming SGLang's options) for a sampling option SGLang has no name for (SGLang
        0.5.23 refuses every request that carries one). No I/O."""
        try:
            sglang_options(sampling.to_dict())
        except EngineError as exc:
            raise ConfigError(str(exc)) from exc

    @property
    def urls(self) -> list[str]:
        return list(self._servers.urls)

    async def start(self) -> None:
        """Load the tokenizer (in a thread) and open the HTTP client. Idempotent."""
        await self._http.start()

    async def close(self) -> None:
        await self._http.close()

    async def generate(self, prompt: Mapping[str, Any], n: int, sampling: SamplingParams, *,
                       deadline: Deadline | None = None, progress: Progress | None = None) -> Generation:
        """`n` concurrent requests for `prompt`, all within `deadline` (None: each request's own timeout
        only); if one gives up, the others are cancelled. With `progress` (checkpoints), a sample with a
        checkpoint continues from it (with the prompt's token ids: a tokenizer), and each request streams,
        its state saved every `Progress.interval_s` seconds and once finished (`_resume`).

        Raises:
            EngineError: a sample failed after its retries (not retriable: the engine already retried);
                was aborted more than ``max_continuations`` times with partial output, or the deadline
                ran out (retriable).
        """
        if self._http.client is None:
            raise EngineError("SGLangHTTPEngine.generate called before start()", retriable=False)
        text, ids = await self._http.prompt_input(prompt)
        payload = request_payload(text, ids, sampling.to_dict())
        if progress is not None and progress.interval_s > 0:
            payload["stream"] = True  # the state is saved as it streams
        completions = await self._samples(payload, n, deadline, progress)
        return Generation(completions=completions, prompt_text=text, prompt_tokens=ids or ())

    async def generate_tokens(self, input_ids: Sequence[int], n: int, sampling: SamplingParams, *,
                              deadline: Deadline | None = None) -> list[Completion]:
        """`n` completions continuing `input_ids` exactly as given (no template, no re-tokenisation): the
        token-in/token-out policy of `rollstream.producers.multiturn`. Raises EngineError as `generate`."""
        if self._http.client is None:
            raise EngineError("SGLangHTTPEngine.generate_tokens called before start()", retriable=False)
        return await self._samples(request_payload("", [int(t) for t in input_ids], sampling.to_dict()), n,
                                   deadline)

    async def _samples(self, payload: Mapping[str, Any], n: int, deadline: Deadline | None,
                       progress: Progress | None = None) -> list[Completion]:
        deadline = deadline or Deadline.after(None)
        return await gather_or_cancel([self._sample(seeded(payload, i), deadline, i, progress) for i in range(n)])

    async def _sample(self, payload: Mapping[str, Any], deadline: Deadline, index: int = 0,
                      progress: Progress | None = None) -> Completion:
        """One sample, retried and continued as the module docstring says; resumed from its checkpoint and
        saved as it streams, with `progress`."""
        r = self._retry
        rollout = partial_rollout(payload, mode=self._partial, max_continuations=r.max_continuations,
                                 abort_attempts=r.abort_attempts)
        return await checkpointed(progress, index, rollout, prompt_ids=lambda: payload.get("input_ids"),
                                  run=lambda saver: self._run(payload, rollout, deadline, saver))

    async def _run(self, payload: Mapping[str, Any], rollout: PartialRollout, deadline: Deadline,
                   saver: StreamSaver | None) -> Completion:
        """The requests of `rollout` (`run_sample`), streamed into `saver` when the body asks to stream."""
        streams = saver is not None and bool(payload.get("stream"))
        endpoint = replace(_GENERATE, stream=lambda: StreamedGenerate(saver)) if streams else _GENERATE
        return await run_sample(self._http, self._servers, endpoint, rollout, retry=self._retry, deadline=deadline,
                                rng=self._rng)


@dataclass(frozen=True)
class WeightSync:
    """How `SGLangSyncEngine` updates a server: ``/pause_generation`` with `pause_mode` (``abort``: samples in
    flight come back with their partial output and are continued on the new weights; ``retract``: SGLang
    holds them and continues them itself, reporting both versions in ``weight_versions``), then
    ``/update_weights_from_disk`` (up to `update_timeout_s`), then ``/continue_generation``."""

    pause_mode: Literal["abort", "retract"] = "abort"
    control_timeout_s: float = 30.0
    update_timeout_s: float = 600.0  # loading a large checkpoint from disk takes minutes
    load_format: str | None = None

    def __post_init__(self) -> None:
        if self.pause_mode not in ("abort", "retract"):
            raise ConfigError(f"pause_mode {self.pause_mode!r}: use abort or retract")
        if not (self.control_timeout_s > 0 and self.update_timeout_s > 0):
            raise ConfigError(f"weight sync timeouts must be > 0: {self}")


class SGLangSyncEngine(FleetEngine, SGLangHTTPEngine):
    """SGLang servers whose weights this producer updates (``--sglang-sync-weights``): a `ReloadableEngine`.

    Give the servers' own URLs (not a router's): each one is paused, updated and continued on its own,
    concurrently (``/pause_generation``, ``/update_weights_from_disk`` with ``weight_version``,
    ``/continue_generation``: `_weight_sync.ServerFleet`, shared with `VLLMSyncEngine`). The servers must read
    `weights_path` (a shared file system) and report ``weight_version`` (so each sample is stamped with the
    version of the server that generated it); the version each serves is read at `start` (`_read_version`).
    Arguments as `SGLangHTTPEngine`, and `sync` (`WeightSync`: pause mode, timeouts, load format).
    """

    capabilities = EngineCapabilities(takes_deadline=True, checks_sampling=True, reloads_weights=True,
                                      saves_progress=True)

    def __init__(self, urls: Sequence[str], *, tokenizer: str | Path | Any | None = None, chat_template: bool = True,
                 timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, connect_timeout_s: float = 10.0,
                 retry: RetryPolicy | None = None, partial_rollouts: PartialRollouts = "continue",
                 max_connections: int = 512, seed: int | None = None, sync: WeightSync | None = None,
                 sampling: SamplingParams | None = None) -> None:
        super().__init__(urls, tokenizer=tokenizer, chat_template=chat_template, timeout_s=timeout_s,
                         connect_timeout_s=connect_timeout_s, retry=retry, partial_rollouts=partial_rollouts,
                         max_connections=max_connections, seed=seed, sampling=sampling)
        self._sync = sync or WeightSync()
        self._fleet = ServerFleet(self.urls)
        self._steps = _SGLangSteps(self._http, self._sync)

    async def _read_version(self, url: str) -> int | None:
        """``weight_version`` of ``GET /model_info`` (SGLang >= 0.5.15; 0.5.23 has no other route), else of
        ``GET /get_weight_version`` (older servers, which lack ``/model_info``); None when neither says."""
        for route in ("/model_info", "/get_weight_version"):
            found, version = await read_version(self._http.client, url, route, timeout_s=self._sync.control_timeout_s,
                                                connect_timeout_s=self._http.connect_timeout_s)
            if found:
                return version
        return None


class _SGLangSteps:
    """SGLang's steps of one server's update (`_weight_sync.UpdateSteps`)."""

    label = "SGLang"

    def __init__(self, http: HTTPSession, sync: WeightSync) -> None:
        self._http = http
        self._sync = sync

    async def pause(self, url: str) -> None:
        await self._post(url, "/pause_generation", {"mode": self._sync.pause_mode})

    async def load(self, url: str, weights_path: str, version: int) -> None:
        body: dict[str, Any] = {"model_path": weights_path, "weight_version": str(version)}
        if self._sync.load_format is not None:
            body["load_format"] = self._sync.load_format
        await self._post(url, "/update_weights_from_disk", body, self._sync.update_timeout_s)

    async def label_version(self, url: str, version: int) -> None:
        pass  # /update_weights_from_disk set it

    async def resume(self, url: str) -> None:
        await self._post(url, "/continue_generation", {})

    async def _post(self, url: str, path: str, body: Mapping[str, Any], timeout_s: float | None = None) -> None:
        await control(self._http.client, url, path, body, timeout_s=timeout_s or self._sync.control_timeout_s,
                      connect_timeout_s=self._http.connect_timeout_s)
