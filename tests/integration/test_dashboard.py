"""The Grafana dashboard (``infra/grafana/rollstream.json``) against real scrapes, and the metric names.

Pinned here:
- every metric a dashboard query references exists in a scrape of a running producer (its
  ``--metrics-port`` endpoint) and of a trainer's consumer that took and committed steps, one of them
  with a filtered group (failed on its last attempt) and a requeued one (stale): the labelled series the
  queries select are there, with the label values they match on;
- the dashboard is an importable classic Grafana model: panels with ids and non-overlapping gridPos,
  targets with refId and expr, every query (annotations' too) through the ``datasource`` variable (a
  Prometheus one);
- every name in both scrapes follows Prometheus' naming conventions: base units last and no other unit,
  counters end in ``_total`` and gauges do not, lag gauges carry their unit, and no sentinel values
  (``weight_version`` and ``step`` are absent until known, never -1).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from rollstream.consumers import RolloutConsumer
from rollstream.consumers._metrics import ConsumerMetrics
from rollstream.infra import KafkaConfig, TopicNames, announce_policy_version
from rollstream.producers import ProducerSettings, RolloutProducer
from rollstream.producers.metrics import ProducerMetrics
from rollstream.schemas import PolicyVersion, Prompt, ScoredGroup, encode

from tests import plugins
from tests.integration._kafka import write_prompts
from tests.integration.test_policy_versions import running, wait_for
from tests.records import make_group, publish

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "rollstream.json"
CURRENT = 5
# What issue 14 asks the dashboard to show, one metric each (a panel dropped fails here).
REQUIRED = {"rollstream_consumer_lag_records", "rollstream_consumer_groups_taken_total",
            "rollstream_producer_groups_published_total", "rollstream_consumer_group_staleness_versions_bucket",
            "rollstream_consumer_groups_filtered_total", "rollstream_consumer_groups_requeued_total",
            "rollstream_producer_event_loop_lag_seconds_bucket", "rollstream_consumer_take_seconds_bucket",
            "rollstream_producer_paused", "rollstream_producer_in_flight_groups",
            "rollstream_consumer_steps_committed_total",
            # issue 37: each producer's share and prompt partitions, and the prompt group's rebalances
            "rollstream_producer_lag_share_records", "rollstream_producer_assigned_partitions",
            "rollstream_producer_rebalances_total"}
BASE_UNITS = {"seconds", "bytes"}
OTHER_UNITS = {"ms", "milliseconds", "us", "microseconds", "minutes", "hours", "kb", "mb", "gb", "kib", "mib",
               "kilobytes", "megabytes", "percent"}
SERIES_SUFFIXES = ("_total", "_created", "_bucket", "_sum", "_count")
_NAME = re.compile(r"\brollstream_[a-z_]*[a-z]")
_SELECTOR = re.compile(r"\b(rollstream_[a-z_]*[a-z])\{([^}]*)\}")
_FIXED_MATCHER = re.compile(r'(\w+)="([^"$]*)"')


def _targets(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def _annotation_queries(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """The annotations that query Prometheus (not Grafana's built-in one)."""
    return [a for a in dashboard["annotations"]["list"] if "expr" in a]


def _scrape_families(text: str) -> list[Any]:
    return list(text_string_to_metric_families(text))


def _samples(families: list[Any]) -> list[Sample]:
    return [s for f in families for s in f.samples]


def _stale_group_for_requeue() -> ScoredGroup:
    """A group two versions behind the trainer, carrying its prompt: the trainer requeues it (stale)."""
    prompt = Prompt(id="stale", prompt="question stale", label="42")
    return replace(make_group("stale", versions=(CURRENT - 2,)), max_attempts=3, source_prompt=encode(prompt))


def _run_producer_and_trainer(kafka_config: KafkaConfig, names: TopicNames, group_id: str) -> tuple[str, str]:
    """Scrape texts (producer over HTTP, trainer's registry) after three committed steps of two groups."""
    announce_policy_version(kafka_config, names, PolicyVersion(CURRENT))
    publish(kafka_config, names, [_stale_group_for_requeue()])
    settings = ProducerSettings(namespace=names.namespace, n_samples=2, concurrency=2, max_lag=1000,
                                trainer_group=group_id, summary_interval_s=0, max_new_tokens=2,
                                generate_attempts=1, max_attempts=1, metrics_port=0)
    producer = RolloutProducer(plugins.instant, settings, kafka=kafka_config, reward="tests.plugins:alternating")
    with running(producer):
        wait_for(lambda: producer.policy_version == CURRENT, f"the producer to read version {CURRENT}")
        # First a prompt whose engine fails: published as failed, filtered (its one attempt was the last).
        write_prompts(kafka_config, names, ["engine-fail-0"] + [f"p{i}" for i in range(5)])
        with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace,
                             max_staleness=1, policy_version=CURRENT) as consumer:
            kinds: dict[str, int] = {}
            for _ in range(3):  # 6 groups: p0..p4 and the regenerated stale prompt
                batch = consumer.take(2, timeout=30)
                consumer.commit(batch)
                for kind, n in batch.counts().items():
                    kinds[kind] = kinds.get(kind, 0) + n
            trainer = generate_latest(consumer.metrics.registry).decode()
        assert kinds["taken"] == 6 and kinds["filtered"] == 1 and kinds["requeued"] == 1, kinds
        wait_for(lambda: producer.stats().groups_published >= 7, "the producer's 7 groups to be acknowledged")
        assert producer.metrics_port is not None
        scraped = httpx.get(f"http://127.0.0.1:{producer.metrics_port}/metrics", timeout=5.0)
        scraped.raise_for_status()
    return scraped.text, trainer


