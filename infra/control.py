"""The latest policy version announced on NS.control, for stamping samples (and, later, loading weights).

A thread (``rollstream-control``) reads the compacted control topic from the beginning with an
explicit assignment (no group membership, nothing committed) and keeps the highest `PolicyVersion`.
`current_weight_version` is safe to read from any thread. Engines that report their own version
(SGLang's ``meta_info.weight_version``) win over this one; with neither, samples are stamped 0.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from infra import KafkaConfig
from schemas import DecodeError, PolicyVersion, decode

log = logging.getLogger(__name__)


class ControlWatcher:
    """Follows NS.control. `start` returns at once; `stop` is idempotent and never blocks."""

    def __init__(self, config: KafkaConfig, topic: str, *,
                 on_version: Callable[[PolicyVersion], None] | None = None) -> None:
        self._conf = config.consumer(f"rollstream-control-watch-{uuid.uuid4().hex[:12]}",
                                     {"fetch.wait.max.ms": 200})
        self.topic = topic
        self._on_version = on_version
        self._latest: PolicyVersion | None = None
        self._stop = threading.Event()
        self._caught_up = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def current_weight_version(self) -> int | None:
        latest = self._latest
        return None if latest is None else latest.version

    @property
    def latest(self) -> PolicyVersion | None:
        return self._latest

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollstream-control", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def wait_caught_up(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` until every record present at startup was read; False on timeout."""
        return self._caught_up.wait(timeout_s)

    def _run(self) -> None:
        consumer = Consumer(self._conf)
        try:
            meta = consumer.list_topics(self.topic, timeout=10.0).topics.get(self.topic)
            if meta is None or meta.error is not None:
                log.warning("control topic %s not readable; samples get no policy version from it", self.topic)
                return
            ends = {p: consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=10.0)[1]
                    for p in meta.partitions}
            pending = {p for p, end in ends.items() if end > 0}
            consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in meta.partitions])
            while not self._stop.is_set():
                if not pending:
                    self._caught_up.set()
                msg = consumer.poll(0.2)
                if msg is None or msg.error() is not None:
                    continue
                self._handle(msg.value() or b"", msg.partition(), msg.offset())
                if msg.offset() + 1 >= ends.get(msg.partition(), 0):
                    pending.discard(msg.partition())
        except KafkaException as exc:
            log.warning("control watcher stopped: %s", exc)
        finally:
            self._caught_up.set()  # nothing more will come: do not keep anyone waiting
            consumer.close()

    def _handle(self, value: bytes, partition: int, offset: int) -> None:
        try:
            version = decode(value, PolicyVersion)
        except DecodeError as exc:
            log.warning("skipping undecodable control record: %s", exc.located(self.topic, partition, offset))
            return
        if self._latest is None or version.version > self._latest.version:
            self._latest = version
            log.info("policy version %d announced (weights %s)", version.version, version.weights_path)
            if self._on_version is not None:
                self._on_version(version)
