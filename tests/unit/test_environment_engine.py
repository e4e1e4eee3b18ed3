"""Multi-turn on an engine (`rollstream.producers.engines.environment`, ``rollstream produce --environment``),
without a broker or a server: a fake token engine is the policy.

Pinned here:

1. ``--environment MODULE:CLASS`` is checked when the engine is made: a malformed spec, a missing module or
   attribute, something that is not a class, a class without ``reply(turn, episode)``, or one that cannot be
   made as ``CLASS(tokenizer)`` are each a one-line ConfigError saying what to give; so are ``--environment``
   with ``--generate``, without ``--engine``, an HTTP engine without ``--tokenizer``, and ``--max-turns``
   without ``--environment`` (also through the CLI: ``error: ...``, exit 2);
2. an episode's sample is the policy turns and the replies concatenated, loss mask 0 and logprob 0.0 exactly
   on the replies, the prompt encoded once by the engine; each episode gets a fresh environment;
3. plug-in code never runs on the event loop: the environment is made, and a sync ``reply`` runs, in the
   producer's ``rollstream-user`` threads (or the call's own); an async ``reply`` is awaited on the loop;
4. per-token versions: a turn's version spans (a turn continued on new weights) are kept token for token, so
   staleness counts from the oldest; a reply takes the version of the turn it answers;
5. failures: an environment that raises fails the attempt retriably, naming the environment; a reply that is
   not token ids fails it for good; an aborted turn is retriable; the wrapper reloads weights exactly when
   its engine can, and passes the group's deadline to every turn.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from rollstream.infra.threads import ThreadPool
from rollstream.producers import Completion, CustomEngine, EngineError, EnvironmentEngine, SamplingParams, make_engine
from rollstream.producers.engines._retry import Deadline
from rollstream.producers.engines.base import EngineCapabilities
from rollstream.producers.engines.environment import EXAMPLE_ENVIRONMENT, load_environment
from rollstream.producers.multiturn import Episode
from rollstream.schemas import ConfigError, VersionSpan

PROMPT = {"id": "p0", "prompt": "2+3", "label": "5", "metadata": {"seed": "7"}, "epoch": 0, "attempt": 0}
PROMPT_IDS = [1, 2, 3]
TURN = 2  # tokens per policy turn (max_new_tokens)
REPLY = [7, 8, 9]


def token_at(position: int) -> int:
    return 100 + position


class _Tokenizer:
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return " ".join(str(i) for i in ids)


class _Policy:
    """A token engine: a turn continuing `input_ids` gives `token_at(p)` at absolute position p, logprob
    -p/100; each call takes the next of `versions` (None when it runs out)."""

    name = "fake"
    capabilities = EngineCapabilities()

    def __init__(self, *, versions: Sequence[int] = (), finish: str = "length") -> None:
        self.tokenizer = _Tokenizer()
        self.versions = list(versions)
        self.finish = finish
        self.contexts: list[list[int]] = []
        self.encoded = 0

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def generate(self, prompt: Any, n: int, sampling: SamplingParams) -> Any:
        raise AssertionError("an episode's turns go through generate_tokens")

    async def prompt_ids(self, prompt: Any) -> tuple[str, list[int]]:
        self.encoded += 1
        return str(prompt["prompt"]), list(PROMPT_IDS)

    async def generate_tokens(self, input_ids: Sequence[int], n: int, sampling: SamplingParams) -> list[Completion]:
        self.contexts.append(list(input_ids))
        version = self.versions.pop(0) if self.versions else None
        p = len(input_ids)
        tokens = [token_at(p + i) for i in range(sampling.max_new_tokens)]
        return [Completion(text="", tokens=tokens, logprobs=[-(p + i) / 100 for i in range(len(tokens))],
                           finish_reason=self.finish, policy_version=version) for _ in range(n)]


class _Tool:
    """Replies `REPLY` to every turn; records who made it and where each reply ran."""

    made: list[str] = []
    replied: list[str] = []

    def __init__(self, tokenizer: Any) -> None:
        assert isinstance(tokenizer, _Tokenizer)
        _Tool.made.append(threading.current_thread().name)

    def reply(self, turn: Completion, episode: Episode) -> list[int] | None:
        assert episode.prompt["metadata"] == {"seed": "7"} and episode.prompt_tokens == tuple(PROMPT_IDS)
        _Tool.replied.append(threading.current_thread().name)
        return list(REPLY)


class _AsyncTool(_Tool):
    async def reply(self, turn: Completion, episode: Episode) -> list[int] | None:  # type: ignore[override]
        await asyncio.sleep(0)
        _Tool.replied.append(threading.current_thread().name)
        return list(REPLY) if episode.policy_turns < 2 else None


def _generate(engine: EnvironmentEngine, n: int = 2, *, threads: ThreadPool | None = None) -> Any:
    async def go() -> Any:
        if threads is not None:
            engine.use_threads(threads)
        await engine.start()
        try:
            return await engine.generate(PROMPT, n, SamplingParams(max_new_tokens=TURN))
        finally:
            await engine.close()

    _Tool.made, _Tool.replied = [], []
    return asyncio.run(go())


# -- 1. the option is checked when the engine is made --------------------------------------------------------


@pytest.mark.parametrize(("spec", "message"), [
    ("tests.plugins", "expected MODULE:CLASS, e.g. rollstream.examples.calculator:CalculatorEnvironment"),
    ("tests.no_such_module:Env", "module 'tests.no_such_module' not found"),
    ("tests.plugins:NoSuchEnv", "module 'tests.plugins' has no attribute 'NoSuchEnv'"),
    ("tests.plugins:instant", "'instant' is a function, not a class; give the environment's class"),
    ("tests.plugins:NotAnEnvironment", "NotAnEnvironment has no reply(turn, episode) method, so it is not an "
                                       "environment"),
    ("tests.plugins:EnvironmentWithoutTokenizer", "each episode makes its environment as CLASS(tokenizer)"),
    ("tests.plugins:EnvironmentWithBadReply", "EnvironmentWithBadReply.reply(self, turn) cannot take (turn, episode)"),
])
def test_a_bad_environment_is_one_line_saying_what_to_give(spec: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_environment(spec)
    assert message in str(caught.value) and f"--environment {spec!r}" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_example_environment_loads() -> None:
    from rollstream.examples.calculator import CalculatorEnvironment

    assert load_environment(EXAMPLE_ENVIRONMENT) is CalculatorEnvironment


@pytest.mark.parametrize(("flags", "message"), [
    ({"kind": None, "generate": "tests.plugins:instant"}, "--generate replaces the engine"),
    ({"kind": None}, "--environment needs an engine as the policy; --engine vllm --vllm-url URL --tokenizer DIR"),
    ({"kind": "vllm", "vllm_urls": ["http://h:8000"]}, "--environment with --engine vllm needs --tokenizer DIR"),
    ({"kind": "sglang", "sglang_urls": ["http://h:30000"]}, "--environment with --engine sglang needs --tokenizer"),
    ({"kind": "hf", "model": "m", "max_turns": 0}, "--max-turns 0: an episode needs at least one policy turn"),
    ({"kind": "hf", "model": "m", "environment": None, "max_turns": 2}, "--max-turns bounds the episodes of "
                                                                         "--environment MODULE:CLASS"),
])
def test_flags_that_do_not_go_together_are_refused(flags: dict[str, Any], message: str) -> None:
    flags = {"environment": EXAMPLE_ENVIRONMENT, **flags}
    with pytest.raises(ConfigError) as caught:
        make_engine(flags.pop("kind"), **flags)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_cli_says_it_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from rollstream.cli import main

    monkeypatch.setattr(sys, "argv", ["rollstream", "produce", "--engine", "vllm", "--vllm-url", "http://h:8000",
                                      "--environment", EXAMPLE_ENVIRONMENT, "--max-turns", "2"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --environment with --engine vllm needs --tokenizer DIR") and "\n" not in err


def test_engines_wrap_as_their_weights_require() -> None:
    vllm = make_engine("vllm", vllm_urls=["http://h:8000"], tokenizer="tok", environment=EXAMPLE_ENVIRONMENT)
    assert isinstance(vllm, EnvironmentEngine) and not vllm.capabilities.reloads_weights and vllm.max_turns == 4
    assert vllm.capabilities.checks_sampling and vllm.capabilities.takes_deadline  # as its engine declares
    hf = make_engine("hf", model="m", environment=EXAMPLE_ENVIRONMENT, max_turns=2)
    assert isinstance(hf, EnvironmentEngine) and hf.capabilities.reloads_weights and hf.max_turns == 2
    assert not hf.capabilities.checks_sampling
    sync = make_engine("sglang", sglang_urls=["http://h:30000"], model="m", sglang_sync_weights=True,
                       environment=EXAMPLE_ENVIRONMENT)
    assert sync.capabilities.reloads_weights
    with pytest.raises(ConfigError, match="cannot play multi-turn episodes: it has no prompt_ids, generate_tokens, "
                                          "tokenizer; use --engine vllm, sglang or hf"):
        EnvironmentEngine(CustomEngine(lambda p, n, s: []), _Tool)


# -- 2., 3. the episodes, and where plug-in code runs ------------------------------------------------------


def test_samples_concatenate_turns_and_masked_replies() -> None:
    policy = _Policy()
    threads = ThreadPool("rollstream-user", 2)
    try:
        generation = _generate(EnvironmentEngine(policy, _Tool, max_turns=3), threads=threads)
    finally:
        threads.close()
    assert policy.encoded == 1 and list(generation.prompt_tokens) == PROMPT_IDS and generation.prompt_text == "2+3"
    p, step = len(PROMPT_IDS), TURN + len(REPLY)
    turns = [[token_at(p + k * step + i) for i in range(TURN)] for k in range(3)]
    for c in generation.completions:
        assert list(c.tokens) == turns[0] + REPLY + turns[1] + REPLY + turns[2]
        assert list(c.loss_mask) == ([1] * TURN + [0] * len(REPLY)) * 2 + [1] * TURN
        policy_logprobs = [-(p + k * step + i) / 100 for k in range(3) for i in range(TURN)]
        assert [x for x, m in zip(c.logprobs, c.loss_mask, strict=True) if m] == pytest.approx(policy_logprobs)
        assert [x for x, m in zip(c.logprobs, c.loss_mask, strict=True) if not m] == [0.0] * 2 * len(REPLY)
        assert c.text == " ".join(map(str, c.tokens)) and c.finish_reason == "length"
    # every later turn continued prompt + response exactly (no re-encoding)
    assert policy.contexts[0] == PROMPT_IDS and policy.contexts[-1] == PROMPT_IDS + turns[0] + REPLY + turns[1] + REPLY
    assert len(_Tool.made) == 2  # one fresh environment per episode
    assert all(name.startswith("rollstream-user") for name in _Tool.made + _Tool.replied)


def test_without_lent_threads_plugin_code_still_runs_off_the_loop() -> None:
    _generate(EnvironmentEngine(_Policy(), _Tool, max_turns=2))
    assert _Tool.made and _Tool.replied
    assert all(name.startswith("rollstream-user") for name in _Tool.made + _Tool.replied)


def test_an_async_reply_is_awaited_on_the_loop() -> None:
    generation = _generate(EnvironmentEngine(_Policy(), _AsyncTool, max_turns=5), n=1)
    [c] = generation.completions
    assert list(c.loss_mask) == [1] * TURN + [0] * len(REPLY) + [1] * TURN  # None after the 2nd turn ended it
    assert _Tool.replied == [threading.main_thread().name] * 2


# -- 4. versions -------------------------------------------------------------------------------------------


def test_versions_follow_the_turns_and_their_spans() -> None:
    generation = _generate(EnvironmentEngine(_Policy(versions=[3, 4]), _Tool, max_turns=2), n=1)
    [c] = generation.completions
    end = TURN + len(REPLY)
    assert c.version_spans == (VersionSpan(3, 0, end), VersionSpan(4, end, end + TURN)) and c.policy_version == 4

    episode = Episode(prompt_tokens=(1,))
    continued = Completion(text="", tokens=[5, 6, 7], logprobs=[-1.0] * 3, policy_version=9,
                           version_spans=(VersionSpan(8, 0, 1), VersionSpan(9, 1, 3)))
    episode.add_policy_turn(continued)
    episode.add_tool_turn(REPLY)
    assert episode.versions == [8, 9, 9, 9, 9, 9]  # staleness counts from 8, not from the turn's newest


# -- 5. failures, weights, deadline ------------------------------------------------------------------------


class _Broken(_Tool):
    def reply(self, turn: Completion, episode: Episode) -> list[int] | None:
        raise ValueError("sandbox gone")


class _Unmakeable(_Tool):
    def __init__(self, tokenizer: Any) -> None:
        raise OSError("no sandbox left")


class _Texty(_Tool):
    def reply(self, turn: Completion, episode: Episode) -> Any:
        return "=5"


@pytest.mark.parametrize(("environment", "retriable", "message"), [
    (_Broken, True, "the reply of --environment x:Broken raised ValueError: sandbox gone"),
    (_Unmakeable, True, "making --environment x:Broken raised OSError: no sandbox left"),
    (_Texty, False, "a tool's reply must be a list of token ids (ints) or None, got '=5'"),
])
def test_environment_failures(environment: type, retriable: bool, message: str) -> None:
    engine = EnvironmentEngine(_Policy(), environment, label="--environment x:Broken")
    with pytest.raises(EngineError) as caught:
        _generate(engine)
    assert str(caught.value) == message and caught.value.retriable is retriable


def test_an_aborted_turn_is_retriable() -> None:
    with pytest.raises(EngineError, match="was aborted") as caught:
        _generate(EnvironmentEngine(_Policy(finish="abort"), _Tool))
    assert caught.value.retriable


class _Reloadable(_Policy):
    capabilities = EngineCapabilities(takes_deadline=True, reloads_weights=True)
    policy_version = 1

    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[tuple[str, int]] = []
        self.deadlines: list[Deadline | None] = []

    async def reload(self, weights_path: str, version: int) -> bool:
        self.loaded.append((weights_path, version))
        self.policy_version = version
        return True

    async def generate_tokens(self, input_ids: Sequence[int], n: int, sampling: SamplingParams, *,
                              deadline: Deadline | None = None) -> list[Completion]:
        self.deadlines.append(deadline)
        return await super().generate_tokens(input_ids, n, sampling)


def test_weights_and_deadline_reach_the_engine() -> None:
    policy = _Reloadable()
    engine = EnvironmentEngine(policy, _Tool, max_turns=2)
    assert engine.capabilities == EngineCapabilities(takes_deadline=True, runs_user_code=True, reloads_weights=True,
                                                     saves_progress=True)
    assert not EnvironmentEngine(_Policy(), _Tool).capabilities.reloads_weights
    deadline = Deadline.after(30.0)

    async def go() -> None:
        assert await engine.reload("/ckpt/v2", 2) and engine.policy_version == 2  # type: ignore[attr-defined]
        await engine.generate(PROMPT, 2, SamplingParams(max_new_tokens=TURN), deadline=deadline)

    asyncio.run(go())
    assert policy.loaded == [("/ckpt/v2", 2)] and policy.deadlines == [deadline] * 3  # first turn of both, then 1 each
