"""An HTTP stand-in of an SGLang server (``python -m sglang.launch_server``): SGLang needs a GPU, this runs
anywhere. Each `SGLangStandIn` serves on 127.0.0.1 from its own event loop in a daemon thread.

It follows SGLang 0.5.23 (the wheel on PyPI; `ROUTES` holds its routes and `SAMPLING_FIELDS` its strict
``sampling_params`` schema, and tests/upstream checks both against the installed package) and, for what
that release did not change, sgl-project/sglang as read in the stored copies on 2026-12-01 (the code is
ours; only names and behaviours are SGLang's):

- 0.5.23 ``python/sglang/srt/entrypoints/http_server.py``: ``GET /model_info`` (``weight_version`` among the
  model's facts; ``/get_model_info`` a deprecated alias), ``POST /update_weight_version``; no
  ``/get_weight_version`` (0.5.15 answered it 404 "deprecated", 0.5.23 has no such route: `legacy=True`
  serves it, without ``/model_info``, as SGLang before 0.5.15 did). ``POST /generate`` checks the body with
  ``entrypoints/api_contract.py`` ``generate_contract_error`` (``sglang/api/v1/api_types.py``
  ``GenerateRequest``: ``sampling_params`` keys outside ``SamplingParams``' fields are an HTTP 400
  ``{"error": "unknown field `seed`, expected one of ..."}``).

- ``python/sglang/srt/entrypoints/http_server.py`` (commit 0025436eab0556737d615b36a4dd3e1e26e82f3d):
  ``POST /generate`` (a ``GenerateReqInput`` body; non-streaming: one JSON object, HTTP 200 also for an
  aborted request); ``POST /update_weights_from_disk`` (``{"success", "message", "num_paused_requests"}``,
  200 on success, 400 on failure; on success with ``weight_version`` the server's version becomes it and
  " Weight version updated to X." is appended to the message); ``POST /pause_generation`` and
  ``POST /continue_generation`` (``{"message": "Generation paused successfully.", "status": "ok"}``);
  ``GET /get_weight_version`` (``{"weight_version"}``, before 0.5.15); ``GET /get_model_info``; ``GET /health``.
- ``python/sglang/srt/managers/io_struct.py`` (commit 001067fffe33427bee0ed2f007fb7551a1d76b44):
  ``GenerateReqInput`` (``text`` | ``input_ids``, ``sampling_params``, ``return_logprob``, ``stream``),
  ``UpdateWeightFromDiskReqInput`` (``model_path``, ``load_format``, ``abort_all_requests``,
  ``weight_version``, ...), ``PauseGenerationReqInput.mode`` (``abort`` | ``retract`` | ``in_place``,
  default ``abort``), ``ContinueGenerationReqInput``.
- ``python/sglang/srt/managers/tokenizer_manager.py`` (same commit): ``meta_info`` = ``id``,
  ``finish_reason``, ``prompt_tokens``, ``weight_version`` (the server's version when the response is
  made), ``num_retractions``, ``completion_tokens``, ``cached_tokens``, ``output_token_logprobs``
  (``[[logprob, token_id, null], ...]`` with ``return_logprob``) and ``output_token_logprobs_length``,
  ``e2e_latency``. ``pause_generation``
  with mode ``abort`` aborts every request in flight (each returns what it generated so far, finish
  reason abort) and returns once none is left; other modes hold them in the scheduler. While paused, a
  new request waits until ``continue_generation``. An update while not paused waits for the requests in
  flight (the ``model_update_lock`` writer lock) and holds new ones.
- ``python/sglang/srt/utils/weight_versions.py`` (commit 19f93835d3f8a0b84485592090245d11de783289):
  ``meta_info.weight_versions`` = spans ``{"version", "start", "end"}`` over the output tokens (one per
  change of version while the request ran; an empty first span when nothing was generated) and
  ``weight_version`` = the last span's version. `report_spans=False` answers like an older SGLang.
- 0.5.23 ``"stream": true`` (``srt/entrypoints/http_server.py`` ``serve_generate_request``,
  ``srt/managers/tokenizer_manager.py`` ``_handle_batch_output``, ``_stream_one_response`` and
  ``add_logprob_to_meta_info``, ``srt/managers/scheduler_components/output_streamer.py`` ``accept``):
  server-sent events, ``data: {chunk}`` per chunk, then ``data: [DONE]``. A chunk every ``stream_interval``
  tokens (the request's ``sampling_params.stream_interval``, else the server's ``--stream-interval``,
  default 1; the first token at once), the last one finished: the non-streamed answer itself. Each chunk has
  the answer's shape, cumulative (``text``, ``output_ids``, ``meta_info.output_token_logprobs`` hold the
  whole output so far); with ``--incremental-streaming-output`` (`incremental_streaming_output`) those three
  hold only what is new. ``meta_info`` of a chunk before the last: ``finish_reason`` null,
  ``completion_tokens`` and ``output_token_logprobs_length`` of the whole output so far, ``weight_version``
  (no ``weight_versions``: only the finished chunk has them), ``response_sent_to_client_ts`` on the first.
  The stand-in sends them all at once when the generation ends (it does not stream as it generates).
- ``python/sglang/srt/managers/schedule_batch.py``: finish reasons ``{"type": "length", "length": n}``,
  ``{"type": "abort", "message", "status_code", "err_type"}``.

Deterministic generation, so tests can check continued samples exactly: the token at absolute position
``p`` (prompt and output together) under weight version ``v`` is `token_at(p, v)`, its logprob
`logprob_at(p, v)`; every request runs to ``max_new_tokens`` (finish ``length``). A text prompt is
tokenised one id per character. An update succeeds when ``model_path`` is a directory (and `fail_updates`
is off), as SGLang fails to load a checkpoint that is not there.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.standins._http_server import Events, StandInServer

_PAUSE_MODES = ("abort", "retract", "in_place")
_ABORT = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def version_number(version: str) -> int:
    """The stand-in's weights of version ``"3"`` are number 3; ``"default"`` (nothing loaded) is 0."""
    return int(version) if version.isdigit() else 0


