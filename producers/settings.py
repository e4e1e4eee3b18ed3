"""`ProducerSettings`: everything a rollout producer is configured with, typed, frozen and validated; the
engine's own options are `EngineSettings`' (`rollstream.producers.engines.options`), grouped per engine."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from rollstream.infra import DEFAULT_TRAINER_GROUP, TopicNames
from rollstream.infra.group_protocol import GroupProtocol, check_group_protocol
from rollstream.producers.engines._retry import DEFAULT_GROUP_TIMEOUT_S
from rollstream.producers.engines.base import EngineError, SamplingParams
from rollstream.schemas import ConfigError

Backpressure = Literal["pushed", "poll"]
BACKPRESSURE: tuple[Backpressure, ...] = ("pushed", "poll")


@dataclass(frozen=True)
class ProducerSettings:
    """How a producer takes prompts, generates and publishes.

    Attributes:
        namespace: topic namespace (NS.prompts in, NS.rollouts out, NS.control for policy versions).
        n_samples: completions per prompt (the group size).
        concurrency: groups generated at once.
        max_lag: the fleet's max lag (give every producer of a trainer group the same): pause intake while the
            trainer's lag on NS.rollouts exceeds it, or while this producer's own groups the trainer has not
            committed exceed its share of it (`rollstream.producers._share`), so the lag stays within max_lag +
            every producer's concurrency for any number of producers (default: concurrency).
        trainer_group: the trainer's consumer group whose lag is watched.
        intake_group: consumer group of the producers on NS.prompts (default ``{namespace}.producers``).
        producer_id: stable identity: stamped on groups, and the static ``group.instance.id`` so a
            restarted producer gets its partitions back at once. None: ``host-pid``, dynamic membership.
        exit_when_idle_s: exit once for this long there was no prompt to take while intake was not
            paused by backpressure, everything taken is published and committed, and no partition of
            NS.prompts holds prompts the intake group has not committed (another producer's unfinished
            prompts may still come to this one).
        max_new_tokens, temperature, top_p, sampling_extra: sampling parameters (SGLang names).
        generate_attempts: whole-generation tries of a group, within its deadline, when the engine raises a
            retriable error it did not retry itself (a custom generate function raised); the HTTP engines
            retry their requests themselves (`RetryPolicy`), within the same deadline.
        max_attempts: attempts per prompt across the fleet, stamped on every group: a group the trainer
            finds stale, or one that failed for a passing reason (engine timeout, server restart), has its
            prompt requeued on NS.prompts by the trainer while ``attempt + 1 < max_attempts``; 1: never.
        generate_timeout_s: the group's one deadline (``--group-timeout``): its generation, with every
            engine retry, continuation of a partial rollout and backoff, and its scoring must end within it,
            with any engine (a custom generate function too). Retries spend it and never extend it; an HTTP
            request waits at most min(the engine's request timeout, what is left). Past it the group is
            published as failed, marked retriable (the trainer may requeue its prompt). None: no limit.
        retry_backoff_s: first backoff between those tries (doubles, with jitter, up to 10 s).
        user_threads: threads for sync generate and reward functions (``rollstream-user``, their own: a hung
            one holds its own thread, never the producer's). None: `concurrency`.
        backpressure: how the lag gate learns the trainer's lag: ``pushed`` follows the position the
            trainer's `RolloutConsumer` publishes on NS.control after every commit (within milliseconds,
            one record per trainer step whatever the number of producers) and, once one came, reads the
            lag itself only when none came for `lag_fallback_s` (until the first, for a trainer that
            publishes nothing, every `lag_interval_s`); ``poll`` reads it every `lag_interval_s`.
        lag_interval_s: how often the trainer lag is read when no pushed position comes.
        lag_fallback_s: with pushed positions, the lag is read only after this long without one.
        commit_interval_s: how often acknowledged prompt offsets are committed.
        drain_timeout_s: on stop, how long in-flight groups may take to finish and publish.
        drain_on_revoke_s: on a rebalance, how long in-flight groups of the prompt partitions this producer
            gives up may take to finish and commit before the partitions move (0: at once; their next owner
            then generates them again, duplicates the trainer skips).
        startup_timeout_s: how long to wait for the broker at startup before a clear error.
        session_timeout_s: consumer-group session timeout: how soon a dead producer's prompts move. Under the
            consumer protocol the broker keeps the session: it is set as the intake group's own config
            (``consumer.session.timeout.ms``) where the broker allows it, else the broker's default applies.
        group_protocol: the intake group's rebalance protocol (``--group-protocol``): ``classic``
            (cooperative-sticky, assigned by a member), ``consumer`` (KIP-848, assigned by the broker; Kafka
            >= 4.0), or ``auto`` (decided once at start: the consumer protocol where the broker serves it,
            classic otherwise; `rollstream.infra.group_protocol`). A static member (`producer_id`) restarted
            after a crash takes its partitions back at once only under classic: KIP-848 refuses a second member
            with the same ``group.instance.id`` until the first one's session expired.
        metrics_port: serve Prometheus metrics on this port (None: no server; 0: any free port).
        summary_interval_s: period of the one-line log summary (0: never).
        watch_control: follow NS.control for the current policy version.
        producer_overrides, intake_overrides: extra librdkafka properties for the rollout producer
            and the prompt consumer; rollstream's guarantees still win (see `KafkaConfig`).
        checkpoint_interval_s: in-flight checkpoints on NS.inflight (`rollstream.producers._inflight`), so that
            the producer that takes a prompt over after a crash continues its samples: an engine that saves
            progress checkpoints each sample: an ``--environment`` episode at every turn boundary and when it
            ends, a single generation on vLLM or SGLang (streamed) every this many seconds and when it
            finishes (not at all when it finishes within the first interval). Default 30; 0: no checkpoints
            (and none resumed, nothing streamed).
        checkpoint_max_staleness: a checkpoint whose oldest token is more than this many policy versions behind
            the one followed is discarded and its sample generated again (None: any age; a checkpoint of
            another trainer run is always discarded).
    """

    namespace: str = "rollstream"
    n_samples: int = 4
    concurrency: int = 8
    max_lag: int | None = None
    trainer_group: str = DEFAULT_TRAINER_GROUP
    intake_group: str | None = None
    producer_id: str | None = None
    exit_when_idle_s: float | None = None
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    sampling_extra: Mapping[str, Any] = field(default_factory=dict)
    generate_attempts: int = 3
    max_attempts: int = 3
    generate_timeout_s: float | None = DEFAULT_GROUP_TIMEOUT_S
    retry_backoff_s: float = 0.5
    user_threads: int | None = None
    backpressure: Backpressure = "pushed"
    lag_interval_s: float = 0.5
    lag_fallback_s: float = 5.0
    commit_interval_s: float = 0.2
    drain_timeout_s: float = 60.0
    drain_on_revoke_s: float = 30.0
    startup_timeout_s: float = 15.0
    session_timeout_s: float = 10.0
    group_protocol: GroupProtocol = "auto"
    metrics_port: int | None = None
    summary_interval_s: float = 30.0
    watch_control: bool = True
    producer_overrides: Mapping[str, Any] = field(default_factory=dict)
    intake_overrides: Mapping[str, Any] = field(default_factory=dict)
    checkpoint_interval_s: float = 30.0
    checkpoint_max_staleness: int | None = None

    def __post_init__(self) -> None:
        TopicNames(self.namespace)  # validates the namespace
        for name in ("n_samples", "concurrency", "generate_attempts", "max_attempts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.user_threads is not None and self.user_threads < 1:
            raise ConfigError(f"user_threads={self.user_threads} must be >= 1 (or None: concurrency)")
        check_group_protocol(self.group_protocol)
        if self.max_lag is not None and self.max_lag < 0:
            raise ConfigError(f"max_lag={self.max_lag} must be >= 0")
        if self.checkpoint_max_staleness is not None and self.checkpoint_max_staleness < 0:
            raise ConfigError(f"checkpoint_max_staleness={self.checkpoint_max_staleness} must be >= 0 (or None)")
        for name in ("retry_backoff_s", "drain_timeout_s", "drain_on_revoke_s", "summary_interval_s",
                     "checkpoint_interval_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        if self.backpressure not in BACKPRESSURE:
            raise ConfigError(f"backpressure={self.backpressure!r}: use pushed (follow the trainer's position on "
                              "NS.control) or poll (read the lag every lag_interval_s)")
        for name in ("lag_interval_s", "lag_fallback_s", "commit_interval_s", "startup_timeout_s",
                     "session_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
        if self.generate_timeout_s is not None and not self.generate_timeout_s > 0:
            raise ConfigError(f"generate_timeout_s={self.generate_timeout_s} must be > 0 (or None for no limit)")
        if self.exit_when_idle_s is not None and self.exit_when_idle_s <= 0:
            raise ConfigError(f"exit_when_idle_s={self.exit_when_idle_s} must be > 0 (or None to run forever)")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port={self.metrics_port} is not a TCP port")
        if not self.trainer_group:
            raise ConfigError("trainer_group must not be empty")
        for name in ("sampling_extra", "producer_overrides", "intake_overrides"):
            object.__setattr__(self, name, dict(getattr(self, name)))
        self.sampling()  # validates the sampling parameters

    @property
    def topics(self) -> TopicNames:
        return TopicNames(self.namespace)

    @property
    def effective_max_lag(self) -> int:
        return self.concurrency if self.max_lag is None else self.max_lag

    @property
    def effective_user_threads(self) -> int:
        return self.concurrency if self.user_threads is None else self.user_threads

    @property
    def effective_intake_group(self) -> str:
        return self.intake_group or TopicNames(self.namespace).producer_group

    @property
    def effective_producer_id(self) -> str:
        return self.producer_id or f"{socket.gethostname()}-{os.getpid()}"

    def sampling(self) -> SamplingParams:
        """The sampling parameters engines receive. Raises ConfigError when out of range."""
        try:
            return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                  top_p=self.top_p, extra=self.sampling_extra)
        except EngineError as exc:
            raise ConfigError(str(exc)) from exc
