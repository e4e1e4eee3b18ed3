"""A fleet that changes while the trainer takes: producers SIGKILLed, replaced, drained, against a real broker.

Pinned here (docs/operations.md, "When producers come and go"): six `rollstream produce` processes share one
max_lag over 8 prompt partitions while an in-process trainer takes 16 groups a step (max_lag 32: a step and a
step of headroom). Part way, two are SIGKILLed and two new ones started, then one is drained with SIGTERM.
Every prompt is taken exactly once (nothing lost, nothing trained twice), the audit is green, no producer
process ends badly, and the trainer group's committed lag, sampled every 50 ms through the churn, stays
within the bound the docs derive for members that leave: max_lag + the in flight of every producer alive +
what the producers that left had outstanding (each at most its share + 1 + its concurrency), until the
trainer takes those groups. It prints the largest lag seen and how long the trainer took for 5 steps after
the kills (throughput back).

At fleet scale (128 producers, 3 broker nodes and one of them killed too): `python -m tests.fleet --churn`.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from pathlib import Path

from rollstream.consumers import audit
from rollstream.infra import KafkaConfig

from tests.chaos._procs import Role, producer_role
from tests.integration._kafka import until, write_prompts
from tests.integration.test_fleet_bound import TAKE_N, Trainer, sample_lag

PARTITIONS = 8
MAX_LAG = 2 * TAKE_N  # a step and a step of headroom, as docs/operations.md sizes it: the duplicates that a killed
#                       producer's prompts leave (published, not committed, generated again) count in the lag too
FLEET = 6  # producers alive at once
CONCURRENCY = 2
PROMPTS = 640
KILLED, DRAINED = 2, 1


def _producer(name: str, bootstrap: str, namespace: str, group: str, log_dir: Path) -> Role:
    role = producer_role(name, bootstrap, namespace, group, log_dir, gen_delay_s="0.02",
                         extra=("--max-lag", str(MAX_LAG), "--concurrency", str(CONCURRENCY),
                                "--session-timeout", "6"))
    role.start()
    return role


def _churn_bound() -> int:
    """max_lag + every live producer's in flight + what each producer that left can leave outstanding: its
    share of max_lag (its partitions' part, at most ceil(PARTITIONS / FLEET) of them) + 1 + its concurrency."""
    share = MAX_LAG * math.ceil(PARTITIONS / FLEET) / PARTITIONS
    left = KILLED + DRAINED
    return MAX_LAG + FLEET * CONCURRENCY + left * (math.floor(share) + 1 + CONCURRENCY)


def test_a_fleet_that_changes_keeps_the_promise_and_the_bound(
        bootstrap_servers: str, kafka_config: KafkaConfig, namespace_factory, group_id: str,
        tmp_path: Path) -> None:
    names = namespace_factory(partitions=PARTITIONS)
    write_prompts(kafka_config, names, [f"c{i:05d}" for i in range(PROMPTS)])
    roles = [_producer(f"churn-{i}", bootstrap_servers, names.namespace, group_id, tmp_path) for i in range(FLEET)]
    trainer = Trainer(kafka_config, names.namespace, group_id)
    lags: list[int] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_lag, args=(kafka_config, trainer, names.rollouts, stop, lags),
                               kwargs={"partitions": PARTITIONS}, name="churn-lag", daemon=True)
    try:
        trainer.start()
        until(lambda: trainer.steps >= 3 or trainer.error is not None, 120, "the trainer's first steps")
        sampler.start()
        for role in roles[:KILLED]:  # two nodes preempted ...
            role.signal(signal.SIGKILL)
        roles += [_producer(f"churn-{FLEET + i}", bootstrap_servers, names.namespace, group_id, tmp_path)
                  for i in range(KILLED)]  # ... and as many started
        at, killed_at = trainer.steps, time.monotonic()
        until(lambda: trainer.steps >= at + 5 or trainer.error is not None, 120, "steps after the kills")
        recovered_s = time.monotonic() - killed_at
        drained = roles[KILLED]
        drained.signal(signal.SIGTERM)  # one drained
        assert drained.wait(60) == 0, drained.tail()
        until(lambda: len(set(trainer.taken)) >= PROMPTS or trainer.error is not None, 240, "every prompt taken")
    finally:
        stop.set()
        trainer.stop.set()
        trainer.join(60)
        sampler.join(15)
        bad = [role.terminate() for role in roles if role is not roles[KILLED]]
    assert trainer.error is None, trainer.error
    assert not [b for b in bad if b], bad
    assert len(trainer.taken) == len(set(trainer.taken)) == PROMPTS, "a prompt was lost or taken twice"
    report = audit(kafka_config, names.namespace, group_id, timeout=60)
    assert report.ok, report
    assert len(lags) >= 20, lags
    bound = _churn_bound()
    print(f"churn: max lag {max(lags)} (bound {bound}; max_lag {MAX_LAG}), {len(lags)} samples, "
          f"{trainer.steps} steps, 5 steps {recovered_s:.1f} s after the kills")
    assert max(lags) <= bound, f"lag reached {max(lags)} > {bound}: {sorted(lags)[-10:]}"
