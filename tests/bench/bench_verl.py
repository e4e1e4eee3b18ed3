"""verl's transport, side by side in one run: how fast the rollouter's acknowledged puts go, now and as main
b5c9eaa published them, and what a trainer step of 32 prompts x 8 responses costs on top of training.

1. Publishing: ``VerlRolloutQueue.put_sample`` fed the bytes verl's rollouter puts (``ray.cloudpickle`` of a
   RolloutSample of 8 responses, 1024 + 2048 token widths: ~72 kB records), `CONCURRENCY` puts running at
   once as verl's ``max_concurrent_samples`` tasks run them; each put returns when its sample is acknowledged.
   The other side is the same workload through another checkout's code, run as a child process by that
   checkout's interpreter (``ROLLSTREAM_VERL_BASE_PYTHON``, e.g. main b5c9eaa's, where one thread produced a
   sample and polled until its acknowledgement, then the next). `REPEATS` alternating runs per side, best of
   each; without the variable only this checkout is measured. "Transport only" publishes groups encoded
   beforehand through the same queue (its publish thread and acknowledgement wait), without verl's unpickle
   and the codec, which bound a put by CPU (here in the queue's encode threads; on the rollouter's loop before).
2. A trainer step: `VerlTrainerQueue` takes 32 groups (``take``), hands each over as verl's
   ``_get_samples_from_queue`` reads it (``get_sample`` then ``ray.cloudpickle.loads``), and verl's own
   ``assemble_batch_from_rollout_samples`` builds the batch; ``rebuild`` is everything after the take. Best of
   `STEPS` steps, in this checkout and (a child process) in the other.

Needs the verl venv: ``.venv-verl/bin/python -m tests.bench --only verl``, or alone (against
``ROLLSTREAM_BOOTSTRAP_SERVERS``): ``.venv-verl/bin/python -m tests.bench.bench_verl``. Side by side with main
b5c9eaa::

    git worktree add ../wt-verlbase b5c9eaa   # then its .venv-verl as the Makefile's install-verl makes one
    ROLLSTREAM_VERL_BASE_PYTHON=../wt-verlbase/.venv-verl/bin/python .venv-verl/bin/python -m tests.bench --only verl
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from rollstream.consumers._verl_codec import encode_sample
from rollstream.consumers._verl_rollouter import VerlRolloutQueue
from rollstream.consumers.verl import VerlSettings, VerlTrainerQueue
from rollstream.infra import BOOTSTRAP_ENV, KafkaConfig, TopicNames
from rollstream.schemas import encode
from verl.experimental.fully_async_policy.detach_utils import RolloutSample, assemble_batch_from_rollout_samples

from tests.bench._common import Rows, run_standalone
from tests.standins.verl_fully_async.rollouts import agent_loop_output

RESPONSES, PROMPT_WIDTH, RESPONSE_WIDTH = 8, 1024, 2048
STEP = 32  # groups a trainer step takes
CONCURRENCY = 64
SAMPLES = 48  # puts per run, for the other checkout: main b5c9eaa's ~40-110 puts/s make that ~1 s
BASE_ENV = "ROLLSTREAM_VERL_BASE_PYTHON"
REPEATS = 3
STEPS = 3


def rollout_samples(count: int) -> list[bytes]:
    """`count` distinct samples as verl's rollouter puts them (cloudpickled RolloutSamples)."""
    out = []
    for i in range(count):
        full = agent_loop_output(i, RESPONSES, version=0, prompt_width=PROMPT_WIDTH, response_width=RESPONSE_WIDTH)
        sample_id = f"sample_0_{i}"
        full.non_tensor_batch["uid"] = np.array([f"uid_{sample_id}"] * RESPONSES, dtype=object)
        out.append(ray.cloudpickle.dumps(RolloutSample(full_batch=full, sample_id=sample_id, epoch=0,
                                                       rollout_status={"count/staleness_samples": 0})))
    return out


def _settings(config: KafkaConfig, names: TopicNames) -> VerlSettings:
    return VerlSettings(bootstrap_servers=config.bootstrap_servers, namespace=names.namespace,
                        group=f"bench-verl-{names.namespace}", take_timeout_s=60.0, poll_interval_s=0.2,
                        lag_refresh_s=0.0, kafka_timeout_s=60.0)


