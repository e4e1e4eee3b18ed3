"""`rollstream acls`: print (or apply) the least-privilege ACLs of a producer and a trainer principal."""

from __future__ import annotations

from typing import Annotated

import typer

from rollstream.cli._common import (
    DEFAULT_NAMESPACE,
    DEFAULT_TRAINER_GROUP,
    BootstrapOpt,
    KafkaConfigOpt,
    NamespaceOpt,
    examples,
    kafka_config,
)
from rollstream.infra import apply_acls, plan_acls

HELP = "\n\n".join([
    "Print the ACLs a producer and a trainer principal need on a namespace; --apply creates them.",
    "Nothing else is needed: internal readers (manifests, replay, audit, lag) use no consumer group of their own. "
    "Applying needs a principal allowed to alter ACLs (the SASL broker's admin.properties, via --kafka-config).",
    "The trainer's two transactional ids fence a replaced trainer: rollstream.NS.trainer-run (trainer runs, "
    "PolicyAnnouncer) and rollstream.NS.group-run.GROUP (every RolloutConsumer and rollstream take of "
    "--trainer-group fences the group's older ones; run this once per trainer group). A consumer with "
    "fence=False (take --no-fence) needs no group-run id, and is not fenced.",
])


def acls(
    producer_principal: Annotated[str, typer.Option(help="The producers' principal: User:NAME (or NAME).")],
    trainer_principal: Annotated[str, typer.Option(help="The trainer's principal: User:NAME (or NAME).")],
    namespace: NamespaceOpt = DEFAULT_NAMESPACE,
    trainer_group: Annotated[str, typer.Option(
        "--trainer-group", "--group", "-g", envvar="ROLLSTREAM_TRAINER_GROUP",
        help="The trainer's consumer group id.")] = DEFAULT_TRAINER_GROUP,
    intake_group: Annotated[str | None, typer.Option(
        help="The producers' consumer group on NS.prompts (default NS.producers).")] = None,
    apply: Annotated[bool, typer.Option("--apply", help="Create the ACLs (idempotent) instead of printing only.")]
    = False,
    bootstrap_servers: BootstrapOpt = None,
    kafka_config_file: KafkaConfigOpt = None,
) -> None:
    rules = plan_acls(namespace, producer_principal, trainer_principal, trainer_group=trainer_group,
                      intake_group=intake_group)
    for rule in rules:
        typer.echo(f"ALLOW {rule}")
    if apply:
        apply_acls(rules, kafka_config(bootstrap_servers, kafka_config_file, "rollstream-acls"))
        typer.echo(f"applied {len(rules)} ACLs")


def register(root: typer.Typer) -> None:
    """Add the `acls` command to the root app."""
    root.command("acls", help=HELP, epilog=examples(
        "rollstream acls --namespace demo --producer-principal User:producer --trainer-principal User:trainer",
        "rollstream acls --namespace demo --producer-principal User:producer --trainer-principal User:trainer "
        "--apply --kafka-config admin.properties"))(acls)
