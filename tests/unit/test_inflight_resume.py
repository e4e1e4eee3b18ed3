"""In-flight checkpoints on the engine side (`rollstream.producers.multiturn` with a `Progress`), no broker.

Pinned here:

1. an episode is saved at every turn boundary (after the environment's reply, with its ``snapshot()``) and
   once when it ends, finished;
2. an episode restored from a checkpoint goes on from it: its tokens, logprobs, loss mask and versions kept
   as they were, the environment restored from the snapshot, the next policy turn continuing the context, and
   the result carries the resume point and whose checkpoint it continued; the result equals what the
   uninterrupted episode gives (a deterministic policy);
3. a finished sample's checkpoint is kept as it is (no policy call), and an environment without
   ``snapshot``/``restore`` starts its episode again, said through `Progress.restarted`;
4. a checkpoint round-trips through the wire format, and its invariants are checked;
5. the vLLM engine (against the stand-in) streams every request when checkpoints are on and saves each sample
   finished; a restored sample is continued from prompt + its tokens (``max_tokens`` reduced), its text,
   resume points and versions kept (the new tokens take the group's version); a finished one is kept without
   a request; a text prompt's checkpoint (no token ids to continue from) starts again; a paced stand-in
   (``tokens_per_s``, as the chaos harness `tests.chaos.inflight` runs it) streams each token as it makes it,
   the engine saving them as they come, and stops generating a request whose client left;
6. the SGLang engine (against the stand-in) the same way: its streamed chunks (cumulative, or new only with
   ``--incremental-streaming-output``, every ``stream_interval`` tokens) join into exactly the answer a request
   that does not stream gets; each sample is saved as it streams and once finished; a restored sample is
   continued from prompt ids + its tokens (``max_new_tokens`` reduced), its checkpointed versions kept in
   every later save; without checkpoints nothing streams; a stream that ends refused fails as that HTTP
   status would. The in-process SGLang engine (a stub ``sglang.Engine`` streaming as SGLang does) the same.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import fastavro
import httpx
import numpy as np
import pytest
from rollstream.producers.engines.base import Completion, SamplingParams
from rollstream.producers.engines.progress import SampleState
from rollstream.producers.multiturn import Episode, run_episodes
from rollstream.schemas import InflightCheckpoint, InvalidRecordError, decode, encode, fingerprint
from rollstream.schemas.codec import MAGIC, SCHEMA_DIR

SAMPLING = SamplingParams(max_new_tokens=2)


class Policy:
    """Deterministic: each turn answers two tokens derived from the context's length; counts its calls."""

    def __init__(self) -> None:
        self.contexts: list[list[int]] = []

    async def __call__(self, ids: Sequence[int], n: int, sampling: SamplingParams) -> list[Completion]:
        self.contexts.append(list(ids))
        base = 100 + len(ids)
        return [Completion(text="", tokens=[base, base + 1], logprobs=[-0.5, -0.25], policy_version=7)
                for _ in range(n)]


class UnversionedPolicy(Policy):
    async def __call__(self, ids: Sequence[int], n: int, sampling: SamplingParams) -> list[Completion]:
        return [Completion(text="", tokens=list(c.tokens), logprobs=c.logprobs)
                for c in await super().__call__(ids, n, sampling)]


class CountingEnv:
    """Replies [turn number] three times, then ends; its state is the turn count (snapshot/restore)."""

    def __init__(self) -> None:
        self.turns = 0

    def reply(self, turn: Completion, episode: Episode) -> list[int] | None:
        self.turns += 1
        return [self.turns] if self.turns <= 3 else None

    def snapshot(self) -> bytes:
        return json.dumps({"turns": self.turns}).encode()

    def restore(self, state: bytes) -> None:
        self.turns = json.loads(state)["turns"]


class StatelessEnv:
    """Like CountingEnv, reading its count from the episode: no snapshot/restore."""

    def reply(self, turn: Completion, episode: Episode) -> list[int] | None:
        return [episode.policy_turns] if episode.policy_turns <= 3 else None


