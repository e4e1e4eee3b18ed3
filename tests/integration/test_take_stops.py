"""Ctrl-C (SIGINT) and SIGTERM stop `rollstream take` promptly right after a broker restart.

A private 1-node broker (it is SIGKILLed and restarted on its data dir, so never the session's), 3 partitions,
groups published before the kill and after the restart, and `rollstream take -n 3 --steps 0 --out F` running
throughout. Each run is signalled right after the broker came back: SIGINT as soon as the restarted broker
serves (librdkafka is still reconnecting and logging, the moment a KeyboardInterrupt used to be lost inside a
librdkafka callback and turned into a SystemError), SIGTERM once the take has taken groups through the
restarted broker. Each must:

- exit within 20 s (it did not exit within 60 s in 3 of 4 runs before) with 130 (SIGINT) or 143 (SIGTERM),
  saying it was interrupted, with no traceback;
- lose nothing: every step the group committed is in F, the audit accounts for every committed offset, and
  a take afterwards gets every group published that F does not hold yet.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rollstream.consumers import RolloutConsumer, TakeTimeout, audit
from rollstream.infra import KafkaConfig, TopicNames, TopicPlan, create_topics
from rollstream.infra.broker import BrokerSpec, broker_status, free_port, restart_node, start_broker, stop_broker

from tests.integration._kafka import REPO_ROOT, cli_env, until
from tests.records import make_group, publish

N = 3  # groups per step
EXIT_BOUND_S = 20.0
GROUP = "stops-trainer"


def _ids(path: Path) -> list[str]:
    return [json.loads(line)["group_id"] for line in path.read_text().splitlines()] if path.exists() else []


def _taken_all(out: Path, published: list[str], proc: subprocess.Popen[str], what: str) -> None:
    until(lambda: len(_ids(out)) >= len(published) or proc.poll() is not None, 60, what)
    assert proc.poll() is None, proc.communicate()[1]


def _restart(spec: BrokerSpec, down_s: float) -> None:
    """SIGKILL the broker's JVM, wait `down_s`, start it again on its data dir."""
    (pid,) = broker_status(spec.data_dir).pids
    os.kill(pid, signal.SIGKILL)
    until(lambda: broker_status(spec.data_dir).node_pids == (None,), 10, "the killed broker to be gone")
    time.sleep(down_s)
    restart_node(spec.data_dir, 1, timeout=120)


def _stops(proc: subprocess.Popen[str], sig: signal.Signals) -> str:
    """Send `sig`; assert the take exits within the bound with 128 + sig and a clean message; its stderr."""
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        _, stderr = proc.communicate(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate(timeout=10)
        raise AssertionError(f"rollstream take did not exit within {EXIT_BOUND_S:g} s of {sig.name} right after a "
                             f"broker restart; its stderr:\n{stderr[-3000:]}") from None
    took = time.monotonic() - sent
    assert proc.returncode == 128 + sig, f"{sig.name}: exit {proc.returncode} after {took:.1f} s:\n{stderr[-3000:]}"
    assert "interrupted" in stderr and "Traceback" not in stderr, stderr[-3000:]
    return stderr


@pytest.mark.slow
def test_sigint_and_sigterm_stop_take_right_after_a_broker_restart(tmp_path: Path) -> None:
    spec = BrokerSpec(port=free_port(1), data_dir=tmp_path / "broker", heap_mb=384)
    out = tmp_path / "taken.jsonl"
    published: list[str] = []
    procs: list[subprocess.Popen[str]] = []
    try:
        config = KafkaConfig(bootstrap_servers=start_broker(spec, timeout=120))
        names = TopicNames("stops")
        create_topics(TopicPlan(names=names, partitions=3, replication_factor=1), config)

        def publish_step() -> None:
            groups = [make_group(f"g{len(published) + i}") for i in range(N)]
            publish(config, names, groups)
            published.extend(g.group_id for g in groups)

        args = [sys.executable, "-m", "rollstream", "take", "-n", str(N), "--steps", "0", "--out", str(out),
                "--group", GROUP, "--namespace", names.namespace]
        for sig, down_s in ((signal.SIGINT, 3.0), (signal.SIGTERM, 6.0)):
            proc = subprocess.Popen(args, cwd=REPO_ROOT, env=cli_env(config.bootstrap_servers),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            procs.append(proc)
            for _ in range(2):
                publish_step()
            _taken_all(out, published, proc, "two steps taken")
            _restart(spec, down_s)
            if sig == signal.SIGTERM:  # taking again through the restarted broker, then stopped
                publish_step()
                _taken_all(out, published, proc, "a step taken after the restart")
            _stops(proc, sig)

        report = audit(config, names.namespace, GROUP, timeout=60)
        assert report.ok, report
        written = _ids(out)
        rest: list[str] = []
        with RolloutConsumer(config=config, group_id=GROUP, namespace=names.namespace, filters=(),
                             timeout=60) as trainer:
            try:
                while True:
                    rest += trainer.take(1, timeout=5).group_ids
            except TakeTimeout:
                pass
        assert set(published) <= set(written) | set(rest), "a group was lost"
        assert not set(rest) - set(published)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
        stop_broker(spec.data_dir)