def _put_all(queue: Any, samples: list[bytes], count: int, *, transport: bool) -> float:
    """Seconds for `count` acknowledged puts, `CONCURRENCY` at once (samples reused cyclically). `transport`:
    the samples are encoded beforehand and only published (the put without verl's unpickle and the codec)."""
    groups = [encode_sample(ray.cloudpickle.loads(s)) for s in samples] if transport else []
    if hasattr(queue, "serve_run"):  # this checkout: the run verl's trainer hands over at its first weight sync
        queue.serve_run(1)

    async def put(i: int) -> None:
        if not transport:
            if await queue.put_sample(samples[i % len(samples)]) is not True:
                raise RuntimeError("bench: put_sample did not return True")
        elif hasattr(queue, "_send"):  # this checkout: produce, then await the acknowledgement
            await asyncio.wrap_future(await queue._publish.run(queue._send, groups[i % len(groups)]))
        else:  # main b5c9eaa: the one publish thread produces and waits for the acknowledgement
            await queue._publish.run(queue._produce, groups[i % len(groups)])

    async def go() -> float:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(i: int) -> None:
            async with gate:
                await put(i)

        await put(0)  # warm-up, not timed: the producer connects and gets its producer id
        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(count)))
        return time.perf_counter() - started

    try:
        return asyncio.run(go())
    finally:
        queue.close()


def _step(trainer: VerlTrainerQueue) -> tuple[float, float, float, float]:
    """(take, rebuild, assemble, commit) seconds of one step, as verl's _get_samples_from_queue runs it."""
    async def go() -> tuple[float, float, list[Any]]:
        started = time.perf_counter()
        first, _left = await trainer.get_sample()  # the take, then the rebuild of the whole step
        took = trainer.metrics().get("rollstream/take_s", 0.0)
        out = [ray.cloudpickle.loads(first)]
        while len(out) < STEP:
            sample, _left = await trainer.get_sample()
            out.append(ray.cloudpickle.loads(sample))
        return took, time.perf_counter() - started - took, out

    took, rebuilt, samples = asyncio.run(go())
    started = time.perf_counter()
    assemble_batch_from_rollout_samples(samples, tokenizer=None, config=None)
    assembled = time.perf_counter() - started
    trainer.commit_trained()
    return took, rebuilt, assembled, trainer.metrics()["rollstream/commit_s"]


def puts_per_s(config: KafkaConfig, names: TopicNames, samples: list[bytes], count: int, transport: bool) -> float:
    """Acknowledged puts a second of this checkout's `VerlRolloutQueue`."""
    return count / _put_all(VerlRolloutQueue(_settings(config, names)), samples, count, transport=transport)


def base_puts_per_s(python: str, config: KafkaConfig, names: TopicNames, count: int, transport: bool) -> float:
    """The same, measured by `python` (another checkout's interpreter) in a child process."""
    args = ["--puts", names.namespace, str(count), *(["transport"] if transport else [])]
    return float(_child(python, config, args)["puts_per_s"])


