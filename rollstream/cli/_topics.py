"""`rollstream topics ...`: create the namespace's topics from an explicit plan, raise their limits, and show them."""

from __future__ import annotations

from typing import Annotated

import typer

from rollstream.cli._common import (
    DEFAULT_NAMESPACE,
    BootstrapOpt,
    KafkaConfigOpt,
    NamespaceOpt,
    examples,
    kafka_config,
    require_reachable,
    topic_names,
)
from rollstream.infra import TopicPlan, alter_topics, create_topics, describe_topic_configs, existing_topics

app = typer.Typer(help="Create, alter and inspect the topics of a namespace.", no_args_is_help=True,
                  epilog=examples("rollstream topics create --namespace demo",
                                  "rollstream topics alter --namespace demo --max-message-mib 128",
                                  "rollstream topics describe --namespace demo"))


@app.command("create", epilog=examples(
    "rollstream topics create --namespace demo",
    "rollstream topics create --namespace prod --partitions 12 --replication-factor 3 --max-message-mib 128"))
def create(
    namespace: NamespaceOpt = DEFAULT_NAMESPACE,
    partitions: Annotated[int, typer.Option(help="Partitions of the prompts and rollouts topics.")] = 3,
    replication_factor: Annotated[int, typer.Option(help="Replicas of every topic (3 on a real cluster).")] = 1,
    min_insync_replicas: Annotated[int | None, typer.Option(
        help="Replicas that must have a write for acks=all (default min(2, replication factor)).")] = None,
    retention_days: Annotated[float, typer.Option(help="Time retention, long enough to replay.")] = 7.0,
    max_message_mib: Annotated[int, typer.Option(help="Largest record (one scored group) in MiB.")] = 64,
    bootstrap_servers: BootstrapOpt = None,
    kafka_config_file: KafkaConfigOpt = None,
) -> None:
    """Create NS.prompts, NS.rollouts, NS.steps, NS.control and NS.inflight (idempotent: existing topics are kept;
    run it again on a namespace made by an older rollstream to add NS.inflight, the producers' checkpoints)."""
    plan = TopicPlan(names=topic_names(namespace), partitions=partitions, replication_factor=replication_factor,
                     min_insync_replicas=min_insync_replicas, retention_days=retention_days,
                     max_message_bytes=max_message_mib * 1024 * 1024)
    config = plan.kafka_config(kafka_config(bootstrap_servers, kafka_config_file, "rollstream-topics"))
    require_reachable(config, [], namespace)
    for name, outcome in create_topics(plan, config).items():
        typer.echo(f"{name}: {outcome}")


@app.command("alter", epilog=examples(
    "rollstream topics alter --namespace demo --max-message-mib 128",
    "rollstream topics alter --namespace prod --retention-days 14"))
def alter(
    namespace: NamespaceOpt = DEFAULT_NAMESPACE,
    max_message_mib: Annotated[int | None, typer.Option(
        min=1, help="Largest record (one scored group) in MiB, on every topic of the namespace.")] = None,
    retention_days: Annotated[float | None, typer.Option(
        help="Time retention of NS.prompts, NS.rollouts and NS.steps (NS.control is compacted).")] = None,
    bootstrap_servers: BootstrapOpt = None,
    kafka_config_file: KafkaConfigOpt = None,
) -> None:
    """Change the limits of a namespace's existing topics (idempotent: a value already set is left alone).

    Producers and trainers read max.message.bytes when they start: restart them afterwards to use a new one.
    """
    if max_message_mib is None and retention_days is None:
        raise typer.BadParameter("give --max-message-mib M, --retention-days D, or both")
    names = topic_names(namespace)
    config = kafka_config(bootstrap_servers, kafka_config_file, "rollstream-topics")
    require_reachable(config, [names.prompts, names.rollouts, names.steps, names.control], namespace)
    changes = alter_topics(names, config, retention_days=retention_days,
                           max_message_bytes=None if max_message_mib is None else max_message_mib * 1024 * 1024)
    for topic, changed in changes.items():
        typer.echo(f"{topic}: " + "  ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
    if not changes:
        typer.echo(f"{namespace}: unchanged (every value already set)")


@app.command("describe", epilog=examples("rollstream topics describe --namespace demo"))
def describe(namespace: NamespaceOpt = DEFAULT_NAMESPACE, bootstrap_servers: BootstrapOpt = None,
             kafka_config_file: KafkaConfigOpt = None) -> None:
    """Print the configs the broker holds for the namespace's topics."""
    names = topic_names(namespace)
    config = kafka_config(bootstrap_servers, kafka_config_file, "rollstream-topics")
    require_reachable(config, [names.prompts, names.rollouts, names.steps, names.control], namespace)
    keys = ("min.insync.replicas", "max.message.bytes", "retention.ms", "cleanup.policy", "compression.type")
    topics = [names.prompts, names.rollouts, names.steps, names.control]
    for topic, conf in describe_topic_configs(topics + existing_topics(config, [names.inflight]), config).items():
        typer.echo(topic + "  " + "  ".join(f"{k}={conf.get(k)}" for k in keys))
