"""A tiny stand-alone trainer for crash tests (the record builders are in `tests.records`).

Run as a script: ``python tests/integration/_rollouts.py BOOTSTRAP NS GROUP N`` takes N groups with
``commit=False``, prints their ids as one JSON line, then waits for a line on stdin before committing
(the test kills it with SIGKILL while it waits).
"""

from __future__ import annotations

import json
import sys


def _trainer(bootstrap: str, namespace: str, group: str, n: int) -> None:
    from rollstream.consumers import RolloutConsumer

    with RolloutConsumer(bootstrap, group, namespace, timeout=30) as consumer:
        batch = consumer.take(n, timeout=60, commit=False)
        print(json.dumps({"step": batch.step, "ids": batch.group_ids}), flush=True)
        sys.stdin.readline()  # the test SIGKILLs us here: taken, not committed
        consumer.commit(batch)
        print(json.dumps({"committed": batch.step}), flush=True)


if __name__ == "__main__":
    _trainer(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
