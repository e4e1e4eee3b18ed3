"""Reading a consumer group's step manifests back from NS.steps (the consumer at start, replay, audit).

Built on the readers of `rollstream.infra.kafka_io`: explicit assignment, nothing committed, no group membership. The
reader's group id is the trainer's own group, so a principal granted only its own group reads manifests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rollstream.infra import KafkaConfig, partitions_of, position_of, read_ranges, reader, watermarks
from rollstream.schemas import SchemaError, StepManifest, decode

log = logging.getLogger(__name__)


def read_manifests(config: KafkaConfig, steps_topic: str, consumer_group: str, *, timeout: float = 30.0,
                   on_bad: Callable[[int, SchemaError], None] | None = None) -> list[StepManifest]:
    """Every StepManifest of `consumer_group` on `steps_topic` (keyed by group), in log order.

    Records of other groups are skipped without decoding; an undecodable record under this group's
    key is reported to `on_bad(offset, error)` (default: a warning) and skipped. Blocks until everything
    present when it started is read (no progress for `timeout` s is an error). Commits nothing.

    Raises:
        KafkaIOError: NS.steps does not exist, or (retriable) the broker did not answer in time.
    """
    key = consumer_group.encode()
    # The trainer's own group: a principal granted it needs no other group ACL. Safe next to a live trainer:
    # this reader assigns (never joins) and never commits, so the group never sees it.
    group_id = consumer_group
    out: list[StepManifest] = []
    with reader(config, group_id) as consumer:
        partitions = partitions_of(consumer, steps_topic, timeout=timeout)
        bounds = {p: watermarks(consumer, steps_topic, p, timeout=timeout) for p in partitions}
    for msg in read_ranges(config, steps_topic, bounds, group_id=group_id, timeout=timeout):
        if msg.key() != key:
            continue
        partition, offset = position_of(msg)
        try:
            manifest = decode(msg.value() or b"", StepManifest)
        except SchemaError as exc:
            exc.located(steps_topic, partition, offset)
            if on_bad is None:
                log.warning("skipping an undecodable step manifest: %s", exc)
            else:
                on_bad(offset, exc)
            continue
        if manifest.consumer_group == consumer_group:
            out.append(manifest)
    return out
