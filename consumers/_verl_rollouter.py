"""The rollouter's side of `rollstream.consumers.verl`: verl's ``MessageQueueClient.put_sample`` on NS.rollouts.

`VerlRolloutQueue` publishes each RolloutSample as one ScoredGroup (`_verl_codec`), keyed by its group id,
through an idempotent producer (acks=all), and answers verl's "queue size" with the trainer group's lag,
read at most every ``lag_refresh_s`` (verl asks before every sample it starts, fully_async_rollouter.py:907).
Publishing and lag reads run in threads of their own, so none blocks the rollouter's event loop or waits for
another: ``rollstream-verl-encode`` (`ENCODE_THREADS` threads) unpickles what verl hands over, encodes the record
and produces it, the CPU of a put (~1 ms for 8 x 3072 tokens) off verl's loop, concurrent puts side by side
where torch, numpy and librdkafka release the interpreter lock; ``rollstream-verl-publish`` drains and sends the
end marker, ``rollstream-verl-acks`` serves the acknowledgements, ``rollstream-verl-lag`` reads the lag. Every put
verl runs concurrently is in flight at once (`_verl_publish`); each returns only when the broker acknowledged its
own sample, so a sample verl counts as produced is durable and one that is not acknowledged when the rollouter
dies was never counted. The end marker goes after every sample put before it: its put waits for their encoding
and produce, then for their acknowledgements.

Every group is stamped with the trainer run the rollouter serves (`VerlRolloutQueue.serve_run`: the verl trainer
hands its run over at each weight sync, the first before the rollouter generates anything), so a resumed trainer
(a newer run) tells this run's groups from a dead run's whatever their param versions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from typing import Any

import numpy as np
from rollstream.consumers._verl_codec import END_KEY, RolloutSample, encode_sample
from rollstream.consumers._verl_publish import AckedPublisher, PublishFailed
from rollstream.infra import TopicNames
from rollstream.infra.lag import LagReader
from rollstream.infra.threads import ThreadPool
from rollstream.schemas import ConfigError, LifecycleError, Samples, ScoredGroup, encode, now_ms

log = logging.getLogger(__name__)
_GRACE_S = 1.0  # librdkafka answers within kafka_timeout_s of the produce (message.timeout.ms); past the put's
# deadline by more than this, the put gives up (only when waiting for room in librdkafka's queue took long)
ENCODE_THREADS = 2  # puts unpickled, encoded and produced side by side

__all__ = ["PublishFailed", "VerlRolloutQueue", "end_marker"]


class VerlRolloutQueue:
    """verl's ``MessageQueueClient`` as the rollouter uses it (``put_sample``, ``get_queue_size``,
    ``get_statistics``). The async methods never block the event loop. No network in ``__init__``."""

    def __init__(self, settings: Any, *, producer_id: str | None = None) -> None:  # settings: VerlSettings
        self.settings = settings
        self.names = TopicNames(settings.namespace)
        self.producer_id = producer_id or f"verl-rollouter-{uuid.uuid4().hex[:8]}"
        self._kafka = settings.kafka(self.producer_id)
        self._publisher = AckedPublisher(self._kafka.producer(), self.names.rollouts, settings.kafka_timeout_s)
        self._lag_reader = LagReader(self._kafka)
        self._encoding = ThreadPool("rollstream-verl-encode", ENCODE_THREADS)
        self._publish = ThreadPool("rollstream-verl-publish", 1)
        self._producing: set[asyncio.Future[tuple[str, concurrent.futures.Future[None]]]] = set()  # the loop's only
        self._lags = ThreadPool("rollstream-verl-lag", 1)
        self._lag: tuple[float, int] | None = None  # (monotonic time read, lag)
        self.published = 0
        self.policy_run: int | None = None  # the trainer run served (`serve_run`)

    def serve_run(self, run: int) -> None:
        """Stamp trainer run `run` on every group published from now on (the verl trainer's, once it began).
        Does not block. Raises ConfigError for a run below 1."""
        if run < 1:
            raise ConfigError(f"serve_run({run}): trainer runs are numbered from 1 (rollstream.infra.runs)")
        self.policy_run = run

    async def put_sample(self, sample: bytes | RolloutSample | None) -> bool:
        """Publish `sample` (verl passes ``ray.cloudpickle`` bytes of a RolloutSample, fully_async_rollouter.py:
        1007; None: the rollouter's end of data, published as the end marker, after every sample put before
        it is acknowledged). Returns True once the broker acknowledged it (acks=all): never False, nothing is
        dropped. Any number of puts may run concurrently, all in flight at once; each waits for its own
        acknowledgement only, at most ``kafka_timeout_s``.

        Raises:
            PublishFailed: no acknowledgement within ``kafka_timeout_s``; VerlEncodingError.
            LifecycleError: no trainer run to stamp yet (`serve_run` was not called): nothing published.
        """
        deadline = time.monotonic() + self.settings.kafka_timeout_s  # one for the put: room, then acknowledgement
        if sample is None:
            # after every sample put before it: their encoding and produce, then their acknowledgements
            if self._producing:  # asyncio.wait, not gather: cancelling this put must not cancel theirs
                await asyncio.wait(set(self._producing))
            await self._publish.run(self._publisher.drain, self.settings.kafka_timeout_s)
            deadline = time.monotonic() + self.settings.kafka_timeout_s  # the marker's own, after the samples
            group = end_marker(self.producer_id)
            key, acked = group.group_id, await self._publish.run(self._send, group)
        else:
            if self.policy_run is None:
                raise LifecycleError("verl's rollouter has no trainer run to stamp on its samples: run verl through "
                                     "rollstream.consumers.verl (its trainer hands its run over at the first weight "
                                     "sync, before the rollouter generates), or call serve_run(run)")
            producing = asyncio.wrap_future(self._encoding.submit(self._encode_and_send, sample, self.policy_run))
            self._producing.add(producing)
            try:
                key, acked = await producing
            finally:
                self._producing.discard(producing)
        try:
            await asyncio.wait_for(asyncio.wrap_future(acked), max(0.0, deadline - time.monotonic()) + _GRACE_S)
        except TimeoutError as exc:
            raise PublishFailed(f"verl sample {key} to {self.names.rollouts}: no acknowledgement in "
                                f"{self.settings.kafka_timeout_s} s (it may still land: the trainer's dedupe of "
                                "group ids keeps it from being trained twice)", retriable=True) from exc
        self.published += 1
        return True

    async def get_queue_size(self) -> int:
        """The trainer group's lag on NS.rollouts (published, not committed), at most ``lag_refresh_s`` old."""
        return await self._lags.run(self._read_lag)

    def get_queue_size_sync(self) -> int:
        return self._lags.submit(self._read_lag).result()

    async def get_statistics(self) -> dict[str, Any]:
        return {"queue_size": await self.get_queue_size(), "total_produced": self.published, "total_consumed": 0,
                "dropped_samples": 0, "max_queue_size": 0}

    async def clear_queue(self) -> None:
        """Nothing to clear: published groups stay on NS.rollouts (on purpose)."""

    async def shutdown(self) -> None:
        self.close()

    def close(self) -> None:
        """Wait up to ``kafka_timeout_s`` for what is in flight, then stop. Idempotent."""
        self._publisher.close(self.settings.kafka_timeout_s)
        self._lags.submit(self._lag_reader.close).result()
        self._encoding.retire()
        self._publish.retire()
        self._lags.retire()

    def _send(self, group: ScoredGroup) -> concurrent.futures.Future[None]:
        return self._publisher.send(group.group_id, encode(group))

    def _encode_and_send(self, sample: bytes | RolloutSample,
                         policy_run: int) -> tuple[str, concurrent.futures.Future[None]]:
        """In ``rollstream-verl-encode``: `sample` produced as its record; (its key, its acknowledgement)."""
        import ray

        # verl pickled it in this process a moment ago; what goes on the wire is the Avro record
        rs = ray.cloudpickle.loads(sample) if isinstance(sample, bytes) else sample
        group = encode_sample(rs, producer_id=self.producer_id, policy_run=policy_run)
        return group.group_id, self._send(group)

    def _read_lag(self) -> int:
        now = time.monotonic()
        if self._lag is None or now - self._lag[0] >= self.settings.lag_refresh_s:
            lag = self._lag_reader.group_lag(self.settings.group, self.names.rollouts,
                                             timeout=min(10.0, self.settings.kafka_timeout_s)).total
            self._lag = (now, lag)
        return self._lag[1]


def end_marker(producer_id: str) -> ScoredGroup:
    """The record that says verl's rollouter finished its data: a failed group the trainer filters as
    ``end_of_stream`` (its own group id each time, so dedupe never hides it)."""
    at = now_ms()
    return ScoredGroup(group_id=f"verl-end-{producer_id}-{at}#0", prompt_id=f"verl-end-{producer_id}", epoch=0,
                       prompt_tokens=np.zeros(0, dtype=np.int32),
                       samples=Samples(), started_at_ms=at, finished_at_ms=at, producer_id=producer_id,
                       status="failed", error="verl's rollouter finished its data (end of stream)",
                       metadata={END_KEY: "1"})
