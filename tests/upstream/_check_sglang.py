"""Run in a subprocess by test_upstream.py: SGLang's own validators over the bodies our engines sent, and
SGLang's own response types for our parsers. ``python -m tests.upstream._check_sglang FOLDER IN.json OUT.json``.

Validation as SGLang's HTTP server does it (python/sglang/srt/entrypoints/http_server.py): a ``/generate``
body is parsed into ``GenerateReqInput`` (FastAPI: pydantic), checked by ``api_contract.generate_contract_error``
(``sglang/api/v1/api_types.py`` ``GenerateRequest``: unknown ``sampling_params`` keys refused), normalized,
and its ``sampling_params`` become ``sglang.srt.sampling.sampling_params.SamplingParams`` (as the tokenizer
manager makes them; unknown keys a TypeError there). Control bodies are parsed into their io_struct types
(msgspec structs, validated by pydantic through ``msgspec_struct_pydantic_core_schema``).
"""

from __future__ import annotations

import ast
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from tests.upstream._checking import declared_routes, run_checks

CONTROL = {"/pause_generation": "PauseGenerationReqInput", "/continue_generation": "ContinueGenerationReqInput",
           "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
           "/update_weight_version": "UpdateWeightVersionReqInput"}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:800]


def check_generate(body: dict[str, Any]) -> str | None:
    import pydantic
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    try:
        obj = pydantic.TypeAdapter(GenerateReqInput).validate_python(body)
        contract = generate_contract_error(body)
        if contract is not None:
            return f"api_contract: {contract}"
        obj.normalize_batch_and_arguments()
        SamplingParams(**(body.get("sampling_params") or {})).verify(32000)  # normalize needs the tokenizer
    except Exception as exc:  # every failure is a finding, reported by name
        return _error(exc)
    return None


def check_control(path: str, body: dict[str, Any]) -> str | None:
    import pydantic
    from sglang.srt.managers import io_struct

    try:
        pydantic.TypeAdapter(getattr(io_struct, CONTROL[path])).validate_python(body)
    except Exception as exc:
        return _error(exc)
    return None


def check_in_process(call: dict[str, Any]) -> str | None:
    """What `SGLangEngine` hands ``sglang.Engine`` in-process: ``async_generate``'s keywords become a
    ``GenerateReqInput`` (engine.py), and the reload's io_struct requests."""
    from sglang.srt.managers import io_struct
    from sglang.srt.sampling.sampling_params import SamplingParams

    try:
        if call["kind"] == "generate":
            obj = io_struct.GenerateReqInput(**call["kwargs"])
            obj.normalize_batch_and_arguments()
            SamplingParams(**call["kwargs"]["sampling_params"]).verify(32000)
        else:
            getattr(io_struct, call["kind"])(**call["kwargs"])
    except Exception as exc:
        return _error(exc)
    return None


def responses() -> dict[str, Any]:
    """SGLang's own response types, encoded as its server sends them (api_types' ``to_json_value``)."""
    from sglang.api.v1 import api_types as t

    spans = [t.WeightVersionSpan(version="3", start=0, end=1), t.WeightVersionSpan(version="4", start=1, end=2)]
    finished = t.GenerateResponse(text="ab", output_ids=[11, 12], meta_info=t.GenerateMetaInfo(
        id="r1", prompt_tokens=3, completion_tokens=2, finish_reason=t.FinishLength(length=2),
        output_token_logprobs=[t.LogprobEntry(logprob=-0.5, token_id=11), t.LogprobEntry(logprob=-0.25, token_id=12)],
        weight_version="4", weight_versions=spans))
    aborted = t.GenerateResponse(text="a", output_ids=[11], meta_info=t.GenerateMetaInfo(
        id="r2", prompt_tokens=3, completion_tokens=1, finish_reason=t.FinishAbort(message="Aborted"),
        output_token_logprobs=[t.LogprobEntry(logprob=-0.5, token_id=11)], weight_version="3",
        weight_versions=[t.WeightVersionSpan(version="3", start=0, end=1)]))
    info = t.GetModelInfoResponse(model_path="/m", weight_version="7")
    return {"finished": finished.to_json_value(), "aborted": aborted.to_json_value(),
            "model_info": info.to_json_value(),
            "model_info_fields": sorted(f for f in t.GetModelInfoResponse.__struct_fields__),
            "sampling_fields": list(t.SamplingParams.__struct_fields__)}


def incremental_meta() -> list[str]:
    """``_INCREMENTAL_STREAMING_META_INFO_KEYS`` of the tokenizer manager (the ``meta_info`` lists that
    ``--incremental-streaming-output`` sends only the new part of), read from its source: importing it needs a
    GPU."""
    source = metadata.distribution("sglang").locate_file("sglang/srt/managers/tokenizer_manager.py")
    for node in ast.parse(Path(str(source)).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_INCREMENTAL_STREAMING_META_INFO_KEYS"
                                                for t in node.targets):
            return [str(e.value) for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
    return []


def checks(todo: dict[str, Any], result: dict[str, Any]) -> None:
    result["generate"] = [check_generate(b) for b in todo["generate"]]
    result["control"] = [check_control(p, b) for p, b in todo["control"]]
    result["in_process"] = [check_in_process(c) for c in todo["in_process"]]
    result["responses"] = responses()
    result["incremental_meta"] = incremental_meta()
    result["routes"] = declared_routes("sglang", ["sglang/srt/entrypoints/http_server.py"])


if __name__ == "__main__":
    run_checks("sglang", sys.argv[1:4], checks)
