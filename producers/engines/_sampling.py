"""Sampling options per engine: rollstream's `SamplingParams` speaks SGLang's names (and ``seed``); each HTTP
or in-process engine maps them to its own and refuses, before anything is sent, an option it has no name for.

Why refuse: SGLang 0.5.23 checks ``sampling_params`` against a fixed schema (``sglang/api/v1/api_types.py``
``SamplingParams``, unknown keys rejected: an HTTP 400 on every sample; in-process a ``TypeError``), and
vLLM 0.33 accepts anything and drops what it does not know (``CompletionRequest`` is ``extra="allow"``): an
option either engine cannot honour must be a clear error at startup, never a silent difference.

The names (read in the wheels of SGLang 0.5.23 and vLLM 0.33.0; the code is ours):
- SGLang: the fields of ``sglang.api.v1.api_types.SamplingParams``; ``seed`` is sent as SGLang's
  ``sampling_seed``.
- vLLM: ``vllm/entrypoints/openai/completion/protocol.py`` ``CompletionRequest``'s sampling fields;
  SGLang's ``max_new_tokens`` / ``min_new_tokens`` / ``sampling_seed`` / ``no_stop_trim`` are sent as
  ``max_tokens`` / ``min_tokens`` / ``seed`` / ``include_stop_str_in_output``.
The conformance tests (tests/upstream) hold both tables against the installed packages.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from rollstream.producers.engines.base import EngineError

SGLANG_OPTIONS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice"})
_SGLANG_RENAMES = {"seed": "sampling_seed"}
_SGLANG_SET_BY_ENGINE = frozenset({"n"})  # one request per sample

# rollstream's (SGLang's) name -> vLLM's CompletionRequest field
VLLM_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed",
                "no_stop_trim": "include_stop_str_in_output"}
VLLM_OPTIONS = frozenset({
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "logit_bias", "bad_words", "allowed_token_ids",
    "truncate_prompt_tokens", "length_penalty"})
_VLLM_SET_BY_ENGINE = frozenset({"n", "logprobs", "prompt", "model", "stream", "echo", "return_token_ids",
                                 "return_tokens_as_token_ids", "return_weight_versions"})


def sglang_options(sampling: Mapping[str, Any]) -> dict[str, Any]:
    """`sampling` (a `SamplingParams.to_dict()`) in SGLang's names.

    Raises:
        EngineError (not retriable): an option SGLang has no name for, or one the engine sets itself.
    """
    out: dict[str, Any] = {}
    for key, value in sampling.items():
        name = _SGLANG_RENAMES.get(key, key)
        if name in _SGLANG_SET_BY_ENGINE:
            raise EngineError(f"sampling option {key!r}: the SGLang engine sends one request per sample; set "
                              "n_samples instead", retriable=False)
        if name not in SGLANG_OPTIONS:
            raise _unknown("SGLang", key, SGLANG_OPTIONS | set(_SGLANG_RENAMES),
                           "sglang/api/v1/api_types.py SamplingParams")
        out[name] = value
    return out


def vllm_options(sampling: Mapping[str, Any]) -> dict[str, Any]:
    """`sampling` (a `SamplingParams.to_dict()`) in vLLM's names; a ``top_k`` of -1 or 0 (off) is left out.

    Raises:
        EngineError (not retriable): an option vLLM has no name for, or one the engine sets itself.
    """
    out: dict[str, Any] = {}
    for key, value in sampling.items():
        if key in ("max_tokens", "min_tokens"):  # vLLM's own name, where rollstream has SGLang's
            raise EngineError(f"sampling option {key!r}: give rollstream's name {_reverse(key)!r} (sent to vLLM "
                              f"as {key!r})", retriable=False)
        name = VLLM_RENAMES.get(key, key)
        if name in _VLLM_SET_BY_ENGINE:
            raise EngineError(f"sampling option {key!r} is set by the vLLM engine itself (one request per sample, "
                              "token ids and logprobs always asked for)", retriable=False)
        if name not in VLLM_OPTIONS:
            raise _unknown("vLLM", key, VLLM_OPTIONS | set(VLLM_RENAMES),
                           "vllm/entrypoints/openai/completion/protocol.py CompletionRequest")
        if name == "top_k" and int(value) in (-1, 0):
            continue
        out[name] = value
    return out


def _reverse(vllm_name: str) -> str:
    return next(k for k, v in VLLM_RENAMES.items() if v == vllm_name)


def _unknown(engine: str, key: str, known: set[str] | frozenset[str], where: str) -> EngineError:
    close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return EngineError(f"sampling option {key!r} is not one {engine} knows ({where}: {', '.join(sorted(known))})"
                       f"{hint}", retriable=False)