def _check_dashboard_model(dashboard: dict[str, Any]) -> None:
    """What Grafana's import needs of a classic dashboard model, and what makes this one portable."""
    assert dashboard["schemaVersion"] >= 39 and dashboard["title"] and dashboard["uid"] == "rollstream"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance"} <= variables.keys()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    boxes = []
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["x"] + g["w"] <= 24, p["title"]
        boxes.append((p["title"], g["x"], g["y"], g["x"] + g["w"], g["y"] + g["h"]))
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]
        assert all(t["expr"].strip() and t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
    for a in _annotation_queries(dashboard):
        assert a["name"] and a["expr"].strip() and a["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    for i, (a, ax0, ay0, ax1, ay1) in enumerate(boxes):
        for b, bx0, by0, bx1, by1 in boxes[i + 1:]:
            assert ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0, f"panels {a!r} and {b!r} overlap"


def _check_names(families: list[Any]) -> None:
    """Prometheus naming conventions over one scrape (https://prometheus.io/docs/practices/naming/)."""
    for f in families:
        assert f.name.startswith(("rollstream_producer_", "rollstream_consumer_")), f.name
        if f.name.endswith("_created"):
            continue  # prometheus_client's creation-time gauges of counters and histograms
        words = f.name.split("_")
        assert not OTHER_UNITS & set(words), f"{f.name}: use base units (seconds, bytes), no other unit"
        assert not BASE_UNITS & set(words[:-1]), f"{f.name}: the unit goes last (before _total)"
        if f.type == "counter":
            assert all(s.name == f.name + "_total" or s.name.endswith("_created") for s in f.samples), f.name
        if f.type == "gauge":
            assert not f.name.endswith("_total"), f"{f.name}: a gauge is no running total"
            if "lag" in words:
                assert words[-1] in {"records", "seconds"}, f"{f.name}: say the lag's unit"
        if f.name.endswith("weight_version"):
            assert all(s.value >= 0 for s in f.samples), f"{f.name}: no sentinel versions"


def test_every_dashboard_query_finds_its_metrics_in_real_scrapes(kafka_config: KafkaConfig, namespace_factory,
                                                                group_id: str) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    _check_dashboard_model(dashboard)
    exprs = [t["expr"] for t in _targets(dashboard)] + [a["expr"] for a in _annotation_queries(dashboard)]
    queried = {n for e in exprs for n in _NAME.findall(e)}
    assert REQUIRED <= queried, f"the dashboard lost {sorted(REQUIRED - queried)}"

    producer_text, trainer_text = _run_producer_and_trainer(kafka_config, namespace_factory(partitions=1), group_id)
    families = _scrape_families(producer_text) + _scrape_families(trainer_text)
    samples = _samples(families)
    present = {s.name for s in samples}
    missing = sorted(queried - present)
    assert not missing, f"queried by the dashboard, absent from the scrapes: {missing}"
    for e in exprs:  # fixed label values a query selects (status="failed") have their series too
        for name, matchers in _SELECTOR.findall(e):
            for label, value in _FIXED_MATCHER.findall(matchers):
                assert any(s.name == name and s.labels.get(label) == value for s in samples), (name, label, value)
    by_reason = {(s.name, s.labels.get("reason")) for s in samples if s.value > 0}
    assert ("rollstream_consumer_groups_filtered_total", "failed") in by_reason
    assert ("rollstream_consumer_groups_requeued_total", "stale") in by_reason

    _check_names(families)
    assert "rollstream_producer_weight_version" not in present, "a custom engine reports no version: absent"
    assert any(s.name == "rollstream_consumer_step" and s.value == 2 for s in samples)


def test_no_sentinels_before_a_version_or_step_is_known() -> None:
    producer, trainer = ProducerMetrics(), ConsumerMetrics()
    _check_names(_scrape_families(generate_latest(producer.registry).decode())
                 + _scrape_families(generate_latest(trainer.registry).decode()))
    assert producer.registry.get_sample_value("rollstream_producer_weight_version") is None
    assert trainer.registry.get_sample_value("rollstream_consumer_step") is None
    # Closed label sets start at zero, so rate() over them exists before the first event.
    assert producer.registry.get_sample_value("rollstream_producer_groups_published_total",
                                              {"status": "failed"}) == 0
    assert producer.registry.get_sample_value("rollstream_producer_lag_updates_total", {"source": "pushed"}) == 0
    assert producer.registry.get_sample_value("rollstream_producer_rebalances_total", {"change": "lost"}) == 0
    producer.show_weight_version(0)
    producer.show_weight_version(3)
    assert producer.registry.get_sample_value("rollstream_producer_weight_version") == 3
