"""The design users switch from, side by side with rollstream on the same synthetic workload.

`_OriginalWorker` and `_original_generate_rollout` are a small, faithful REPRODUCTION OF THE BUGGY
ORIGINAL described in ``docs/origin.md`` (slime's fully-async rollout before the
fix). They exist only to be measured here; nothing else imports them, and they must not be reused:

- an asyncio loop in a daemon thread tops up to `concurrency` generate tasks from a data buffer, then
  sleeps a poll interval (1 s in the original; `POLL_S` here, in its favour);
- each task's done-callback does a *blocking* ``queue.Queue(maxsize).put`` on the loop thread (bug 2:
  once the queue is full, the whole event loop freezes until the trainer drains it);
- ``generate_rollout(target)`` drains *everything* queued and returns ``sorted(...)[:target]``
  (bug 1: every completed group beyond `target` is silently dropped, its prompt burned).

Rollstream runs the same generate function (`GEN_S` of ``asyncio.sleep``) in a `RolloutProducer`, and the
trainer side calls ``RolloutConsumer.take(TARGET)``. Both trainers "train" `TRAIN_S` between steps.
rollstream runs at its default settings (backpressure pushed by the trainer's position on NS.control),
then with the polling gate (``backpressure="poll"``) and without backpressure, for comparison.

Scenario A (delivery): `PROMPTS` prompts, concurrency `CONCURRENCY`, target `TARGET`, the original's
queue at its real size (1000). Each side runs until its prompts are used up; groups generated, delivered
(by id) and lost are counted. Scenario B (freeze): the original with a queue of `SMALL_QUEUE` and a
`LONG_TRAIN_S` training step; a probe on the worker loop (a 10 ms timer) records the longest stall.
rollstream runs the same with ``max_lag=SMALL_QUEUE`` (its bound on what waits), and its own loop probe.
Every wait is bounded, so the bench cannot hang on the original's frozen loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollstream.consumers import RolloutConsumer
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.producers import ProducerSettings, RolloutProducer
from rollstream.producers.metrics import LoopLagProbe
from rollstream.producers.prompts import publish_prompts
from rollstream.schemas import Prompt, make_group_id

from tests.bench._common import start_producer, wait_until

PROMPTS = 600
CONCURRENCY = 64
TARGET = 16
GEN_S = 0.005
TRAIN_S = 0.02
POLL_S = 0.05
SMALL_QUEUE = 8
LONG_TRAIN_S = 0.5
FREEZE_STEPS = 3
SAMPLES = 4
TIMEOUT_S = 60.0


async def synthetic_generate(prompt: dict[str, Any], n: int, sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
    """The shared workload: `GEN_S` of waiting (a remote engine), then n short completions."""
    await asyncio.sleep(GEN_S)
    return [{"text": f"answer {j}", "tokens": list(range(16)), "finish_reason": "stop"} for j in range(n)]


# -- REPRODUCTION OF THE BUGGY ORIGINAL (benchmark only) --------------------------------------------


class _OriginalWorker:
    """The original worker, bugs included: blocking put in the done-callback, queue drained wholesale."""

    def __init__(self, prompts: list[str], concurrency: int, maxsize: int) -> None:
        self.data_buffer = list(prompts)
        self.concurrency = concurrency
        self.output_queue: queue.Queue[tuple[int, str]] = queue.Queue(maxsize=maxsize)
        self.running = True
        self.generated: list[str] = []  # ids whose generation finished (appended on the loop thread)
        self.in_flight = 0
        self.probe = LoopLagProbe(interval_s=0.01)
        self.thread = threading.Thread(target=lambda: asyncio.run(self._loop()), name="original-worker",
                                       daemon=True)  # daemon: a frozen loop cannot keep the bench alive

    def idle(self) -> bool:
        return not self.data_buffer and self.in_flight == 0

    def get_completed_groups(self) -> list[tuple[int, str]]:
        completed = []
        while True:
            try:
                completed.append(self.output_queue.get_nowait())
            except queue.Empty:
                return completed

    async def _loop(self) -> None:
        probe = asyncio.create_task(self.probe.run())
        active: set[asyncio.Task[Any]] = set()
        gid = 0
        while self.running:
            active = {t for t in active if not t.done()}
            while len(active) < self.concurrency and self.running and self.data_buffer:
                prompt_id = self.data_buffer.pop(0)
                task = asyncio.create_task(synthetic_generate({"id": prompt_id}, SAMPLES, {}))
                task.add_done_callback(self._done_callback(gid, prompt_id))
                active.add(task)
                self.in_flight += 1
                gid += 1
            await asyncio.sleep(POLL_S)
        probe.cancel()

    def _done_callback(self, gid: int, prompt_id: str) -> Callable[[asyncio.Task[Any]], None]:
        def done(task: asyncio.Task[Any]) -> None:
            task.result()
            self.generated.append(prompt_id)
            self.in_flight -= 1
            self.output_queue.put((gid, prompt_id))  # THE BUG: blocks the event loop when the queue is full

        return done

    def stop(self) -> list[str]:
        """Stop the loop; drain the queue until the thread exits (unblocking a frozen put). Returns what
        was still queued (bounded by TIMEOUT_S; the thread is a daemon either way)."""
        self.running = False
        stranded: list[str] = []
        deadline = time.monotonic() + TIMEOUT_S
        while self.thread.is_alive() and time.monotonic() < deadline:
            stranded += [pid for _, pid in self.get_completed_groups()]
            self.thread.join(0.01)
        return stranded + [pid for _, pid in self.get_completed_groups()]


def _original_generate_rollout(worker: _OriginalWorker, target: int) -> list[str]:
    """The original rollout call: drain everything, wait for `target`, return ``sorted(...)[:target]``."""
    collected: dict[int, str] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while len(collected) < target and time.monotonic() < deadline:
        drained = worker.get_completed_groups()
        collected.update(drained)
        if not drained:
            time.sleep(0.05)
    return [pid for _, pid in sorted(collected.items())[:target]]  # THE BUG: the surplus is dropped


# -- measurements -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one side did with its prompts."""

    seconds: float = 0.0
    generated: int = 0
    delivered: list[str] = field(default_factory=list)
    stranded: int = 0  # generated, not delivered, still waiting at the end (not lost)
    loop_stall_max_ms: float = 0.0
    max_lag_seen: int = 0  # rollstream: the most records waiting after the trainer's position, after a take

    @property
    def lost(self) -> int:
        return self.generated - len(set(self.delivered)) - self.stranded

    @property
    def duplicates(self) -> int:
        return len(self.delivered) - len(set(self.delivered))


