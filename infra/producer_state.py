"""What a producer tells `rollstream status` about itself, carried in its prompt-offset commits.

Kafka keeps a metadata string with every committed offset (`TopicPartition.metadata`, up to the broker's
``offset.metadata.max.bytes``, 4 KiB by default). A producer commits its prompt watermarks anyway, so it
writes its state there: who it is, whether backpressure holds it, since when, and its max lag. Reading
the producer group's committed offsets (`status`, `TakeTimeout`'s diagnosis) then shows every producer's
state at no cost to the fleet: no extra topic, no extra record that every producer would have to read.

The state is as fresh as the producer's last commit: a producer commits again, with the same offsets,
when its backpressure gate opens or closes (see `rollstream.producers.intake`). Metadata that is not ours (another
tool committed with the group) reads as None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_PREFIX = "rollstream/1 "


@dataclass(frozen=True)
class ProducerState:
    """A producer's state as of `updated_at_ms`.

    Attributes:
        producer_id: the producer's id (``--producer-id``, or the generated one).
        paused: backpressure holds it: it starts no new prompt until the trainer's lag falls.
        since_ms: when `paused` last changed (wall clock, ms).
        max_lag: the lag above which it pauses.
        updated_at_ms: when it committed this state.
        trainer_group: the trainer group whose lag it gates on (None: written by a producer before it said).
    """

    producer_id: str
    paused: bool
    since_ms: int
    max_lag: int
    updated_at_ms: int
    trainer_group: str | None = None

    def to_metadata(self) -> str:
        """The commit metadata string for this state (compact JSON behind a version prefix)."""
        fields = {"id": self.producer_id, "paused": self.paused, "since_ms": self.since_ms, "max_lag": self.max_lag,
                  "at_ms": self.updated_at_ms}
        if self.trainer_group is not None:
            fields["tg"] = self.trainer_group
        return _PREFIX + json.dumps(fields, separators=(",", ":"))

    @classmethod
    def from_metadata(cls, text: str | None) -> ProducerState | None:
        """The state in a commit's metadata, or None when it holds none (empty, another tool's, garbled)."""
        if not text or not text.startswith(_PREFIX):
            return None
        try:
            d = json.loads(text[len(_PREFIX):])
            return cls(producer_id=str(d["id"]), paused=bool(d["paused"]), since_ms=int(d["since_ms"]),
                       max_lag=int(d["max_lag"]), updated_at_ms=int(d["at_ms"]),
                       trainer_group=str(d["tg"]) if "tg" in d else None)
        except (ValueError, KeyError, TypeError):
            return None
