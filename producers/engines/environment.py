"""Multi-turn rollouts on an engine: the engine is the policy, an environment plug-in answers its turns
(``rollstream produce --engine vllm|sglang|hf --environment MODULE:CLASS [--max-turns N]``).

The contract (docs/engines.md, "Multi-turn on an engine"):

- ``MODULE:CLASS`` names a class; each episode gets a fresh instance, made as ``CLASS(tokenizer)`` with the
  engine's tokenizer (loaded, read-only: encode and decode freely), so an instance may keep the episode's
  state. Making it is plug-in code: it runs in the producer's ``rollstream-user`` threads.
- ``reply(turn, episode)`` answers each policy turn but the last: `turn` is the turn's `Completion` (``text``
  as the engine decoded it, ``tokens``, ``logprobs``, ``finish_reason``) and `episode` the `Episode` so far
  (``prompt``: the prompt dict with ``label`` and ``metadata``; ``prompt_tokens``, ``tokens``,
  ``loss_mask``, ``policy_turns``). It returns the token ids to append (the tool's answer, encoded once by
  the environment) or None to end the episode. Sync (run in the ``rollstream-user`` threads, never on the
  event loop, so a slow or hung one holds its own thread only) or ``async`` (awaited on the loop: for an
  environment that waits on I/O).
- The prompt is encoded once by the engine's tokenizer, chat template applied, as `generate` sends it
  (the engine's ``prompt_ids``); every policy turn continues the prompt and response token ids as they
  are (``generate_tokens``: never decoded and encoded again), at most ``--max-new-tokens`` tokens a turn
  and ``--max-turns`` policy turns an episode (`rollstream.producers.multiturn`).
- Each of the ``--n-samples`` episodes is one sample: its tokens are the policy turns and the replies
  concatenated, its loss mask 1 on the policy's tokens and 0 on the replies' (logprob 0.0 there), its policy
  versions per token as `rollstream.producers.multiturn` records them; the group records the sampling
  parameters as any group does.
- A group's episodes run under its one deadline (``--group-timeout``), every turn and reply included.
  Making an environment or its reply raised: the attempt fails, retriably (the producer tries the prompt again
  within the deadline, then publishes a failed group); a reply that is not token ids fails the group.

Checkpoints: an environment may also define ``snapshot() -> bytes`` and ``restore(state)``; each episode is then
checkpointed at every turn boundary and resumes on the producer that takes its prompt over after a crash
(`rollstream.producers.multiturn`); without them a resumed episode starts again.

Capabilities: the wrapper runs user code, saves progress and takes the group's deadline (handed to every policy
turn when its engine takes one); it checks sampling options and reloads weights exactly when its engine declares so
(``--engine hf``, ``--sglang-sync-weights``), so the producer loads announced weights as it does without an
environment.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, cast

from rollstream.infra.threads import ThreadPool
from rollstream.producers._plugins import load_callable
from rollstream.producers.engines._retry import Deadline
from rollstream.producers.engines.base import (
    ChecksSampling,
    Engine,
    EngineCapabilities,
    EngineError,
    Generation,
    ReloadableEngine,
    SamplingParams,
    capabilities_of,
)
from rollstream.producers.engines.custom import completion_from_dict
from rollstream.producers.engines.progress import Progress
from rollstream.producers.multiturn import DEFAULT_MAX_TURNS, run_episodes
from rollstream.schemas import ConfigError

__all__ = ["EXAMPLE_ENVIRONMENT", "EnvironmentEngine", "load_environment"]

EXAMPLE_ENVIRONMENT = "rollstream.examples.calculator:CalculatorEnvironment"
_TOKEN_METHODS = ("prompt_ids", "generate_tokens")  # what an engine needs to be a multi-turn policy (and `tokenizer`)


def load_environment(spec: str) -> type:
    """Import ``MODULE:CLASS`` and check it is an environment class: made as ``CLASS(tokenizer)``, with a
    ``reply(turn, episode)`` method. No instance is made.

    Raises:
        ConfigError: malformed spec, module not importable, attribute missing, not a class, no ``reply``, or
            a constructor or ``reply`` that cannot take those arguments (each message says what to give).
    """
    where = f"--environment {spec!r}"
    target = load_callable(spec, "--environment", expected=f"MODULE:CLASS, e.g. {EXAMPLE_ENVIRONMENT}", kind="class")
    if not inspect.isclass(target):
        raise ConfigError(f"{where}: {spec.partition(':')[2]!r} is a {type(target).__name__}, not a class; give the "
                          f"environment's class (each episode makes one: CLASS(tokenizer)), e.g. {EXAMPLE_ENVIRONMENT}")
    name = target.__name__
    if not callable(getattr(target, "reply", None)):
        raise ConfigError(f"{where}: {name} has no reply(turn, episode) method, so it is not an environment; give it "
                          "one that returns the tool's token ids, or None to end the episode")
    if not _accepts(target, 1):
        raise ConfigError(f"{where}: {name}(tokenizer) does not fit {name}{_signature(target)}; each episode makes "
                          "its environment as CLASS(tokenizer): take the tokenizer as the one argument")
    reply = getattr(target, "reply")  # noqa: B009 - any class: mypy knows no `reply` on it
    bound = isinstance(inspect.getattr_static(target, "reply"), staticmethod | classmethod)
    if not _accepts(reply, 2 if bound else 3):
        raise ConfigError(f"{where}: {name}.reply{_signature(reply)} cannot take (turn, episode); give it the "
                          "signature reply(self, turn, episode)")
    return target


def _accepts(fn: Any, count: int) -> bool:
    """Whether `fn` can be called with `count` positional arguments (True when its signature is unknown)."""
    try:
        inspect.signature(fn).bind(*([None] * count))
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): let the call say
        return True
    return True


def _signature(fn: Any) -> str:
    """`fn`'s parameters as written, without annotations: ``(self, turn)``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "(...)"
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=bare, return_annotation=inspect.Signature.empty))