class Recorder:
    """A `Progress` that hands out given states and records what is saved."""

    interval_s, version = 0.0, 9

    def __init__(self, restored: dict[int, SampleState] | None = None) -> None:
        self._restored = restored or {}
        self.saved: list[tuple[int, SampleState]] = []
        self.restarts: list[int] = []

    def restored(self, index: int) -> SampleState | None:
        return self._restored.get(index)

    def save(self, index: int, state: SampleState) -> None:
        self.saved.append((index, state))

    def restarted(self, index: int, why: str) -> None:
        assert "snapshot" in why or "token ids" in why
        self.restarts.append(index)


def _play(env: type, progress: Recorder | None, n: int = 1, policy: Policy | None = None) -> list[dict[str, Any]]:
    return asyncio.run(run_episodes(policy or Policy(), env, [1, 2, 3], n, SAMPLING, decode=str, max_turns=8,
                                    progress=progress))


def test_episodes_are_saved_at_every_turn_boundary_and_when_they_end() -> None:
    progress = Recorder()
    [out] = _play(CountingEnv, progress)
    states = [s for _, s in progress.saved]
    assert [s.policy_turns for s in states] == [1, 2, 3, 4]  # after each of 3 replies, then finished
    assert [s.finish_reason for s in states] == [None, None, None, "stop"]
    assert [json.loads(s.environment_state or b"null") for s in states] == [{"turns": t} for t in (1, 2, 3)] + [None]
    assert list(states[-1].tokens) == out["tokens"] and list(states[-1].loss_mask or ()) == out["loss_mask"]
    assert "resume_points" not in out


def test_a_restored_episode_goes_on_where_its_checkpoint_was_and_says_so() -> None:
    whole = Recorder()
    [uninterrupted] = _play(CountingEnv, whole)
    checkpoint = whole.saved[1][1]  # after the second reply
    restored = SampleState(**{**vars(checkpoint), "resume_points": (len(checkpoint.tokens),),
                              "resumed_from": ("producer-a",)})
    policy, progress = Policy(), Recorder({0: restored})
    [resumed] = _play(CountingEnv, progress, policy=policy)
    assert resumed["tokens"] == uninterrupted["tokens"] and resumed["loss_mask"] == uninterrupted["loss_mask"]
    assert resumed["logprobs"] == uninterrupted["logprobs"]
    assert resumed["tokens"][:len(checkpoint.tokens)] == list(checkpoint.tokens)
    assert resumed["resume_points"] == [len(checkpoint.tokens)] and resumed["resumed_from"] == ["producer-a"]
    assert policy.contexts[0] == [1, 2, 3, *checkpoint.tokens]  # the first call continues the checkpoint
    assert len(policy.contexts) == 2  # turns 3 and 4 only
    assert all(s.resume_points == (len(checkpoint.tokens),) for _, s in progress.saved)
    assert resumed["weight_version"] == 7  # the policy's own versions, restored and new

    unversioned = SampleState(**{**vars(restored), "versions": (3,) * len(checkpoint.tokens)})
    [older] = _play(CountingEnv, Recorder({0: unversioned}), policy=UnversionedPolicy())
    n = len(checkpoint.tokens)  # the checkpoint's tokens keep version 3, the new ones take the group's (9)
    assert older["weight_versions"] == [{"version": 3, "start": 0, "end": n},
                                        {"version": 9, "start": n, "end": len(older["tokens"])}]


def test_finished_samples_are_kept_and_episodes_without_snapshots_start_again() -> None:
    whole = Recorder()
    _play(CountingEnv, whole, n=2)
    finished = next(s for i, s in whole.saved if i == 1 and s.finish_reason)
    policy = Policy()
    out = _play(CountingEnv, Recorder({1: finished}), n=2, policy=policy)
    assert out[1]["tokens"] == list(finished.tokens)
    assert all(len(c) != 3 or c == [1, 2, 3] for c in policy.contexts) and len(policy.contexts) == 4  # sample 0 only

    midway = SampleState(tokens=(9, 9, 1), logprobs=(-1.0, -1.0, 0.0), loss_mask=(1, 1, 0), versions=(7, 7, 7),
                         policy_turns=1, environment_state=None, resume_points=(3,), resumed_from=("a",))
    progress = Recorder({0: midway})
    [restarted] = _play(StatelessEnv, progress)
    assert progress.restarts == [0] and "resume_points" not in restarted
    assert restarted["tokens"][:2] != [9, 9]