def _run_original(prompts: list[str], maxsize: int, train_s: float, max_steps: int | None) -> Outcome:
    worker = _OriginalWorker(prompts, CONCURRENCY, maxsize)
    out = Outcome()
    started = time.perf_counter()
    worker.thread.start()
    steps = 0
    while max_steps is None or steps < max_steps:
        if worker.idle() and worker.output_queue.qsize() < TARGET:
            break  # prompts used up; the next call could never complete
        out.delivered += _original_generate_rollout(worker, TARGET)
        out.seconds = time.perf_counter() - started
        steps += 1
        time.sleep(train_s)
    stranded = worker.stop()
    out.generated, out.loop_stall_max_ms = len(worker.generated), worker.probe.max_ms()
    out.stranded = len(set(stranded) - set(out.delivered))
    return out


def _run_rollstream(config: KafkaConfig, names: TopicNames, prompts: list[str], max_lag: int, train_s: float,
                    max_steps: int | None, backpressure: str = "pushed") -> Outcome:
    publish_prompts([Prompt(id=p, prompt=p) for p in prompts], config, names.prompts)
    group = f"bench-baseline-{uuid.uuid4().hex[:8]}"
    settings = ProducerSettings(namespace=names.namespace, n_samples=SAMPLES, concurrency=CONCURRENCY,
                                max_lag=max_lag, trainer_group=group, summary_interval_s=0, watch_control=False,
                                backpressure=backpressure)  # type: ignore[arg-type]
    producer = RolloutProducer(synthetic_generate, settings, kafka=config)
    out = Outcome()
    with RolloutConsumer(config=config, group_id=group, namespace=names.namespace, filters=()) as consumer:
        consumer.position()
        thread, failure = start_producer(producer, "bench-baseline-producer")
        try:
            started = wait_until(lambda: producer.stats().prompts_taken > 0 or bool(failure), TIMEOUT_S,
                                 "the producer's first prompt")
            while len(out.delivered) < len(prompts) and (max_steps is None or max_steps > 0) and not failure:
                want = min(TARGET, len(prompts) - len(out.delivered))
                out.delivered += consumer.take(want, timeout=TIMEOUT_S).group_ids
                out.seconds = time.perf_counter() - started
                out.max_lag_seen = max(out.max_lag_seen, consumer.estimated_lag())
                max_steps = None if max_steps is None else max_steps - 1
                time.sleep(train_s)
        finally:
            producer.stop()
            thread.join(TIMEOUT_S)
    if failure:
        raise RuntimeError(f"bench: the producer failed: {failure[0]}") from failure[0]
    stats = producer.stats()
    out.generated, out.loop_stall_max_ms = stats.groups_published, stats.loop_lag_max_ms
    out.stranded = stats.groups_published - len(set(out.delivered))  # on NS.rollouts: taken next time
    return out


