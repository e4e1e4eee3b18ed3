"""How the demo runs on each engine, without starting anything. Pinned here:

1. ``hf`` keeps the demo as it was (2 producers, the 4-head model); ``vllm`` runs exactly one producer (one
   server, reloaded once per version) on the same recipe with 2 heads of vLLM's smallest CPU head size and an
   output layer of its own (not tied to the embedding, which vLLM's in-place reload would leave stale).
2. The vLLM producer's command line points at the server, the model's tokenizer, and syncs the weights.
3. A bad engine or a second vLLM producer is refused by `DemoOptions`, naming the fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.demo import DemoError, DemoOptions
from rollstream.demo._engines import generation_server, producer_engine_args
from rollstream.demo.task import DEMO_RECIPE
from rollstream.vllm_server import MIN_HEAD_SIZE, VLLMServer


def test_hf_is_the_default_and_unchanged() -> None:
    options = DemoOptions()
    assert options.engine == "hf" and options.producer_count == 2 and options.plan.recipe == DEMO_RECIPE
    assert DemoOptions(producers=3).producer_count == 3
    assert producer_engine_args(options.plan, Path("/m"), None) == ["--engine", "hf", "--model", "/m",
                                                                    "--concurrency", "4"]
    with generation_server("hf", Path("/m"), Path("/out")) as server:
        assert server is None  # nothing to start: each producer loads the model itself


def test_vllm_runs_one_producer_on_a_model_vllm_can_serve() -> None:
    options = DemoOptions(engine="vllm")
    recipe = options.plan.recipe
    assert options.producer_count == 1
    assert recipe.hidden_size // recipe.heads == MIN_HEAD_SIZE and recipe.hidden_size == DEMO_RECIPE.hidden_size
    assert not recipe.tie_embeddings  # vLLM's in-place reload leaves a tied output layer at its old weights
    assert {**vars(recipe), "heads": DEMO_RECIPE.heads, "tie_embeddings": True} == vars(DEMO_RECIPE)  # nothing else
    args = producer_engine_args(options.plan, Path("/m"), VLLMServer(Path("/m"), port=8123))
    assert args[:4] == ["--engine", "vllm", "--vllm-url", "http://127.0.0.1:8123"]
    assert args[args.index("--tokenizer") + 1] == "/m" and "--vllm-sync-weights" in args
    assert int(args[args.index("--concurrency") + 1]) >= 2  # 32+ requests in flight keep the server busy


def test_options_refuse_an_unknown_engine_and_a_second_vllm_producer() -> None:
    with pytest.raises(DemoError, match="hf or vllm"):
        DemoOptions(engine="sglang")  # type: ignore[arg-type]
    with pytest.raises(DemoError, match="leave --producers out"):
        DemoOptions(engine="vllm", producers=2)
    assert DemoOptions(engine="vllm", producers=1).producer_count == 1
