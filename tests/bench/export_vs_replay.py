"""Export of a long range against replay of the same offsets: time and peak memory (docs/benchmarks.md).

``python -m tests.bench.export_vs_replay BOOTSTRAP GROUPS [OUT_DIR]``: publishes GROUPS small groups (4 samples
of 16 tokens) to a fresh one-partition namespace, takes them in steps of 1,000 with a trainer group, then
runs `rollstream replay --from 0:0 --to 0:GROUPS` and `rollstream export --steps 0:` as processes under
``/usr/bin/time -v`` and prints wall time and peak RSS of each as one JSON line. Not part of `make bench`.
"""

from __future__ import annotations

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


def _measure(args: list[str]) -> dict[str, float]:
    started = time.monotonic()
    done = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "rollstream", *args],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))  # type: ignore[union-attr]
    return {"wall_s": round(time.monotonic() - started, 1), "peak_rss_mb": round(rss / 1024, 1)}


def main(bootstrap: str, groups: int, out: Path) -> None:
    config = KafkaConfig(bootstrap_servers=bootstrap)
    names = TopicNames(f"bench-export-{uuid.uuid4().hex[:6]}")
    create_topics(TopicPlan(names=names, partitions=1), config)
    _publish(config, names, groups)
    with RolloutConsumer(config=config, group_id="bench", namespace=names.namespace, filters=[]) as consumer:
        for _ in range(groups // 1000):
            consumer.take(1000, timeout=120, policy_version=groups // 1000)
    common = ["--namespace", names.namespace, "--group", "bench", "--bootstrap-servers", bootstrap]
    out.mkdir(parents=True, exist_ok=True)
    replay = _measure(["replay", "--from", "0:0", "--to", f"0:{groups}", "--out", str(out / "replay.jsonl"),
                       *common])
    export = _measure(["export", "--steps", "0:", "--out", str(out / "export.parquet"), *common])
    print(json.dumps({"groups": groups, "samples": 4 * groups, "replay": replay, "export": export,
                      "replay_mb": round((out / "replay.jsonl").stat().st_size / 1e6, 1),
                      "export_mb": round((out / "export.parquet").stat().st_size / 1e6, 1)}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3] if len(sys.argv) > 3 else "bench-out/export"))
