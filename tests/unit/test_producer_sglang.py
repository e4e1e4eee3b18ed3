"""The SGLang engines against a local fake server speaking SGLang's native /generate format.

Pinned: request fields (input_ids or text, sampling_params, return_logprob); parsing of output_ids,
meta_info.output_token_logprobs ([logprob, token_id, text]), finish_reason {"type": ...} and
weight_version; retries with backoff on 5xx, timeouts and refused connections; aborted requests never
returned as finished (a text prompt's re-issued, the in-process engine's continued); 4xx failing at
once; round robin over several URLs. Partial rollouts and weight sync: test_sglang_*.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import types
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from rollstream.producers.engines import EngineError, RetryPolicy, SamplingParams, SGLangEngine, SGLangHTTPEngine
from rollstream.producers.engines._sglang_format import parse_completion

from tests.standins.sglang_server import CharTokenizer

PROMPT = {"id": "p1", "prompt": "2+2?", "label": "4", "metadata": {}, "epoch": 0}
FAST = RetryPolicy(attempts=3, abort_attempts=2, backoff_s=0.01, max_backoff_s=0.02)


def sglang_response(tokens: list[int], *, finish: str = "stop", version: str = "7") -> dict[str, Any]:
    return {"text": "".join(f"t{t}" for t in tokens), "output_ids": tokens,
            "meta_info": {"id": "rid", "finish_reason": {"type": finish, "matched": 0} if finish != "abort"
                          else {"type": "abort", "message": "weights updating"},
                          "prompt_tokens": 3, "completion_tokens": len(tokens), "weight_version": version,
                          "output_token_logprobs": [[-0.25 * (i + 1), t, None] for i, t in enumerate(tokens)]}}


class FakeSGLang:
    """Answers POST /generate from a script of actions; records every request body."""

    def __init__(self) -> None:
        self.script: list[tuple[str, Any]] = []
        self.default: tuple[str, Any] = ("ok", [5, 6, 2])
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append({"path": self.path, **body})
                    action, arg = fake.script.pop(0) if fake.script else fake.default
                if action == "sleep":
                    time.sleep(arg)
                    action, arg = "ok", [1]
                if action == "status":
                    self._send(arg, {"error": {"message": f"status {arg}"}})
                elif action == "abort":
                    self._send(200, sglang_response([9], finish="abort"))
                else:
                    self._send(200, sglang_response(arg))

            def _send(self, status: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out closed the socket under a slow answer: that is the test


@pytest.fixture
def fake() -> Iterator[FakeSGLang]:
    server = FakeSGLang()
    yield server
    server.close()


def run_engine(engine: Any, n: int = 2, prompt: dict[str, Any] = PROMPT) -> Any:
    async def go() -> Any:
        await engine.start()
        try:
            return await engine.generate(prompt, n, SamplingParams(max_new_tokens=8, temperature=0.7))
        finally:
            await engine.close()
    return asyncio.run(go())


def test_request_and_response_format(fake: FakeSGLang) -> None:
    gen = run_engine(SGLangHTTPEngine([fake.url], retry=FAST), n=2)
    assert len(gen.completions) == 2 and len(fake.requests) == 2
    req = fake.requests[0]
    assert req["path"] == "/generate" and req["text"] == "2+2?" and req["return_logprob"] is True
    assert req["sampling_params"] == {"max_new_tokens": 8, "temperature": 0.7, "top_p": 1.0}
    c = gen.completions[0]
    assert list(c.tokens) == [5, 6, 2] and c.logprobs == [-0.25, -0.5, -0.75]
    assert c.finish_reason == "stop" and c.policy_version == 7 and c.text == "t5t6t2"


def test_retries_5xx_timeouts_and_aborts_then_succeeds(fake: FakeSGLang) -> None:
    fake.script = [("status", 503), ("sleep", 1.0), ("abort", None), ("ok", [3, 4])]
    engine = SGLangHTTPEngine(fake.url + "/generate", retry=FAST, timeout_s=0.3)
    gen = run_engine(engine, n=1)
    assert [list(c.tokens) for c in gen.completions] == [[3, 4]]
    assert len(fake.requests) == 4
    assert all(c.finish_reason != "abort" for c in gen.completions)


def test_gives_up_after_bounded_retries(fake: FakeSGLang) -> None:
    fake.default = ("status", 500)
    with pytest.raises(EngineError, match="failed 3 times") as err:
        run_engine(SGLangHTTPEngine([fake.url], retry=FAST), n=1)
    assert not err.value.retriable and len(fake.requests) == 3


def test_keeps_aborting_is_an_error_not_a_sample(fake: FakeSGLang) -> None:
    fake.default = ("abort", None)
    with pytest.raises(EngineError, match="aborted 3 times"):
        run_engine(SGLangHTTPEngine([fake.url], retry=FAST), n=1)


def test_client_error_fails_at_once(fake: FakeSGLang) -> None:
    fake.default = ("status", 400)
    with pytest.raises(EngineError, match="HTTP 400"):
        run_engine(SGLangHTTPEngine([fake.url], retry=FAST), n=1)
    assert len(fake.requests) == 1


def test_round_robin_and_dead_server_failover(fake: FakeSGLang) -> None:
    other = FakeSGLang()
    dead = "http://127.0.0.1:1"
    try:
        gen = run_engine(SGLangHTTPEngine([fake.url, f"{other.url},{dead}"], retry=FAST), n=6)
        assert len(gen.completions) == 6
        assert len(fake.requests) >= 2 and len(other.requests) >= 2
    finally:
        other.close()


def test_chat_prompt_needs_a_tokenizer(fake: FakeSGLang) -> None:
    chat = {**PROMPT, "prompt": [{"role": "user", "content": "hi"}]}
    with pytest.raises(EngineError, match="--tokenizer"):
        run_engine(SGLangHTTPEngine([fake.url], retry=FAST), n=1, prompt=chat)


def test_parse_rejects_foreign_shapes() -> None:
    with pytest.raises(EngineError, match="meta_info"):
        parse_completion({"text": "x"})
    c = parse_completion({"text": "x", "output_ids": [1, 2], "meta_info": {"finish_reason": "length",
                                                                        "weight_version": "default"}})
    assert list(c.tokens) == [1, 2] and c.logprobs is None and c.finish_reason == "length"
    assert c.policy_version is None


def test_in_process_engine_with_a_stub_sglang(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    calls: list[dict[str, Any]] = []
    aborts = [True]

    class StubEngine:
        def __init__(self, model_path: str, **kwargs: Any) -> None:
            self.model_path = model_path

        async def async_generate(self, **kwargs: Any) -> dict[str, Any]:
            calls.append(kwargs)
            if aborts and aborts.pop():
                return sglang_response([9], finish="abort")
            return sglang_response([7, 8])

        def shutdown(self) -> None:
            pass

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=StubEngine))
    monkeypatch.setattr("rollstream.producers.engines.sglang_engine.load_tokenizer", lambda path: CharTokenizer())
    gen = run_engine(SGLangEngine(tmp_path), n=1)
    assert [list(c.tokens) for c in gen.completions] == [[9, 7, 8]]  # the aborted token, then its continuation
    assert len(calls) == 2 and calls[0]["return_logprob"] is True and calls[0]["input_ids"] == [50, 43, 50, 63]
    assert calls[1]["input_ids"] == [50, 43, 50, 63, 9] and calls[1]["sampling_params"]["max_new_tokens"] == 7
