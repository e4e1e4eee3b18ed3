"""What the HTTP engines (SGLang's `/generate`, vLLM's `/v1/completions`) share: their server list, their
client, prompt encoder and tokenizer threads, the prompt they send, and how one POST's failure is
classified (their per-sample loop is `_samples`). Loop-only; never blocks the loop."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import httpx
from rollstream.infra.threads import ThreadPool
from rollstream.producers.engines._retry import Deadline
from rollstream.producers.engines._tokenize import PromptEncoder, load_tokenizer
from rollstream.producers.engines.base import EngineError
from rollstream.schemas import ConfigError

RETRY_STATUS = frozenset({408, 429})  # with every 5xx: the server may answer next time
_TOKENIZE_THREADS = 4  # fast tokenizers release the GIL; a few threads keep up with many groups


def base_urls(urls: str | Sequence[str], *, suffixes: Iterable[str], option: str) -> list[str]:
    """Each of `urls` (repeated or comma-separated) as ``http://host:port``, without a trailing `suffixes`
    path. Raises ConfigError naming `option` when one has no host, or when none is given."""
    parts = [urls] if isinstance(urls, str) else urls
    out = []
    for raw in (u for part in parts for u in part.split(",") if u.strip()):
        url = raw.strip().rstrip("/")
        for suffix in suffixes:
            if url.endswith(suffix):
                url = url[: -len(suffix)]
        if "://" not in url:
            url = "http://" + url
        if not url.split("://", 1)[1]:
            raise ConfigError(f"{option} {url!r} has no host")
        out.append(url)
    if not out:
        raise ConfigError(f"this engine needs at least one {option}")
    return out


class RoundRobin:
    """The next server of a list, in turn."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self._next = 0

    def pick(self) -> str:
        url = self.urls[self._next % len(self.urls)]
        self._next += 1
        return url


class HTTPSession:
    """An HTTP engine's client (opened by `start`, closed by `close`) and, with a tokenizer (a name or
    path loaded at start, or a tokenizer object), its prompt encoder and the ``rollstream-tokenize`` threads
    it runs in (its own: never behind user code or other infrastructure). Loop-only."""

    def __init__(self, tokenizer: str | Path | Any | None, *, chat_template: bool, timeout_s: float,
                 connect_timeout_s: float, max_connections: int) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.client: httpx.AsyncClient | None = None
        self.encoder: PromptEncoder | None = None
        self.threads: ThreadPool | None = None
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)

    async def start(self) -> bool:
        """Load the tokenizer (in a thread) and open the client. Idempotent; True when it opened the client."""
        if self._tokenizer is not None and self.encoder is None:
            if self.threads is None:
                self.threads = ThreadPool("rollstream-tokenize", _TOKENIZE_THREADS)
            tok = self._tokenizer
            if isinstance(tok, str | Path):
                tok = await self.threads.run(load_tokenizer, tok)
            self.encoder = PromptEncoder(tok, chat_template=self._chat_template)
        if self.client is not None:
            return False
        self.client = httpx.AsyncClient(timeout=self._timeout, limits=self._limits)
        return True

    async def close(self) -> None:
        """Close the client and the tokenizer threads. Idempotent."""
        if self.threads is not None:
            threads, self.threads, self.encoder = self.threads, None, None
            threads.close()
        if self.client is not None:
            client, self.client = self.client, None
            await client.aclose()

    @property
    def tokenizer(self) -> Any:
        """The loaded tokenizer (read-only: thread-safe to encode and decode with).

        Raises:
            EngineError (not retriable): none was given (pass --tokenizer), or read before `start`.
        """
        if self.encoder is None:
            raise self._no_encoder()
        return self.encoder.tokenizer

    async def prompt_ids(self, prompt: Mapping[str, Any]) -> tuple[str, list[int]]:
        """The prompt as the model sees it (chat template applied) and its token ids, encoded in a tokenizer
        thread. Raises EngineError (not retriable) as `tokenizer`, or as `PromptEncoder.encode`."""
        if self.encoder is None or self.threads is None:
            raise self._no_encoder()
        return await self.threads.run(self.encoder.encode, prompt)

    def _no_encoder(self) -> EngineError:
        if self._tokenizer is None:
            return EngineError("this engine has no tokenizer to encode token ids with: pass --tokenizer DIR (the "
                               "served model's)", retriable=False)
        return EngineError("the engine's tokenizer is used before start() or after close()", retriable=False)

    def timeout_within(self, deadline: Deadline | None) -> httpx.Timeout | None:
        """One request's timeout under `deadline`: the session's own, each part cut to what is left (None:
        the client's, without a deadline)."""
        if deadline is None or deadline.total_s is None:
            return None
        left = deadline.remaining()
        return httpx.Timeout(min(self.timeout_s, left), connect=min(self.connect_timeout_s, left))

    async def prompt_input(self, prompt: Mapping[str, Any]) -> tuple[str, Sequence[int] | None]:
        """The prompt text and, with a tokenizer, its token ids (chat template applied, in a tokenizer thread).

        Raises:
            EngineError (not retriable): chat messages without a tokenizer to render them; the session is closed.
        """
        if self.encoder is None:
            return prompt_input(None, prompt)
        if self.threads is None:
            raise EngineError("engine closed", retriable=False)
        return await self.threads.run(self.encoder.encode, prompt)


