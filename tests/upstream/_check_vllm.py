"""Run in a subprocess by test_upstream.py: vLLM's own validators over the bodies our engine sent, and vLLM's
own response types for our parsers. ``python -m tests.upstream._check_vllm FOLDER IN.json OUT.json``.

Validation as ``vllm serve`` does it (vllm/entrypoints/openai/completion/api_router.py, serving.py): the body
is parsed into ``CompletionRequest`` (pydantic, ``extra="allow"``: an unknown key is dropped silently, so
every key must also be one of its fields), then ``to_sampling_params`` makes vLLM's ``SamplingParams``.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from tests.upstream._checking import declared_routes, run_checks

ROUTER_FILES = ("vllm/entrypoints/openai/completion/api_router.py", "vllm/entrypoints/openai/models/api_router.py",
                "vllm/entrypoints/serve/instrumentator/health.py", "vllm/entrypoints/rl/online/api_router.py",
                "vllm/entrypoints/serve/dev/rpc/api_router.py")


def check_completion(body: dict[str, Any]) -> dict[str, Any]:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    try:
        unknown = sorted(set(body) - set(CompletionRequest.model_fields))
        if unknown:
            return {"error": f"not CompletionRequest fields (vLLM drops them silently): {unknown}"}
        request = CompletionRequest.model_validate(body)
        params = request.to_sampling_params(int(body.get("max_tokens", 16)))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:800]}
    return {"error": None, "seed": params.seed, "logprobs": params.logprobs, "max_tokens": params.max_tokens,
            "min_tokens": params.min_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "include_stop_str_in_output": params.include_stop_str_in_output,
            "return_weight_versions": request.return_weight_versions}


def responses() -> dict[str, Any]:
    """vLLM's own response types, serialized as its server sends them."""
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionLogProbs,
        CompletionRequest,
        CompletionResponse,
        CompletionResponseChoice,
    )
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import RetryableRequestError
    from vllm.outputs import WeightVersionSpan

    logprobs = CompletionLogProbs(text_offset=[0, 10], token_logprobs=[-0.5, -0.25],
                                  tokens=["token_id:11", "token_id:12"],
                                  top_logprobs=[{"token_id:11": -0.5}, {"token_id:12": -0.25}])
    choice = CompletionResponseChoice(index=0, text="ab", logprobs=logprobs, finish_reason="length", stop_reason=None,
                                      token_ids=[11, 12], prompt_token_ids=[1, 2, 3],
                                      weight_versions=[WeightVersionSpan("3", 0, 1), WeightVersionSpan("4", 1, 2)])
    response = CompletionResponse(model="m", choices=[choice],
                                  usage=UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5))
    core = Path(str(metadata.distribution("vllm").locate_file("vllm/v1/engine/core.py"))).read_text()
    found = re.search(r'code="engine_paused",\s*message="([^"]+)"', core)
    paused = create_error_response(RetryableRequestError(found.group(1) if found else "?"))
    return {"completion": response.model_dump(mode="json"), "paused_found": bool(found),
            "paused": {"status": int(paused.error.code), "body": paused.model_dump_json()},
            "fields": sorted(CompletionRequest.model_fields)}


def checks(todo: dict[str, Any], result: dict[str, Any]) -> None:
    result["completions"] = [check_completion(b) for b in todo["completions"]]
    result["responses"] = responses()
    result["routes"] = declared_routes("vllm", ROUTER_FILES)  # the server needs a GPU: read from the source


if __name__ == "__main__":
    run_checks("vllm", sys.argv[1:4], checks)
