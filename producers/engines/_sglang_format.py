"""SGLang's native ``/generate`` request and response format, shared by the HTTP and in-process engines.

Request (``GenerateReqInput``): ``input_ids`` (or ``text``), ``sampling_params`` (``max_new_tokens``,
``temperature``, ``top_p``, ...), ``return_logprob``. One request per sample: each sample is routed,
retried and, when aborted by a weight update, re-issued on its own; SGLang's radix cache shares the
prompt prefix between them.
Response: ``text``, ``output_ids``, ``meta_info`` with ``output_token_logprobs`` (a list of
``[logprob, token_id, token_text_or_null]``), ``finish_reason`` (``{"type": "stop" | "length" |
"abort", ...}``) and ``weight_version`` (a string in SGLang's server args; numeric ones are kept).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from producers.engines.base import Completion, EngineError


def request_payload(text: str, input_ids: Sequence[int] | None, sampling: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body of one ``/generate`` call (token ids when we have them, else text)."""
    payload: dict[str, Any] = {"sampling_params": dict(sampling), "return_logprob": True}
    if input_ids is not None:
        payload["input_ids"] = list(input_ids)
    else:
        payload["text"] = text
    return payload


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
    """SGLang reports the version as a string (``"default"`` unless the trainer set one): keep integers."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def parse_completion(out: Any) -> Completion:
    """One ``/generate`` response object -> `Completion`.

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
    return Completion(text=str(out.get("text", "")), tokens=tokens, logprobs=logprobs, finish_reason=finish,
                      policy_version=parse_policy_version(meta.get("weight_version")))
