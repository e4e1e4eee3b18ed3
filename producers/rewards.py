"""Reward functions: ``--reward MODULE:FUNC`` (sync or async) or a built-in NAME (``math``, ``exact``).

A reward function is ``f(prompt: dict, completion: dict) -> float``; `prompt` is a `Prompt.plugin_dict()`
(id, prompt, label, metadata, epoch, attempt), `completion` a `Completion.to_dict()` (text, tokens, logprobs,
finish_reason, weight_version, and the custom generate contract's loss_mask and weight_versions, so a
multi-turn reward can tell the policy's tokens from a tool's). A user's sync function runs in the
producer's ``rollstream-user`` threads (a slow verifier must not stall the event loop, and a hung one holds
its own thread, never the producer's tokenization or shutdown); async functions are awaited. Whatever a reward
raises, or a result that is not a finite number, becomes a `RewardError`, and the producer publishes the
group as failed.

Built-ins compare against the prompt's ``label`` (a prompt without one is an error, not a zero):
``math`` extracts the completion's answer (the last ``\\boxed{...}``, else a GSM8K ``#### x`` line, else
the last number) and the label's (boxed, ``#### x``, else the whole label) and compares them after
normalisation, numerically when both parse; ``exact`` compares stripped strings.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from rollstream.infra.threads import ThreadPool
from rollstream.producers._plugins import load_callable
from rollstream.schemas import RollstreamError

RewardFn = Callable[[dict[str, Any], dict[str, Any]], Any]
_OWN_THREADS = 4  # a Reward called without the producer's threads (tests, scripts) makes this many of its own


class RewardError(RollstreamError):
    """A reward function raised or returned something that is not a finite number."""


class Reward:
    """A reward function made safe to call on the event loop. Stateless but for the threads it makes when
    called without any (made once); share it freely on one loop."""

    def __init__(self, fn: RewardFn, *, name: str, inline: bool = False) -> None:
        self.fn = fn
        self.name = name
        self._is_async = inspect.iscoroutinefunction(fn)
        self._inline = inline
        self._own: ThreadPool | None = None

    async def __call__(self, prompt: Mapping[str, Any], completion: Mapping[str, Any], *,
                       threads: ThreadPool | None = None) -> float:
        """Score one completion; a sync function runs in `threads` (the producer's ``rollstream-user``; None:
        a few threads of this reward's own). Raises RewardError (with the function's name and error)."""
        try:
            if self._is_async:
                value = await self.fn(dict(prompt), dict(completion))
            elif self._inline:
                value = self.fn(dict(prompt), dict(completion))
            else:
                if threads is None:
                    threads = self._own = self._own or ThreadPool("rollstream-user", _OWN_THREADS)
                value = await threads.run(self.fn, dict(prompt), dict(completion))
            if inspect.isawaitable(value):
                value = await value
        except RewardError:
            raise
        except Exception as exc:
            raise RewardError(f"reward {self.name} raised {type(exc).__name__}: {exc}") from exc
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise RewardError(f"reward {self.name} returned {value!r}; expected a finite float")
        return float(value)


def load_reward(spec: str | RewardFn | Reward | None) -> Reward | None:
    """Resolve ``--reward``: None, a built-in name, ``MODULE:FUNC``, or a function.

    Raises:
        ConfigError: unknown name or a plug-in path that does not import.
    """
    if spec is None or isinstance(spec, Reward):
        return spec
    if callable(spec):
        return Reward(spec, name=getattr(spec, "__qualname__", repr(spec)))
    if spec in BUILTIN_REWARDS:
        return Reward(BUILTIN_REWARDS[spec], name=spec, inline=True)
    if ":" not in spec:
        from rollstream.schemas import ConfigError

        raise ConfigError(f"--reward {spec!r}: not a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) "
                          "and not MODULE:FUNC")
    return Reward(load_callable(spec, "--reward"), name=spec)


def _label(prompt: Mapping[str, Any], reward: str) -> str:
    label = prompt.get("label")
    if label is None:
        raise RewardError(f"prompt {prompt.get('id')!r} has no label; the {reward!r} reward compares against it")
    return str(label)


def exact_reward(prompt: Mapping[str, Any], completion: Mapping[str, Any]) -> float:
    """1.0 when the completion text equals the label (both stripped), else 0.0."""
    return 1.0 if str(completion.get("text", "")).strip() == _label(prompt, "exact").strip() else 0.0


def math_reward(prompt: Mapping[str, Any], completion: Mapping[str, Any]) -> float:
    """1.0 when the completion's final answer matches the label's, else 0.0."""
    label = _label(prompt, "math")
    gsm = _GSM8K.findall(label)
    gold = last_boxed(label) or (gsm[-1].strip() if gsm else label.strip())
    pred = extract_answer(str(completion.get("text", "")))
    return 1.0 if pred is not None and answers_match(pred, gold) else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {"math": math_reward, "exact": exact_reward}

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_GSM8K = re.compile(r"####\s*(.+)")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces included."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i:j - 1].strip() if depth == 0 else None


def extract_answer(text: str) -> str | None:
    """The final answer in `text`: last boxed, else a ``#### x`` line, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    gsm = _GSM8K.findall(text)
    if gsm:
        return gsm[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalize(answer: str) -> str:
    s = answer.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = s.replace("\\!", "").replace("\\,", "").replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", r"\1/\2", s)
    return s.replace(" ", "").rstrip(".")


def _as_number(answer: str) -> Fraction | None:
    s = answer.replace(",", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(pred: str, gold: str) -> bool:
    """Equal after normalisation (LaTeX noise, ``\\frac``, thousands separators), or numerically equal."""
    p, g = _normalize(pred), _normalize(gold)
    if p == g:
        return True
    pn, gn = _as_number(p), _as_number(g)
    return pn is not None and gn is not None and pn == gn
