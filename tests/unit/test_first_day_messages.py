"""The words of the first-day errors, without a broker: a namespace without topics lists the closest namespaces
first and caps the list; a producer's committed state carries the trainer group it gates on (and reads an older
state without one); a trainer group the producers do not follow is the first cause; an oversize group names its
size, the limit and both fixes; `topics alter` without the right to alter says who may. The broker-side paths:
tests/integration/test_first_day_errors.py."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from rollstream.consumers.forensics._status_causes import causes_of
from rollstream.consumers.forensics._status_report import ProducerInfo, ProducersReport
from rollstream.infra import KafkaConfig, KafkaIOError, MissingNamespaceError, TopicNames, alter_topics
from rollstream.infra import topics as topics_module
from rollstream.infra.kafka_errors import missing_namespace_error
from rollstream.infra.producer_state import ProducerState
from rollstream.producers._groups import oversize_error
from rollstream.schemas import now_ms


def test_missing_namespace_lists_closest_first_and_caps_the_list() -> None:
    existing = sorted([f"team-{i}" for i in range(20)] + ["demo"])
    err = missing_namespace_error("dem0", "broker:9092", existing)
    assert isinstance(err, MissingNamespaceError) and err.existing == existing and not err.retriable
    assert str(err).startswith("namespace dem0 has no topics on broker:9092 (namespaces there: demo, team-0, ")
    assert "and 16 more): did you mean --namespace demo? Else run 'rollstream topics create --namespace dem0'" \
        in str(err)
    assert "no namespace has topics there yet" in str(missing_namespace_error("x", "b:1", []))


def test_producer_state_carries_its_trainer_group() -> None:
    state = ProducerState("p1", paused=True, since_ms=1, max_lag=8, updated_at_ms=2, trainer_group="mine")
    assert ProducerState.from_metadata(state.to_metadata()) == state
    older = ProducerState("p1", paused=True, since_ms=1, max_lag=8, updated_at_ms=2)
    assert '"tg"' not in older.to_metadata() and ProducerState.from_metadata(older.to_metadata()) == older


def _producers(*groups: str | None) -> ProducersReport:
    members = tuple(ProducerInfo(f"p{i}", f"m{i}", None, None, (i,), ProducerState(
        f"p{i}", paused=True, since_ms=now_ms(), max_lag=2, updated_at_ms=now_ms(), trainer_group=g))
        for i, g in enumerate(groups))
    return ProducersReport("ns.producers", "STABLE", members, ())


def test_a_trainer_group_the_producers_do_not_follow_is_the_first_cause() -> None:
    names = TopicNames("ns")
    causes = causes_of(names, "ns.producers", _producers("theirs", None), None, None, trainer_group="mine")
    assert causes[0].code == "trainer_group_mismatch" and causes[0].blocking
    assert "gate on trainer group theirs, but this trainer commits as mine" in causes[0].message
    assert "--trainer-group mine" in causes[0].message and "--group theirs" in causes[0].message
    same = causes_of(names, "ns.producers", _producers("mine", None), None, None, trainer_group="mine")
    assert "trainer_group_mismatch" not in {c.code for c in same}


def test_an_oversize_group_names_size_limit_and_both_fixes() -> None:
    text = oversize_error(3 << 20, 1 << 20, "ns")
    assert text.startswith(f"group record of {3 << 20} bytes exceeds max_message_bytes={1 << 20} (max.message.bytes "
                           "of ns.rollouts): raise it to 4 MiB")
    assert "'rollstream topics alter --namespace ns --max-message-mib 4' and restart the producers" in text
    assert "--n-samples" in text


class _RefusingAdmin:
    """An admin client whose every alteration is refused as not authorized."""

    def incremental_alter_configs(self, resources: list[Any], **_: Any) -> dict[Any, Future[None]]:
        out = {}
        for resource in resources:
            future: Future[None] = Future()
            future.set_exception(KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)))
            out[resource] = future
        return out


def test_alter_without_the_right_to_says_it_takes_an_admin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topics_module, "describe_topic_configs",
                        lambda names, *_, **__: {n: {"max.message.bytes": "8192"} for n in names})
    monkeypatch.setattr(topics_module, "open_admin", lambda _conf: _RefusingAdmin())
    monkeypatch.setattr(topics_module, "existing_topics", lambda _config, names, *_: names)
    with pytest.raises(KafkaIOError) as caught:
        alter_topics(TopicNames("ns"), KafkaConfig(bootstrap_servers="b:1"), max_message_bytes=1 << 20)
    assert caught.value.code == "TOPIC_AUTHORIZATION_FAILED" and "\n" not in str(caught.value)
    assert str(caught.value).startswith("not authorized to alter topic ns.") and "on b:1" in str(caught.value)
    assert "an admin principal's --kafka-config" in str(caught.value)