def test_checkpoints_round_trip_and_are_checked() -> None:
    c = InflightCheckpoint(group_id="p#0", prompt_id="p", attempt=1, sample_index=2, prompt_partition=0,
                           prompt_offset=5, producer_id="a", written_at_ms=1, policy_run=3, tokens=[4, 5, 6],
                           logprobs=[-0.5, 0.0, -1.0], loss_mask=[1, 0, 1], versions=[2, 2, -1], policy_turns=2,
                           environment_state=b"{}", resume_points=(1,), resumed_from=("b",), prompt_tokens=[7, 8])
    back = decode(encode(c), InflightCheckpoint)
    assert back.key == "p#0/2" and back.token_versions() == [2, 2, None]
    assert back.prompt_tokens is not None and back.prompt_tokens.tolist() == [7, 8]
    assert back.tokens.tolist() == [4, 5, 6] and np.allclose(back.logprobs, [-0.5, 0.0, -1.0])  # type: ignore[arg-type]
    assert back.loss_mask.tolist() == [1, 0, 1] and back.environment_state == b"{}"  # type: ignore[union-attr]
    assert (back.resume_points, back.resumed_from, back.finish_reason) == ((1,), ("b",), None)
    with pytest.raises(InvalidRecordError, match="logprobs has 1 entries for 3 tokens"):
        InflightCheckpoint("p#0", "p", 0, 0, 0, 0, "a", 1, 0, tokens=[1, 2, 3], logprobs=[0.0])
    with pytest.raises(InvalidRecordError, match="resume points"):
        InflightCheckpoint("p#0", "p", 0, 0, 0, 0, "a", 1, 0, tokens=[1], resume_points=(2,), resumed_from=("b",))


def test_a_version_1_checkpoint_reads_with_its_prompt_ids_not_known() -> None:
    schema = fastavro.parse_schema(json.loads((SCHEMA_DIR / "history" / "inflight_checkpoint.v1.avsc").read_text()))
    datum = {"group_id": "p#0", "prompt_id": "p", "attempt": 0, "sample_index": 0, "prompt_partition": 0,
             "prompt_offset": 1, "producer_id": "a", "written_at_ms": 1, "policy_run": 0, "has_logprobs": False,
             "version_spans": b"", "loss_mask": b"", "logprobs": b"", "tokens": np.asarray([4, 5], "<i4").tobytes()}
    body = io.BytesIO()
    fastavro.schemaless_writer(body, schema, datum)
    old = decode(MAGIC + fingerprint(schema) + body.getvalue(), InflightCheckpoint)
    assert old.tokens.tolist() == [4, 5] and old.prompt_tokens is None and old.text == ""


def _vllm_run(url: str, progress: Recorder, *, tokenizer: Any = None, n: int = 2) -> Any:
    from rollstream.producers.engines import VLLMHTTPEngine

    return _generate(VLLMHTTPEngine([url], tokenizer=tokenizer), progress, n)


def _generate(engine: Any, progress: Recorder | None, n: int) -> Any:
    async def go() -> Any:
        await engine.start()
        try:
            return await engine.generate({"id": "p", "prompt": "2+2?"}, n, SamplingParams(max_new_tokens=6),
                                         progress=progress)
        finally:
            await engine.close()
    return asyncio.run(go())


