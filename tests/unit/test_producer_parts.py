"""Broker-free pieces of the producer: commit watermarks, rewards, plug-in loading, settings, the custom
engine's contract, prompt-file validation, and the publisher's loop-safety under a full local queue."""

from __future__ import annotations

import asyncio
import math
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from rollstream.infra import KafkaConfig
from rollstream.producers import (
    CustomEngine,
    EngineError,
    ProducerSettings,
    PromptFileError,
    RewardError,
    SamplingParams,
    load_reward,
    make_engine,
)
from rollstream.producers._watermarks import Watermarks
from rollstream.producers.metrics import LoopLagProbe
from rollstream.producers.prompts import read_prompts
from rollstream.producers.publisher import Publisher, PublishError
from rollstream.producers.rewards import answers_match, extract_answer, math_reward
from rollstream.schemas import ConfigError

# -- watermarks ----------------------------------------------------------------------------------------


def test_watermark_is_the_lowest_unacknowledged_offset() -> None:
    marks = Watermarks()
    marks.assign([0, 1])
    gens = {o: marks.take(0, o) for o in range(10, 14)}
    assert marks.committable() == {0: 10}
    for o in (11, 13):  # finish out of order
        assert marks.ack(0, o, gens[o])
    assert marks.committable() == {0: 10}
    marks.ack(0, 10, gens[10])
    assert marks.committable() == {0: 12}
    marks.mark_committed({0: 12})
    assert marks.committable() == {} and not marks.settled()
    marks.ack(0, 12, gens[12])
    assert marks.committable() == {0: 14}
    marks.mark_committed({0: 14})
    assert marks.settled() and marks.outstanding() == 0


def test_revoke_drops_bookkeeping_and_ignores_late_acks() -> None:
    marks = Watermarks()
    marks.assign([0])
    g = marks.take(0, 5)
    marks.take(0, 6)
    assert g is not None and marks.ack(0, 5, g)
    assert marks.revoke([0]) == {0: 6}
    assert not marks.ack(0, 6, g) and marks.take(0, 7) is None
    marks.assign([0])  # the same partition comes back: a fresh generation
    assert not marks.is_current(0, g)
    g2 = marks.take(0, 6)
    assert not marks.ack(0, 6, g) and marks.committable() == {0: 6}
    assert g2 is not None and marks.ack(0, 6, g2) and marks.committable() == {0: 7}


# -- rewards -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,label,expected", [
    ("so \\boxed{42}", "42", 1.0), ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0), ("it is 1,234.", "#### 1234", 1.0),
    ("first 3 then 7", "7", 1.0), ("\\boxed{x^{2}+1}", "x^{2}+1", 1.0), ("\\boxed{41}", "42", 0.0),
    ("no number", "42", 0.0), ("$\\boxed{\\text{yes}}$", "yes", 1.0),
])
def test_math_reward(text: str, label: str, expected: float) -> None:
    assert math_reward({"id": "p", "label": label}, {"text": text}) == expected


def test_answer_helpers() -> None:
    assert extract_answer("a \\boxed{1+\\boxed{2}} b \\boxed{3}") == "3"
    assert extract_answer("\\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    assert answers_match("3/4", "0.75") and not answers_match("3/4", "0.7")


def test_reward_loading_and_failures() -> None:
    assert load_reward(None) is None
    exact = load_reward("exact")
    assert exact is not None and asyncio.run(exact({"id": "p", "label": " a "}, {"text": "a"})) == 1.0
    with pytest.raises(RewardError, match="no label"):
        asyncio.run(exact({"id": "p", "label": None}, {"text": "a"}))
    with pytest.raises(ConfigError, match="not a built-in"):
        load_reward("nosuch")
    with pytest.raises(ConfigError, match="has no attribute"):
        load_reward("tests.plugins:nosuch")
    boom = load_reward("tests.plugins:reward")
    assert boom is not None
    with pytest.raises(RewardError, match="reward exploded"):
        asyncio.run(boom({"id": "reward-fail"}, {"text": ""}))

    async def nan_reward(prompt: dict[str, Any], completion: dict[str, Any]) -> float:
        return math.nan

    with pytest.raises(RewardError, match="finite"):
        asyncio.run(load_reward(nan_reward)({"id": "p"}, {}))  # type: ignore[misc]


# -- engines, settings ---------------------------------------------------------------------------------


def test_custom_engine_contract() -> None:
    async def gen(prompt: dict[str, Any], n: int, sp: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"text": "x", "tokens": [1, 2], "logprobs": [-1.0, -2.0], "weight_version": 3}] * n

    out = asyncio.run(CustomEngine(gen).generate({"id": "p"}, 2, SamplingParams()))
    assert len(out.completions) == 2 and out.completions[0].policy_version == 3

    async def bad(prompt: dict[str, Any], n: int, sp: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"text": "x", "tokens": ["a"]}]

    with pytest.raises(EngineError, match="'tokens' must be a list of ints") as err:
        asyncio.run(CustomEngine(bad).generate({"id": "p"}, 1, SamplingParams()))
    assert not err.value.retriable

    def sync_gen(prompt: dict[str, Any], n: int, sp: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"text": "y", "tokens": [], "finish_reason": "abort"}] * n

    with pytest.raises(EngineError, match="aborted") as err:
        asyncio.run(CustomEngine(sync_gen).generate({"id": "p"}, 1, SamplingParams()))
    assert err.value.retriable


