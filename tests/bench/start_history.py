"""A trainer's start and `seek_to_step` with 100,000 manifests of other groups on NS.steps, two trees side by side.

Not part of ``make bench`` (it compares two checkouts, not rollstream with a raw client): each tree's
interpreter runs the same child, in turns, against one namespace on one broker. Usage::

    ROLLSTREAM_BOOTSTRAP_SERVERS=... python -m tests.bench.start_history BEFORE_PYTHON AFTER_PYTHON

where each is a venv's python with that tree installed (e.g. a git worktree of the older commit with its own .venv).
Each tree's trainer group first commits `STEPS` steps; then, per scenario, each tree starts a consumer (construction
to ready to take: the manifests read) and calls `seek_to_step(2)`, `REPEATS` times, best run counts.

- A: the other groups' 100,000 manifests were written before this group's (an old experiment's history).
- B: 100,000 more were written after this group's last commit (other trainers ran while it was down). Its
  first start reads them (they might hide a step recorded and not committed); `seek_to_step` then commits
  the index, so the starts after it do not: the table shows B's first run apart.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

from confluent_kafka import Producer
from rollstream.infra import KafkaConfig, TopicNames, TopicPlan, create_topics
from rollstream.schemas import OffsetDisposition, PartitionRange, StepManifest, encode

from tests.records import publish_many

OTHERS = 100_000
STEPS = 5
REPEATS = 3
_Times = dict[str, dict[str, float]]  # tree -> {"start": s, "seek": s}
_CHILD = """
import json, sys, time
from rollstream.consumers import RolloutConsumer
ns, group, mode = sys.argv[1:4]
if mode == "prepare":
    with RolloutConsumer(group_id=group, namespace=ns) as c:
        for _ in range(int(sys.argv[4])):
            c.take(4, timeout=30)
    sys.exit(0)
started = time.perf_counter()
c = RolloutConsumer(group_id=group, namespace=ns)
c.next_step  # starts: reads the manifests
ready = time.perf_counter()
c.seek_to_step(2)
print(json.dumps({"start": ready - started, "seek": time.perf_counter() - ready}))
c.close()
"""


def write_others(config: KafkaConfig, names: TopicNames, count: int) -> None:
    """`count` small manifests of 20 other groups on NS.steps, keyed by group as trainers write them."""
    producer = Producer(config.producer())
    for i in range(count):
        group = f"other-{i % 20}"
        m = StepManifest(i, group, names.rollouts, (PartitionRange(0, i, i + 1),),
                         (OffsetDisposition(0, i, "taken", f"x{i}#0"),))
        while True:
            try:
                producer.produce(names.steps, key=group.encode(), value=encode(m))
                break
            except BufferError:
                producer.poll(0.05)
    if producer.flush(60):
        raise RuntimeError("the other groups' manifests were not all acknowledged")


def child(python: str, *args: str) -> str:
    done = subprocess.run([python, "-c", _CHILD, *args], capture_output=True, text=True, timeout=300, check=False)
    if done.returncode:
        raise RuntimeError(f"{python} {args}: {done.stderr[-2000:]}")
    return done.stdout


def measure(trees: dict[str, str], names: TopicNames) -> tuple[_Times, _Times]:
    """Per tree, the first run and the best of `REPEATS` runs, in turns."""
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    for _ in range(REPEATS):
        for tree, python in trees.items():
            runs[tree].append(json.loads(child(python, names.namespace, f"bench-{tree}", "measure")))
    first = {t: r[0] for t, r in runs.items()}
    best = {t: {k: min(x[k] for x in r) for k in ("start", "seek")} for t, r in runs.items()}
    return first, best


def main(before: str, after: str) -> None:
    config = KafkaConfig.load()
    names = TopicNames(f"bench-start-{uuid.uuid4().hex[:8]}")
    create_topics(TopicPlan(names=names, partitions=3), config)
    publish_many(config, names, 8 * STEPS * 4)
    trees = {"before": before, "after": after}
    write_others(config, names, OTHERS)
    for tree, python in trees.items():
        child(python, names.namespace, f"bench-{tree}", "prepare", str(STEPS))
    _, a_best = measure(trees, names)
    write_others(config, names, OTHERS)
    b_first, b_best = measure(trees, names)
    print("| scenario | start before (s) | start after (s) | seek_to_step before (s) | seek_to_step after (s) |")
    print("|---|---|---|---|---|")
    for label, r in (("A: others before, best", a_best), ("B: others after the last commit, first run", b_first),
                     ("B: the same, best", b_best)):
        print(f"| {label} | {r['before']['start']:.3f} | {r['after']['start']:.3f} | {r['before']['seek']:.3f} "
              f"| {r['after']['seek']:.3f} |")

if __name__ == "__main__":
    main(*sys.argv[1:3])
