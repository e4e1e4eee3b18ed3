"""Multi-turn (agentic) rollouts as one sample: policy turns and tool turns, token in, token out.

A multi-turn rollout is one response in which what the policy generated alternates with what a tool or
an environment answered (a calculator's result, a code runner's output, a game's next observation). The
trainer must learn from the policy's tokens only, so the sample carries a loss mask: 1 on policy tokens,
0 on tool tokens (whose logprob is recorded as 0.0: the policy did not sample them). `run_episodes` plays
`n` such rollouts of one prompt and returns them as completion dicts of the custom generate contract
(`rollstream.producers.engines.custom`), so a generate function for ``rollstream produce --generate`` is a few lines
(`rollstream/examples/calculator.py` is a complete one)::

    class MyAgent:                                  # --generate mymodule:MyAgent
        async def start(self) -> None:              # the producer awaits it before the first prompt
            self.engine = HFEngine("model-dir")
            await self.engine.start()

        async def close(self) -> None:
            await self.engine.close()

        async def __call__(self, prompt: dict, n: int, sampling_params: dict) -> list[dict]:
            tok = self.engine.tokenizer
            text, ids = await self.engine.prompt_ids(prompt)
            return await run_episodes(self.engine.generate_tokens, functools.partial(MyTool, tok), ids, n,
                                      sampling_from_dict(sampling_params), decode=tok.decode,
                                      max_turns=4, prompt_text=text, prompt=prompt)

Without a generate function of one's own, ``rollstream produce --engine vllm|sglang|hf --environment
MODULE:CLASS`` plays the episodes with the engine as the policy (`rollstream.producers.engines.environment`).

The policy is any token-in/token-out call ``(input_ids, n, sampling) -> list[Completion]``
(`TokenPolicy`: ``generate_tokens`` of `HFEngine`, `SGLangHTTPEngine`, `SGLangEngine` and `VLLMHTTPEngine`);
an environment answers a policy turn with token ids,
or None to end the episode (`Environment`). Environments are plug-in code: making one (`new_environment`)
and a sync ``reply`` run in the ``threads`` given (the producer's ``rollstream-user``, else a few of the
call's own), never on the event loop; an async ``reply`` is awaited. Three rules keep the record exact,
with no re-tokenisation drift:

1. every policy turn continues the token ids so far (prompt + response), concatenated; text is never
   decoded and encoded again to build the next context (``encode(decode(ids)) != ids`` in general: merges
   differ across turn boundaries, whitespace is normalised, special tokens vanish);
2. a tool's answer is encoded once, by the environment, and its ids are appended as they are;
3. so the response is exactly the sequence the policy conditioned on, and the trainer's forward pass over
   ``prompt_tokens + tokens`` sees what the engine saw: its logprobs match the policy's turns token for
   token, and its loss mask excludes exactly the tool's tokens.

Policy versions: each token takes the version of the policy turn that produced it (per token where the
turn reports spans: a turn continued on new weights has several); a tool's tokens take the version of the
turn they answer. One version gives ``weight_version``; weights that changed between
turns give ``weight_versions`` spans (staleness counts from the oldest). When the policy reports no
version, neither is set and the producer stamps the group as usual.

Checkpoints (`rollstream.producers.engines.progress`): given a `Progress`, each episode is saved at every turn
boundary (after the environment's reply, before the next policy turn), with the environment's ``snapshot()``
(bytes) when it has one, and once more when it ends. An episode that `Progress.restored` returns a state for
continues from it: its tokens, logprobs, loss mask and versions as they were, the environment restored from
the snapshot (``restore(state)``) and the next policy turn continuing the context; a finished one is kept as it
is. An environment without ``snapshot``/``restore`` (or a checkpoint without a snapshot) starts its episode
again (`Progress.restarted` counts it). A resumed episode's tokens of unknown version take `Progress.version`
(the version the producer stamps the group with), so its checkpointed tokens keep theirs.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
from rollstream.infra.threads import ThreadPool
from rollstream.producers.engines._samples import gather_or_cancel
from rollstream.producers.engines.base import Completion, EngineError, SamplingParams
from rollstream.producers.engines.progress import Progress, SampleState

DEFAULT_MAX_TURNS = 4  # policy turns per episode: `run_episodes`' and ``rollstream produce --max-turns``'s default
_OWN_THREADS = 4  # threads of a `run_episodes` call that is lent none

TokenPolicy = Callable[[Sequence[int], int, SamplingParams], Awaitable[Sequence[Completion]]]
"""``(input_ids, n, sampling) -> n completions`` continuing `input_ids` as given (`HFEngine.generate_tokens`)."""


class Environment(Protocol):
    """Answers policy turns of one episode (`run_episodes` makes one per episode, so it may keep state)."""

    def reply(self, turn: Completion, episode: Episode) -> Sequence[int] | None | Awaitable[Sequence[int] | None]:
        """The token ids to append after the policy's `turn` (the tool's answer, encoded once), or None to
        end the episode. May be a coroutine (an environment that waits on I/O must not block the loop); a
        sync one runs in a worker thread."""
        ...

    # Optional, for checkpoints: ``snapshot() -> bytes`` (the environment's state after a reply) and
    # ``restore(state: bytes)`` (that state back, in a fresh instance on another producer), sync or async.


@dataclass
class Episode:
    """One rollout being built: the prompt, and the response so far with one entry per token in each list.

    `prompt` is the prompt dict (``id``, ``prompt``, ``label``, ``metadata``, ``epoch``, ``attempt``) when the
    caller gave one, else empty. `logprobs` becomes None (for the whole response) once a policy turn comes
    without logprobs. Mutable and owned by one episode; `run_episodes` builds them, an environment may read them.
    """

    prompt_tokens: tuple[int, ...]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    policy_turns: int = 0
    finish_reason: str = "stop"
    prompt: Mapping[str, Any] = field(default_factory=dict)
    resume_points: list[int] = field(default_factory=list)
    resumed_from: list[str] = field(default_factory=list)

    @classmethod
    def from_state(cls, prompt_tokens: tuple[int, ...], state: SampleState, prompt: Mapping[str, Any]) -> Episode:
        """The episode a checkpoint's `state` holds, ready to go on (or finished, as it was)."""
        n = len(state.tokens)
        return cls(prompt_tokens, tokens=[int(t) for t in state.tokens],
                   logprobs=None if state.logprobs is None else [float(x) for x in state.logprobs],
                   loss_mask=[1] * n if state.loss_mask is None else [int(m) for m in state.loss_mask],
                   versions=list(state.versions) if len(state.versions) == n else [None] * n,
                   policy_turns=state.policy_turns, finish_reason=state.finish_reason or "stop", prompt=prompt,
                   resume_points=list(state.resume_points), resumed_from=list(state.resumed_from))

    def state(self, environment_state: bytes | None, *, finished: bool) -> SampleState:
        """What a checkpoint of this episode holds now (`finished`: it ended; else it goes on)."""
        return SampleState(tokens=tuple(self.tokens), logprobs=None if self.logprobs is None else tuple(self.logprobs),
                           loss_mask=tuple(self.loss_mask), versions=tuple(self.versions),
                           finish_reason=self.finish_reason if finished else None, policy_turns=self.policy_turns,
                           environment_state=environment_state, resume_points=tuple(self.resume_points),
                           resumed_from=tuple(self.resumed_from))

    def restart(self) -> None:
        """Forget the response so far (an episode that cannot resume starts again)."""
        self.tokens, self.logprobs, self.loss_mask, self.versions = [], [], [], []
        self.policy_turns, self.finish_reason = 0, "stop"
        self.resume_points, self.resumed_from = [], []

    def context(self) -> list[int]:
        """What the next policy turn continues: prompt + response token ids, concatenated."""
        return [*self.prompt_tokens, *self.tokens]

    def add_policy_turn(self, turn: Completion) -> None:
        """Append the policy's tokens: loss mask 1, their logprobs, their policy versions (the turn's spans
        where it has them, else its version)."""
        tokens = np.asarray(turn.tokens, dtype=np.int64).tolist()
        versions: list[int | None] = [turn.policy_version] * len(tokens)
        for span in turn.version_spans:
            versions[span.start:span.end] = [span.version] * (span.end - span.start)
        self._extend(tokens, turn.logprobs, 1, versions)
        self.policy_turns += 1
        self.finish_reason = turn.finish_reason

    def add_tool_turn(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append a tool's tokens: loss mask 0, logprob 0.0, the version of the policy turn they answer.

        Raises:
            EngineError (not retriable): `tokens` is not a list (or 1-D array) of ints.
        """
        array = np.asarray(tokens) if isinstance(tokens, list | tuple | np.ndarray) else None
        if array is None or array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            shown = list(tokens)[:8] if isinstance(tokens, list | tuple) else tokens
            raise EngineError(f"a tool's reply must be a list of token ids (ints) or None, got {shown!r}",
                              retriable=False)
        ids = array.astype(np.int64).tolist()
        last = self.versions[-1] if self.versions else None
        self._extend(ids, [0.0] * len(ids), 0, [last] * len(ids))

    def _extend(self, tokens: list[int], logprobs: Sequence[float] | Any | None, mask: int,
                versions: list[int | None]) -> None:
        self.tokens += tokens
        if self.logprobs is not None and logprobs is not None:
            self.logprobs += [float(x) for x in logprobs]
        else:
            self.logprobs = None
        self.loss_mask += [mask] * len(tokens)
        self.versions += versions

    def to_dict(self, decode: Callable[[Sequence[int]], str], *, prompt_text: str = "") -> dict[str, Any]:
        """The completion dict of the custom generate contract: text (`decode` of every response token),
        tokens, logprobs, loss_mask, finish_reason, weight_version(s), prompt_tokens and prompt_text."""
        out: dict[str, Any] = {"text": decode(self.tokens), "tokens": list(self.tokens), "logprobs": self.logprobs,
                               "loss_mask": list(self.loss_mask), "finish_reason": self.finish_reason,
                               "prompt_tokens": list(self.prompt_tokens), "prompt_text": prompt_text}
        spans = version_spans(self.versions)
        if spans:
            out["weight_version"] = spans[-1]["version"]
            if len(spans) > 1:
                out["weight_versions"] = spans
        if self.resume_points:
            out["resume_points"], out["resumed_from"] = list(self.resume_points), list(self.resumed_from)
        return out


def version_spans(versions: Sequence[int | None]) -> list[dict[str, int]]:
    """Runs of equal versions as ``{"version", "start", "end"}`` spans, oldest first; [] when any is None."""
    known = [v for v in versions if v is not None]
    if not versions or len(known) != len(versions):
        return []
    spans: list[dict[str, int]] = []
    for i, v in enumerate(known):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": int(v), "start": i, "end": i + 1})
    return spans


def sampling_from_dict(params: Mapping[str, Any]) -> SamplingParams:
    """A generate function's ``sampling_params`` dict back as `SamplingParams` (unknown keys go to ``extra``).

    Raises:
        EngineError (not retriable): a value is out of range.
    """
    known = {"max_new_tokens", "temperature", "top_p", "top_k"}
    return SamplingParams(**{k: v for k, v in params.items() if k in known},
                          extra={k: v for k, v in params.items() if k not in known})


async def run_episodes(policy: TokenPolicy, new_environment: Callable[[], Environment],
                       prompt_tokens: Sequence[int], n: int, sampling: SamplingParams, *,
                       decode: Callable[[Sequence[int]], str], max_turns: int = DEFAULT_MAX_TURNS,
                       max_tokens: int | None = None, prompt_text: str = "", prompt: Mapping[str, Any] | None = None,
                       threads: ThreadPool | None = None, label: str = "the environment",
                       progress: Progress | None = None) -> list[dict[str, Any]]:
    """Play `n` episodes of one prompt and return their completion dicts (see `Episode.to_dict`).

    The first policy turns of all episodes are one call (`n` samples of the prompt, batched as a single
    turn is); the episodes then go on concurrently, each with an environment of its own (`new_environment()`,
    made in `threads`), alternating a policy turn of at most ``sampling.max_new_tokens`` tokens and its
    environment's reply (a sync ``reply`` in `threads`), until the environment returns None, `max_turns`
    policy turns were taken, the response reached `max_tokens` tokens (finish ``length``), or a turn was
    aborted (finish ``abort``: the producer tries the prompt again within its deadline). `prompt` (the prompt
    dict) is handed to the environments as ``episode.prompt``; `decode` makes each dict's text (in `threads`
    too). `threads`: the producer's ``rollstream-user`` pool; None: a few threads of this call's own. Never
    blocks the loop beyond what `policy` and async environments do; if one episode fails, the others are
    cancelled. `progress`: episodes resume from its restored states and are saved to it (module docstring);
    a resumed episode's dict carries ``resume_points`` and ``resumed_from``.

    Raises:
        EngineError: the policy raised, returned the wrong number of completions, or a reply is malformed
            (not retriable); making an environment or its reply raised (retriable, named by `label`).
    """
    if max_turns < 1 or (max_tokens is not None and max_tokens < 1):
        raise EngineError(f"max_turns={max_turns} and max_tokens={max_tokens} must be >= 1", retriable=False)
    ids = tuple(int(t) for t in prompt_tokens)
    pool = threads or ThreadPool("rollstream-user", min(n, _OWN_THREADS))
    try:
        restored = [progress.restored(i) if progress is not None else None for i in range(n)]
        fresh = [i for i, state in enumerate(restored) if state is None]
        first = iter(await _turns(policy, list(ids), len(fresh), _budget(sampling, 0, max_tokens) or sampling)
                     if fresh else ())
        episodes = [Episode(ids, prompt=dict(prompt or {})) if state is None
                    else Episode.from_state(ids, state, dict(prompt or {})) for state in restored]
        play = _Play(policy, new_environment, sampling, max_turns, max_tokens, pool, label, progress)
        await gather_or_cancel([play(i, e, next(first)) if state is None else play.resume(i, e, state)
                                for i, (e, state) in enumerate(zip(episodes, restored, strict=True))])
        for episode, state in zip(episodes, restored, strict=True):
            if state is not None and progress is not None:  # its checkpointed tokens keep their versions
                episode.versions = [progress.version if v is None else v for v in episode.versions]
        return await pool.run(lambda: [e.to_dict(decode, prompt_text=prompt_text) for e in episodes])
    finally:
        if threads is None:
            pool.close()


@dataclass(frozen=True)
class _Play:
    """How every episode of one `run_episodes` call is played (`__call__` plays one)."""

    policy: TokenPolicy
    new_environment: Callable[[], Environment]
    sampling: SamplingParams
    max_turns: int
    max_tokens: int | None
    threads: ThreadPool
    label: str
    progress: Progress | None = None

    async def __call__(self, index: int, episode: Episode, turn: Completion) -> None:
        """Play episode `index` from its first policy turn, `turn`."""
        environment = await self._user("making", self.new_environment)
        await self._play(index, episode, environment, turn)

    async def resume(self, index: int, episode: Episode, state: SampleState) -> None:
        """Go on with episode `index`, rebuilt from a checkpoint's `state` (kept as it is when it had finished)."""
        if state.finish_reason is not None:
            return
        environment = await self._user("making", self.new_environment)
        restore = getattr(environment, "restore", None)
        if state.environment_state is None or not callable(restore):
            if self.progress is not None:  # (a restored state came from it)
                self.progress.restarted(index, "its environment has no snapshot()/restore(state)")
            episode.restart()
            [turn] = await _turns(self.policy, episode.context(), 1,
                                  _budget(self.sampling, 0, self.max_tokens) or self.sampling)
            return await self._play(index, episode, environment, turn)
        await self._user("restore() of", restore, state.environment_state)
        budget = _budget(self.sampling, len(episode.tokens), self.max_tokens)
        if budget is None:
            episode.finish_reason = "length"
            return self._save(index, episode, None, finished=True)
        [turn] = await _turns(self.policy, episode.context(), 1, budget)
        await self._play(index, episode, environment, turn)

    async def _play(self, index: int, episode: Episode, environment: Environment, turn: Completion) -> None:
        while True:
            episode.add_policy_turn(turn)
            if turn.finish_reason == "abort" or episode.policy_turns >= self.max_turns:
                break
            reply = await self._user("the reply of", environment.reply, turn, episode)
            if reply is None:
                break
            episode.add_tool_turn(reply)
            budget = _budget(self.sampling, len(episode.tokens), self.max_tokens)
            if budget is None:
                episode.finish_reason = "length"
                break
            if self.progress is not None:
                self._save(index, episode, await self._snapshot(environment), finished=False)
            [turn] = await _turns(self.policy, episode.context(), 1, budget)
        if episode.finish_reason != "abort":
            self._save(index, episode, None, finished=True)

    def _save(self, index: int, episode: Episode, environment_state: bytes | None, *, finished: bool) -> None:
        if self.progress is not None:
            self.progress.save(index, episode.state(environment_state, finished=finished))

    async def _snapshot(self, environment: Environment) -> bytes | None:
        """The environment's ``snapshot()`` (bytes), or None when it has none. One that raises or returns
        something else than bytes fails the episode (retriable), as a reply that raises does."""
        snapshot = getattr(environment, "snapshot", None)
        if not callable(snapshot):
            return None
        state = await self._user("snapshot() of", snapshot)
        if not isinstance(state, bytes | bytearray):
            raise EngineError(f"snapshot() of {self.label} returned a {type(state).__name__}; it must return bytes "
                              "(e.g. json.dumps(state).encode()), which restore(state) gets back", retriable=False)
        return bytes(state)

    async def _user(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`: awaited when it is a coroutine function, else in the threads (an awaitable it returns
        awaited). Raises EngineError (retriable) naming `what` and `label` for whatever it raises."""
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(*args)
            result = await self.threads.run(fn, *args)
            return await result if inspect.isawaitable(result) else result
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"{what} {self.label} raised {type(exc).__name__}: {exc}", retriable=True) from exc


def _budget(sampling: SamplingParams, used: int, max_tokens: int | None) -> SamplingParams | None:
    """`sampling` with max_new_tokens cut to what `max_tokens` leaves after `used`; None when nothing is left."""
    if max_tokens is None or used + sampling.max_new_tokens <= max_tokens:
        return sampling
    return replace(sampling, max_new_tokens=max_tokens - used) if used < max_tokens else None


async def _turns(policy: TokenPolicy, context: list[int], n: int, sampling: SamplingParams) -> list[Completion]:
    turns = list(await policy(context, n, sampling))
    if len(turns) != n:
        raise EngineError(f"the policy returned {len(turns)} completions for one turn, expected {n}", retriable=False)
    return turns
