"""Export of a long range against replay of the same offsets: time and peak memory (docs/benchmarks.md).

``python -m tests.bench.export_vs_replay BOOTSTRAP GROUPS [OUT_DIR] [--step N] [--partitions P] [--export-only]
[--namespace NS] [--python PY]``: publishes GROUPS small groups (4 samples of 16 tokens) to a fresh namespace
(one partition by default), takes them in steps of N (1,000 by default) with a trainer group, then runs
`rollstream replay --from 0:0 --to 0:GROUPS` and `rollstream export --steps 0:` as processes under
``/usr/bin/time -v`` and prints wall time and peak RSS of each as one JSON line. ``--namespace NS`` measures an
earlier run's namespace again (nothing published; its group is ``bench``); ``--python PY`` runs the commands
with another interpreter (another checkout's venv: before and after on the same data). Not part of `make bench`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

from confluent_kafka import Producer
from rollstream.consumers import RolloutConsumer
from rollstream.infra import KafkaConfig, TopicNames, TopicPlan, create_topics
from rollstream.schemas import encode

from tests.records import make_group


def _publish(config: KafkaConfig, names: TopicNames, count: int) -> None:
    producer = Producer({**config.producer(), "linger.ms": 50})
    for i in range(count):
        g = make_group(f"p{i}", rewards=(0.0, 1.0, 0.5, float(i % 3)), response_len=16, versions=(i // 1000,))
        while True:
            try:
                producer.produce(names.rollouts, encode(g), key=g.group_id.encode())
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
    if producer.flush(120) != 0:
        raise RuntimeError("not every group was acknowledged")


def _measure(python: str, args: list[str]) -> dict[str, float]:
    started = time.monotonic()
    done = subprocess.run(["/usr/bin/time", "-v", python, "-m", "rollstream", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))  # type: ignore[union-attr]
    return {"wall_s": round(time.monotonic() - started, 1), "peak_rss_mb": round(rss / 1024, 1)}


def _prepare(config: KafkaConfig, groups: int, step: int, partitions: int) -> TopicNames:
    """A fresh namespace with `groups` groups taken in steps of `step` by the group ``bench``."""
    names = TopicNames(f"bench-export-{uuid.uuid4().hex[:6]}")
    create_topics(TopicPlan(names=names, partitions=partitions), config)
    _publish(config, names, groups)
    with RolloutConsumer(config=config, group_id="bench", namespace=names.namespace, filters=[]) as consumer:
        for k in range(groups // step):
            consumer.take(step, timeout=120, policy_version=k * step // 1000)
    return names


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.export_vs_replay")
    parser.add_argument("bootstrap")
    parser.add_argument("groups", type=int)
    parser.add_argument("out", type=Path, nargs="?", default=Path("bench-out/export"))
    parser.add_argument("--step", type=int, default=1000)
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--export-only", action="store_true")
    parser.add_argument("--namespace")
    parser.add_argument("--python", default=sys.executable)
    a = parser.parse_args(argv)
    config = KafkaConfig(bootstrap_servers=a.bootstrap)
    names = TopicNames(a.namespace) if a.namespace else _prepare(config, a.groups, a.step, a.partitions)
    common = ["--namespace", names.namespace, "--group", "bench", "--bootstrap-servers", a.bootstrap]
    a.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {"namespace": names.namespace, "groups": a.groups, "samples": 4 * a.groups}
    if not a.export_only:
        result["replay"] = _measure(a.python, ["replay", "--from", "0:0", "--to", f"0:{a.groups}",
                                               "--out", str(a.out / "replay.jsonl"), *common])
        result["replay_mb"] = round((a.out / "replay.jsonl").stat().st_size / 1e6, 1)
    result["export"] = _measure(a.python, ["export", "--steps", "0:", "--out", str(a.out / "export.parquet"),
                                           *common])
    result["export_mb"] = round((a.out / "export.parquet").stat().st_size / 1e6, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
