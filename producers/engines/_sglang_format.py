"""SGLang's native ``/generate`` request and response format, shared by the HTTP and in-process engines,
and how a sample that a weight update aborted is continued (`partial_rollout`: the engines' one
`_samples.PartialRollout`, with SGLang's continuation body).

Request (``GenerateReqInput``): ``input_ids`` (or ``text``), ``sampling_params`` (``max_new_tokens``,
``temperature``, ``top_p``, ...), ``return_logprob``. One request per sample: each sample is routed,
retried and, when aborted by a weight update, continued or re-issued on its own; SGLang's radix cache
shares the prompt prefix between them.
Response: ``text``, ``output_ids``, ``meta_info`` with ``output_token_logprobs`` (a list of
``[logprob, token_id, token_text_or_null]``), ``finish_reason`` (``{"type": "stop" | "length" |
"abort", ...}``; an abort carries the tokens generated so far), ``weight_version`` (a string: the
server's version when the response was made, ``"default"`` until someone sets one) and, in newer
SGLang, ``weight_versions``: spans ``{"version", "start", "end"}`` over the output tokens, oldest first.

Streamed (``"stream": true``; SGLang 0.5.23, read in its wheel: ``srt/entrypoints/http_server.py``
``serve_generate_request``, ``srt/managers/tokenizer_manager.py`` ``_handle_batch_output`` and
``_stream_one_response``, ``srt/managers/scheduler_components/output_streamer.py``): server-sent events,
``data: {chunk}`` each, then ``data: [DONE]``. A chunk has the answer's shape. By default each is cumulative:
``text``, ``output_ids`` and ``meta_info.output_token_logprobs`` hold the whole output so far, and the last one
is the non-streamed answer itself. A server started with ``--incremental-streaming-output`` sends only what is
new in ``text``, ``output_ids`` and the ``output_*`` logprob lists (the rest of ``meta_info`` as it is now:
``completion_tokens`` and ``output_token_logprobs_length`` count the whole output). The scheduler sends a chunk
every ``stream_interval`` tokens (``--stream-interval``, default 1; per request in ``sampling_params``), the
first token at once, and the finished one with ``weight_versions`` (only that one). A request refused while it
streams ends in ``data: {"error": {...}}``, or in an abort whose ``finish_reason.status_code`` is the HTTP
status a request that did not stream would have got. `StreamedGenerate` joins the chunks.

Which policy version generated the tokens (`Completion.version_spans`, `Completion.policy_version`):
the spans of ``weight_versions`` when SGLang gives them, else one span of ``weight_version``; numeric
versions only. When any token's version is not a number (``"default"``: nothing was loaded with a
version), the completion carries no spans and no version, and the producer stamps the newest version
announced when the generation started (`rollstream.producers.policy`): never a newer one than generated a token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from rollstream.producers.engines._http import RETRY_STATUS
from rollstream.producers.engines._samples import PartialRollout, PartialRollouts
from rollstream.producers.engines._sampling import sglang_options
from rollstream.producers.engines.base import Completion, EngineError
from rollstream.schemas import VersionSpan

_MAX_NEW_DEFAULT = 128  # SGLang's max_new_tokens when a request gives none
# what --incremental-streaming-output sends only the new part of (tokenizer_manager.py
# _INCREMENTAL_STREAMING_META_INFO_KEYS), besides text and output_ids
INCREMENTAL_META = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs",
                     "output_token_sampling_mask", "output_token_sampling_logprobs")


def request_payload(text: str, input_ids: Sequence[int] | None, sampling: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body of one ``/generate`` call (token ids when we have them, else text); `sampling` (a
    `SamplingParams.to_dict()`) in SGLang's names (`_sampling.sglang_options`).

    Raises:
        EngineError (not retriable): a sampling option SGLang has no name for.
    """
    payload: dict[str, Any] = {"sampling_params": sglang_options(sampling), "return_logprob": True}
    if input_ids is not None:
        payload["input_ids"] = list(input_ids)
    else:
        payload["text"] = text
    return payload


def seeded(payload: Mapping[str, Any], index: int) -> dict[str, Any]:
    """The body of sample `index`: its own ``sampling_seed`` (``seed + index``) when the body has one, so the
    samples of a group differ but stay reproducible (as the vLLM engine seeds its samples)."""
    sampling = payload["sampling_params"]
    if sampling.get("sampling_seed") is None:
        return dict(payload)
    return {**payload, "sampling_params": {**sampling, "sampling_seed": int(sampling["sampling_seed"]) + index}}


def finish_type(meta: Mapping[str, Any]) -> str:
    """``stop`` | ``length`` | ``abort`` from ``meta_info.finish_reason`` (a dict, or a bare string)."""
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    if kind in ("stop", "length", "abort"):
        return str(kind)
    if kind is None:
        raise EngineError("SGLang response has no finish_reason (an unfinished streaming chunk?)", retriable=True)
    raise EngineError(f"SGLang finish_reason {reason!r} is not stop, length or abort", retriable=False)


