"""`rollstream prompts load`: validate a JSONL prompt file and publish it to NS.prompts (thin: calls `producers`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rollstream.cli._common import DEFAULT_NAMESPACE, BootstrapOpt, KafkaConfigOpt, NamespaceOpt, examples, kafka_config
from rollstream.producers import load_prompts

app = typer.Typer(help="Put prompts on NS.prompts for the producers.", no_args_is_help=True,
                  epilog=examples("rollstream prompts load prompts.jsonl --namespace demo"))


LOAD_HELP = "\n\n".join([
    "Load FILE (JSONL) into NS.prompts.",
    'Each line is a JSON object: "id" (string), "prompt" (text, or a list of {"role", "content"} chat messages), '
    'optional "label" (what built-in rewards compare with) and optional "metadata" (an object).',
    "Every line is validated first: a bad line is an error naming the file and line, and then nothing is published.",
])


@app.command("load", help=LOAD_HELP, epilog=examples(
    "rollstream prompts load prompts.jsonl --namespace demo",
    "rollstream prompts load prompts.jsonl --namespace demo --epochs 3 --start-epoch 1"))
def load(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="JSONL: one prompt per line.")],
    epochs: Annotated[int, typer.Option(min=1, help="Publish every prompt once per epoch.")] = 1,
    start_epoch: Annotated[int, typer.Option(min=0, help="Number of the first epoch (to append more).")] = 0,
    namespace: NamespaceOpt = DEFAULT_NAMESPACE,
    bootstrap_servers: BootstrapOpt = None,
    kafka_config_file: KafkaConfigOpt = None,
) -> None:
    config = kafka_config(bootstrap_servers, kafka_config_file, "rollstream-prompts")
    count = load_prompts(file, config, namespace=namespace, epochs=epochs, start_epoch=start_epoch)
    typer.echo(f"published {count} prompts ({epochs} epoch{'s' if epochs != 1 else ''}) to {namespace}.prompts")


def register(root: typer.Typer) -> None:
    """Add the `prompts` group to the root app."""
    root.add_typer(app, name="prompts")
