"""Options every command shares, and the one way the CLI turns them into library configuration."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from rollstream.infra import BOOTSTRAP_ENV, KafkaConfig, TopicNames
from rollstream.infra import DEFAULT_TRAINER_GROUP as DEFAULT_TRAINER_GROUP  # defined once, in infra; re-exported here
from rollstream.infra.kafka_io import REACH_TIMEOUT_S, require_topics

BootstrapOpt = Annotated[str | None, typer.Option(
    "--bootstrap-servers", "-b", envvar=BOOTSTRAP_ENV, show_envvar=True,
    help="Kafka bootstrap address host:port[,host:port] (default 127.0.0.1:9092).")]
KafkaConfigOpt = Annotated[Path | None, typer.Option(
    "--kafka-config", exists=True, dir_okay=False,
    help="A properties file of librdkafka settings (security.protocol, sasl.*, ssl.*, ...) for every client.")]
NamespaceOpt = Annotated[str, typer.Option(
    "--namespace", "-N", envvar="ROLLSTREAM_NAMESPACE",
    help="Topic namespace: topics are NS.prompts, NS.rollouts, NS.steps, NS.control, NS.inflight.")]
TrainerGroupOpt = Annotated[str, typer.Option(
    "--group", "-g", envvar="ROLLSTREAM_TRAINER_GROUP", help="The trainer's consumer group id.")]

DEFAULT_NAMESPACE = "rollstream"


def examples(*commands: str) -> str:
    """A command's ``--help`` epilog: its example command lines, one a line (rich keeps the line breaks). Each is a
    whole command line whose flags parse: tests/unit/test_cli_help.py checks every command's."""
    if len(commands) == 1:
        return f"Example: {commands[0]}"
    return "\n  ".join(["Examples:", *commands])


EXIT_ERROR = 2  # a usage, configuration or cluster error: what `fail` exits with


def fail(message: str) -> NoReturn:
    """End the command with `message` as one red line on stderr (its own line breaks joined) and exit 2."""
    line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    typer.secho(f"error: {line}", fg=typer.colors.RED, err=True)
    sys.exit(EXIT_ERROR)


def kafka_config(bootstrap_servers: str | None, kafka_config_file: Path | None, client_id: str) -> KafkaConfig:
    """The KafkaConfig every command builds its clients from."""
    return KafkaConfig.load(bootstrap_servers, kafka_config_file, client_id=client_id)


def topic_names(namespace: str) -> TopicNames:
    return TopicNames(namespace)


def setup_logging(verbose: int) -> None:
    """WARNING (default), INFO (-v) or DEBUG (-vv). librdkafka's own lines only with -vv: every failure
    reaches the user as one rollstream error, and librdkafka repeats a refused connection hundreds of times."""
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("librdkafka").setLevel(logging.DEBUG if verbose >= 2 else logging.CRITICAL + 1)


def require_reachable(config: KafkaConfig, topics: list[str], namespace: str, timeout: float = REACH_TIMEOUT_S) -> None:
    """Fail fast and in one line when the cluster does not answer, the namespace has no topics or a topic is missing
    (see `rollstream.infra.kafka_io.require_topics`), before a command's own, longer timeouts."""
    require_topics(config, topics, namespace=namespace, timeout=min(timeout, REACH_TIMEOUT_S))
