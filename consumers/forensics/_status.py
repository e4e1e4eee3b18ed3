"""Why a trainer waits: a read-only report of a namespace (`status`).

`status` reads three parts one after another, each in one kept thread (`rollstream.infra.threads.BoundedCaller`), all
within one deadline (the reads are in `rollstream.consumers.forensics._status_read`):

- producers: the members of the producers' consumer group on NS.prompts (DescribeConsumerGroups: member,
  client and instance ids, host, assigned partitions) and the state each producer writes into the metadata
  of its prompt-offset commits (`rollstream.infra.producer_state.ProducerState`: paused by backpressure or open, since
  when, when written);
- trainer: the trainer group's lag on NS.rollouts, its last step and that step's age, the dispositions of
  its last `recent_steps` effective steps by kind and reason label (from the newest records of NS.steps,
  with the consumer's own ledger rules), and a peek at the next `peek` groups past its committed offsets,
  judged as a take with the default filters would judge them (`rollstream.consumers._gather.judge`);
- prompts (last: it reads until its deadline): NS.prompts past the producers' committed offsets (no commit:
  from the log start), counted exactly from the offsets, and decoded by epoch up to `max_prompts` records
  (beyond that the epochs are "at least"); requeued prompts (attempt > 0) counted apart, undecodable records too.

The report types are in `rollstream.consumers.forensics._status_report`, the causes and their wording in
`forensics._status_causes`, `TakeTimeout`'s diagnosis in `forensics._diagnose`.

Contract (pinned by tests/integration/test_status.py):

- Read-only: commits nothing and joins no group (explicit assignment; members come from the admin API).
- Bounded: `status` returns within about `timeout` s whatever the cluster does.
- Never raises for a part it could not read: `StatusReport.unavailable` names the part and why, and the
  diagnosis uses whatever was read.
- The diagnosis names the likely cause when a trainer would wait: NS.prompts empty, prompts exhausted,
  no producer, every producer paused by backpressure, every group looked at skipped by the filters.
  A cause is *blocking* when work is left that cannot reach the trainer without someone acting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from confluent_kafka import KafkaException
from rollstream.consumers.filters import default_filters
from rollstream.consumers.forensics._status_causes import causes_of, unavailable_note
from rollstream.consumers.forensics._status_read import TrainerAsk, read_producers, read_prompts, read_trainer
from rollstream.consumers.forensics._status_report import (
    PARTS,
    Diagnosis,
    ProducersReport,
    PromptsReport,
    StatusReport,
    TrainerReport,
)
from rollstream.infra import DEFAULT_TRAINER_GROUP, KafkaConfig, TopicNames
from rollstream.infra.kafka_errors import kafka_error
from rollstream.infra.threads import BoundedCaller
from rollstream.schemas import RollstreamError, now_ms

_ORDER = ("producers", "trainer", "prompts")  # the prompt scan reads until its deadline: last
_MAX_WHY = 300
_MIN_PART_S = 0.05  # less time left than this: the part is not started
_T = TypeVar("_T")
_Read = Callable[[float, float], object]  # (each read's timeout, the part's scan deadline) -> its report


def status(config: KafkaConfig, namespace: str, *, trainer_group: str = DEFAULT_TRAINER_GROUP,
           producer_group: str | None = None, recent_steps: int = 10, max_prompts: int = 200_000,
           peek: int = 100, max_staleness: int | None = None, policy_version: int | None = None,
           dynamic_sampling: bool = True, timeout: float = 10.0, parts: Iterable[str] = PARTS,
           caller: BoundedCaller | None = None) -> StatusReport:
    """Read the status of `namespace` (see the module docstring). Thread-safe (clients of its own).

    Blocks up to about `timeout` s: the parts are read one after another in `caller`'s kept thread (None: one
    of its own, ended on return), each waited for at most the time left; a part not read by then is reported
    in ``unavailable`` (a read that overruns ends on its own, and `caller` gets a fresh thread). Commits
    nothing. `policy_version` (default: the last step's) and `max_staleness` judge staleness in the peek;
    `parts` chooses among ``PARTS``.

    Raises:
        ConfigError: `namespace` is not a valid namespace. Nothing else: what cannot be read is reported.
    """
    names = TopicNames(namespace)
    pgroup = producer_group or names.producer_group
    ask = TrainerAsk(recent_steps, peek, default_filters(dynamic_sampling=dynamic_sampling), max_staleness,
                     policy_version)
    wanted = set(parts)
    own = caller is None
    runner = BoundedCaller("rollstream-status") if caller is None else caller
    reads: dict[str, _Read] = {
        "producers": lambda t, _d: read_producers(config, names.prompts, pgroup, t),
        "trainer": lambda t, d: read_trainer(config, names, trainer_group, ask, t, d),
        "prompts": lambda t, d: read_prompts(config, names.prompts, pgroup, max_prompts, t, d),
    }
    try:
        results, unavailable = _read_within({p: reads[p] for p in _ORDER if p in wanted}, timeout, runner)
    finally:
        if own:
            runner.close()
    producers = _typed(results.get("producers"), ProducersReport)
    prompts = _typed(results.get("prompts"), PromptsReport)
    trainer = _typed(results.get("trainer"), TrainerReport)
    diagnosis = Diagnosis(causes=causes_of(names, pgroup, producers, prompts, trainer, trainer_group=trainer_group),
                          note=unavailable_note(unavailable), read_at_ms=now_ms())
    return StatusReport(namespace, pgroup, trainer_group, now_ms(), producers, prompts, trainer, unavailable,
                        diagnosis)


def _read_within(reads: dict[str, _Read], timeout: float, caller: BoundedCaller
                 ) -> tuple[dict[str, object], dict[str, str]]:
    """Run each read in turn in `caller`'s thread, all within `timeout` s. (results, part -> why not), in PARTS
    order. Each read's own timeouts are most of the time left, so most end with their own error first."""
    deadline = time.monotonic() + timeout
    results: dict[str, object] = {}
    failed: dict[str, str] = {}
    for name, read in reads.items():
        left = deadline - time.monotonic()
        if left < _MIN_PART_S:
            failed[name] = f"no time left within the {timeout:g} s timeout (the other parts took it); raise it"
            continue
        budget = 0.8 * left
        ends = time.monotonic() + budget

        def job(read: _Read = read, budget: float = budget, ends: float = ends) -> object:
            return read(budget, ends)

        try:
            finished, value = caller.call(job, left)
        except Exception as exc:  # noqa: BLE001 - reported, never raised: the contract
            failed[name] = _why(exc)
            continue
        if finished:
            results[name] = value
        else:
            failed[name] = f"no answer within {left:.3g} s; is the cluster reachable (rollstream broker status)?"
    return results, {p: failed[p] for p in PARTS if p in failed}


def _typed(value: object, cls: type[_T]) -> _T | None:
    return value if isinstance(value, cls) else None


def _why(exc: BaseException) -> str:
    if isinstance(exc, KafkaException):
        exc = kafka_error("Kafka", exc)
    if isinstance(exc, TimeoutError):
        return "no answer in time; is the cluster reachable (rollstream broker status)?"
    text = str(exc) if isinstance(exc, RollstreamError) else f"{type(exc).__name__}: {exc}"
    return text[:_MAX_WHY]
