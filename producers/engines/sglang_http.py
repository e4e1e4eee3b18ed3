"""SGLang over HTTP: the production engine (native ``/generate``; see `_sglang_format` for the wire format).

One or many server URLs (round robin, a retry moves to the next one) or one sglang-router URL. Each
sample is its own request, retried with exponential backoff and jitter on connection errors, timeouts,
HTTP 408/429/5xx and malformed bodies, up to `RetryPolicy.attempts`; an aborted request (finish_reason
``abort``, e.g. while weights are being updated) is re-issued up to `RetryPolicy.abort_attempts` and
never returned as a finished sample. Any other 4xx (a prompt the server refuses) fails at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from producers.engines._sglang_format import abort_message, parse_completion, request_payload
from producers.engines._tokenize import PromptEncoder, load_tokenizer
from producers.engines.base import DEFAULT_REQUEST_TIMEOUT_S, Completion, EngineError, Generation, SamplingParams
from schemas import ConfigError

log = logging.getLogger(__name__)
_RETRY_STATUS = frozenset({408, 429})


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries per sample. Backoff doubles from `backoff_s` up to `max_backoff_s`, with jitter."""

    attempts: int = 5
    abort_attempts: int = 20
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.abort_attempts < 0 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ConfigError(f"invalid retry policy {self}: attempts >= 1, the rest >= 0")

    def delay_s(self, failures: int, rng: random.Random) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, failures - 1)) * (0.5 + rng.random() / 2)


def normalize_url(url: str) -> str:
    """``host:port``, ``http://host:port/`` or ``.../generate`` -> ``http://host:port``."""
    url = url.strip().rstrip("/")
    if url.endswith("/generate"):
        url = url[: -len("/generate")]
    if "://" not in url:
        url = "http://" + url
    if not url.split("://", 1)[1]:
        raise ConfigError(f"--sglang-url {url!r} has no host")
    return url


class SGLangHTTPEngine:
    """Generates through SGLang servers. Use on one event loop; `start` before `generate`.

    Args:
        urls: server or router base URLs.
        tokenizer: a tokenizer directory (or loaded tokenizer) to send ``input_ids`` (chat template
            applied when it has one); None sends the prompt text and lets the server tokenize.
        timeout_s: per-request read timeout (a long generation is legitimately slow).
    """

    name = "sglang"

    def __init__(self, urls: Sequence[str], *, tokenizer: str | Path | Any | None = None, chat_template: bool = True,
                 timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, connect_timeout_s: float = 10.0,
                 retry: RetryPolicy | None = None,
                 max_connections: int = 512, seed: int | None = None) -> None:
        if isinstance(urls, str):
            urls = [urls]
        self._urls = [normalize_url(u) for part in urls for u in part.split(",") if u.strip()]
        if not self._urls:
            raise ConfigError("--engine sglang needs at least one --sglang-url")
        self._tokenizer_src = tokenizer
        self._chat_template = chat_template
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._retry = retry or RetryPolicy()
        self._rng = random.Random(seed)
        self._next = 0
        self._client: httpx.AsyncClient | None = None
        self._encoder: PromptEncoder | None = None

    @property
    def urls(self) -> list[str]:
        return list(self._urls)

    async def start(self) -> None:
        """Load the tokenizer (in a thread) and open the HTTP client. Idempotent."""
        if self._tokenizer_src is not None and self._encoder is None:
            tok = self._tokenizer_src
            if isinstance(tok, str | Path):
                tok = await asyncio.to_thread(load_tokenizer, tok)
            self._encoder = PromptEncoder(tok, chat_template=self._chat_template)
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout, limits=self._limits)

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    async def generate(self, prompt: Mapping[str, Any], n: int, sampling: SamplingParams) -> Generation:
        """`n` concurrent requests for `prompt`; if one gives up, the others are cancelled.

        Raises:
            EngineError: a sample failed after its retries (not retriable: the engine already retried).
        """
        if self._client is None:
            raise EngineError("SGLangHTTPEngine.generate called before start()", retriable=False)
        if self._encoder is not None:
            text, ids = await asyncio.to_thread(self._encoder.encode, prompt)
        elif isinstance(prompt["prompt"], str):
            text, ids = prompt["prompt"], None
        else:
            raise EngineError(f"prompt {prompt.get('id')!r} is a list of chat messages: pass --tokenizer so its "
                              "chat template can render them", retriable=False)
        payload = request_payload(text, ids, sampling.to_dict())
        completions = await gather_or_cancel([self._sample(payload) for _ in range(n)])
        return Generation(completions=completions, prompt_text=text, prompt_tokens=ids or ())

    async def _sample(self, payload: Mapping[str, Any]) -> Completion:
        failures = aborts = 0
        while True:
            url = self._pick_url()
            completion, error = await self._post_once(url, payload)
            if completion is not None and completion.finish_reason != "abort":
                return completion
            if completion is not None:
                aborts += 1
                if aborts > self._retry.abort_attempts:
                    raise EngineError(f"request aborted {aborts} times by {url} (last: "
                                      f"{error or 'abort'}); giving up", retriable=False)
                log.info("sglang request aborted by %s (%s); retrying", url, error or "abort")
                await asyncio.sleep(self._retry.delay_s(min(aborts, 3), self._rng))
                continue
            failures += 1
            if failures >= self._retry.attempts:
                raise EngineError(f"sglang /generate failed {failures} times; last: {error}", retriable=False)
            log.warning("sglang /generate failed (%s); retry %d/%d", error, failures, self._retry.attempts - 1)
            await asyncio.sleep(self._retry.delay_s(failures, self._rng))

    async def _post_once(self, url: str, payload: Mapping[str, Any]) -> tuple[Completion | None, str | None]:
        """One POST. Returns (completion, None), (aborted completion, message) or (None, retriable error).

        Raises:
            EngineError (not retriable): a 4xx the server will refuse again.
        """
        if self._client is None:
            raise EngineError("engine closed", retriable=False)
        try:
            resp = await self._client.post(f"{url}/generate", json=payload)
        except httpx.TimeoutException as exc:
            return None, f"{url}: timed out ({type(exc).__name__})"
        except httpx.TransportError as exc:
            return None, f"{url}: {type(exc).__name__}: {exc}"
        if resp.status_code >= 500 or resp.status_code in _RETRY_STATUS:
            return None, f"{url}: HTTP {resp.status_code}: {resp.text[:200]}"
        if resp.status_code >= 400:
            raise EngineError(f"{url} refused the request: HTTP {resp.status_code}: {resp.text[:300]}",
                              retriable=False)
        try:
            out = resp.json()
        except ValueError:
            return None, f"{url}: response is not JSON: {resp.text[:200]}"
        if isinstance(out, list) and len(out) == 1:
            out = out[0]
        completion = parse_completion(out)
        return completion, abort_message(out["meta_info"]) if completion.finish_reason == "abort" else None

    def _pick_url(self) -> str:
        url = self._urls[self._next % len(self._urls)]
        self._next += 1
        return url


async def gather_or_cancel(coros: Sequence[Awaitable[Completion]]) -> list[Completion]:
    """Run all; on the first failure cancel the rest and raise that failure (not an ExceptionGroup)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
