"""The chaos run's default trainer: a long-lived Python loop over `RolloutConsumer`, as a training job holds one.

``python -m tests.chaos._trainer BOOTSTRAP NAMESPACE GROUP N OUT [TIMEOUT]``: take N groups with
``commit=False`` and a take timeout of TIMEOUT s (default 30; the consumer's timeout is the same), append
the step's lines to OUT as ``rollstream take --no-dynamic-sampling --out`` does (flushed and fsync'd before
the commit), then commit. A `TakeTimeout` (its diagnosis reads the cluster in the background), another
retriable error of a take (the broker unreachable at start) or a retriable failed commit is logged and tried
again, never fatal. SIGINT or SIGTERM closes the consumer and exits 130 / 143.
Anything else that escapes is a finding: the traceback goes to stderr and the chaos run fails on it.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from types import FrameType

from rollstream.consumers import (
    CommitError,
    RolloutConsumer,
    TakeTimeout,
    commit_until_committed,
    default_filters,
)
from rollstream.infra import KafkaConfig
from rollstream.schemas import RollstreamError

from rollstream.cli._consume import _appending, _write_step

RETRY_PAUSE_S = 1.0  # between a take that failed (not a timeout) and the next


class Stopped(Exception):
    """SIGINT or SIGTERM arrived (`code` is the exit status)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _stop(signum: int, _frame: FrameType | None) -> None:
    raise Stopped(128 + signum)


def _say_commit_failed(exc: CommitError) -> None:
    print(f"commit failed, trying again: {exc}", file=sys.stderr, flush=True)


def run(bootstrap: str, namespace: str, group: str, n: int, out: Path, timeout: float) -> None:
    config = KafkaConfig.load(bootstrap, client_id=f"chaos-trainer-{group}")
    with RolloutConsumer(config=config, group_id=group, namespace=namespace, timeout=timeout,
                         filters=default_filters(dynamic_sampling=False)) as consumer, \
            _appending(out) as (sink, durable):
        while True:
            try:
                batch = consumer.take(n, timeout=timeout, commit=False)
            except TakeTimeout as exc:
                print(f"take timed out: {str(exc)[:300]}", file=sys.stderr, flush=True)
                continue
            except RollstreamError as exc:
                if not exc.retriable:
                    raise
                print(f"take failed, trying again: {exc}", file=sys.stderr, flush=True)
                time.sleep(RETRY_PAUSE_S)
                continue
            _write_step(sink, batch, durable)
            commit_until_committed(consumer.commit, batch, _say_commit_failed)
            print(f"committed step {batch.step}", flush=True)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    bootstrap, namespace, group, n, out, *rest = argv
    try:
        run(bootstrap, namespace, group, int(n), Path(out), float(rest[0]) if rest else 30.0)
    except Stopped as stop:
        return stop.code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