def _child(python: str, config: KafkaConfig, args: list[str]) -> dict[str, Any]:
    """The JSON line ``python -m tests.bench.bench_verl ARGS`` prints last (run from this folder, so `python`'s
    own checkout provides rollstream and this one the bench)."""
    env = {**os.environ, BOOTSTRAP_ENV: config.bootstrap_servers}
    done = subprocess.run([python, "-m", "tests.bench.bench_verl", *args], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench: {python} {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def run(config: KafkaConfig, names_factory: Callable[..., TopicNames], progress: Callable[[str], None] = print) -> Rows:
    """Rows (figure, value): puts/s of this checkout (and of ``ROLLSTREAM_VERL_BASE_PYTHON``'s, and the
    ratio); a step's take and rebuild."""
    samples = rollout_samples(STEP)
    base_python = os.environ.get(BASE_ENV)
    rates: dict[tuple[str, bool], list[float]] = {(side, t): [] for side in ("base", "this") for t in (False, True)}
    for r in range(REPEATS):
        progress(f"publishing, round {r + 1}/{REPEATS}")
        for transport in (False, True):
            if base_python:
                rates["base", transport].append(base_puts_per_s(base_python, config, names_factory(partitions=3),
                                                                SAMPLES, transport))
            rates["this", transport].append(puts_per_s(config, names_factory(partitions=3), samples, SAMPLES * 10,
                                                       transport))
    progress("trainer steps")
    ours = step_seconds(config, names_factory(partitions=3))
    theirs = base_step_seconds(base_python, config, names_factory(partitions=3)) if base_python else None
    record = len(encode(encode_sample(ray.cloudpickle.loads(samples[0]))))
    rows = [("workload", f"RolloutSamples of {RESPONSES} responses, {PROMPT_WIDTH} + {RESPONSE_WIDTH} token widths "
                         f"({record / 1000:.0f} kB records), {CONCURRENCY} puts at once, 3 partitions"),
            *_publish_rows(rates, base_python or f"{BASE_ENV} (unset: not measured)")]
    for i, what in enumerate(("take", "rebuild (get_sample x 32 + verl's unpickle; target < 0.2)",
                              "verl's assemble_batch_from_rollout_samples", "commit")):
        other = f"{theirs[i]:.3f}" if theirs else "-"
        rows.append((f"step of {STEP} x {RESPONSES}, {what}: s, this checkout / the other (best of {STEPS})",
                     f"{ours[i]:.3f} / {other}"))
    return rows


def step_seconds(config: KafkaConfig, names: TopicNames) -> list[float]:
    """(take, rebuild, assemble, commit) seconds of this checkout's trainer steps, best of `STEPS` each."""
    settings = _settings(config, names)
    distinct = rollout_samples(STEP * (STEPS + 1))  # distinct group ids: a repeated one is dropped as a duplicate
    _put_all(VerlRolloutQueue(settings), distinct, len(distinct), transport=False)
    trainer = VerlTrainerQueue(settings, groups_per_step=STEP, group_size=RESPONSES)
    try:
        _step(trainer)  # warm-up: the consumer joins its group
        steps = [_step(trainer) for _ in range(STEPS)]
    finally:
        trainer.close()
    return [min(s[i] for s in steps) for i in range(4)]


def base_step_seconds(python: str, config: KafkaConfig, names: TopicNames) -> list[float]:
    """The same, measured by `python` (another checkout's interpreter) in a child process."""
    return [float(x) for x in _child(python, config, ["--steps", names.namespace])["steps"]]


def _publish_rows(rates: dict[tuple[str, bool], list[float]], base: str) -> Rows:
    rows = []
    for transport, what in ((False, "puts/s (verl's bytes in, acknowledged)"),
                            (True, "transport only: puts/s of records encoded beforehand")):
        ours, theirs = rates["this", transport], rates["base", transport]
        rows += [(f"{what}, {base}", _runs(theirs)), (f"{what}, this checkout", _runs(ours)),
                 (f"{what}: this checkout / the other, best of each",
                  f"{max(ours) / max(theirs):.1f}" if theirs else "-")]
    return rows


def _runs(rates: list[float]) -> str:
    return f"{max(rates):,.1f} (runs: {', '.join(f'{x:.1f}' for x in rates)})" if rates else "-"


if __name__ == "__main__":
    child_config = KafkaConfig(client_id="rollstream-bench")
    if sys.argv[1:2] == ["--puts"]:  # the child of `base_puts_per_s`: one run, in this interpreter's checkout
        rate = puts_per_s(child_config, TopicNames(sys.argv[2]), rollout_samples(STEP), int(sys.argv[3]),
                          transport=sys.argv[4:5] == ["transport"])
        print(json.dumps({"puts_per_s": rate}))
    elif sys.argv[1:2] == ["--steps"]:  # the child of `base_step_seconds`
        print(json.dumps({"steps": step_seconds(child_config, TopicNames(sys.argv[2]))}))
    else:
        run_standalone(lambda c, f: run(c, f), "bench-verl")
