"""Conformance: our engines' requests and parsers against the real SGLang and vLLM packages (issue 26).

Against the versions of `_env` (SGLang 0.5.23 and vLLM 0.33.0 unless ``ROLLSTREAM_UPSTREAM`` says others),
installed without their GPU dependencies by ``make upstream`` (tests/upstream/install.py); skipped, with the
reason, only where they could not be installed. Each package is imported in a subprocess of its own
(`_check_sglang`, `_check_vllm`: its import-time settings stay out of this process) that validates what the
engines sent and encodes upstream's own response types.

Pinned:
- every request body the engines send (collected from the engines themselves, run against the stand-ins:
  SGLang's ``/generate`` with token ids, with text, continued after an abort, the weight-sync control
  bodies, the in-process engine's ``async_generate`` and reload arguments; vLLM's ``/v1/completions``) is
  one upstream's own validators accept, without an unknown key, and means what we meant (vLLM's
  ``to_sampling_params``: seeds, logprobs, stop strings, weight versions);
- upstream's own responses (SGLang's ``GenerateResponse`` finished and aborted, ``GetModelInfoResponse``;
  vLLM's ``CompletionResponse`` with ``weight_versions``, its 503 while paused) parse with our parsers;
- the engines' tables of sampling options are upstream's fields;
- each stand-in's route table is a subset of the routes of the installed upstream package, its strict
  sampling schema SGLang's, its ``/model_info`` keys SGLang's and its paused 503 vLLM's, word for word.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollstream.producers.engines import RetryPolicy, SamplingParams, SGLangHTTPEngine, SGLangSyncEngine, VLLMHTTPEngine
from rollstream.producers.engines import sglang_engine as sglang_engine_module
from rollstream.producers.engines._sampling import SGLANG_OPTIONS, VLLM_OPTIONS, VLLM_RENAMES
from rollstream.producers.engines._sglang_format import INCREMENTAL_META, parse_policy_version
from rollstream.producers.engines._vllm_format import is_paused_answer, parse_response
from rollstream.producers.engines.sglang_engine import SGLangEngine
from rollstream.producers.engines.sglang_http import parse_answer

from tests.standins import sglang_server, vllm_server
from tests.standins.sglang_server import CharTokenizer, SGLangStandIn
from tests.standins.vllm_server import VLLMStandIn
from tests.unit.test_inflight_resume import Recorder
from tests.upstream._env import ROOT, installed, target, versions, why_not_installed

pytestmark = pytest.mark.slow
PROMPT = {"id": "p1", "prompt": "2+2?", "label": "4", "metadata": {}, "epoch": 0}
FAST = RetryPolicy(attempts=3, abort_attempts=2, backoff_s=0.01, max_backoff_s=0.02)
SGLANG_SAMPLING = SamplingParams(max_new_tokens=4, temperature=0.7, top_k=5, extra={
    "seed": 11, "min_new_tokens": 1, "stop": ["\n\n"], "stop_token_ids": [2], "no_stop_trim": True,
    "repetition_penalty": 1.1, "ignore_eos": False, "skip_special_tokens": True})
VLLM_SAMPLING = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=5, extra={
    "seed": 11, "min_new_tokens": 1, "stop": ["\n\n"], "stop_token_ids": [2], "no_stop_trim": True,
    "repetition_penalty": 1.1, "ignore_eos": False, "skip_special_tokens": True})


def _check(module: str, todo: dict[str, Any], tmp: Path) -> dict[str, Any]:
    folder = target()
    if not installed(folder):
        pytest.skip(why_not_installed(folder))
    (tmp / "in.json").write_text(json.dumps(todo))
    done = subprocess.run([sys.executable, "-m", f"tests.upstream.{module}", str(folder), str(tmp / "in.json"),
                           str(tmp / "out.json")], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp / "out.json").read_text())
    assert "crashed" not in result, result["crashed"]
    return result


def _run(engine: Any, work: Any) -> Any:
    async def go() -> Any:
        await engine.start()
        try:
            return await work(engine)
        finally:
            await engine.close()
    return asyncio.run(go())


# -- SGLang ---------------------------------------------------------------------------------------------


def _sglang_bodies(tmp: Path) -> dict[str, Any]:
    """What the SGLang engines send, as the stand-ins received it (and the in-process engine's calls)."""
    generate: list[dict[str, Any]] = []
    control: list[tuple[str, dict[str, Any]]] = []
    with SGLangStandIn(weight_version="1") as server:
        _run(SGLangHTTPEngine([server.url], tokenizer=CharTokenizer(), retry=FAST),
             lambda e: e.generate(PROMPT, 2, SGLANG_SAMPLING))
        _run(SGLangHTTPEngine([server.url], retry=FAST),
             lambda e: e.generate(PROMPT, 1, SamplingParams(max_new_tokens=3)))
        server.abort_after_tokens = 2  # a continued partial rollout: prompt + tokens, a smaller budget
        _run(SGLangHTTPEngine([server.url], tokenizer=CharTokenizer(), retry=FAST),
             lambda e: e.generate(PROMPT, 1, SGLANG_SAMPLING))
        server.abort_after_tokens = None
        checkpointed = Recorder()  # in-flight checkpoints on: the request streams
        checkpointed.interval_s = 30.0
        _run(SGLangHTTPEngine([server.url], tokenizer=CharTokenizer(), retry=FAST),
             lambda e: e.generate(PROMPT, 1, SGLANG_SAMPLING, progress=checkpointed))
        _run(SGLangSyncEngine([server.url], retry=FAST), lambda e: e.reload(str(tmp), 2))
        for path, body in server.requests:
            if path == "/generate":
                generate.append(body)
            elif path.startswith("/") and path != "/model_info":
                control.append((path, body))
    assert len(generate) >= 5 and any("text" in b for b in generate) and len(control) == 3
    assert any(b["sampling_params"]["max_new_tokens"] == 2 for b in generate)  # the continuation
    assert any(b.get("stream") is True for b in generate)
    return {"generate": generate, "control": control, "in_process": _in_process_calls(tmp)}


def _in_process_calls(tmp: Path) -> list[dict[str, Any]]:
    """The keywords `SGLangEngine` passes to ``sglang.Engine.async_generate`` and to the io_struct requests of
    its reload, recorded by stand-ins of those objects."""
    calls: list[dict[str, Any]] = []

    class _Engine:
        async def async_generate(self, **kwargs: Any) -> Any:
            calls.append({"kind": "generate", "kwargs": kwargs})
            n = kwargs["sampling_params"]["max_new_tokens"]
            return {"text": "x", "output_ids": [5] * n, "meta_info": {
                "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.1, 5, None]] * n}}

    class _Manager:
        async def pause_generation(self, request: Any) -> None: ...
        async def continue_generation(self, request: Any) -> None: ...

        async def update_weights_from_disk(self, request: Any, raw: Any) -> Any:
            return True, "ok", 0

    def record(kind: str) -> Any:
        return lambda **kwargs: calls.append({"kind": kind, "kwargs": kwargs})

    kinds = ("PauseGenerationReqInput", "UpdateWeightFromDiskReqInput", "ContinueGenerationReqInput")
    io = types.ModuleType("_rollstream_recorded_io_struct")
    for kind in kinds:
        setattr(io, kind, record(kind))
    engine = SGLangEngine("/models/x", sampling=SGLANG_SAMPLING)
    fake = _Engine()
    fake.tokenizer_manager = _Manager()  # type: ignore[attr-defined]
    engine._engine = fake
    sys.modules[io.__name__] = io
    real, sglang_engine_module._IO_STRUCT = sglang_engine_module._IO_STRUCT, io.__name__
    try:
        asyncio.run(engine.generate_tokens([1, 2, 3], 2, SGLANG_SAMPLING))
        asyncio.run(engine.reload(str(tmp), 3))
    finally:
        sglang_engine_module._IO_STRUCT = real
        del sys.modules[io.__name__]
    assert [c["kind"] for c in calls] == ["generate", "generate", *kinds]
    return calls


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("sglang")
    todo = _sglang_bodies(tmp)
    return {"todo": todo, "result": _check("_check_sglang", todo, tmp)}


def test_sglang_version_is_the_pinned_one(sglang: dict[str, Any]) -> None:
    assert sglang["result"]["version"] == versions()["sglang"]


def test_sglang_accepts_every_body_the_engines_send(sglang: dict[str, Any]) -> None:
    result, todo = sglang["result"], sglang["todo"]
    assert [e for e in result["generate"] if e] == [], todo["generate"]
    assert [e for e in result["control"] if e] == [], todo["control"]
    assert [e for e in result["in_process"] if e] == [], todo["in_process"]
    seeds = sorted(b["sampling_params"]["sampling_seed"] for b in todo["generate"][:2])
    assert seeds == [11, 12]  # rollstream's seed, SGLang's name, one per sample


def test_sglang_responses_parse(sglang: dict[str, Any]) -> None:
    responses = sglang["result"]["responses"]
    done, note = parse_answer(responses["finished"])
    assert (list(done.tokens), list(done.logprobs or []), done.finish_reason) == ([11, 12], [-0.5, -0.25], "length")
    assert [(s.version, s.start, s.end) for s in done.version_spans] == [(3, 0, 1), (4, 1, 2)] and note == ""
    aborted, note = parse_answer(responses["aborted"])
    assert aborted.finish_reason == "abort" and note == "Aborted" and list(aborted.tokens) == [11]
    assert parse_policy_version(responses["model_info"]["weight_version"]) == 7


def test_sglang_option_table_and_stand_in_follow_the_package(sglang: dict[str, Any]) -> None:
    responses = sglang["result"]["responses"]
    assert SGLANG_OPTIONS == set(responses["sampling_fields"])
    assert list(sglang_server.SAMPLING_FIELDS) == responses["sampling_fields"]
    with SGLangStandIn() as server:
        info = httpx.get(server.url + "/model_info", timeout=10).json()
    assert set(info) <= set(responses["model_info_fields"]) and "weight_version" in info


def test_sglang_stream_joiner_follows_the_package(sglang: dict[str, Any]) -> None:
    assert list(INCREMENTAL_META) == sglang["result"]["incremental_meta"]


def test_sglang_stand_in_routes_are_the_packages(sglang: dict[str, Any]) -> None:
    upstream = {tuple(r) for r in sglang["result"]["routes"]}
    assert set(sglang_server.ROUTES) <= upstream, set(sglang_server.ROUTES) - upstream
    assert ("GET", "/get_weight_version") not in upstream  # only `legacy` serves it, as SGLang < 0.5.15 did


# -- vLLM -----------------------------------------------------------------------------------------------


def _vllm_bodies() -> list[dict[str, Any]]:
    with VLLMStandIn() as server:
        _run(VLLMHTTPEngine([server.url], tokenizer=CharTokenizer(), retry=FAST, logprobs_mode="raw_logprobs"),
             lambda e: e.generate(PROMPT, 2, VLLM_SAMPLING))
        _run(VLLMHTTPEngine([server.url], retry=FAST),
             lambda e: e.generate(PROMPT, 1, SamplingParams(max_new_tokens=3)))
        _run(VLLMHTTPEngine([server.url], retry=FAST), lambda e: e.generate_tokens([1, 2], 1, SamplingParams(
            max_new_tokens=2, temperature=0.0)))
        return server.completions()


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    todo = {"completions": _vllm_bodies()}
    return {"todo": todo, "result": _check("_check_vllm", todo, tmp_path_factory.mktemp("vllm"))}


def test_vllm_version_is_the_pinned_one(vllm: dict[str, Any]) -> None:
    assert vllm["result"]["version"] == versions()["vllm"]


def test_vllm_accepts_every_body_the_engine_sends_as_meant(vllm: dict[str, Any]) -> None:
    checked = vllm["result"]["completions"]
    assert [c["error"] for c in checked if c["error"]] == [], vllm["todo"]["completions"]
    first, second = checked[:2]
    assert sorted([first["seed"], second["seed"]]) == [11, 12]
    assert (first["logprobs"], first["max_tokens"], first["min_tokens"], first["top_k"]) == (0, 4, 1, 5)
    assert all(c["include_stop_str_in_output"] and c["return_weight_versions"] for c in checked)


def test_vllm_responses_parse(vllm: dict[str, Any]) -> None:
    responses = vllm["result"]["responses"]
    completion, prompt = parse_response(responses["completion"])
    assert (list(completion.tokens), list(completion.logprobs or []), prompt) == ([11, 12], [-0.5, -0.25], [1, 2, 3])
    assert [(s.version, s.start, s.end) for s in completion.version_spans] == [(3, 0, 1), (4, 1, 2)]
    assert completion.policy_version == 4
    paused = responses["paused"]
    assert responses["paused_found"] and is_paused_answer(paused["status"], paused["body"])


def test_vllm_option_table_and_stand_in_follow_the_package(vllm: dict[str, Any]) -> None:
    fields = set(vllm["result"]["responses"]["fields"])
    assert VLLM_OPTIONS <= fields and set(VLLM_RENAMES.values()) <= fields, (VLLM_OPTIONS | set(VLLM_RENAMES.values())
                                                                             ) - fields
    with VLLMStandIn() as server:
        httpx.post(server.url + "/pause?mode=abort", timeout=10).raise_for_status()
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": [1], "max_tokens": 1}, timeout=10)
    paused = vllm["result"]["responses"]["paused"]
    assert (refused.status_code, refused.json()) == (paused["status"], json.loads(paused["body"]))


def test_vllm_stand_in_routes_are_the_packages(vllm: dict[str, Any]) -> None:
    upstream = {tuple(r) for r in vllm["result"]["routes"]}
    assert set(vllm_server.ROUTES) <= upstream, set(vllm_server.ROUTES) - upstream
