"""`rollstream take --out` against a real broker and SIGKILL: a kill at any moment leaves every committed step
in the file. Two behaviours are pinned here:

1. a step's lines are written (flushed, fsync'd) before it is committed, so every step the group committed
   (its manifests, audited) is in the file with exactly its groups;
2. the file is appended to, and a step written but not committed by a killed run is taken again by the next
   run under the same step number: a step number that repeats in the file is exactly a re-taken step (same
   groups each time), and only its last copy is followed by later steps.

Half the runs are a stand-in CLI whose commit waits a second after the write, killed as soon as its first
step is in the file (a kill between write and commit, every time); the others are the real CLI, killed at a
random moment while a producer streams groups.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rollstream.consumers import audit, replay_step
from rollstream.consumers._manifests import read_manifests
from rollstream.infra import KafkaConfig, TopicNames

from tests.integration._kafka import REPO_ROOT, cli_env, lag, run_cli, until
from tests.records import make_group, publish

log = logging.getLogger(__name__)

N = 3  # groups per step
# The CLI with a commit that waits PAUSE_S seconds before and after committing, and touches MARKER once it
# has committed: a kill as soon as the step is in the file or MARKER exists lands in one of the pauses.
_SLOW_COMMIT = """
import pathlib, sys, time
import rollstream.consumers as consumers
real, pause_s, marker = consumers.RolloutConsumer.commit, float(sys.argv[1]), pathlib.Path(sys.argv[2])
def slow(self, batch):
    time.sleep(pause_s)
    real(self, batch)
    marker.touch()
    time.sleep(pause_s)
consumers.RolloutConsumer.commit = slow
from rollstream.cli import main
sys.argv = ["rollstream", *sys.argv[3:]]
main()
"""


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _newlines(path: Path) -> int:
    """Complete lines in the file now (a reader may see a write in progress: count, do not parse)."""
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""  # it was still running


class _Streamer:
    """Publishes N distinct groups every ~30 ms from a thread while running; remembers every group id."""

    def __init__(self, config: KafkaConfig, names: TopicNames) -> None:
        self.config, self.names, self.ids = config, names, list[str]()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish_step(self) -> None:
        groups = [make_group(f"s{len(self.ids) + i}") for i in range(N)]
        publish(self.config, self.names, groups)
        self.ids.extend(g.group_id for g in groups)

    def __enter__(self) -> _Streamer:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="streamer", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(0.03):
            self.publish_step()


def _kill_between_write_and_commit(args: list[str], env: dict[str, str], out: Path, streamer: _Streamer) -> None:
    """The stand-in, killed as soon as its first step is in the file or committed, whichever comes first (a
    CLI that committed before writing would lose that step here)."""
    before, marker = _newlines(out), out.with_suffix(".committed")
    marker.unlink(missing_ok=True)
    streamer.publish_step()
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_COMMIT, "1.0", str(marker), *args], cwd=REPO_ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        until(lambda: _newlines(out) >= before + N or marker.exists() or proc.poll() is not None, 20,
              "a step in the file or committed", interval_s=0.01)
    finally:
        _kill(proc)


def _kill_at_random(args: list[str], env: dict[str, str], streamer: _Streamer, after_s: float) -> None:
    """The real CLI, killed after `after_s`: in start-up, taking, writing or committing, while groups stream in."""
    with streamer:
        proc = subprocess.Popen([sys.executable, "-m", "rollstream", *args], cwd=REPO_ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(after_s)
        _kill(proc)


def test_a_kill_at_any_moment_leaves_every_committed_step_in_the_file(
        kafka_config: KafkaConfig, namespace_factory, group_id: str, tmp_path: Path) -> None:
    names = namespace_factory(partitions=1)  # so that a re-take of a step takes the very same groups
    out = tmp_path / "taken.jsonl"
    args = ["take", "-n", str(N), "--steps", "0", "--out", str(out), "--group", group_id,
            "--namespace", names.namespace]
    env = cli_env(kafka_config.bootstrap_servers)
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    log.info("seed %d", seed)
    streamer = _Streamer(kafka_config, names)
    for iteration in range(6):
        if iteration % 2 == 0:
            _kill_between_write_and_commit(args, env, out, streamer)
        else:
            _kill_at_random(args, env, streamer, rng.uniform(0.3, 2.0))
    final = run_cli(kafka_config.bootstrap_servers, *args, "--timeout", "3")  # takes the rest, then times out
    assert final.returncode == 2 and "Traceback" not in final.stderr, final.stderr
    assert lag(kafka_config, group_id, names.rollouts) == 0  # everything published was taken and committed

    lines = _lines(out)
    assert len(lines) % N == 0
    copies = [lines[i:i + N] for i in range(0, len(lines), N)]  # one write per step: N lines, one step number
    assert all(len({c["step"] for c in copy}) == 1 for copy in copies)
    order = [int(str(copy[0]["step"])) for copy in copies]
    # A run starts at the step after the last committed one, so a copy followed by the same step number was
    # never committed (the next run took it again), and a committed copy is followed by the next step.
    assert order[0] == 0 and all(b - a in (0, 1) for a, b in zip(order, order[1:], strict=False)), order

    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
    manifests = {m.step: m for m in read_manifests(kafka_config, names.steps, group_id)}  # a re-take's is last
    committed = {step: [d.group_id for d in manifests[step].dispositions if d.kind == "taken"]
                 for step in report.steps}
    assert sorted(committed) == list(range(len(committed))) == sorted(set(order))  # all in the file, nothing else
    for copy, step in zip(copies, order, strict=True):
        assert [c["group_id"] for c in copy] == committed[step], (step, copy)  # a repeat is exactly a re-take
    assert sorted(i for ids in committed.values() for i in ids) == sorted(streamer.ids)
    repeated = sorted({s for s in order if order.count(s) > 1})
    assert len(order) - len(committed) >= 3, order  # each stand-in run left one copy it never committed
    replayed = replay_step(kafka_config, names.namespace, group_id, repeated[0])
    assert [r.group.group_id for r in replayed.records if r.group is not None] == committed[repeated[0]]