class EnvironmentEngine:
    """An engine (the policy) with an environment class: `generate` plays ``n`` episodes of a prompt (see the
    module docstring). It declares ``reloads_weights`` and ``checks_sampling`` as its engine does (see the
    module docstring). Loop-only, like the engine it wraps; `start` and `close` start and close that engine.

    Args:
        engine: an engine with ``tokenizer``, ``prompt_ids`` and ``generate_tokens`` (every built-in one).
        environment: the environment class (`load_environment` checks one named ``MODULE:CLASS``).
        max_turns: policy turns per episode at most.
        label: how errors name the environment (default: the class's qualified name).
    Raises:
        ConfigError: the engine cannot be a multi-turn policy (or declares no capabilities), or `max_turns` < 1.
    """

    def __init__(self, engine: Engine, environment: type, *, max_turns: int = DEFAULT_MAX_TURNS,
                 label: str | None = None) -> None:
        self._policy = capabilities_of(engine)
        missing = [m for m in _TOKEN_METHODS if not callable(getattr(engine, m, None))]
        missing += [] if inspect.getattr_static(engine, "tokenizer", None) is not None else ["tokenizer"]
        if missing:  # (`tokenizer` looked up without reading it: engines load theirs at start)
            raise ConfigError(f"engine {getattr(engine, 'name', type(engine).__name__)!r} cannot play multi-turn "
                              f"episodes: it has no {', '.join(missing)}; use --engine vllm, sglang or hf")
        if max_turns < 1:
            raise ConfigError(f"--max-turns {max_turns}: an episode needs at least one policy turn")
        self.engine = engine
        self.name: str = engine.name
        self.environment = environment
        self.max_turns = max_turns
        self._label = label or f"environment {environment.__qualname__}"
        self._threads: ThreadPool | None = None  # the producer's user threads, lent by `use_threads`
        self.capabilities = EngineCapabilities(takes_deadline=True, checks_sampling=self._policy.checks_sampling,
                                               runs_user_code=True, reloads_weights=self._policy.reloads_weights,
                                               saves_progress=True)

    def use_threads(self, threads: ThreadPool) -> None:
        """Make environments and run sync replies in `threads` (the producer's ``rollstream-user``, which it
        owns); without, each `generate` uses a few threads of its own."""
        self._threads = threads

    def check_sampling(self, sampling: SamplingParams) -> None:
        """The engine's own check (declared as ``checks_sampling``; raises ConfigError for an option it has
        no name for)."""
        if self._policy.checks_sampling:
            cast(ChecksSampling, self.engine).check_sampling(sampling)

    async def start(self) -> None:
        """Start the engine (its tokenizer loads here). Raises what it raises."""
        await self.engine.start()

    async def close(self) -> None:
        await self.engine.close()

    async def generate(self, prompt: Mapping[str, Any], n: int, sampling: SamplingParams, *,
                       deadline: Deadline | None = None, progress: Progress | None = None) -> Generation:
        """`n` episodes of `prompt`, each one sample (every policy turn within `deadline`, when the engine
        takes one; the producer bounds the whole call by it anyway). With `progress`, episodes resume from
        their checkpoints and are saved at every turn boundary (`rollstream.producers.multiturn`).

        Raises:
            EngineError: the engine's (encoding the prompt, a turn); making an environment or a reply raised
                (retriable); a reply is not token ids (not retriable); a turn came back aborted (retriable).
        """
        engine: Any = self.engine
        text, ids = await engine.prompt_ids(prompt)
        tokenizer = engine.tokenizer
        policy = engine.generate_tokens
        if self._policy.takes_deadline and deadline is not None:
            policy = functools.partial(policy, deadline=deadline)
        dicts = await run_episodes(policy, functools.partial(self.environment, tokenizer), ids, n, sampling,
                                   decode=functools.partial(tokenizer.decode, skip_special_tokens=True),
                                   max_turns=self.max_turns, prompt_text=text, prompt=prompt, threads=self._threads,
                                   label=self._label, progress=progress)
        completions = [completion_from_dict(d, self._label, i) for i, d in enumerate(dicts)]
        if any(c.finish_reason == "abort" for c in completions):
            raise EngineError(f"a policy turn of an episode with {self._label} was aborted", retriable=True)
        return Generation(completions=completions, prompt_text=text, prompt_tokens=ids)

    @property
    def policy_version(self) -> int | None:
        """The engine's ``policy_version`` (with ``reloads_weights``; else None)."""
        return cast(ReloadableEngine, self.engine).policy_version if self._policy.reloads_weights else None

    async def reload(self, weights_path: str, version: int) -> bool:
        """The engine's ``reload`` (the producer calls it only with ``reloads_weights``).

        Raises:
            EngineError: the engine's (the old weights keep serving), or the engine owns no weights.
        """
        if not self._policy.reloads_weights:
            raise EngineError(f"engine {self.name!r} owns no weights: it cannot reload {weights_path!r}",
                              retriable=False)
        return await cast(ReloadableEngine, self.engine).reload(weights_path, version)
