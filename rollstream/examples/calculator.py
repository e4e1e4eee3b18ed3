"""A calculator tool the demo's model can call: a multi-turn environment for any engine, and a complete
multi-turn generate function (`rollstream.producers.multiturn`).

The task is the demo's (``a+b=``, `rollstream.demo.task`). The policy calls the calculator by writing an
expression, numbers joined by ``+`` (a lone number counts); after each policy turn the calculator
evaluates the turn's last expression and answers ``=<value>``, appended as tool tokens (loss mask 0,
logprob 0.0) that the next policy turn continues. A turn without an expression, or a value the tokenizer
cannot write as it is (the demo's vocabulary stops at 18), ends the episode, as do `max_turns` policy
turns (two by default: a call, then the answer). `reward` scores the policy's last turn only, so the
calculator's answer earns nothing by itself.

`CalculatorEnvironment` is the tool as an environment plug-in: with an engine as the policy (vLLM or SGLang
servers, given the served model's tokenizer, or transformers on CPU), one producer plays the episodes and
the engine's weights follow the trainer as usual::

    rollstream produce --engine vllm --vllm-url http://127.0.0.1:8000 --tokenizer ./model \\
        --environment rollstream.examples.calculator:CalculatorEnvironment --max-turns 2 \\
        --reward rollstream.examples.calculator:reward --max-new-tokens 3 --n-samples 4

It reads the text the engine decoded, so it works with any tokenizer that can write ``=<value>``
(the demo's stops at 18; a character-level one, `rollstream.producers.build_tiny_model`'s, writes any).

`CalculatorAgent` is the same episode as a generate function on the demo's model (``$ROLLSTREAM_CALCULATOR_MODEL``,
a directory with the demo's tokenizer such as ``demo-out/weights/v400``; unset, the demo's untrained model is
built in a temporary directory)::

    rollstream produce --generate rollstream.examples.calculator:CalculatorAgent \\
        --reward rollstream.examples.calculator:reward --max-new-tokens 3 --n-samples 4

`--max-new-tokens` bounds each policy turn. The agent's weights stay those of the directory: a custom
generate function is not reloaded when the trainer announces a new policy version.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollstream.demo.task import SPECIAL_TOKENS, VOCAB, build_demo_model
from rollstream.demo.task import reward as demo_reward
from rollstream.producers.engines.base import Completion
from rollstream.producers.engines.hf import HFEngine
from rollstream.producers.multiturn import Episode, run_episodes, sampling_from_dict

MODEL_ENV = "ROLLSTREAM_CALCULATOR_MODEL"
_EXPRESSION = re.compile(r"\d+(?:\s*\+\s*\d+)*")


class CalculatorEnvironment:
    """The tool of one episode: answers a policy turn holding an expression with ``=<value>`` as token ids
    (``--environment rollstream.examples.calculator:CalculatorEnvironment`` makes one per episode as
    ``CalculatorEnvironment(tokenizer)``).

    Stateless apart from the tokenizer (read-only), so one instance could serve every episode.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def reply(self, turn: Completion, episode: Episode) -> list[int] | None:
        """``=<value>`` of the turn's last expression, encoded once; None (end) without one, or when the
        tokenizer cannot write the answer exactly."""
        expressions = _EXPRESSION.findall(turn.text)
        if not expressions:
            return None
        value = sum(int(term) for term in expressions[-1].split("+"))
        return encode_exactly(self._tokenizer, f"={value}")


def encode_exactly(tokenizer: Any, text: str) -> list[int] | None:
    """`text`'s token ids (no special tokens added), or None when they do not decode back to it (an unknown
    word). Spaces are ignored in the comparison: word-level decoders put them between tokens."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    back = tokenizer.decode(ids, skip_special_tokens=True)
    return ids if ids and back.replace(" ", "") == text.replace(" ", "") else None


class CalculatorAgent:
    """The generate function (``--generate rollstream.examples.calculator:CalculatorAgent``).

    Args:
        model_dir: a model with the demo's tokenizer (default ``$ROLLSTREAM_CALCULATOR_MODEL``, else the
            demo's untrained model, built at `start` in a temporary directory that `close` removes).
        max_turns: policy turns per episode.

    `start` and `close` belong to the producer's loop; calls may overlap (the engine's one worker thread
    runs one generation at a time).
    """

    def __init__(self, model_dir: str | Path | None = None, *, max_turns: int = 2) -> None:
        configured = model_dir if model_dir is not None else os.environ.get(MODEL_ENV)
        self._model_dir = Path(configured) if configured else None
        self._max_turns = max_turns
        self._built: Path | None = None
        self._engine: HFEngine | None = None

    async def start(self) -> None:
        """Load the model (building the demo's first when none is configured). Blocks nothing; idempotent.

        Raises:
            ConfigError: the model directory does not load.
        """
        if self._engine is not None:
            return
        model_dir = self._model_dir
        if model_dir is None:
            self._built = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="rollstream-calculator-"))
            model_dir = await asyncio.to_thread(build_demo_model, self._built)
        engine = HFEngine(model_dir)
        await engine.start()
        self._engine = engine

    async def close(self) -> None:
        """Release the model and remove a model built by `start`. Idempotent."""
        engine, self._engine = self._engine, None
        if engine is not None:
            await engine.close()
        built, self._built = self._built, None
        if built is not None:
            await asyncio.to_thread(shutil.rmtree, built, True)

    async def __call__(self, prompt: dict[str, Any], n: int, sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
        """`n` episodes of `prompt` as completion dicts (with loss masks and the prompt's tokens).

        Raises:
            EngineError: called before `start`, or generation failed.
        """
        from rollstream.producers.engines.base import EngineError

        engine = self._engine
        if engine is None:
            raise EngineError("CalculatorAgent called before start()", retriable=False)
        tokenizer = engine.tokenizer
        text, ids = await engine.prompt_ids(prompt)
        return await run_episodes(engine.generate_tokens, functools.partial(CalculatorEnvironment, tokenizer), ids,
                                  n, sampling_from_dict(sampling_params),
                                  decode=lambda t: tokenizer.decode(t, skip_special_tokens=True),
                                  max_turns=self._max_turns, prompt_text=text, prompt=prompt)


def final_turn(tokens: Sequence[int], loss_mask: Sequence[int] | None) -> list[int]:
    """The policy's last turn: the tokens after the last tool token (all of them without a mask)."""
    mask = list(loss_mask) if loss_mask is not None else [1] * len(tokens)
    last_tool = max((i for i, m in enumerate(mask) if m == 0), default=-1)
    return list(tokens[last_tool + 1:])


def reward(prompt: Mapping[str, Any], completion: Mapping[str, Any]) -> float:
    """The demo's reward (`rollstream.demo.task.reward`) of the policy's last turn, read with the demo's
    vocabulary: 1.0 for exactly the answer then end of sequence, 0.5 for the answer followed by more.
    Without a ``loss_mask`` in `completion` the whole response is read. Pure.

    Raises:
        ValueError: the prompt has no label.
    """
    words = [VOCAB[t] for t in final_turn(completion.get("tokens") or [], completion.get("loss_mask"))
             if len(SPECIAL_TOKENS) <= t < len(VOCAB)]
    return demo_reward(prompt, {"text": " ".join(words), "finish_reason": completion.get("finish_reason", "stop")})
