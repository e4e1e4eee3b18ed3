"""The prompt group's rebalances, classic vs consumer protocol (KIP-848), side by side in one run.

``python -m tests.bench.bench_rebalance [--producers 8,32] [--protocols classic,consumer] [--events 2]`` against
``ROLLSTREAM_BOOTSTRAP_SERVERS`` (a Kafka >= 4.0 broker; ``python -m rollstream broker start`` gives one). Not part
of ``make bench`` (a minute or two per fleet size).

For each protocol and fleet size N: N `RolloutProducer`s on one asyncio loop (dynamic members, the default
10 s session: heartbeats every 2.5 s under both protocols, the consumer protocol's set as the group's config),
2N prompt partitions with a deep backlog, generation latency-modelled (a fixed sleep a group). Once every
producer publishes, `--events` rounds of: a producer joins (one more `RolloutProducer` starts), then one leaves
(`stop`: it drains what it started, commits and leaves the group), each followed by a quiet spell.

Per event:
- **rebalance s**: from the join (the new producer's `run` begins, so its start-up counts) or the leave (`stop`,
  so the leaver's drain counts) to the moment every partition is owned again, the last one assigned, and, for a
  join, the new producer has taken its first prompt: every producer consuming again (`Trace.settled_at`);
- **from subscribe s** (joins): the same, from the moment the new member's client subscribed: the group's part;
- **prompts lost**: groups the fleet did not publish over that spell compared with the steady rate just before
  it (for a leave, scaled to the N - 1 producers left): throughput the rebalance cost, in groups.

Instrumentation patches `Intake` in this process only (as `tests.fleet._worker.use_old_rule` does).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollstream.infra import KafkaConfig, TopicNames
from rollstream.producers import ProducerSettings, RolloutProducer
from rollstream.producers.intake import Intake, TakenPrompt
from rollstream.producers.prompts import publish_prompts
from rollstream.schemas import Prompt

from tests.bench._common import delete_topics, topic_factory

log = logging.getLogger("tests.bench.rebalance")
GEN_S = 0.5  # a group's generation
CONCURRENCY = 2
SETTLE_S = 4.0  # quiet spell before an event (the steady rate is read over it) and after one
EVENT_LIMIT_S = 40.0


@dataclass
class Trace:
    """What every intake of this process did, stamped with `time.monotonic()`: assignments, revocations (lost
    partitions too) and hand-overs to the loop."""

    assigned: list[tuple[float, int, int]] = field(default_factory=list)  # (t, intake id, partition)
    owner: dict[int, int | None] = field(default_factory=dict)  # partition -> intake id owning it now
    handed: dict[int, list[float]] = field(default_factory=dict)  # intake id -> hand-over times
    subscribed: dict[int, float] = field(default_factory=dict)  # intake id -> when its (first) client subscribed

    def install(self) -> None:
        trace = self
        on_assign, on_revoke, on_lost = Intake._on_assign, Intake._on_revoke, Intake._on_lost
        hand_over_all, serve = Intake._hand_over_all, Intake._serve

        def traced_serve(intake: Intake, consumer: Any) -> bool:
            trace.subscribed.setdefault(id(intake), time.monotonic())
            return serve(intake, consumer)

        def traced_assign(intake: Intake, consumer: Any, partitions: list[Any]) -> None:
            on_assign(intake, consumer, partitions)
            now = time.monotonic()
            for tp in partitions:
                trace.assigned.append((now, id(intake), tp.partition))
                trace.owner[tp.partition] = id(intake)

        def traced_revoke(original: Callable[..., None]) -> Callable[..., None]:
            def revoke(intake: Intake, consumer: Any, partitions: list[Any]) -> None:
                original(intake, consumer, partitions)
                for tp in partitions:
                    if trace.owner.get(tp.partition) == id(intake):
                        trace.owner[tp.partition] = None
            return revoke

        def traced_hand_over(intake: Intake, batch: list[TakenPrompt]) -> None:
            if batch:
                trace.handed.setdefault(id(intake), []).append(time.monotonic())
            hand_over_all(intake, batch)

        Intake._on_assign = traced_assign  # type: ignore[method-assign]  # this bench process only
        Intake._on_revoke = traced_revoke(on_revoke)  # type: ignore[method-assign]
        Intake._on_lost = traced_revoke(on_lost)  # type: ignore[method-assign]
        Intake._hand_over_all = traced_hand_over  # type: ignore[method-assign]
        Intake._serve = traced_serve  # type: ignore[method-assign]

    def joined_at(self, since: float) -> float:
        """When the newest member's client subscribed (the start of its join proper), or `since`."""
        later = [t for t in self.subscribed.values() if t >= since]
        return min(later) if later else since

    def settled_at(self, since: float, partitions: int, joiner: bool) -> float | None:
        """When the group settled after an event at `since` (None: not yet): every partition owned again, the last
        of them assigned since `since`; for a join, also the new member consuming (its first prompt handed over).
        A moved partition's first prompt at its new owner is not waited for: with a deep backlog it queues
        behind what that owner already fetched from its other partitions, which is intake's fairness, not the
        protocol's."""
        if len(self.owner) < partitions or any(who is None for who in self.owner.values()):
            return None
        moved = [(t, who) for t, who, _ in self.assigned if t >= since]
        if not moved:
            return None
        done = max(t for t, _ in moved)
        if joiner:
            before = {who for t, who, _ in self.assigned if t < since}
            new = {who for _, who in moved} - before
            if not new:
                return None
            firsts = [next((h for h in self.handed.get(who, []) if h >= since), None) for who in new]
            if any(f is None for f in firsts):
                return None
            done = max(done, *[f for f in firsts if f is not None])
        return done