def test_vllm_samples_stream_resume_from_their_checkpoint_and_keep_finished_ones() -> None:
    from tests.standins.sglang_server import CharTokenizer
    from tests.standins.vllm_server import VLLMStandIn, token_at

    ids = [ord(ch) for ch in "2+2?"]
    with VLLMStandIn() as vllm:
        whole = Recorder()
        whole.interval_s = 0.001
        plain = _vllm_run(vllm.url, whole, tokenizer=CharTokenizer())
        assert all(b["stream"] is True for b in vllm.completions())  # checkpoints on: every request streams
        assert [s.finish_reason for _, s in whole.saved if s.finish_reason] == ["length", "length"]
        expected = [token_at(len(ids) + i) for i in range(6)]
        assert [list(c.tokens) for c in plain.completions] == [expected, expected]

        partial = SampleState(tokens=expected[:2], logprobs=list(plain.completions[0].logprobs[:2]),
                              versions=(4, 4), text="ab", resume_points=(2,), resumed_from=("P1",))
        finished = SampleState(tokens=expected, logprobs=list(plain.completions[1].logprobs), versions=(4,) * 6,
                               finish_reason="length", text="done", resume_points=(6,), resumed_from=("P1",))
        before = len(vllm.completions())
        out = _vllm_run(vllm.url, Recorder({0: partial, 1: finished}), tokenizer=CharTokenizer())
        [body] = vllm.completions()[before:]  # the finished sample was kept: one request, the continuation
        assert body["prompt"] == [*ids, *expected[:2]] and body["max_tokens"] == 4
        first, kept = out.completions
        assert list(first.tokens) == expected and first.text.startswith("ab")
        assert (list(first.resume_points), list(first.resumed_from)) == ([2], ["P1"])
        assert [(s.version, s.start, s.end) for s in first.version_spans] == [(4, 0, 2), (9, 2, 6)]
        assert list(kept.tokens) == expected and kept.text == "done" and list(kept.resume_points) == [6]

        progress = Recorder({0: partial})
        text_only = _vllm_run(vllm.url, progress, n=1)  # no tokenizer, no prompt ids in the checkpoint
        assert progress.restarts == [0] and not list(text_only.completions[0].resume_points)

        # A text prompt: its streamed checkpoints keep the ids the server tokenized it into (the first chunk's), and
        # a producer without a tokenizer continues from them.
        text_saves = Recorder()
        text_saves.interval_s = 0.001
        _vllm_run(vllm.url, text_saves, n=1)
        assert text_saves.saved and all(list(s.prompt_ids or ()) == ids for _, s in text_saves.saved)
        before = len(vllm.completions())
        progress = Recorder({0: replace(partial, prompt_ids=ids)})
        continued = _vllm_run(vllm.url, progress, n=1)
        [body] = vllm.completions()[before:]
        assert progress.restarts == [] and body["prompt"] == [*ids, *expected[:2]] and body["max_tokens"] == 4
        assert list(continued.completions[0].tokens) == expected and list(continued.completions[0].resume_points) == [2]


def test_a_sample_that_finishes_within_its_first_interval_writes_no_checkpoint() -> None:
    from tests.standins.sglang_server import CharTokenizer
    from tests.standins.vllm_server import VLLMStandIn

    with VLLMStandIn() as vllm:
        short = Recorder()
        short.interval_s = 60.0
        out = _vllm_run(vllm.url, short, tokenizer=CharTokenizer())
        assert all(b["stream"] is True for b in vllm.completions()) and len(out.completions) == 2
        assert short.saved == []  # generated again, each costs less than the 60 s a checkpoint would bound
        resumed = Recorder({0: SampleState(tokens=list(out.completions[0].tokens[:2]), versions=(4, 4))})
        resumed.interval_s = 60.0
        _vllm_run(vllm.url, resumed, tokenizer=CharTokenizer())
        assert [(i, s.finish_reason) for i, s in resumed.saved] == [(0, "length")]  # a resumed one: saved finished


