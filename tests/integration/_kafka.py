"""Small Kafka helpers for producer tests: write prompts, read rollouts with a plain consumer, play trainer.

Producer tests never import `consumers`: they read NS.rollouts with a plain confluent Consumer and
`rollstream.schemas.decode`, as any third-party trainer would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from rollstream.infra import KafkaConfig, LagReader, TopicNames
from rollstream.infra.group_protocol import GroupProtocol, check_group_protocol
from rollstream.producers.prompts import publish_prompts
from rollstream.schemas import Prompt, ScoredGroup, decode

T = TypeVar("T")


def write_prompts(config: KafkaConfig, names: TopicNames, ids: Iterable[str], *, label: str = "42") -> int:
    prompts = [Prompt(id=i, prompt=f"question {i}", label=label) for i in ids]
    return publish_prompts(prompts, config, names.prompts)


def end_offsets(config: KafkaConfig, topic: str) -> dict[int, int]:
    """End offset per partition (retrying while a leader is still being elected, as LagReader does)."""
    with LagReader(config) as reader:
        return {p.partition: p.end for p in reader.group_lag(f"probe-{uuid.uuid4().hex[:8]}", topic).partitions}


def read_records(config: KafkaConfig, topic: str, cls: type[T], timeout_s: float = 20.0, *,
                 key: bytes | None = None) -> list[tuple[int, int, T]]:
    """(partition, offset, decoded record) of everything on `topic` now (only records keyed `key`, when
    given: NS.control holds policy versions and trainer positions), in offset order per partition."""
    ends = {p: e for p, e in end_offsets(config, topic).items() if e > 0}
    consumer = Consumer(config.consumer(f"reader-{uuid.uuid4().hex[:8]}"))
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
    out: list[tuple[int, int, T]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while ends and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error() and (key is None or msg.key() == key):
                out.append((msg.partition(), msg.offset(), decode(msg.value(), cls)))  # type: ignore[arg-type]
            # By position, not the last record's offset: a transaction's commit marker (NS.control's
            # announcements are transactions) takes an offset no record is read at.
            for tp in consumer.position([TopicPartition(topic, p) for p in ends]):
                if tp.offset >= ends[tp.partition]:
                    ends.pop(tp.partition, None)
    finally:
        consumer.close()
    if ends:
        raise AssertionError(f"could not read {topic} to its end in {timeout_s} s: {ends}")
    return sorted(out, key=lambda r: (r[0], r[1]))


def read_all(config: KafkaConfig, topic: str, timeout_s: float = 20.0) -> list[ScoredGroup]:
    """Every group on `topic` (all partitions, from the beginning to the current end), decoded."""
    return [group for _, _, group in read_records(config, topic, ScoredGroup, timeout_s)]


def count(config: KafkaConfig, topic: str) -> int:
    return sum(end_offsets(config, topic).values())


def trainer_take(config: KafkaConfig, topic: str, group: str, n: int, timeout_s: float = 20.0) -> list[ScoredGroup]:
    """A stand-in trainer: consume exactly `n` records as `group` and commit just past them."""
    consumer = Consumer(config.consumer(group))
    consumer.subscribe([topic])
    taken: list[ScoredGroup] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(taken) < n and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=n - len(taken), timeout=0.5):
                if not msg.error():
                    taken.append(decode(msg.value(), ScoredGroup))
                    consumer.store_offsets(msg)
        consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    if len(taken) != n:
        raise AssertionError(f"trainer took {len(taken)} of {n} in {timeout_s} s")
    return taken


def lag(config: KafkaConfig, group: str, topic: str) -> int:
    with LagReader(config) as reader:
        return reader.group_lag(group, topic).total


def committed_everything(config: KafkaConfig, group: str, topic: str) -> bool:
    return lag(config, group, topic) == 0


REPO_ROOT = Path(__file__).resolve().parents[2]
# The prompt group's protocol for producers the tests start (in-process, and `rollstream produce`, whose
# --group-protocol reads it too): ROLLSTREAM_GROUP_PROTOCOL=classic runs them all under the classic protocol.
GROUP_PROTOCOL_ENV = "ROLLSTREAM_GROUP_PROTOCOL"


def group_protocol() -> GroupProtocol:
    """The protocol in-process producers of a test use unless the test picks one (default: auto)."""
    value = os.environ.get(GROUP_PROTOCOL_ENV, "auto")
    check_group_protocol(value)
    return value  # type: ignore[return-value]  # checked


def cli_env(bootstrap: str, **extra: str) -> dict[str, str]:
    """Environment for a `python -m rollstream` subprocess: this checkout importable, the test broker."""
    env = {**os.environ, "ROLLSTREAM_BOOTSTRAP_SERVERS": bootstrap, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def start_cli(bootstrap: str, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "rollstream", *args], cwd=REPO_ROOT, env=cli_env(bootstrap, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_cli(bootstrap: str, *args: str, timeout_s: float = 60.0, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollstream", *args], cwd=REPO_ROOT, env=cli_env(bootstrap, **env),
                          capture_output=True, text=True, timeout=timeout_s)


def until(probe: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.1) -> T:
    """Poll `probe` until it returns something truthy and return that; AssertionError naming `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    """Send `sig` to each of `pids` that still runs (SIGSTOP / SIGCONT freeze and thaw a broker)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def freezable_broker(data_dir: Path) -> Iterator[tuple[KafkaConfig, tuple[int, ...]]]:
    """A broker of its own in `data_dir` (the session's must never freeze): its config and its pids, for the tests
    that SIGSTOP it. Thawed and stopped at the end; each test thaws it before it ends, too."""
    from rollstream.infra.broker import BrokerSpec, broker_status, free_port, start_broker, stop_broker

    spec = BrokerSpec(port=free_port(), data_dir=data_dir, heap_mb=384)
    config = KafkaConfig(bootstrap_servers=start_broker(spec, timeout=120))
    pids = broker_status(spec.data_dir).pids
    try:
        yield config, pids
    finally:
        signal_all(pids, signal.SIGCONT)
        stop_broker(spec.data_dir)