def token_at(position: int, version: str) -> int:
    return 1000 * (version_number(version) + 1) + position


def logprob_at(position: int, version: str) -> float:
    return -(version_number(version) + (position + 1) / 1000)


class CharTokenizer:
    """A tokenizer for engines that send ``input_ids``: one id per character, as the stand-in tokenises a
    text prompt, and no chat template."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(ch) for ch in text]}


@dataclass
class _Request:
    rid: str
    aborted: bool = False
    retractions: int = 0
    versions: list[str] = field(default_factory=list)


# SGLang 0.5.23's sglang/api/v1/api_types.py SamplingParams: its fields, in order (unknown keys rejected)
SAMPLING_FIELDS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                   "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
                   "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                   "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
                   "custom_params", "beam_width", "watermark", "choice")
SAMPLING_KEYS = frozenset(SAMPLING_FIELDS)

# (method, path) -> handler, as SGLang 0.5.23's python/sglang/srt/entrypoints/http_server.py routes them
ROUTES = {("POST", "/generate"): "_generate", ("PUT", "/generate"): "_generate",
          ("POST", "/update_weights_from_disk"): "_update",
          ("POST", "/update_weight_version"): "_update_weight_version",
          ("POST", "/pause_generation"): "_pause", ("POST", "/continue_generation"): "_continue",
          ("GET", "/model_info"): "_model_info", ("GET", "/get_model_info"): "_model_info",
          ("GET", "/health"): "_health", ("GET", "/health_generate"): "_health"}
# an SGLang before /model_info (0.5.14 and older): the version at /get_weight_version; sampling keys not checked
LEGACY_ROUTES = {**{k: v for k, v in ROUTES.items() if k[1] not in ("/model_info", "/update_weight_version")},
                 ("GET", "/get_weight_version"): "_weight_version"}


class SGLangStandIn(StandInServer):
    """One stand-in server. Knobs (`token_delay_s`, `fail_updates`, `abort_after_tokens`, `report_spans`, and
    the server options `stream_interval` and `incremental_streaming_output`) may be changed from any thread;
    `requests` logs ``(path, body)`` of every request in arrival order. `legacy` answers as an SGLang before
    ``/model_info`` (`LEGACY_ROUTES`)."""

    def __init__(self, *, weight_version: str = "default", model_path: str = "/models/base",
                 token_delay_s: float = 0.005, update_delay_s: float = 0.0, abort_after_tokens: int | None = None,
                 report_spans: bool = True, legacy: bool = False) -> None:
        super().__init__("SGLang")
        self.legacy = legacy
        self.weight_version = weight_version
        self.model_path = model_path
        self.token_delay_s = token_delay_s
        self.update_delay_s = update_delay_s
        self.abort_after_tokens = abort_after_tokens
        self.report_spans = report_spans
        self.stream_interval = 1
        self.incremental_streaming_output = False
        self.fail_updates = False
        self.tokens_generated = 0
        self._paused = False
        self._updating = False
        self._running: set[str] = set()
        self._by_rid: dict[str, _Request] = {}

    def paths(self) -> list[str]:
        return [path for path, _ in list(self.requests)]

    async def _route(self, method: str, path: str, query: str, raw: bytes) -> tuple[int, Any]:
        try:
            body = json.loads(raw) if raw else {}
        except ValueError as exc:
            return 400, {"error": {"message": f"invalid JSON: {exc}"}}
        self.requests.append((path, body))
        routes = LEGACY_ROUTES if self.legacy else ROUTES
        name = routes.get((method, path))
        if name is None:
            return 404, {"detail": "Not Found"}
        handler = getattr(self, name)
        return await handler(body)

    # -- the routes ---------------------------------------------------------------------------------

    async def _model_info(self, body: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"model_path": self.model_path, "served_model_name": self.model_path,
                     "tokenizer_path": self.model_path, "is_generation": True, "preferred_sampling_params": None,
                     "weight_version": self.weight_version, "load_format": None, "reasoning_parser": None,
                     "tool_call_parser": None}

    async def _weight_version(self, body: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"weight_version": self.weight_version}

    async def _update_weight_version(self, body: dict[str, Any]) -> tuple[int, Any]:
        if body.get("abort_all_requests", True):
            self._abort_all()
        self.weight_version = str(body["new_version"])
        return 200, {"success": True, "message": f"Weight version updated to {self.weight_version}",
                     "new_version": self.weight_version}

    async def _health(self, body: dict[str, Any]) -> tuple[int, Any]:
        return 200, None

    # -- the engine --------------------------------------------------------------------------------

    async def _generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        unknown = sorted(set(body.get("sampling_params") or {}) - SAMPLING_KEYS)
        if unknown and not self.legacy:  # api_contract.generate_contract_error: serde's unknown_field text
            return 400, {"error": f"unknown field `{unknown[0]}`, expected one of "
                                  f"{', '.join(f'`{k}`' for k in SAMPLING_FIELDS)}"}
        ids = body.get("input_ids")
        if ids is None:
            ids = [ord(ch) for ch in body.get("text") or ""]
        if not ids or not all(isinstance(i, int) for i in ids):
            return 400, {"error": {"message": "give text or input_ids (a list of ints)"}}
        max_new = int((body.get("sampling_params") or {}).get("max_new_tokens", 128))
        started = time.monotonic()
        await self._wait_for(lambda: not self._paused and not self._updating)
        request = _Request(rid=uuid.uuid4().hex)
        self._running.add(request.rid)
        self._by_rid[request.rid] = request
        try:
            tokens = await self._decode(request, len(ids), max_new)
        finally:
            self._running.discard(request.rid)
            self._by_rid.pop(request.rid, None)
            await self._notify()
        finish = _ABORT if request.aborted else {"type": "length", "length": max_new}
        response = self._response(body, request, len(ids), tokens, finish, time.monotonic() - started)
        return 200, self._events(body, response, request.versions) if body.get("stream") else response

    async def _decode(self, request: _Request, prompt_len: int, max_new: int) -> list[int]:
        tokens: list[int] = []
        while len(tokens) < max_new:
            await asyncio.sleep(self.token_delay_s)
            if self._paused and not request.aborted:  # retract / in_place: held until continue_generation
                await self._wait_for(lambda: not self._paused or request.aborted)
            if request.aborted:
                break
            tokens.append(token_at(prompt_len + len(tokens), self.weight_version))
            request.versions.append(self.weight_version)
            self.tokens_generated += 1
            if self.abort_after_tokens is not None and len(tokens) >= self.abort_after_tokens:
                request.aborted = True
                break
        return tokens

    def _response(self, body: dict[str, Any], request: _Request, prompt_len: int, tokens: list[int],
                  finish: dict[str, Any], elapsed_s: float) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": request.rid, "finish_reason": dict(finish), "prompt_tokens": prompt_len,
                                "weight_version": self.weight_version, "num_retractions": request.retractions,
                                "completion_tokens": len(tokens), "cached_tokens": 0, "e2e_latency": elapsed_s}
        if self.report_spans:
            meta["weight_versions"] = _spans(request.versions, self.weight_version)
            meta["weight_version"] = meta["weight_versions"][-1]["version"]
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[logprob_at(prompt_len + i, v), t, None]
                                             for i, (t, v) in enumerate(zip(tokens, request.versions, strict=True))]
            meta["output_token_logprobs_length"] = len(tokens)
        return {"text": "".join(_piece(t) for t in tokens), "output_ids": tokens, "meta_info": meta}

    def _events(self, body: dict[str, Any], response: dict[str, Any], versions: list[str]) -> Events:
        """`response` streamed: a chunk at each of `_chunk_ends`, the last one `response` itself (sliced to
        what is new with `incremental_streaming_output`)."""
        interval = int(body["sampling_params"].get("stream_interval") or self.stream_interval)
        tokens, meta = response["output_ids"], response["meta_info"]
        chunks, sent = [], 0
        for end in _chunk_ends(len(tokens), interval):
            last = end == len(tokens)
            part = meta if last else {k: meta[k] for k in _CHUNK_META if k in meta}
            part = {**part, "completion_tokens": end, "weight_version": versions[end - 1] if end and not last
                    else meta["weight_version"], **({"finish_reason": None} if not last else {})}
            start = sent if self.incremental_streaming_output else 0
            if "output_token_logprobs" in meta:
                part.update(output_token_logprobs=meta["output_token_logprobs"][start:end],
                            output_token_logprobs_length=end)
            if not chunks:
                part["response_sent_to_client_ts"] = time.time()
            chunks.append({"text": "".join(_piece(t) for t in tokens[start:end]), "output_ids": tokens[start:end],
                           "meta_info": part})
            sent = end
        return Events(chunks)

    async def _pause(self, body: dict[str, Any]) -> tuple[int, Any]:
        mode = body.get("mode", "abort")
        if mode not in _PAUSE_MODES:
            return 400, {"error": {"message": f"Invalid mode: {mode!r}. Expected one of {list(_PAUSE_MODES)}."}}
        self._paused = True
        if mode == "abort":
            self._abort_all()
            await self._notify()
            await self._wait_for(lambda: not self._running)
        else:
            for request in self._by_rid.values():
                request.retractions += mode == "retract"
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    async def _continue(self, body: dict[str, Any]) -> tuple[int, Any]:
        self._paused = False
        await self._notify()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _abort_all(self) -> None:
        for request in self._by_rid.values():
            request.aborted = True

    async def _update(self, body: dict[str, Any]) -> tuple[int, Any]:
        model_path = body.get("model_path")
        if not isinstance(model_path, str):
            return 400, {"error": {"message": "model_path: Field required"}}
        if body.get("abort_all_requests"):
            self._abort_all()
        if not self._paused:  # the writer lock: wait for what runs, hold what comes
            self._updating = True
            await self._wait_for(lambda: not self._running)
        try:
            await asyncio.sleep(self.update_delay_s)
            if self.fail_updates or not Path(model_path).is_dir():
                return 400, {"success": False, "num_paused_requests": 0,
                             "message": f"Failed to get weights iterator: {model_path} cannot be loaded."}
            self.model_path = model_path
            message = "Succeeded to update model weights."
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
                message += f" Weight version updated to {self.weight_version}."
            return 200, {"success": True, "message": message, "num_paused_requests": 0}
        finally:
            self._updating = False
            await self._notify()


_CHUNK_META = ("id", "prompt_tokens", "num_retractions", "cached_tokens")  # a chunk's meta_info before the last


def _piece(token: int) -> str:
    """The stand-in's text of one token."""
    return f"<{token}>"


def _chunk_ends(n: int, interval: int) -> list[int]:
    """How many output tokens each chunk of a request that made `n` ends at: the first token at once, then
    every `interval` (output_streamer.py ``accept``), and the finished one at `n` (an abort without tokens:
    only that)."""
    ends = [1, *range(1 + interval, n, interval)] if n > 1 else []
    return [*ends, n]


def _spans(versions: list[str], current: str) -> list[dict[str, Any]]:
    """SGLang's ``weight_versions``: one span per run of equal versions; ``[{current, 0, 0}]`` when empty."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans or [{"version": current, "start": 0, "end": 0}]
