"""SGLang's native ``/generate`` request and response format, shared by the HTTP and in-process engines,
and the continuation of a sample that a weight update aborted (`PartialRollout`).

Request (``GenerateReqInput``): ``input_ids`` (or ``text``), ``sampling_params`` (``max_new_tokens``,
``temperature``, ``top_p``, ...), ``return_logprob``. One request per sample: each sample is routed,
retried and, when aborted by a weight update, continued or re-issued on its own; SGLang's radix cache
shares the prompt prefix between them.
Response: ``text``, ``output_ids``, ``meta_info`` with ``output_token_logprobs`` (a list of
``[logprob, token_id, token_text_or_null]``), ``finish_reason`` (``{"type": "stop" | "length" |
"abort", ...}``; an abort carries the tokens generated so far), ``weight_version`` (a string: the
server's version when the response was made, ``"default"`` until someone sets one) and, in newer
SGLang, ``weight_versions``: spans ``{"version", "start", "end"}`` over the output tokens, oldest first.

Which policy version generated the tokens (`Completion.version_spans`, `Completion.policy_version`):
the spans of ``weight_versions`` when SGLang gives them, else one span of ``weight_version``; numeric
versions only. When any token's version is not a number (``"default"``: nothing was loaded with a
version), the completion carries no spans and no version, and the producer stamps the newest version
announced when the generation started (`rollstream.producers.policy`): never a newer one than generated a token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

from rollstream.producers.engines._sampling import sglang_options
from rollstream.producers.engines.base import Completion, EngineError
from rollstream.schemas import VersionSpan

PartialRollouts = Literal["continue", "restart"]
PARTIAL_ROLLOUTS: tuple[PartialRollouts, ...] = ("continue", "restart")


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


def join_segments(segments: Sequence[Completion]) -> Completion:
    """One completion from the segments of a continued sample: tokens, logprobs and texts concatenated,
    each segment's version spans shifted by its offset (adjacent spans of one version merged), the last
    segment's finish reason. If a segment with tokens has no known version, the result has none."""
    if len(segments) == 1:
        return segments[0]
    tokens = [int(t) for s in segments for t in s.tokens]
    logprobs = None if any(s.logprobs is None for s in segments) else [
        float(p) for s in segments for p in s.logprobs]  # type: ignore[union-attr]
    spans: list[VersionSpan] = []
    offset, known = 0, True
    for segment in segments:
        if len(segment.tokens) and not segment.version_spans:
            known = False
        for span in segment.version_spans:
            if spans and spans[-1].version == span.version and spans[-1].end == offset + span.start:
                spans[-1] = replace(spans[-1], end=offset + span.end)
            else:
                spans.append(VersionSpan(span.version, offset + span.start, offset + span.end))
        offset += len(segment.tokens)
    if not known:
        spans = []
    version = spans[-1].version if spans else (segments[-1].policy_version if not tokens else None)
    return Completion(text="".join(s.text for s in segments), tokens=tokens, logprobs=logprobs,
                      finish_reason=segments[-1].finish_reason, policy_version=version, version_spans=tuple(spans))


class PartialRollout:
    """One sample across the aborts of weight updates: what to send next, and when it is finished.

    With ``continue``, an aborted response that carries tokens is kept and the next request continues it
    on the (new) weights from prompt + tokens so far, ``max_new_tokens`` reduced by what was generated,
    at most `max_continuations` times. With ``restart`` (or a prompt sent as text, whose token ids are not
    known here), an aborted response is dropped and the request is issued again as it was, at most
    `abort_attempts` times. An abort without tokens is issued again in both modes. Pure: no I/O.
    """

    def __init__(self, payload: Mapping[str, Any], *, mode: PartialRollouts = "continue", max_continuations: int = 4,
                 abort_attempts: int = 20) -> None:
        if mode not in PARTIAL_ROLLOUTS:
            raise EngineError(f"partial rollouts {mode!r}: use continue or restart", retriable=False)
        self._base = dict(payload)
        self._continue = mode == "continue" and "input_ids" in payload
        self._max_continuations = max_continuations
        self._abort_attempts = abort_attempts
        self._max_new = int(self._base["sampling_params"].get("max_new_tokens", 128))  # SGLang's default
        self._segments: list[Completion] = []
        self._generated = 0
        self.continuations = 0
        self.aborts = 0

    def payload(self) -> dict[str, Any]:
        """The body of the next request: the original one, or its continuation."""
        if not self._generated:
            return self._base
        sampling = dict(self._base["sampling_params"])
        sampling["max_new_tokens"] = self._max_new - self._generated
        if "min_new_tokens" in sampling:
            sampling["min_new_tokens"] = max(0, int(sampling["min_new_tokens"]) - self._generated)
        prefix = [int(t) for s in self._segments for t in s.tokens]
        return {**self._base, "input_ids": list(self._base["input_ids"]) + prefix, "sampling_params": sampling}

    def add(self, completion: Completion, where: str = "") -> Completion | None:
        """Take one response: the finished sample, or None when the next `payload` must be sent.

        Raises:
            EngineError: aborted more often than allowed (retriable when continuations ran out: the
                producer may try the prompt again).
        """
        if completion.finish_reason != "abort":
            return join_segments([*self._segments, completion])
        if self._continue and len(completion.tokens):
            self.continuations += 1
            if self.continuations > self._max_continuations:
                raise EngineError(f"sample aborted {self.continuations} times with partial output{where}; more "
                                  f"than {self._max_continuations} continuations", retriable=True)
            self._segments.append(completion)
            self._generated += len(completion.tokens)
            if self._generated >= self._max_new:
                return join_segments([*self._segments[:-1], replace(completion, finish_reason="length")])
            return None
        self.aborts += 1
        if self.aborts > self._abort_attempts:
            raise EngineError(f"request aborted {self.aborts} times{where}; giving up", retriable=False)
        return None
