"""The nemesis: random faults from one seeded `random.Random`, each undone after a random few seconds.

Faults (a kind is only drawn when it has a target): SIGKILL of a producer or the trainer (restarted
later with the same arguments), SIGSTOP of a producer or the trainer (SIGCONT later), a broker pause
(SIGSTOP of a node's JVM, 3-25 s) and a SIGKILL of one node (restarted 5-20 s later; with 1 node, the
broker). At most one broker fault is active at a time, so a 3-node cluster keeps its quorum and min.insync 2.

Every process end the nemesis did not cause is judged (`tests.chaos._procs.Role.bad_exit`): a death by a
signal it did not send or a traceback is recorded in `failures`, which fails the run.

The random draws depend only on the seed and the order of faults, not on timing, so a seed repeats the
same sequence of fault kinds, targets and durations (what each one hits in the data flow still depends on timing).
"""

from __future__ import annotations

import heapq
import itertools
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.chaos._cluster import Cluster
from tests.chaos._procs import Role

Say = Callable[[str], None]
KINDS = ("producer_kill", "producer_stop", "trainer_kill", "trainer_stop", "broker_pause", "node_kill")
_WEIGHTS = {"producer_kill": 3, "producer_stop": 2, "trainer_kill": 2, "trainer_stop": 1, "broker_pause": 1,
            "node_kill": 1}


@dataclass(order=True)
class _Recovery:
    due: float
    seq: int
    what: str = field(compare=False)
    action: Callable[[], None] = field(compare=False)


class Nemesis:
    """Injects faults and undoes them; `tick` runs what is due and restarts processes that ended on their own."""

    def __init__(self, rng: random.Random, cluster: Cluster, producers: list[Role], trainer: Role, say: Say) -> None:
        self.rng = rng
        self.cluster = cluster
        self.producers = producers
        self.trainer = trainer
        self.say = say
        self.counts: Counter[str] = Counter()
        self.unexpected_exits: list[str] = []
        self.failures: list[str] = []  # process ends the nemesis did not cause: a foreign signal, a traceback
        self._recoveries: list[_Recovery] = []
        self._seq = itertools.count()
        self._awaiting: set[str] = set()  # roles killed by us, with a restart scheduled
        self._broker_fault = False

    # -- faults --------------------------------------------------------------------------------

    def inject(self) -> None:
        """Draw one fault kind among those with a target, and inject it."""
        kinds = [k for k in KINDS if self._possible(k)]
        if not kinds:
            return
        kind = self.rng.choices(kinds, weights=[_WEIGHTS[k] for k in kinds])[0]
        getattr(self, f"_{kind}")()
        self.counts[kind] += 1

    def _possible(self, kind: str) -> bool:
        if kind.startswith("producer"):
            return bool(self._targets(self.producers))
        if kind.startswith("trainer"):
            return bool(self._targets([self.trainer]))
        return not self._broker_fault

    @staticmethod
    def _targets(roles: list[Role]) -> list[Role]:
        return [r for r in roles if r.alive and not r.stopped]

    def _kill(self, role: Role, low_s: float, high_s: float) -> None:
        delay = self.rng.uniform(low_s, high_s)
        role.signal(signal.SIGKILL)
        self._awaiting.add(role.name)
        self.say(f"SIGKILL {role.name}; restart in {delay:.1f} s")

        def restart() -> None:
            self._awaiting.discard(role.name)
            if not role.alive:
                role.start()
                self.say(f"restarted {role.name} (start {role.starts})")
        self._later(delay, f"restart {role.name}", restart)

    def _stop(self, role: Role, low_s: float, high_s: float) -> None:
        delay = self.rng.uniform(low_s, high_s)
        role.signal(signal.SIGSTOP)
        self.say(f"SIGSTOP {role.name} for {delay:.1f} s")

        def resume() -> None:
            if role.signal(signal.SIGCONT):
                self.say(f"SIGCONT {role.name}")
        self._later(delay, f"SIGCONT {role.name}", resume)

    def _producer_kill(self) -> None:
        self._kill(self.rng.choice(self._targets(self.producers)), 0.5, 5.0)

    def _producer_stop(self) -> None:
        # Up to 15 s: longer than the producers' 10 s session timeout, so its prompts move to the other.
        self._stop(self.rng.choice(self._targets(self.producers)), 1.0, 15.0)

    def _trainer_kill(self) -> None:
        self._kill(self.trainer, 0.5, 4.0)

    def _trainer_stop(self) -> None:
        self._stop(self.trainer, 1.0, 10.0)

    def _broker_pause(self) -> None:
        node = self.rng.choice(self.cluster.nodes)
        delay = self.rng.uniform(3.0, 25.0)
        self.cluster.pause(node)
        self._broker_fault = True
        self.say(f"SIGSTOP broker node {node} for {delay:.1f} s")

        def resume() -> None:
            self.cluster.resume(node)
            self._broker_fault = False
            self.say(f"SIGCONT broker node {node}")
        self._later(delay, f"SIGCONT broker node {node}", resume)

    def _node_kill(self) -> None:
        node = self.rng.choice(self.cluster.nodes)
        delay = self.rng.uniform(5.0, 20.0)
        self.cluster.kill(node)
        self._broker_fault = True
        self.say(f"SIGKILL broker node {node}; restart in {delay:.1f} s")

        def restart() -> None:
            took = self.cluster.restart_node(node)
            self._broker_fault = False
            self.say(f"restarted broker node {node} (listening after {took:.1f} s)")
        self._later(delay, f"restart broker node {node}", restart)

    def _later(self, delay_s: float, what: str, action: Callable[[], None]) -> None:
        heapq.heappush(self._recoveries, _Recovery(time.monotonic() + delay_s, next(self._seq), what, action))

    # -- supervision ---------------------------------------------------------------------------

    def tick(self, *, restart_exited: bool = True) -> None:
        """Run the recoveries that are due; restart (and record) roles that ended without being
        killed (with ``restart_exited=False`` only those that failed)."""
        now = time.monotonic()
        while self._recoveries and self._recoveries[0].due <= now:
            heapq.heappop(self._recoveries).action()
        for role in [*self.producers, self.trainer]:
            code = role.reap()
            if code is None or role.name in self._awaiting:
                continue
            again = restart_exited or code != 0  # in the drain, rc 0 is a producer done (--exit-when-idle)
            self.say(f"{role.name} exited on its own with rc {code}" + ("; restarting" if again else ""))
            self.judge(role, code)
            if again:
                role.start()

    def judge(self, role: Role, code: int) -> None:
        """Record a process life of `role` that ended with `code` without the nemesis killing it."""
        if code != 0:
            self.unexpected_exits.append(f"{role.name} rc {code}:\n{role.tail()}")
        failure = role.bad_exit(code)
        if failure is not None:
            self.failures.append(failure)
            self.say(f"FAILURE: {failure.splitlines()[0]}")

    def heal(self) -> None:
        """Undo every outstanding fault now (in due order): continue, restart, resume."""
        while self._recoveries:
            recovery = heapq.heappop(self._recoveries)
            recovery.action()
        for role in [*self.producers, self.trainer]:
            if role.stopped:
                role.signal(signal.SIGCONT)
            if not role.alive:
                code = role.reap()
                if code is not None:
                    self.judge(role, code)
                role.start()