def test_a_paced_vllm_stand_in_streams_as_it_generates_and_stops_with_its_client() -> None:
    from tests.standins.vllm_server import VLLMStandIn, token_at

    ids = [ord(ch) for ch in "2+2?"]
    with VLLMStandIn(tokens_per_s=200) as vllm:
        live = Recorder()
        live.interval_s = 0.001
        began = time.monotonic()
        out = _vllm_run(vllm.url, live, n=2)
        assert time.monotonic() - began >= 6 / 200  # 6 tokens at 200 a second
        assert [list(c.tokens) for c in out.completions] == [[token_at(len(ids) + i) for i in range(6)]] * 2
        assert len({len(s.tokens) for _, s in live.saved}) >= 3  # saved as the tokens came, not all at the end
        assert vllm.tokens_generated == 12

        with httpx.Client() as client, client.stream("POST", f"{vllm.url}/v1/completions", json={
                "prompt": "2+2?", "max_tokens": 1000, "stream": True}) as answer:
            lines = answer.iter_lines()
            streamed = sum(1 for _, line in zip(range(10), lines, strict=False) if line.startswith("data: "))
        vllm.wait_until(lambda: vllm.in_flight() == 0, "the request whose client left to stop")
        assert streamed <= vllm.tokens_generated - 12 <= streamed + 2  # the token in the making when it left

        made = vllm.tokens_generated
        with pytest.raises(httpx.ReadTimeout):  # not streamed: its client gives up after 0.1 s, ~20 tokens
            httpx.post(f"{vllm.url}/v1/completions", json={"prompt": "2+2?", "max_tokens": 1000}, timeout=0.1)
        vllm.wait_until(lambda: vllm.in_flight() == 0, "the request whose client left to stop")
        assert vllm.tokens_generated - made < 60


def _sglang_run(url: str, progress: Recorder | None, *, tokenizer: Any = None, n: int = 2) -> Any:
    from rollstream.producers.engines import SGLangHTTPEngine

    return _generate(SGLangHTTPEngine([url], tokenizer=tokenizer), progress, n)


def _fields(c: Completion) -> tuple[Any, ...]:
    return (list(c.tokens), list(c.logprobs or ()), c.text, c.finish_reason, c.policy_version, c.version_spans)


@pytest.mark.parametrize(("incremental", "interval"), [(False, 1), (True, 1), (False, 4), (True, 4)])
def test_sglang_streams_join_into_the_unstreamed_answer_and_are_saved(incremental: bool, interval: int) -> None:
    from tests.standins.sglang_server import CharTokenizer, SGLangStandIn

    with SGLangStandIn(weight_version="5") as sglang:
        sglang.incremental_streaming_output, sglang.stream_interval = incremental, interval
        plain = _sglang_run(sglang.url, None, tokenizer=CharTokenizer())
        assert not any("stream" in body for _, body in sglang.requests)  # checkpoints off: nothing streams
        progress = Recorder()
        progress.interval_s = 1e-9
        streamed = _sglang_run(sglang.url, progress, tokenizer=CharTokenizer())
        bodies = sglang.requests[2:]
        assert len(bodies) == 2 and all(body["stream"] is True for _, body in bodies)
    assert [_fields(c) for c in streamed.completions] == [_fields(c) for c in plain.completions]
    for index, completion in enumerate(streamed.completions):
        states = [s for i, s in progress.saved if i == index]
        assert [len(s.tokens) for s in states] == [*([1, 5] if interval == 4 else range(1, 6)), 6, 6]
        assert [s.finish_reason for s in states] == [None] * (len(states) - 1) + ["length"]
        assert all(list(s.tokens) == list(completion.tokens)[:len(s.tokens)] for s in states)
        assert all(list(s.versions) == [5] * len(s.tokens) and s.text for s in states)


def test_sglang_chunks_join_field_for_field() -> None:
    from rollstream.producers.engines._http import post_json
    from rollstream.producers.engines._sglang_format import StreamedGenerate

    from tests.standins.sglang_server import SGLangStandIn

    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 7}, "return_logprob": True}
    timestamps = ("id", "e2e_latency", "response_sent_to_client_ts")

    async def answers(url: str) -> tuple[Any, Any]:
        async with httpx.AsyncClient() as client:
            plain = await post_json(client, url, "/generate", body)
            streamed = await post_json(client, url, "/generate", {**body, "stream": True}, stream=StreamedGenerate())
        return plain.out, streamed.out

    with SGLangStandIn() as sglang:
        for incremental in (False, True):
            sglang.incremental_streaming_output = incremental
            plain, streamed = asyncio.run(answers(sglang.url))
            for out in (plain, streamed):
                for key in timestamps:
                    out["meta_info"].pop(key, None)
            assert streamed == plain and len(plain["output_ids"]) == 7


