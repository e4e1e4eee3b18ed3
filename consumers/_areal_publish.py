"""The producer half of the AReaL adapter (`rollstream.consumers.areal`): its settings, and AReaL trajectories
published to NS.rollouts before AReaL's executor sees them.

`RollstreamWorkflow` wraps the user's `RolloutWorkflow`: each trajectory it returns (not None) is encoded
(``rollstream.areal/1``, `rollstream.consumers._areal_codec`) and returned only once the broker acknowledged it
(acks=all, idempotent), stamped with the trainer run it serves (``policy_run``). Nothing is committed here: the
trainer half commits the offsets of what it trained.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal.api import RolloutWorkflow
from rollstream.consumers._areal_codec import encode_trajectory
from rollstream.consumers._consumer import DEFAULT_GROUP
from rollstream.consumers._verl_publish import AckedPublisher
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.infra.config import ConfigError
from rollstream.schemas import encode, make_group_id


@dataclass(frozen=True)
class ArealSettings:
    """rollstream's side of an AReaL run. `of` reads the environment."""

    bootstrap_servers: str | None = None
    kafka_config: str | None = None
    namespace: str = "rollstream"
    group: str = DEFAULT_GROUP
    take_timeout_s: float | None = None  # None: wait
    poll_interval_s: float = 0.5
    lag_refresh_s: float = 0.5
    kafka_timeout_s: float = 30.0
    producer_id: str = field(default_factory=lambda: f"areal-{uuid.uuid4().hex[:8]}")

    def __post_init__(self) -> None:
        if not self.namespace or not self.group:
            raise ConfigError(f"namespace={self.namespace!r} and group={self.group!r} must be non-empty")
        if self.poll_interval_s <= 0 or self.kafka_timeout_s <= 0 or self.lag_refresh_s < 0:
            raise ConfigError(f"poll_interval_s={self.poll_interval_s} and kafka_timeout_s={self.kafka_timeout_s} "
                              f"must be > 0, lag_refresh_s={self.lag_refresh_s} >= 0")

    @classmethod
    def of(cls, env: dict[str, str] | None = None) -> ArealSettings:
        """From ``ROLLSTREAM_BOOTSTRAP_SERVERS``, ``ROLLSTREAM_KAFKA_CONFIG``, ``ROLLSTREAM_NAMESPACE`` and
        ``ROLLSTREAM_TRAINER_GROUP`` (`env`, default the process environment); unset ones keep their defaults."""
        source = os.environ if env is None else env
        return cls(bootstrap_servers=source.get("ROLLSTREAM_BOOTSTRAP_SERVERS") or None,
                   kafka_config=source.get("ROLLSTREAM_KAFKA_CONFIG") or None,
                   namespace=source.get("ROLLSTREAM_NAMESPACE") or cls.namespace,
                   group=source.get("ROLLSTREAM_TRAINER_GROUP") or cls.group)

    def kafka(self, client_id: str) -> KafkaConfig:
        return KafkaConfig.load(self.bootstrap_servers, Path(self.kafka_config) if self.kafka_config else None,
                                client_id=client_id)


class TrajectoryPublisher:
    """Publishes AReaL trajectories to NS.rollouts, any number in flight (`AckedPublisher`). Thread-safe; no
    network before the first publish. `policy_run`: the trainer run stamped on each group (set by the trainer)."""

    def __init__(self, settings: ArealSettings) -> None:
        self.settings = settings
        kafka = settings.kafka(settings.producer_id)
        self._publisher = AckedPublisher(kafka.producer(), TopicNames(settings.namespace).rollouts,
                                         settings.kafka_timeout_s)
        self.policy_run = 0
        self._count = 0

    def send(self, traj: dict[str, Any]) -> tuple[str, concurrent.futures.Future[None]]:
        """Encode and queue `traj` (never waits for the broker); returns its group id and a future resolved
        when acknowledged, or failed with `PublishFailed`.

        Raises:
            ArealEncodingError: `traj` cannot be carried. PublishFailed: librdkafka refused it.
        """
        self._count += 1
        key = f"{self.settings.producer_id}.r{self.policy_run}.{self._count}"
        group = encode_trajectory(traj, group_id=make_group_id(key, 0), prompt_id=key,
                                  producer_id=self.settings.producer_id, policy_run=self.policy_run)
        return group.group_id, self._publisher.send(group.group_id, encode(group))

    async def publish(self, traj: dict[str, Any]) -> str:
        """Publish `traj`; returns its group id once the broker acknowledged it (at most ``kafka_timeout_s``).

        Raises:
            PublishFailed: not acknowledged in time; ArealEncodingError.
        """
        group_id, acked = self.send(traj)
        await asyncio.wrap_future(acked)
        return group_id

    def close(self) -> None:
        """Wait up to ``kafka_timeout_s`` for what is in flight, then stop. Idempotent."""
        self._publisher.close(self.settings.kafka_timeout_s)


class RollstreamWorkflow(RolloutWorkflow):
    """AReaL's `RolloutWorkflow` `inner`, whose trajectories are published before they are returned.

    ``arun_episode`` returns what `inner` returned (None: rejected, nothing published) once the broker
    acknowledged it. Raises what `inner` raises, `PublishFailed` or `ArealEncodingError` (AReaL's executor
    counts a raising episode as rejected)."""

    def __init__(self, inner: Any, publisher: TrajectoryPublisher) -> None:
        self.inner, self.publisher = inner, publisher

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        traj = await self.inner.arun_episode(engine, data)
        if traj is None:
            return None
        await self.publisher.publish(traj)
        return traj
