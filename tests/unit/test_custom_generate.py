"""The custom generate contract, extended (`rollstream.producers.engines.custom`). Pinned here:

1. a completion dict's ``loss_mask``, ``weight_versions`` spans and ``prompt_tokens``/``prompt_text`` reach
   the `Completion` and the `Generation`; ``weight_version`` defaults to the newest span's;
2. a malformed field is a non-retriable EngineError naming the completion, the field and the lengths;
3. ``--generate MODULE:CLASS`` instantiates the class, and its instance's ``start``/``close`` bracket the run.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from rollstream.producers import CustomEngine, EngineError, SamplingParams
from rollstream.producers.engines.custom import completion_from_dict
from rollstream.schemas import ConfigError, VersionSpan

SPANS = [{"version": 3, "start": 0, "end": 2}, {"version": 4, "start": 2, "end": 5}]


def test_loss_mask_spans_and_prompt_reach_the_generation() -> None:
    async def gen(prompt: dict[str, Any], n: int, sp: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"text": "ab=3c", "tokens": [7, 8, 9, 10, 11], "logprobs": [-1.0, -0.5, 0.0, 0.0, -0.2],
                 "loss_mask": [1, 1, 0, 0, 1], "weight_versions": SPANS, "prompt_tokens": [1, 2],
                 "prompt_text": "q"}] * n

    out = asyncio.run(CustomEngine(gen).generate({"id": "p"}, 2, SamplingParams()))
    assert out.prompt_tokens == (1, 2) and out.prompt_text == "q"
    c = out.completions[1]
    np.testing.assert_array_equal(c.loss_mask, [1, 1, 0, 0, 1])
    assert c.version_spans == (VersionSpan(3, 0, 2), VersionSpan(4, 2, 5)) and c.policy_version == 4

    plain = completion_from_dict({"text": "x", "tokens": [1]}, "g", 0)
    assert plain.loss_mask is None and plain.version_spans == () and plain.policy_version is None


@pytest.mark.parametrize(("extra", "message"), [
    ({"loss_mask": [1, 0, 1, 1]}, "g completion 2: loss_mask has 4 entries for 5 tokens"),
    ({"loss_mask": [1, 0, 2, 1, 1]}, "g completion 2: loss_mask has 5 entries for 5 tokens; give one 0 or 1"),
    ({"loss_mask": ["1"] * 5}, "g completion 2: 'loss_mask' must be a list of 0/1 ints"),
    ({"weight_versions": SPANS[:1]}, "g completion 2: 'weight_versions': version spans end at token 2, but the "
                                     "sample has 5 tokens"),
    ({"weight_versions": [SPANS[1], SPANS[0]]}, "'weight_versions' must be oldest first, got versions \\[4, 3\\]"),
    ({"weight_versions": [{"version": 3, "start": 0, "end": 2}, {"version": 4, "start": 3, "end": 5}]},
     "span .* starts at 3, expected 2"),
    ({"weight_versions": [{"version": 3, "start": 0}]}, "'weight_versions' entry 0 must be a dict of int"),
    ({"weight_versions": SPANS, "weight_version": 3}, "'weight_version' 3 is not the newest of 'weight_versions' "
                                                      "\\(4\\)"),
    ({"logprobs": [0.0] * 4}, "g completion 2: completion has 5 tokens but 4 logprobs"),
])
def test_malformed_fields_name_the_field_and_lengths(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(EngineError, match=message) as err:
        completion_from_dict({"text": "x", "tokens": [1, 2, 3, 4, 5], **extra}, "g", 2)
    assert not err.value.retriable


def test_completions_of_one_call_share_their_prompt() -> None:
    async def gen(prompt: dict[str, Any], n: int, sp: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"text": "x", "tokens": [1], "prompt_tokens": [i]} for i in range(n)]

    with pytest.raises(EngineError, match="2 different 'prompt_tokens'; they share one prompt"):
        asyncio.run(CustomEngine(gen).generate({"id": "p"}, 2, SamplingParams()))


class Agent:
    """A generate class (``--generate tests.unit.test_custom_generate:Agent``): counts its lifecycle calls."""

    def __init__(self) -> None:
        self.events: list[str] = []

    async def start(self) -> None:
        self.events.append("start")

    async def close(self) -> None:
        self.events.append("close")

    async def __call__(self, prompt: dict[str, Any], n: int, sp: dict[str, Any]) -> list[dict[str, Any]]:
        self.events.append(f"generate {sp['max_new_tokens']}")
        return [{"text": "x", "tokens": [1]}] * n


class Broken:
    def __init__(self) -> None:
        raise RuntimeError("no model")


def test_a_class_spec_is_instantiated_and_its_lifecycle_awaited() -> None:
    engine = CustomEngine.from_spec("tests.unit.test_custom_generate:Agent")

    async def run() -> None:
        await engine.start()
        await engine.generate({"id": "p"}, 1, SamplingParams(max_new_tokens=7))
        await engine.close()

    asyncio.run(run())
    assert engine._fn.events == ["start", "generate 7", "close"]  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"Broken\(\) raised RuntimeError: no model"):
        CustomEngine.from_spec("tests.unit.test_custom_generate:Broken")
