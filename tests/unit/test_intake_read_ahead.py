"""How far intake's librdkafka client may read NS.prompts ahead (`rollstream.producers.intake._read_ahead`), without
a broker: a few record batches per fetch, whatever the rollout size the consumer defaults are sized
for, while a larger prompt is still received whole and an ``intake_overrides`` property still wins. The read-ahead
itself, against a broker: tests/integration/test_intake_read_ahead.py.
"""

from __future__ import annotations

import pytest
from rollstream.infra import KafkaConfig
from rollstream.producers.gate import LagGate
from rollstream.producers.intake import Intake
from rollstream.producers.metrics import ProducerMetrics


def _conf(kafka: KafkaConfig, overrides: dict[str, object] | None = None) -> dict[str, object]:
    metrics = ProducerMetrics()
    gate = LagGate(kafka, "trainer", "ns.rollouts", max_lag=1, interval_s=1.0, metrics=metrics)
    intake = Intake(kafka, "ns.prompts", "ns.producers", gate=gate, metrics=metrics, prefetch=2, overrides=overrides)
    conf = dict(intake._client._conf)
    intake._client.open().close()  # librdkafka accepts it
    return conf


@pytest.mark.parametrize("max_message_kib", [1, 100, 1024, 64 << 10, 512 << 10])
def test_intake_reads_little_ahead_whatever_the_record_size(max_message_kib: int) -> None:
    kafka = KafkaConfig(bootstrap_servers="127.0.0.1:1", max_message_bytes=max_message_kib << 10)
    conf = _conf(kafka)
    assert conf["queued.min.messages"] == 1000
    assert conf["max.partition.fetch.bytes"] <= 64 << 10  # the 64 MiB default fetched 4 MiB per partition
    assert conf["fetch.max.bytes"] <= 256 << 10
    assert conf["fetch.max.bytes"] + 512 <= conf["receive.message.max.bytes"]  # librdkafka's own rule
    assert conf["receive.message.max.bytes"] > kafka.max_message_bytes  # the largest prompt still comes whole


def test_intake_overrides_still_win() -> None:
    conf = _conf(KafkaConfig(bootstrap_servers="127.0.0.1:1"), {"queued.max.messages.kbytes": 8192,
                                                                "max.partition.fetch.bytes": 1 << 20})
    assert conf["queued.max.messages.kbytes"] == 8192
    assert conf["max.partition.fetch.bytes"] == 1 << 20