class TokenizedSession:
    """What an HTTP engine offers multi-turn rollouts (`rollstream.producers.engines.environment`) from its
    session `_http`: the tokenizer and the prompt's token ids."""

    _http: HTTPSession

    @property
    def tokenizer(self) -> Any:
        """The tokenizer the engine was given, loaded (`HTTPSession.tokenizer`). Raises EngineError without one."""
        return self._http.tokenizer

    async def prompt_ids(self, prompt: Mapping[str, Any]) -> tuple[str, list[int]]:
        """The prompt as `generate` sends it (chat template applied) and its token ids, encoded in a tokenizer
        thread. Raises EngineError (not retriable) without a tokenizer."""
        return await self._http.prompt_ids(prompt)


def prompt_input(encoder: PromptEncoder | None, prompt: Mapping[str, Any]) -> tuple[str, Sequence[int] | None]:
    """The prompt text and, with a tokenizer, its token ids (chat template applied; blocks while it tokenizes:
    call it off the loop, as `HTTPSession.prompt_input` does).

    Raises:
        EngineError (not retriable): chat messages without a tokenizer to render them.
    """
    if encoder is not None:
        return encoder.encode(prompt)
    if isinstance(prompt["prompt"], str):
        return prompt["prompt"], None
    raise EngineError(f"prompt {prompt.get('id')!r} is a list of chat messages: pass --tokenizer so its chat "
                      "template can render them", retriable=False)


class Answer(NamedTuple):
    """One POST's outcome: the decoded JSON answer (`out`), or why another try may work (`error`). `status` lets
    the caller tell a paused server's 503; `reached` is False when no connection was made at all (the server
    is down or restarting: nothing ran, so waiting for it costs no work)."""

    out: Any
    error: str | None
    status: int | None
    reached: bool = True


class Stream(Protocol):
    """Takes the chunks of a streamed answer (server-sent events, ``data: {json}``) and joins them."""

    def add(self, chunk: Any) -> None:
        """One decoded chunk. Raises EngineError for a chunk not of the engine's shape."""

    def result(self) -> Any:
        """The answer the chunks make, as a request that was not streamed gets it."""


async def post_json(client: httpx.AsyncClient | None, server: str, path: str, body: Mapping[str, Any], *,
                    timeout: httpx.Timeout | None = None, stream: Stream | None = None) -> Answer:
    """One POST of `body` to `server` + `path` (waiting up to `timeout`; None: the client's): an `Answer` with
    the decoded JSON, or with why another try may work (no connection, timeout, transport error,
    5xx/408/429, a body that is not JSON). With `stream`, the answer is server-sent events (the body asks for
    them): each ``data:`` chunk goes to `stream` as it comes, and the answer is `Stream.result` once the
    events end (``data: [DONE]``); a connection that breaks first is a try that may work again.

    Raises:
        EngineError (not retriable): the engine is closed, or a 4xx the server will refuse again.
    """
    if client is None:
        raise EngineError("engine closed", retriable=False)
    try:
        request = client.build_request("POST", f"{server}{path}", json=dict(body),
                                       timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout)
        resp = await client.send(request, stream=stream is not None)
        try:
            if stream is not None and resp.status_code < 400:
                return await _events(resp, server, stream)
            await resp.aread()
        finally:
            await resp.aclose()
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        return Answer(None, f"{server}: unreachable ({type(exc).__name__}: {exc})", None, reached=False)
    except httpx.TimeoutException as exc:
        return Answer(None, f"{server}: timed out ({type(exc).__name__})", None)
    except httpx.TransportError as exc:
        return Answer(None, f"{server}: {type(exc).__name__}: {exc}", None)
    if resp.status_code >= 500 or resp.status_code in RETRY_STATUS:
        return Answer(None, f"{server}: HTTP {resp.status_code}: {resp.text[:200]}", resp.status_code)
    if resp.status_code >= 400:
        raise EngineError(f"{server} refused the request: HTTP {resp.status_code}: {resp.text[:300]}",
                          retriable=False)
    try:
        return Answer(resp.json(), None, resp.status_code)
    except ValueError:
        return Answer(None, f"{server}: response is not JSON: {resp.text[:200]}", resp.status_code)


async def _events(resp: httpx.Response, server: str, stream: Stream) -> Answer:
    """The server-sent events of `resp` into `stream`, to their ``[DONE]``."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            return Answer(stream.result(), None, resp.status_code)
        try:
            chunk = json.loads(data)
        except ValueError:
            return Answer(None, f"{server}: streamed chunk is not JSON: {data[:200]}", resp.status_code)
        stream.add(chunk)
    return Answer(None, f"{server}: the stream ended without [DONE]", resp.status_code)