def test_sglang_samples_resume_from_their_checkpoint_and_keep_finished_ones() -> None:
    from tests.standins.sglang_server import CharTokenizer, SGLangStandIn

    ids = [ord(ch) for ch in "2+2?"]
    with SGLangStandIn() as sglang:
        plain = _sglang_run(sglang.url, None, tokenizer=CharTokenizer())
        expected = list(plain.completions[0].tokens)
        partial = SampleState(tokens=expected[:2], logprobs=list(plain.completions[0].logprobs[:2]),
                              versions=(4, 4), text="ab", resume_points=(2,), resumed_from=("P1",))
        finished = SampleState(tokens=expected, logprobs=list(plain.completions[1].logprobs), versions=(4,) * 6,
                               finish_reason="length", text="done", resume_points=(6,), resumed_from=("P1",))
        before = len(sglang.requests)
        progress = Recorder({0: partial, 1: finished})
        progress.interval_s = 1e-9
        out = _sglang_run(sglang.url, progress, tokenizer=CharTokenizer())
        [(_, body)] = sglang.requests[before:]  # the finished sample was kept: one request, the continuation
        assert body["input_ids"] == [*ids, *expected[:2]] and body["sampling_params"]["max_new_tokens"] == 4
        assert body["stream"] is True
        first, kept = out.completions
        assert list(first.tokens) == expected and first.text.startswith("ab")
        assert list(first.logprobs) == list(plain.completions[0].logprobs)
        assert (list(first.resume_points), list(first.resumed_from)) == ([2], ["P1"])
        assert [(s.version, s.start, s.end) for s in first.version_spans] == [(4, 0, 2), (9, 2, 6)]
        assert list(kept.tokens) == expected and kept.text == "done" and list(kept.resume_points) == [6]
        saved = [s for i, s in progress.saved if i == 0]
        assert [len(s.tokens) for s in saved] == [3, 4, 5, 6, 6]
        assert all(list(s.versions) == [4, 4] + [9] * (len(s.tokens) - 2) for s in saved)
        assert all(s.resume_points == (2,) and s.resumed_from == ("P1",) for s in saved)

        sglang.weight_version = "5"  # versions the server reports win over the group's
        out = _sglang_run(sglang.url, Recorder({0: partial}), tokenizer=CharTokenizer(), n=1)
        assert [(s.version, s.start, s.end) for s in out.completions[0].version_spans] == [(4, 0, 2), (5, 2, 6)]

        progress = Recorder({0: partial})
        text_only = _sglang_run(sglang.url, progress, n=1)  # no tokenizer: its prompt ids are not known here
        assert progress.restarts == [0] and not list(text_only.completions[0].resume_points)


