"""Startup checks that turn the usual first-run mistakes into one clear, bounded error."""

from __future__ import annotations

from collections.abc import Sequence

from confluent_kafka import KafkaException

from infra import BOOTSTRAP_ENV, KafkaConfig, open_admin
from schemas import RollstreamError


def check_cluster(config: KafkaConfig, topics: Sequence[str], namespace: str, *, timeout_s: float) -> None:
    """Verify the broker answers within `timeout_s` and every topic in `topics` exists. Blocks; call off-loop.

    Raises:
        RollstreamError (retriable): the broker did not answer; the message names the address and the fix.
        RollstreamError: a topic is missing; the message says to run ``rollstream topics create``.
    """
    # log_level 0: librdkafka's own connection-refused lines would repeat what the error below says.
    admin = open_admin(config.admin({"log_level": 0}))
    try:
        metadata = admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise RollstreamError(
            f"cannot reach Kafka at {config.bootstrap_servers} within {timeout_s:g} s ({exc.args[0].str()}); "
            f"start one (rollstream broker start) or set {BOOTSTRAP_ENV} / --bootstrap-servers to a running "
            "broker", retriable=True) from exc
    missing = [t for t in topics if t not in metadata.topics]
    if missing:
        raise RollstreamError(f"topic(s) {', '.join(missing)} do not exist on {config.bootstrap_servers}: "
                              f"run 'rollstream topics create --namespace {namespace}' first")