def test_engine_selection_errors() -> None:
    assert isinstance(make_engine(generate="tests.plugins:instant"), CustomEngine)
    with pytest.raises(ConfigError, match="no engine given"):
        make_engine()
    with pytest.raises(ConfigError, match="--sglang-url"):
        make_engine("sglang")
    with pytest.raises(ConfigError, match="--model"):
        make_engine("hf")
    with pytest.raises(ConfigError, match="module 'no_such_mod' not found"):
        make_engine(generate="no_such_mod:f")


def test_settings_validation() -> None:
    s = ProducerSettings(namespace="ns", concurrency=5)
    assert s.effective_max_lag == 5 and s.effective_intake_group == "ns.producers"
    for bad in ({"concurrency": 0}, {"max_lag": -1}, {"namespace": "a b"}, {"temperature": -1.0},
                {"exit_when_idle_s": 0.0}):
        with pytest.raises(ConfigError):
            ProducerSettings(**bad)  # type: ignore[arg-type]


# -- prompt files --------------------------------------------------------------------------------------


def test_prompt_file_validation(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"id": 1, "prompt": "a", "label": 42}\n\n'
                    '{"id": "b", "prompt": [{"role": "user", "content": "hi"}], "metadata": {"k": [1]}}\n')
    prompts = read_prompts(good)
    assert [p.id for p in prompts] == ["1", "b"] and prompts[0].label == "42" and prompts[1].metadata == {"k": "[1]"}
    cases = {'{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}': ":2: duplicate id 'a' (first on line 1)",
             '{"id": "a", "prompt": "x"}\n{"id": "c", "prompt": "x"\n': ":2: invalid JSON",
             '{"id": "a", "prompt": "x", "answer": 1}': ":1: unknown key(s) 'answer'",
             '{"id": "", "prompt": "x"}': ":1: 'id' must be a non-empty string",
             '{"id": "a", "prompt": [{"role": "user"}]}': ":1: a chat message needs"}
    for text, message in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(PromptFileError, match=re.escape(message)) as err:
            read_prompts(bad)
        assert str(bad) in str(err.value) and "nothing from this file was published" in str(err.value)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "caf\xe9"}\n')
    with pytest.raises(PromptFileError, match=r"latin1.jsonl:2: not UTF-8: byte 0xe9 at column 27"):
        read_prompts(latin1)


# -- publisher: a full queue never blocks the loop ---------------------------------------------------


def test_full_producer_queue_waits_off_loop() -> None:
    """No broker listens: every record stays queued, the queue (2 records) fills at once, and the loop
    keeps running while the third produce waits in the worker thread until the first two time out."""
    config = KafkaConfig(bootstrap_servers="127.0.0.1:1", extra={"log_level": 0})
    waiting = threading.Event()
    publisher = Publisher(config, "t", overrides={"queue.buffering.max.messages": 2, "message.timeout.ms": 2000},
                          on_queue_full=waiting.set)

    async def scenario() -> float:
        publisher.start(asyncio.get_running_loop())
        probe = LoopLagProbe(interval_s=0.005)
        probe_task = asyncio.create_task(probe.run())
        sends = [asyncio.create_task(publisher.publish(b"k", b"v" * 100)) for _ in range(3)]
        assert await asyncio.to_thread(waiting.wait, 5.0), "the third produce never had to wait for room"
        assert publisher.queued() == 2 and not any(t.done() for t in sends)
        results = await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), 20)
        probe_task.cancel()
        await publisher.close(timeout=0.5)
        assert all(isinstance(r, PublishError) and r.code == "_MSG_TIMED_OUT" for r in results)
        return probe.max_ms()

    assert asyncio.run(scenario()) < 100.0


# -- plug-ins: a module in the working directory, without touching sys.path -------------------------------


def test_a_plugin_in_the_working_directory_loads_and_sys_path_is_left_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from rollstream.producers._plugins import load_callable

    package = tmp_path / "rs_cwd_plugin"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "gen.py").write_text("def generate(prompt, n, sampling_params):\n    return 'from cwd'\n")
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    try:
        fn = load_callable("rs_cwd_plugin.gen:generate", "--generate")
        assert fn({}, 1, {}) == "from cwd" and sys.path == before
        with pytest.raises(ConfigError, match="has no attribute"):
            load_callable("rs_cwd_plugin.gen:nosuch", "--generate")
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "rs_cwd_plugin"]:
            del sys.modules[name]
