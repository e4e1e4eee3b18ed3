"""The `rollstream` command line: a thin layer that parses arguments and calls library code.

Each group of commands lives in its own module and registers itself on the root app here.
Errors derived from `RollstreamError` (and librdkafka's own, mapped by `rollstream.infra.kafka_errors.kafka_error`) are
printed as one clear line (`_common.fail`: never a traceback) and exit with status 2.
"""

from __future__ import annotations

from typing import Annotated

import typer
from confluent_kafka import KafkaException

from rollstream.cli import _acls, _broker, _consume, _demo, _inspect, _produce, _prompts, _status, _topics
from rollstream.cli._common import examples, fail, setup_logging
from rollstream.infra.kafka_errors import kafka_error
from rollstream.schemas import RollstreamError

app = typer.Typer(
    name="rollstream",
    help="Kafka-based streaming rollouts for LLM RL: producers publish scored groups, the trainer takes exactly N.",
    epilog=examples("rollstream broker start", "rollstream topics create --namespace demo",
                    "rollstream prompts load prompts.jsonl --namespace demo",
                    "rollstream produce --namespace demo --engine hf --model ./tiny --reward math",
                    "rollstream take --namespace demo -n 8 --steps 3"),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root(verbose: Annotated[int, typer.Option("--verbose", "-v", count=True,
                                                help="-v for INFO logs, -vv for DEBUG.")] = 0) -> None:
    setup_logging(verbose)


def _register() -> None:
    app.add_typer(_broker.app, name="broker")
    app.add_typer(_topics.app, name="topics")
    for module in (_prompts, _produce, _consume, _inspect, _status, _demo, _acls):
        module.register(app)


_register()


def main() -> None:
    """Entry point of the `rollstream` console script."""
    try:
        app()
    except RollstreamError as exc:
        fail(str(exc))
    except KafkaException as exc:  # raised by librdkafka itself, e.g. a client refusing a setting
        error = kafka_error("Kafka client", exc)
        fail(f"{error}{' (check the --kafka-config file)' if error.code == '_INVALID_ARG' else ''}")
