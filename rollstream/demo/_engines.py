"""What generates in the demo: ``hf`` (transformers inside each producer) or ``vllm`` (one real vLLM server).

- ``hf`` (the default): every producer process loads the model with transformers and loads each announced
  policy version itself (``rollstream produce --engine hf``). Two producers, four groups in flight each.
- ``vllm``: one vLLM server of vLLM's CPU build (``make install-vllm``; `rollstream.vllm_server`) serves the
  demo model, and ONE producer (``rollstream produce --engine vllm --vllm-sync-weights``) sends it the
  requests and, for each version the trainer announces on NS.control, pauses the server, has it reload the
  weights from ``<out>/weights/v<k>``, labels the version and resumes it. One producer because there is one
  server: two producers syncing it would pause and reload it twice per version. `VLLM_CONCURRENCY` groups in
  flight (16 samples each) keep it busy without drowning the producer's event loop.

The vLLM demo's model is the demo recipe with two changes vLLM 0.32's CPU build needs:

- 2 attention heads instead of 4: its CPU attention supports head sizes 32, 64, 80, ... but not the demo
  model's 16 (hidden 64, 4 heads); 2 heads have size 32 (`MIN_HEAD_SIZE`), at the same width and parameter count.
- An output layer of its own instead of the input embedding (``tie_word_embeddings`` false; +1,536
  parameters): vLLM's in-place ``reload_weights`` loads the embedding but leaves a tied output layer at the
  weights the server started with (the checkpoint has no ``lm_head.weight`` to load into it), so the served
  policy would be neither the trainer's nor the old one. Measured: after a reload, logprobs off by up to 0.35
  nats with tied embeddings, identical (to 1e-6) untied.

The demo model has 64 positions, hence ``--max-model-len 64``. The server runs
``--logprobs-mode processed_logprobs``, the vLLM engine's default contract (at the demo's temperature 1.0 and
top_p 1.0 raw and processed logprobs agree anyway).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rollstream.demo.task import DEMO_RECIPE, DemoRecipe
from rollstream.vllm_server import MIN_HEAD_SIZE, VLLMServer, vllm_python

DemoEngine = Literal["hf", "vllm"]
ENGINES: tuple[DemoEngine, ...] = ("hf", "vllm")
HF_CONCURRENCY = 4  # groups in flight per hf producer: a batch of 16 samples each, one torch thread
# Groups in flight on the one vLLM producer (16 requests each, one per sample). More is slower on 2 shared cores:
# measured 2.3 groups/s at 4 and 1.6 at 16, where the producer's event loop lagged 1.5-3 s behind 256 requests
# and each pause for a weight update aborted more work.
VLLM_CONCURRENCY = 4
VLLM_MAX_MODEL_LEN = 64  # the demo model's max_position_embeddings
VLLM_STARTUP_TIMEOUT_S = 300.0  # the CPU build starts in 1-2 minutes on 2 busy cores

__all__ = ["ENGINES", "DemoEngine", "EnginePlan", "check_engine_installed", "engine_plan", "generation_server",
           "producer_engine_args"]


@dataclass(frozen=True)
class EnginePlan:
    """How one engine runs the demo: the model recipe, producers by default, groups in flight, a label."""

    name: DemoEngine
    recipe: DemoRecipe
    default_producers: int
    concurrency: int
    label: str


def engine_plan(name: DemoEngine) -> EnginePlan:
    """The plan for `name` (``hf`` or ``vllm``). Pure; raises ValueError for another name."""
    if name == "hf":
        return EnginePlan("hf", DEMO_RECIPE, 2, HF_CONCURRENCY, "transformers in each producer process")
    if name == "vllm":
        recipe = dataclasses.replace(DEMO_RECIPE, heads=DEMO_RECIPE.hidden_size // MIN_HEAD_SIZE, tie_embeddings=False)
        return EnginePlan("vllm", recipe, 1, VLLM_CONCURRENCY,
                          "a vLLM server, CPU build; its weights reloaded at each version")
    raise ValueError(f"unknown demo engine {name!r}: use {' or '.join(ENGINES)}")


def check_engine_installed(name: DemoEngine) -> None:
    """Fail before anything starts when the engine's environment is missing. Blocks briefly (a file check).

    Raises:
        ConfigError: ``vllm`` without vLLM's environment; the message names ``make install-vllm``.
    """
    if name == "vllm":
        vllm_python()


@contextlib.contextmanager
def generation_server(name: DemoEngine, model_dir: Path, out: Path) -> Iterator[VLLMServer | None]:
    """The server the producers generate with: none for ``hf``; for ``vllm`` a vLLM server of `model_dir`
    logging to ``<out>/vllm-server.log``, started on entry (blocks until it serves: 1-2 minutes) and stopped
    with its whole process group on exit, also when its start is interrupted (Ctrl-C) or fails.

    Raises:
        ConfigError: vLLM's environment is not installed.
        VLLMServerError: the server did not start (the message carries the end of its log).
    """
    if name != "vllm":
        yield None
        return
    server = VLLMServer(model_dir, max_model_len=VLLM_MAX_MODEL_LEN, log_path=out / "vllm-server.log",
                        startup_timeout_s=VLLM_STARTUP_TIMEOUT_S,
                        extra_args=("--logprobs-mode", "processed_logprobs"))
    try:  # start inside the try: a Ctrl-C while it waits for /health still stops the process group
        server.start()
        yield server
    finally:
        server.stop()


def producer_engine_args(plan: EnginePlan, model_dir: Path, server: VLLMServer | None) -> list[str]:
    """The engine part of a demo producer's ``rollstream produce`` command line."""
    if plan.name == "vllm":
        if server is None:
            raise ValueError("the vllm demo engine needs its running server")
        return ["--engine", "vllm", "--vllm-url", server.url, "--tokenizer", str(model_dir), "--vllm-sync-weights",
                "--vllm-logprobs-mode", "processed_logprobs", "--concurrency", str(plan.concurrency)]
    return ["--engine", "hf", "--model", str(model_dir), "--concurrency", str(plan.concurrency)]