def refused(out: Any) -> EngineError | None:
    """The failure a streamed answer ended in where a request that did not stream gets an HTTP error: an
    ``error`` chunk, or an abort with a ``status_code`` (retriable as that status would be: 5xx, 408, 429);
    None for any other answer."""
    error = out.get("error") if isinstance(out, Mapping) else None
    meta = out.get("meta_info") if isinstance(out, Mapping) and error is None else None
    reason = meta.get("finish_reason") if isinstance(meta, Mapping) else None
    if isinstance(error, Mapping):
        status, message = error.get("code"), error.get("message")
    elif isinstance(reason, Mapping) and isinstance(reason.get("status_code"), int) and reason["status_code"] >= 400:
        status, message = reason["status_code"], reason.get("message")
    elif error is not None:
        status, message = 400, error
    else:
        return None
    code = status if isinstance(status, int) else 400
    return EngineError(f"SGLang refused the streamed request: HTTP {code}: {str(message)[:300]}",
                       retriable=code >= 500 or code in RETRY_STATUS)


def abort_message(meta: Mapping[str, Any]) -> str:
    reason = meta.get("finish_reason")
    return str(reason.get("message", "")) if isinstance(reason, Mapping) else ""


def parse_policy_version(value: Any) -> int | None:
    """SGLang reports versions as strings (``"default"`` unless one was set): integers are kept, anything
    else is None (unknown)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def parse_version_spans(meta: Mapping[str, Any], n_tokens: int) -> tuple[VersionSpan, ...] | None:
    """The version spans over `n_tokens` output tokens, or None when a token's version is unknown.

    Raises:
        EngineError (not retriable): ``weight_versions`` does not cover the tokens back to back.
    """
    if n_tokens == 0:
        return ()
    raw = meta.get("weight_versions")
    if raw is None:  # an older SGLang: one version for the whole response
        version = parse_policy_version(meta.get("weight_version"))
        return None if version is None else (VersionSpan(version, 0, n_tokens),)
    try:
        pairs = [(span["version"], int(span["start"]), min(int(span["end"]), n_tokens)) for span in raw]
    except (TypeError, KeyError, ValueError) as exc:
        raise EngineError(f"malformed meta_info.weight_versions {str(raw)[:200]}: {exc}", retriable=False) from exc
    spans, cursor = [], 0
    for version, start, end in pairs:
        if end <= start:
            continue  # SGLang keeps an empty first span when nothing was generated
        if start != cursor:
            raise EngineError(f"meta_info.weight_versions {raw} do not cover the {n_tokens} output tokens back "
                              f"to back (a span starts at {start}, expected {cursor})", retriable=False)
        number = parse_policy_version(version)
        if number is None:
            return None
        spans.append(VersionSpan(number, start, end))
        cursor = end
    if cursor != n_tokens:
        raise EngineError(f"meta_info.weight_versions {raw} end at token {cursor} of {n_tokens}", retriable=False)
    return tuple(spans)


def parse_completion(out: Any) -> Completion:
    """One ``/generate`` response object -> `Completion` (versions as the module docstring says).

    Tokens and logprobs come from ``output_token_logprobs`` when present (they are paired there), else
    tokens from ``output_ids`` without logprobs.
    Raises:
        EngineError (not retriable): the response does not have SGLang's shape.
    """
    if not isinstance(out, Mapping) or not isinstance(out.get("meta_info"), Mapping):
        raise EngineError(f"not an SGLang /generate response (no meta_info): {str(out)[:200]}", retriable=False)
    meta = out["meta_info"]
    finish = finish_type(meta)
    pairs = meta.get("output_token_logprobs")
    try:
        if pairs is not None:
            tokens = [int(p[1]) for p in pairs]
            logprobs: list[float] | None = [float(p[0]) for p in pairs]
        else:
            tokens = [int(t) for t in out.get("output_ids") or []]
            logprobs = None
    except (TypeError, ValueError, IndexError) as exc:
        raise EngineError(f"malformed output_token_logprobs in SGLang response: {exc}", retriable=False) from exc
    spans = parse_version_spans(meta, len(tokens))
    if spans is None:
        version = None
    else:
        version = spans[-1].version if spans else parse_policy_version(meta.get("weight_version"))
    return Completion(text=str(out.get("text", "")), tokens=tokens, logprobs=logprobs, finish_reason=finish,
                      policy_version=version, version_spans=spans or ())


def continue_payload(payload: Mapping[str, Any], prefix: Sequence[int]) -> dict[str, Any] | None:
    """The body continuing `payload` after the output tokens `prefix`: ``input_ids`` + `prefix`,
    ``max_new_tokens`` (and ``min_new_tokens``) reduced by their number; None for a prompt sent as text
    (its token ids are not known here: SGLang does not return them)."""
    if "input_ids" not in payload:
        return None
    sampling = dict(payload["sampling_params"])
    sampling["max_new_tokens"] = int(sampling.get("max_new_tokens", _MAX_NEW_DEFAULT)) - len(prefix)
    if "min_new_tokens" in sampling:
        sampling["min_new_tokens"] = max(0, int(sampling["min_new_tokens"]) - len(prefix))
    return {**payload, "input_ids": [*payload["input_ids"], *prefix], "sampling_params": sampling}


def partial_rollout(payload: Mapping[str, Any], *, mode: PartialRollouts, max_continuations: int,
                    abort_attempts: int) -> PartialRollout:
    """One SGLang sample across aborts (`_samples.PartialRollout` with `continue_payload`)."""
    return PartialRollout(payload, continued=partial(continue_payload, payload), mode=mode,
                          max_new=int(payload["sampling_params"].get("max_new_tokens", _MAX_NEW_DEFAULT)),
                          max_continuations=max_continuations, abort_attempts=abort_attempts)


class StreamedGenerate:
    """The chunks of one streamed ``/generate`` answer joined into the answer a request that was not streamed
    gets (`result`), whichever way the server streams (the module docstring): a chunk is cumulative when its
    ``output_ids`` are as many as its ``meta_info.completion_tokens``, else new (``--incremental-streaming-
    output``; the first chunk is both). `on_tokens` gets this joiner after each chunk that brought tokens
    (`partial`: the output so far). A `_http.Stream`; loop-only."""

    def __init__(self, on_tokens: Callable[[StreamedGenerate], None] | None = None) -> None:
        self._on_tokens = on_tokens
        self._text: list[str] = []
        self._ids: list[int] = []
        self._lists: dict[str, list[Any]] = {}  # the INCREMENTAL_META lists so far
        self._last: dict[str, Any] = {}  # the newest chunk, as sent
        self._first_version: Any = None  # meta_info.weight_version of the first chunk

    def add(self, chunk: Any) -> None:
        """One chunk. Raises EngineError (not retriable) for one not of SGLang's shape, or whose tokens do not
        add up to its ``completion_tokens``."""
        if isinstance(chunk, Mapping) and "error" in chunk:
            self._last = dict(chunk)  # the end of the stream: `refused` reads it
            return
        meta = chunk.get("meta_info") if isinstance(chunk, Mapping) else None
        ids = chunk.get("output_ids") if isinstance(meta, Mapping) else None
        if not isinstance(meta, Mapping) or not isinstance(ids, list):
            raise EngineError(f"not an SGLang /generate stream chunk: {str(chunk)[:200]}", retriable=False)
        before = len(self._ids)
        if not self._ids or len(ids) == meta.get("completion_tokens", len(ids)):
            # cumulative: the ids so far are a prefix of these; take only what is new (no O(n) work per chunk)
            self._text = [str(chunk.get("text") or "")]
            self._ids += [int(t) for t in ids[before:]]
            self._lists = {k: meta[k] for k in INCREMENTAL_META if k in meta}
        elif len(self._ids) + len(ids) == meta.get("completion_tokens"):
            self._text.append(str(chunk.get("text") or ""))
            self._ids += [int(t) for t in ids]
            for key in (k for k in INCREMENTAL_META if k in meta):
                self._lists.setdefault(key, []).extend(meta[key])
        else:
            raise EngineError(f"SGLang stream chunk of {len(ids)} output_ids after {len(self._ids)} does not add up "
                              f"to its completion_tokens {meta.get('completion_tokens')}", retriable=False)
        if not self._last:
            self._first_version = meta.get("weight_version")
        self._last = dict(chunk)
        if len(self._ids) > before and self._on_tokens is not None:
            self._on_tokens(self)

    def result(self) -> dict[str, Any]:
        """The answer the chunks so far make (an ``error`` chunk as it came)."""
        if "error" in self._last:
            return self._last
        meta = {**self._last.get("meta_info", {}), **self._lists}
        return {**self._last, "text": "".join(self._text), "output_ids": list(self._ids), "meta_info": meta}

    def partial(self) -> Completion:
        """The output so far, as a sample aborted here (finish reason ``abort``). Its tokens take the server's
        ``weight_version`` only while that is the version of the first chunk (a chunk before the last carries
        no ``weight_versions``; a version that changed mid-request leaves them unknown). Raises EngineError as
        `parse_completion`."""
        out = self.result()
        meta = {**out["meta_info"], "finish_reason": {"type": "abort"}}
        if "weight_versions" not in meta and meta.get("weight_version") != self._first_version:
            meta.pop("weight_version", None)
        return parse_completion({**out, "meta_info": meta})