def test_sglang_streams_that_end_refused_fail_as_their_http_status_would() -> None:
    from rollstream.producers.engines import EngineError
    from rollstream.producers.engines._sglang_format import StreamedGenerate
    from rollstream.producers.engines.sglang_http import parse_answer

    def ended(chunk: dict[str, Any]) -> EngineError:
        stream = StreamedGenerate()
        stream.add({"text": "<7>", "output_ids": [7], "meta_info": {"finish_reason": None, "completion_tokens": 1}})
        stream.add(chunk)
        with pytest.raises(EngineError) as caught:
            parse_answer(stream.result())
        return caught.value

    refused = ended({"error": {"message": "bad input", "type": "invalid_request_error", "code": 400}})
    assert not refused.retriable and "HTTP 400: bad input" in str(refused)
    busy = ended({"text": "", "output_ids": [], "meta_info": {"completion_tokens": 1, "finish_reason": {
        "type": "abort", "message": "overloaded", "status_code": 503, "err_type": None}}})
    assert busy.retriable and "HTTP 503: overloaded" in str(busy)
    stream = StreamedGenerate()
    stream.add({"output_ids": [1, 2], "meta_info": {"completion_tokens": 2}})
    with pytest.raises(EngineError, match="does not add up"):
        stream.add({"output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 9}})


def test_in_process_sglang_streams_saves_and_resumes(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import sys
    import types

    from rollstream.producers.engines import SGLangEngine

    from tests.standins.sglang_server import CharTokenizer

    calls: list[dict[str, Any]] = []

    class StubEngine:
        """Streams cumulative chunks, a token each: token 100 + its absolute position, version "3"."""

        def __init__(self, model_path: str, **kwargs: Any) -> None:
            pass

        async def async_generate(self, **kwargs: Any) -> Any:
            calls.append(kwargs)
            start, n = len(kwargs["input_ids"]), kwargs["sampling_params"]["max_new_tokens"]
            tokens = [100 + start + i for i in range(n)]

            def chunk(k: int) -> dict[str, Any]:
                finish = {"type": "length", "length": n} if k == n else None
                meta = {"finish_reason": finish, "completion_tokens": k, "weight_version": "3",
                        "output_token_logprobs": [[-0.5, t, None] for t in tokens[:k]]}
                if finish:
                    meta["weight_versions"] = [{"version": "3", "start": 0, "end": n}]
                return {"text": "x" * k, "output_ids": tokens[:k], "meta_info": meta}

            async def chunks() -> Any:
                for k in range(1, n + 1):
                    yield chunk(k)
            return chunks() if kwargs.get("stream") else chunk(n)

        def shutdown(self) -> None:
            pass

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=StubEngine))
    monkeypatch.setattr("rollstream.producers.engines.sglang_engine.load_tokenizer", lambda path: CharTokenizer())
    ids = [ord(ch) for ch in "2+2?"]
    partial = SampleState(tokens=[104, 105], logprobs=[-0.5, -0.5], versions=(2, 2), text="ab", resume_points=(2,),
                          resumed_from=("P1",))
    progress = Recorder({0: partial})
    progress.interval_s = 1e-9
    plain = _generate(SGLangEngine(tmp_path), None, 1).completions[0]
    [resumed, fresh] = _generate(SGLangEngine(tmp_path), progress, 2).completions
    assert "stream" not in calls[0] and all(c["stream"] is True for c in calls[1:])
    assert calls[1]["input_ids"] == [*ids, 104, 105] and calls[1]["sampling_params"]["max_new_tokens"] == 4
    assert _fields(fresh) == _fields(plain) and list(resumed.tokens) == list(plain.tokens)
    assert [(s.version, s.start, s.end) for s in resumed.version_spans] == [(2, 0, 2), (3, 2, 6)]
    assert list(resumed.resume_points) == [2] and resumed.text == "abxxxx"
    saved = {i: [(len(s.tokens), s.finish_reason, list(s.versions)) for j, s in progress.saved if j == i]
             for i in (0, 1)}
    assert saved[0] == [(k, None, [2, 2] + [3] * (k - 2)) for k in range(3, 7)] + [(6, "length", [2, 2, 3, 3, 3, 3])]
    assert saved[1] == [(k, None, [3] * k) for k in range(1, 7)] + [(6, "length", [3] * 6)]


def test_a_streamed_sglang_partial_takes_the_servers_version_only_while_it_did_not_change() -> None:
    from rollstream.producers.engines._sglang_format import StreamedGenerate

    def chunk(k: int, version: str) -> dict[str, Any]:
        return {"text": "x" * k, "output_ids": list(range(k)), "meta_info": {
            "finish_reason": None, "completion_tokens": k, "weight_version": version,
            "output_token_logprobs": [[-0.5, t, None] for t in range(k)]}}

    stream = StreamedGenerate()
    stream.add(chunk(1, "3"))
    stream.add(chunk(2, "3"))
    assert [(s.version, s.start, s.end) for s in stream.partial().version_spans] == [(3, 0, 2)]
    stream.add(chunk(3, "4"))  # an update while it ran (SGLang's retract): which tokens had which is not said
    partial = stream.partial()
    assert partial.finish_reason == "abort" and list(partial.tokens) == [0, 1, 2] and not partial.version_spans
