"""Plug-ins for producer tests, importable as ``tests.plugins:NAME`` (``--generate`` / ``--reward``).

Behaviour is keyed off the prompt id so one run can mix outcomes: an id containing ``engine-fail``
makes the generate functions raise, ``reward-fail`` makes `reward` raise. `slow` sleeps
``ROLLSTREAM_TEST_GEN_DELAY_S`` (default 0.2 s) so tests can kill a producer mid-run.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any


def _completions(prompt: dict[str, Any], n: int) -> list[dict[str, Any]]:
    answer = prompt.get("label") or "0"
    return [{"text": f"the answer is \\boxed{{{answer}}}", "tokens": [1, 2, 3, i], "logprobs": [-0.5] * 4,
             "finish_reason": "stop"} for i in range(n)]


async def instant(prompt: dict[str, Any], n: int, sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
    """Completes at once (the fully-async test's "instantly completing generations")."""
    if "engine-fail" in prompt["id"]:
        raise RuntimeError(f"engine exploded on {prompt['id']}")
    return _completions(prompt, n)


async def slow(prompt: dict[str, Any], n: int, sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
    """Takes ROLLSTREAM_TEST_GEN_DELAY_S seconds per group."""
    await asyncio.sleep(float(os.environ.get("ROLLSTREAM_TEST_GEN_DELAY_S", "0.2")))
    return await instant(prompt, n, sampling_params)


def reward(prompt: dict[str, Any], completion: dict[str, Any]) -> float:
    """1.0 unless the prompt id asks for a reward failure."""
    if "reward-fail" in prompt["id"]:
        raise ValueError(f"reward exploded on {prompt['id']}")
    return 1.0


def alternating(prompt: dict[str, Any], completion: dict[str, Any]) -> float:
    """0.0 and 1.0 in turn by completion (its last token is its index): groups that DAPO keeps."""
    return float(completion["tokens"][-1] % 2)


class NotAnEnvironment:
    """Has no ``reply``: refused by ``--environment``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer


class EnvironmentWithoutTokenizer:
    """``__init__`` takes no tokenizer: refused by ``--environment`` (each episode makes ``CLASS(tokenizer)``)."""

    def reply(self, turn: Any, episode: Any) -> list[int] | None:
        return None


class EnvironmentWithBadReply:
    """``reply`` takes no episode: refused by ``--environment``."""

    def __init__(self, tokenizer: Any) -> None:
        pass

    def reply(self, turn: Any) -> list[int] | None:
        return None


class SlowCountingEnvironment:
    """Answers each policy turn with `` [N]`` (N: its replies so far) after ``ROLLSTREAM_TEST_REPLY_DELAY_S``
    seconds (default 0.3), for ``ROLLSTREAM_TEST_REPLIES`` replies (default 5); its state (N) survives a crash
    through ``snapshot``/``restore``. A resumed episode that lost its state would answer ``[1]`` again."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.replies = 0

    def reply(self, turn: Any, episode: Any) -> list[int] | None:
        import time

        time.sleep(float(os.environ.get("ROLLSTREAM_TEST_REPLY_DELAY_S", "0.3")))
        if self.replies >= int(os.environ.get("ROLLSTREAM_TEST_REPLIES", "5")):
            return None
        self.replies += 1
        return list(self.tokenizer.encode(f" [{self.replies}]", add_special_tokens=False))

    def snapshot(self) -> bytes:
        return str(self.replies).encode()

    def restore(self, state: bytes) -> None:
        self.replies = int(state)
