"""Which Kafka the local broker runs, without starting it. Four behaviours are pinned here:

- the pinned version (infra/kafka/pom.xml) unless ``ROLLSTREAM_KAFKA_VERSION`` or ``kafka_version`` names another,
  3.3.0 or newer (KRaft), and 3.5.0 or newer with ``sasl``; a bad one is named before Maven is asked;
- a 3.x broker is configured without the properties only Kafka 4's coordinators read;
- a data dir keeps the newest Kafka that ran it: a newer one is recorded, an older one refused;
- a version's jar dir is complete for any checkout whose pom, set to that version, is the same: the pinned
  version's marker is the pom's own hash, as before versions were selectable (no re-resolution under a
  broker another checkout runs from that dir).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from rollstream.infra.broker import BrokerError, BrokerSpec, _jars, default_kafka_version, ensure_kafka_jars
from rollstream.infra.broker._files import cluster_id, read_json, write_config
from rollstream.infra.broker._spec import KAFKA_VERSION_ENV, POM, pinned_kafka_version
from rollstream.schemas import ConfigError


def properties(spec: BrokerSpec) -> dict[str, str]:
    text = write_config(spec, node=1).read_text()
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_the_version_is_the_pinned_one_unless_the_env_or_the_spec_names_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KAFKA_VERSION_ENV, raising=False)
    assert pinned_kafka_version().startswith("4.")
    assert default_kafka_version() == pinned_kafka_version() == BrokerSpec(data_dir=tmp_path).kafka_version
    monkeypatch.setenv(KAFKA_VERSION_ENV, "3.3.2")
    assert BrokerSpec(data_dir=tmp_path).kafka_version == "3.3.2"
    assert BrokerSpec(data_dir=tmp_path, kafka_version="3.9.1").kafka_release == (3, 9, 1)


@pytest.mark.parametrize(("version", "says"), [
    ("4.4", "MAJOR.MINOR.PATCH|such as 4.4.0"), ("latest", "such as 4.4.0"), ("3.2.3", "production-ready from 3.3.0"),
    ("2.8.2", "production-ready from 3.3.0")])
def test_a_version_kraft_cannot_run_is_refused_with_its_name(tmp_path: Path, version: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as raised:
        BrokerSpec(data_dir=tmp_path, kafka_version=version)
    assert repr(version) in str(raised.value) and "--kafka-version" in str(raised.value)


def test_sasl_needs_scram_in_kraft(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"sasl=True needs Kafka 3\.5\.0 or newer .*KIP-900"):
        BrokerSpec(data_dir=tmp_path, kafka_version="3.4.1", sasl=True)
    assert BrokerSpec(data_dir=tmp_path, kafka_version="3.5.2", sasl=True).sasl


def test_a_malformed_version_is_named_before_maven_runs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'4.4-SNAPSHOT'"):
        ensure_kafka_jars(tmp_path, version="4.4-SNAPSHOT")
    assert not any(tmp_path.iterdir())


def test_a_3x_broker_gets_no_kafka_4_properties(tmp_path: Path) -> None:
    four = properties(BrokerSpec(data_dir=tmp_path / "4", kafka_version=pinned_kafka_version()))
    three = properties(BrokerSpec(data_dir=tmp_path / "3", kafka_version="3.3.2"))
    only_four = set(four) - set(three)
    assert only_four == {"share.coordinator.state.topic.replication.factor", "share.coordinator.state.topic.min.isr",
                         "group.consumer.min.session.timeout.ms", "group.consumer.session.timeout.ms",
                         "group.consumer.min.heartbeat.interval.ms", "group.consumer.heartbeat.interval.ms",
                         "group.coordinator.append.linger.ms"}
    assert set(three) < set(four) and three["controller.quorum.voters"] == four["controller.quorum.voters"]
    assert three["transaction.state.log.replication.factor"] == "1"


def test_a_data_dir_moves_to_a_newer_kafka_never_back(tmp_path: Path) -> None:
    old = BrokerSpec(data_dir=tmp_path, kafka_version="3.3.2")
    first = cluster_id(old)
    assert read_json(tmp_path / "cluster.json")["kafka_version"] == "3.3.2"
    assert cluster_id(BrokerSpec(data_dir=tmp_path, kafka_version="4.4.0")) == first
    assert read_json(tmp_path / "cluster.json")["kafka_version"] == "4.4.0"
    with pytest.raises(BrokerError, match=r"Kafka 4\.4\.0 ran, and Kafka 3\.3\.2 cannot read.*--kafka-version 4\.4\.0"):
        cluster_id(old)


def test_a_data_dir_from_before_versions_were_kept_starts_with_any(tmp_path: Path) -> None:
    (tmp_path / "cluster.json").write_text('{"cluster_id": "abc", "nodes": 1, "sasl": false}')
    assert cluster_id(BrokerSpec(data_dir=tmp_path, kafka_version="4.4.0")) == "abc"


def test_a_resolved_version_is_reused_by_every_checkout_with_the_same_pom(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_jars.shutil, "which", lambda name: None)  # resolving would fail: Maven "is missing"
    pom = POM.read_bytes()
    as_333 = re.sub(rb"<kafka\.version>[^<]*<", b"<kafka.version>3.3.2<", pom)
    for version, resolved_pom in ((pinned_kafka_version(), pom), ("3.3.2", as_333)):
        root = tmp_path / f"kafka-{version}"
        (root / "libs").mkdir(parents=True)
        (root / "complete").write_text(hashlib.sha256(resolved_pom).hexdigest())
        assert ensure_kafka_jars(tmp_path, version=version) == root / "libs"
    (tmp_path / "kafka-3.3.2" / "complete").write_text(hashlib.sha256(pom).hexdigest())  # the pin's pom: stale
    with pytest.raises(BrokerError, match="Maven"):
        ensure_kafka_jars(tmp_path, version="3.3.2")
