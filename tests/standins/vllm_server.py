"""An HTTP stand-in of a vLLM OpenAI-compatible server (``vllm serve``): vLLM needs a GPU, this runs anywhere.
Each `VLLMStandIn` serves on 127.0.0.1 from its own event loop in a daemon thread.

It follows vllm-project/vllm field for field for what rollstream's vLLM engine uses, as read in the stored
copies on 2026-12-01 (the code is ours; only names and behaviours are vLLM's):

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
  ``GET /is_paused`` (``{"is_paused"}``). While paused, a new request waits for ``/resume``.
- ``GET /v1/models`` (``{"object": "list", "data": [{"id", "object": "model", ...}]}``), ``GET /health``.
- vLLM before 0.10.2 (PR #22587) has no ``return_token_ids``: ``old_vllm=True`` ignores it, as pydantic's
  ``extra="allow"`` there did, and answers ``token_ids`` null.

Deterministic generation: the token at absolute position ``p`` (prompt and output together) is
`token_at(p)`, its logprob `logprob_at(p)`; a request runs to ``max_tokens`` (finish ``length``), or to
``stop_after`` tokens (finish ``stop``, EOS: ``stop_reason`` null) when that knob is set. A text prompt is
tokenised one id per character. Knobs to inject failures (each a count of the next requests it hits, in
this order): `drop_next` (the connection closes without an answer), `fail_next` (HTTP 503),
`slow_next` (answers after `slow_s`), `abort_next` (the choice comes back aborted after
`abort_after_tokens` tokens).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any
from urllib.parse import parse_qs

from tests.standins._http_server import StandInServer

_PAUSE_MODES = ("abort", "wait", "keep")
_LOGPROB_FLOOR = -9999.0  # serving.py: max(step_token.logprob, -9999.0)


def token_at(position: int) -> int:
    return 1000 + position


def logprob_at(position: int) -> float:
    return -(position + 1) / 1000


def piece(token: int) -> str:
    """The stand-in's decoding of one token."""
    return f"<{token}>"


class VLLMStandIn(StandInServer):
    """One stand-in server. Knobs may be changed from any thread; `requests` logs ``(path, body)`` of every
    request in arrival order (``/pause`` with its query as the body)."""

    def __init__(self, *, model: str = "/models/base", token_delay_s: float = 0.0, old_vllm: bool = False,
                 stop_after: int | None = None, abort_after_tokens: int = 1, slow_s: float = 1.0) -> None:
        super().__init__("vLLM")
        self.model = model
        self.token_delay_s = token_delay_s
        self.old_vllm = old_vllm
        self.stop_after = stop_after
        self.abort_after_tokens = abort_after_tokens
        self.slow_s = slow_s
        self.drop_next = self.fail_next = self.slow_next = self.abort_next = 0
        self._paused = False
        self._aborting: set[str] = set()
        self._running: set[str] = set()

    def completions(self) -> list[dict[str, Any]]:
        """The bodies of every ``/v1/completions`` request so far."""
        return [body for path, body in list(self.requests) if path == "/v1/completions"]

    def in_flight(self) -> int:
        """How many ``/v1/completions`` requests are generating now."""
        return len(self._running)

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
        if method == "POST" and path == "/v1/completions":
            return await self._completions(body)
        if method == "POST" and path == "/pause":
            return await self._pause(body.get("mode", "abort"))
        if method == "POST" and path == "/resume":
            self._paused = False
            await self._notify()
            return 200, {"status": "resumed"}
        if method == "GET" and path == "/is_paused":
            return 200, {"is_paused": self._paused}
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                     "owned_by": "vllm", "root": self.model, "parent": None,
                                                     "max_model_len": 4096}]}
        if method == "GET" and path == "/health":
            return 200, None
        return 404, {"detail": "Not Found"}

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
        prompt = body["prompt"]
        ids = list(prompt) if isinstance(prompt, list) else [ord(ch) for ch in prompt]
        await self._wait_for(lambda: not self._paused)
        rid = uuid.uuid4().hex
        abort_after = None
        if self.abort_next > 0:
            self.abort_next -= 1
            abort_after = self.abort_after_tokens
        self._running.add(rid)
        try:
            tokens, finish = await self._decode(rid, len(ids), int(body.get("max_tokens", 16)), abort_after)
        finally:
            self._running.discard(rid)
            self._aborting.discard(rid)
            await self._notify()
        return 200, self._response(body, ids, tokens, finish)

    async def _decode(self, rid: str, prompt_len: int, max_tokens: int, abort_after: int | None
                      ) -> tuple[list[int], str]:
        tokens: list[int] = []
        limit = max_tokens if self.stop_after is None else min(max_tokens, self.stop_after)
        while len(tokens) < limit:
            if rid in self._aborting or (abort_after is not None and len(tokens) >= abort_after):
                return tokens, "abort"
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            tokens.append(token_at(prompt_len + len(tokens)))
        return tokens, "length" if limit == max_tokens else "stop"

    def _response(self, body: dict[str, Any], ids: list[int], tokens: list[int], finish: str) -> dict[str, Any]:
        token_ids = body.get("return_token_ids") and not self.old_vllm
        choice: dict[str, Any] = {"index": 0, "text": "".join(piece(t) for t in tokens), "logprobs": None,
                                  "finish_reason": finish, "stop_reason": None,
                                  "token_ids": tokens if token_ids else None, "prompt_logprobs": None,
                                  "prompt_token_ids": ids if token_ids else None}
        if body.get("logprobs") is not None:
            choice["logprobs"] = _logprobs(tokens, len(ids), bool(body.get("return_tokens_as_token_ids")))
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model") or self.model, "choices": [choice], "service_tier": None,
                "system_fingerprint": None, "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + len(tokens),
                                                      "completion_tokens": len(tokens), "prompt_tokens_details": None},
                "kv_transfer_params": None}

    async def _pause(self, mode: str) -> tuple[int, Any]:
        if mode not in _PAUSE_MODES:
            return 400, {"error": f"Invalid pause mode {mode!r}"}
        self._paused = True
        if mode == "abort":
            self._aborting.update(self._running)
            await self._notify()
        if mode in ("abort", "wait"):
            await self._wait_for(lambda: not self._running)
        return 200, {"status": "paused"}


def _logprobs(tokens: list[int], prompt_len: int, as_ids: bool) -> dict[str, Any]:
    names = [f"token_id:{t}" if as_ids else piece(t) for t in tokens]
    values = [max(logprob_at(prompt_len + i), _LOGPROB_FLOOR) for i in range(len(tokens))]
    offsets, at = [], 0
    for name in names:
        offsets.append(at)
        at += len(name)
    # logprobs=0: each step's top_logprobs holds the sampled token only (the stand-in knows no other)
    return {"text_offset": offsets, "token_logprobs": values, "tokens": names,
            "top_logprobs": [{name: value} for name, value in zip(names, values, strict=True)]}


def _invalid(body: dict[str, Any]) -> str | None:
    """vLLM's 400s for what the engine could get wrong (`CompletionRequest`'s validators)."""
    prompt = body.get("prompt")
    if not prompt or not (isinstance(prompt, str) or all(isinstance(t, int) and t >= 0 for t in prompt)):
        return "Either prompt or prompt_embeds must be provided and non-empty."
    if body.get("stream"):
        return "the stand-in does not stream"
    if body.get("n", 1) != 1:
        return "the stand-in answers n=1 only (the engine sends one request per sample)"
    logprobs = body.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or (logprobs < 0 and logprobs != -1)):
        return "`logprobs` must be a positive value or -1."
    return None


def _error(message: str, *, kind: str = "BadRequestError", code: int = 400) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