async def generate(prompt: dict[str, Any], n: int, sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
    await asyncio.sleep(GEN_S)
    return [{"text": "x", "tokens": [1, i], "logprobs": [-0.5, -0.5], "finish_reason": "stop"} for i in range(n)]


def settings(names: TopicNames, protocol: str) -> ProducerSettings:
    return ProducerSettings(namespace=names.namespace, n_samples=2, concurrency=CONCURRENCY, max_lag=10_000_000,
                            max_new_tokens=2, summary_interval_s=0, watch_control=False, lag_interval_s=5.0,
                            group_protocol=protocol,  # type: ignore[arg-type]
                            startup_timeout_s=60.0, drain_timeout_s=30.0, drain_on_revoke_s=10.0)


@dataclass
class Event:
    kind: str
    rebalance_s: float
    lost: float
    group_s: float  # the group's part of rebalance_s: a join from the new member's subscribe


class Fleet:
    def __init__(self, config: KafkaConfig, names: TopicNames, protocol: str, trace: Trace,
                 event_limit_s: float = EVENT_LIMIT_S) -> None:
        self.config, self.names, self.protocol, self.trace = config, names, protocol, trace
        self.event_limit_s = event_limit_s
        self.partitions = 0
        self.running: list[tuple[RolloutProducer, asyncio.Task[Any]]] = []
        self.stopped: list[RolloutProducer] = []

    def start(self) -> None:
        producer = RolloutProducer(generate, settings(self.names, self.protocol), kafka=self.config)
        self.running.append((producer, asyncio.create_task(producer.run())))

    async def leave(self) -> None:
        producer, task = self.running.pop(0)
        producer.stop()
        self.stopped.append(producer)
        await task

    def published(self) -> int:
        return sum(p.stats().groups_published for p, _ in self.running) + sum(
            p.stats().groups_published for p in self.stopped)

    async def rate(self, seconds: float) -> float:
        before, t = self.published(), time.monotonic()
        await asyncio.sleep(seconds)
        return (self.published() - before) / (time.monotonic() - t)

    async def event(self, kind: str, act: Callable[[], Any]) -> Event:
        members = len(self.running)
        rate = await self.rate(SETTLE_S)
        if kind == "leave":
            rate *= (members - 1) / members
        t0, before = time.monotonic(), self.published()
        result = act()
        if asyncio.iscoroutine(result):
            leaving: asyncio.Task[Any] | None = asyncio.ensure_future(result)
        else:
            leaving = None
        await asyncio.sleep(0.5)
        done = None
        while done is None:
            if time.monotonic() - t0 > self.event_limit_s:
                unowned = sorted(p for p, who in self.trace.owner.items() if who is None)
                raise RuntimeError(f"{kind}: the group did not settle within {self.event_limit_s:g} s (leaver gone: "
                                   f"{leaving is None or leaving.done()}; partitions owned by nobody: {unowned}; "
                                   "a larger fleet on a loaded machine may need a larger --event-limit)")
            await asyncio.sleep(0.05)
            done = self.trace.settled_at(t0, self.partitions, joiner=kind == "join")
            if done is not None and leaving is not None and not leaving.done():
                done = None  # a leave is over once the leaver is gone
        if leaving is not None:
            await leaving
        elapsed = done - t0
        lost = max(0.0, rate * elapsed - (self.published() - before))
        # A join's own rebalance starts when the new member subscribes (after its start-up: topic checks, the
        # lag gate's first read, the protocol probe), a leave's when the leaver starts closing (`stop`).
        group_s = done - self.trace.joined_at(t0) if kind == "join" else elapsed
        return Event(kind, elapsed, lost, group_s)

    async def close(self) -> None:
        for producer, _ in self.running:
            producer.stop()
        await asyncio.gather(*(task for _, task in self.running), return_exceptions=True)


async def one_fleet(config: KafkaConfig, names: TopicNames, protocol: str, producers: int, events: int,
                    trace: Trace, event_limit_s: float = EVENT_LIMIT_S) -> list[Event]:
    fleet = Fleet(config, names, protocol, trace, event_limit_s)
    fleet.partitions = 2 * producers
    trace.owner.clear()
    for _ in range(producers):
        fleet.start()
    deadline = time.monotonic() + 120
    while sum(1 for p, _ in fleet.running if p.stats().groups_published > 0) < producers:
        if time.monotonic() > deadline:
            raise RuntimeError("not every producer published within 120 s")
        for _, task in fleet.running:
            if task.done():
                task.result()
        await asyncio.sleep(0.2)
    out = []
    try:
        for _ in range(events):
            out.append(await fleet.event("join", fleet.start))
            out.append(await fleet.event("leave", fleet.leave))
    finally:
        await fleet.close()
    return out


def run(config: KafkaConfig, sizes: list[int], protocols: list[str], events: int,
        event_limit_s: float = EVENT_LIMIT_S) -> list[tuple[str, int, Event]]:
    trace = Trace()
    trace.install()
    made: list[TopicNames] = []
    make = topic_factory(config, made, "rebalance")
    results = []
    try:
        for n in sizes:
            for protocol in protocols:
                names = make(partitions=2 * n)
                budget = int((n + 1) * CONCURRENCY / GEN_S * (60 + events * 30))
                publish_prompts([Prompt(id=f"p{i}", prompt="q", label="1") for i in range(budget)], config,
                                names.prompts)
                log.info("%s protocol, %d producers, %d partitions, %d prompts", protocol, n, 2 * n, budget)
                for e in asyncio.run(one_fleet(config, names, protocol, n, events, trace, event_limit_s)):
                    log.info("  %s: %.2f s (group %.2f s), %.0f groups lost", e.kind, e.rebalance_s, e.group_s, e.lost)
                    results.append((protocol, n, e))
    finally:
        delete_topics(config, made)
    return results


def table(results: list[tuple[str, int, Event]]) -> str:
    rows = ["| producers | protocol | join: rebalance s | join: from subscribe s | join: groups lost | "
            "leave: rebalance s | leave: groups lost |", "|---|---|---|---|---|---|---|"]
    keys = sorted({(n, p) for p, n, _ in results})
    for n, protocol in keys:
        cells = []
        for kind in ("join", "leave"):
            es = [e for p, m, e in results if (p, m) == (protocol, n) and e.kind == kind]
            secs = ", ".join(f"{e.rebalance_s:.2f}" for e in es)
            lost = ", ".join(f"{e.lost:.0f}" for e in es)
            cells.append(f"{statistics.median(e.rebalance_s for e in es):.2f} ({secs})")
            if kind == "join":
                group = ", ".join(f"{e.group_s:.2f}" for e in es)
                cells.append(f"{statistics.median(e.group_s for e in es):.2f} ({group})")
            cells.append(f"{statistics.median(e.lost for e in es):.0f} ({lost})")
        rows.append(f"| {n} | {protocol} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--producers", default="8,32", help="fleet sizes, comma-separated (default 8,32)")
    parser.add_argument("--protocols", default="classic,consumer")
    parser.add_argument("--events", type=int, default=2, help="join + leave rounds per fleet (default 2)")
    parser.add_argument("--event-limit", type=float, default=EVENT_LIMIT_S,
                        help=f"seconds an event may take to settle before the run fails (default {EVENT_LIMIT_S:g})")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    log.setLevel(logging.INFO)
    results = run(KafkaConfig(client_id="rollstream-bench"), [int(n) for n in args.producers.split(",")],
                  args.protocols.split(","), args.events, args.event_limit)
    print(f"GEN_S={GEN_S}, concurrency {CONCURRENCY}, session 10 s; median (each event)\n")
    print(table(results))


if __name__ == "__main__":
    main()
