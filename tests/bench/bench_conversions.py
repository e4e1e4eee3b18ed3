"""What each trainer adapter's conversion costs a step: the taken records decoded, then turned into what the
trainer trains on (TRL's ``RolloutSample``s, slime's ``Sample``s). No broker: the take and the commit are the
shared `RolloutConsumer`'s, measured by the consumer and verl parts.

Step shape: 32 groups x 8 responses, a 256-token prompt, responses of 1-2048 tokens (uniform, seeded) with
logprobs, a loss mask and a reward: the token counts of the verl part's step. Best of `ROUNDS`.

Run alone: ``python -m tests.bench.bench_conversions`` (slime: the stand-in of tests/standins/slime, field for
field slime's ``Sample``; TRL: the installed trl).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rollstream.consumers._slime_samples import to_slime_group
from rollstream.consumers._trl_samples import to_rollout_samples
from rollstream.schemas import Sample, ScoredGroup, decode, encode

from tests.bench._common import Rows

GROUPS, RESPONSES, PROMPT, RESPONSE_MAX = 32, 8, 256, 2048
ROUNDS = 5
STANDINS = Path(__file__).resolve().parents[1] / "standins"


def records(seed: int = 0) -> list[bytes]:
    """One step's records as they arrive from NS.rollouts."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(GROUPS):
        samples = []
        for _ in range(RESPONSES):
            k = int(rng.integers(1, RESPONSE_MAX + 1))
            mask = np.ones(k, np.uint8)
            mask[k // 2:k // 2 + min(8, k // 4)] = 0
            samples.append(Sample(tokens=rng.integers(5, 150_000, k), logprobs=-rng.random(k), text="x" * 64,
                                  reward=float(rng.integers(0, 2)), weight_versions=(1,), loss_mask=mask))
        out.append(encode(ScoredGroup(group_id=f"g{g}#0", prompt_id=f"g{g}", epoch=0, prompt="q" * 64,
                                      prompt_tokens=rng.integers(5, 150_000, PROMPT), samples=samples,
                                      started_at_ms=0, finished_at_ms=1)))
    return out


def _best(fn: Callable[[], object]) -> float:
    fn()
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def run() -> Rows:
    """Rows (figure, value): seconds a step for decoding, and for decoding plus each adapter's conversion."""
    raw = records()
    sys.path.insert(0, str(STANDINS))  # slime's stand-in as `slime`, as the tests' slime_path fixture does
    try:
        from slime.utils.types import Sample as SlimeSample  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(STANDINS))

    def decoded() -> list[ScoredGroup]:
        return [decode(r, ScoredGroup) for r in raw]

    def trl() -> None:
        for g in decoded():
            to_rollout_samples(g, model_version=1)

    def slime() -> None:
        for i, g in enumerate(decoded()):
            to_slime_group(g, i, sample_cls=SlimeSample)

    def touch() -> None:  # decoding includes building every Sample, as the adapters' first look does
        for g in decoded():
            g.samples  # noqa: B018

    tokens = sum(len(s.tokens) for r in raw for s in decode(r, ScoredGroup).samples)
    return [
        ("step", f"{GROUPS} groups x {RESPONSES} responses, {PROMPT}-token prompts, {tokens:,} response tokens, "
                 f"{sum(map(len, raw)) / 1e6:.1f} MB of records"),
        ("decode s (records -> ScoredGroups with their Samples)", f"{_best(touch):.4f}"),
        ("TRL: decode + to_rollout_samples s", f"{_best(trl):.4f}"),
        ("slime: decode + to_slime_group s", f"{_best(slime):.4f}"),
    ]


if __name__ == "__main__":
    print("| figure | value |\n|---|---|")
    for name, value in run():
        print(f"| {name} | {value} |")
