"""The one root exception of rollstream and the errors every layer shares.

`schemas` is the bottom of the dependency graph, so the root lives here and every other package
re-exports it. Each error carries enough to act on: where it happened (topic / partition / offset
when known) and whether retrying can help (`retriable`, as aiokafka does).
"""

from __future__ import annotations


class RollstreamError(Exception):
    """Root of every error rollstream raises on purpose.

    Attributes:
        retriable: True when the same call may succeed later without any change by the user
            (a broker that is still starting, a timeout); False when something must be fixed first.
    """

    retriable: bool = False

    def __init__(self, message: str, *, retriable: bool | None = None) -> None:
        super().__init__(message)
        if retriable is not None:
            self.retriable = retriable


class ConfigError(RollstreamError):
    """A setting is missing, unknown or out of range; the message names it and the fix."""


class LifecycleError(RollstreamError):
    """A call out of order on a client: before ``start()``, after ``close()``, or a second ``run()``; the
    message names the call that has to come first (or says to build a new object)."""


class SchemaError(RollstreamError):
    """A record cannot be encoded or decoded.

    Attributes:
        topic, partition, offset: where the bytes came from, when they came from Kafka.
        raw: the offending bytes (decode errors), as confluent's ``ConsumeError.kafka_message``.
    """

    def __init__(
        self,
        message: str,
        *,
        raw: bytes | None = None,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(message)
        self.raw = raw
        self.topic = topic
        self.partition = partition
        self.offset = offset

    def located(self, topic: str, partition: int, offset: int) -> SchemaError:
        """Return the same error, annotated with the Kafka position of the bad bytes."""
        self.topic, self.partition, self.offset = topic, partition, offset
        self.args = (f"{self.args[0]} (at {topic}[{partition}]@{offset})",)
        return self


class DecodeError(SchemaError):
    """Bytes are not a rollstream record: bad header, truncated body, wrong record type."""


class UnknownSchemaError(DecodeError):
    """The bytes carry a schema fingerprint this version of rollstream does not know."""


class InvalidRecordError(SchemaError):
    """A record does not fit its schema (wrong type, missing field) and cannot be encoded."""
