"""A stand-alone trainer for the requeue crash test: a new policy version every step, strict staleness.

Run as a script: ``python tests/integration/_requeue_trainer.py BOOTSTRAP NS GROUP N MAX_STALENESS``. Each
step it announces version ``step + 1`` on NS.control (the producers stamp it on what they generate from
then on), takes N groups with ``commit=False`` at that version, prints ``{"step", "ids", "requeued"}`` as
one JSON line, "trains" for a moment (the test SIGKILLs it there: taken, not committed), then commits.
It exits 0 once no group came for a few seconds in a row.
"""

from __future__ import annotations

import json
import sys
import time


def _train(bootstrap: str, namespace: str, group: str, n: int, max_staleness: int) -> None:
    from rollstream.consumers import RolloutConsumer, TakeTimeout
    from rollstream.infra import KafkaConfig, TopicNames, announce_policy_version
    from rollstream.schemas import PolicyVersion

    config = KafkaConfig(bootstrap_servers=bootstrap)
    names = TopicNames(namespace)
    idle = 0
    with RolloutConsumer(config=config, group_id=group, namespace=namespace, max_staleness=max_staleness,
                         timeout=30) as consumer:
        while idle < 3:
            version = consumer.next_step + 1
            announce_policy_version(config, names, PolicyVersion(version))
            try:
                batch = consumer.take(n, timeout=2.0, commit=False, policy_version=version)
            except TakeTimeout:
                idle += 1
                continue
            idle = 0
            print(json.dumps({"step": batch.step, "ids": batch.group_ids, "requeued": batch.counts()["requeued"]}),
                  flush=True)
            time.sleep(0.3)  # the optimizer step
            consumer.commit(batch)


if __name__ == "__main__":
    _train(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