def _verify_ids(prompts: list[str], outcome: Outcome) -> str:
    """rollstream must deliver every prompt's group exactly once: check by group id."""
    expected = {make_group_id(p, 0) for p in prompts}
    got = set(outcome.delivered)
    if got != expected or outcome.duplicates:
        raise RuntimeError(f"bench: rollstream delivered {len(got)} distinct of {len(expected)} groups "
                           f"({len(expected - got)} missing, {outcome.duplicates} duplicates)")
    return f"all {len(expected)} group ids, each once"


def run(config: KafkaConfig, names_factory: Callable[..., TopicNames], *,
        progress: Callable[[str], None] | None = None) -> list[tuple[str, str]]:
    """Rows (figure, value) for scenarios A (delivery) and B (freeze). See the module docstring."""
    say: Callable[[str], Any] = progress or (lambda _msg: None)
    prompts = [f"p{i}" for i in range(PROMPTS)]
    say("original design, delivery")
    orig = _run_original(prompts, 1000, TRAIN_S, None)
    say("rollstream, delivery")
    ours = _run_rollstream(config, names_factory(partitions=3), prompts, CONCURRENCY, TRAIN_S, None)
    checked = _verify_ids(prompts, ours)
    say("rollstream, polling backpressure, delivery")
    polled = _run_rollstream(config, names_factory(partitions=3), prompts, CONCURRENCY, TRAIN_S, None, "poll")
    _verify_ids(prompts, polled)
    say("rollstream without backpressure, delivery")
    free = _run_rollstream(config, names_factory(partitions=3), prompts, 10**9, TRAIN_S, None)
    _verify_ids(prompts, free)
    say("original design, freeze")
    frozen = _run_original(prompts, SMALL_QUEUE, LONG_TRAIN_S, FREEZE_STEPS)
    say("rollstream, freeze")
    calm = _run_rollstream(config, names_factory(partitions=3), prompts, SMALL_QUEUE, LONG_TRAIN_S, FREEZE_STEPS)
    return [
        ("baseline workload", f"{PROMPTS} prompts, generate = {GEN_S * 1000:.0f} ms asyncio.sleep, concurrency "
                              f"{CONCURRENCY}, target {TARGET} per step, {TRAIN_S * 1000:.0f} ms train step"),
        *_delivery_rows("original (queue.Queue(1000) + asyncio worker)", orig),
        *_delivery_rows(f"rollstream (RolloutProducer + take, default max_lag {CONCURRENCY})", ours),
        ("rollstream: groups verified by id", checked),
        (f"rollstream: most groups waiting after a take (bound: max_lag {CONCURRENCY} + in flight {CONCURRENCY})",
         f"{ours.max_lag_seen} ({'within' if ours.max_lag_seen <= 2 * CONCURRENCY else 'PAST'} the bound)"),
        ("rollstream with the polling gate (backpressure=poll, lag read every 0.5 s): delivered groups/s",
         f"{_rate(polled):,.0f} ({len(polled.delivered)} in {polled.seconds:.2f} s; ids verified; "
         f"{_rate(polled) / max(_rate(orig), 1e-9):.2f}x the original)"),
        ("rollstream without backpressure (max_lag unlimited): delivered groups/s",
         f"{_rate(free):,.0f} ({len(free.delivered)} in {free.seconds:.2f} s; ids verified)"),
        ("ratio delivered groups/s: rollstream / original", f"{_rate(ours) / max(_rate(orig), 1e-9):.2f} "
                                                            f"({_rate(free) / max(_rate(orig), 1e-9):.2f} unlimited)"),
        ("ratio groups delivered per prompt: rollstream / original",
         f"{len(ours.delivered) / max(len(orig.delivered), 1):.2f}"),
        (f"freeze: original loop stall max ms (queue {SMALL_QUEUE}, {FREEZE_STEPS} steps of "
         f"{LONG_TRAIN_S * 1000:.0f} ms training)", f"{frozen.loop_stall_max_ms:,.0f}"),
        (f"freeze: rollstream loop lag max ms (max_lag {SMALL_QUEUE}, same steps)", f"{calm.loop_stall_max_ms:,.1f}"),
    ]


def _rate(outcome: Outcome) -> float:
    return len(outcome.delivered) / outcome.seconds if outcome.seconds else 0.0


def _delivery_rows(label: str, o: Outcome) -> list[tuple[str, str]]:
    share = len(set(o.delivered)) / o.generated if o.generated else 0.0
    return [(f"{label}: delivered groups/s", f"{_rate(o):,.0f} ({len(o.delivered)} in {o.seconds:.2f} s)"),
            (f"{label}: generated / delivered / lost / left waiting",
             f"{o.generated} / {len(o.delivered)} / {o.lost} / {o.stranded} "
             f"({share:.0%} of generated reach the trainer)"),
            (f"{label}: event-loop stall max ms", f"{o.loop_stall_max_ms:,.1f}")]


if __name__ == "__main__":
    from tests.bench._common import run_standalone

    run_standalone(run, "bench-baseline")
