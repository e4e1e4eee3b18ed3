"""Every confluent-kafka client in rollstream is opened here, from a config dict built by `KafkaConfig`.

librdkafka checks the properties when a client is created: an unknown property or a bad value (often
from a ``--kafka-config`` file) raises `KafkaException` there. These functions turn that into a
`ConfigError` that names the property and what to do, so callers of the Python API see rollstream's
root exception, as CLI users do. Creating a client does not block and does not connect.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient
from rollstream.schemas import ConfigError

_C = TypeVar("_C")


def open_producer(conf: Mapping[str, Any]) -> Producer:
    """A producer for `conf` (from `KafkaConfig.producer`). Raises ConfigError on a bad property."""
    return _open("producer", Producer, conf)


def open_consumer(conf: Mapping[str, Any]) -> Consumer:
    """A consumer for `conf` (from `KafkaConfig.consumer`). Raises ConfigError on a bad property."""
    return _open("consumer", Consumer, conf)


def open_admin(conf: Mapping[str, Any]) -> AdminClient:
    """An admin client for `conf` (from `KafkaConfig.admin`). Raises ConfigError on a bad property."""
    return _open("admin client", AdminClient, conf)


def _open(kind: str, factory: Callable[[dict[str, Any]], _C], conf: Mapping[str, Any]) -> _C:
    try:
        return factory(dict(conf))
    except KafkaException as exc:
        reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
        raise ConfigError(f"cannot create a Kafka {kind}: {reason}. Fix or remove that property (from "
                          "--kafka-config or the code's overrides); librdkafka's CONFIGURATION.md lists "
                          "the valid ones") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cannot create a Kafka {kind}: {exc}") from exc
