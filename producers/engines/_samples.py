"""The per-sample loop of the HTTP engines (SGLang's ``/generate``, vLLM's ``/v1/completions``), written once.

One sample is one request, sent to the next server in turn. A try that fails for a passing reason
(connection, timeout, HTTP 408/429/5xx, a body that is not the engine's shape in a way another try may
fix) is tried again after a `Backoff`, at most `RetryPolicy.attempts` tries; any other 4xx fails at once.
A server that could not take the request at all is asked again after a backoff for as long as the deadline
lasts, and those tries count against nothing else: one refusing it because it is paused (vLLM's 503 around a
weight update, `Endpoint.paused`), or one that no connection reached (down, or restarting: a vLLM server
takes a minute to start again).
An answer that finished is the sample. An aborted answer (a weight update) goes to the sample's `Rollout`,
which says what to send next: the continuation of its partial output (SGLang's `PartialRollout`) or the
same request again (`Reissue`), bounded by its own counts.

Everything runs under the group's `Deadline`: each request waits at most ``min(request timeout, what is
left)``, each backoff sleeps at most what is left, and once nothing is left the sample ends with a
retriable `EngineError` naming the last failure. What differs between engines (the path, parsing an
answer) is passed in as an `Endpoint`. Loop-only.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from rollstream.producers.engines._http import HTTPSession, RoundRobin, post_json
from rollstream.producers.engines._retry import Deadline, RetryPolicy
from rollstream.producers.engines.base import Completion, EngineError

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class Rollout(Protocol):
    """One sample across aborts: the next request's body, and whether an answer finished it."""

    aborts: int  # re-issues from scratch so far (a backoff precedes each)

    def payload(self) -> Mapping[str, Any]:
        """The body of the next request."""
        ...

    def add(self, completion: Completion, where: str = "") -> Completion | None:
        """Take one answer: the finished sample, or None when the next `payload` must be sent.

        Raises:
            EngineError: aborted more often than allowed.
        """
        ...


@dataclass(frozen=True)
class Endpoint:
    """What one engine's samples differ in. `parse` turns a decoded JSON answer into (the completion, why it
    was aborted when it was) and raises EngineError for an answer not of the engine's shape (retriable: try
    again)."""

    label: str  # "sglang /generate": names the engine in errors and logs
    path: str
    parse: Callable[[Any], tuple[Completion, str]]
    paused: Callable[[int, str], bool] | None = None  # (status, error) -> the server refused it while paused


class Reissue:
    """A sample whose aborted answers are dropped and its request issued again as it was, at most
    `abort_attempts` times (vLLM's; SGLang's ``restart`` is `PartialRollout`'s)."""

    def __init__(self, body: Mapping[str, Any], abort_attempts: int) -> None:
        self._body = body
        self._abort_attempts = abort_attempts
        self.aborts = 0

    def payload(self) -> Mapping[str, Any]:
        return self._body

    def add(self, completion: Completion, where: str = "") -> Completion | None:
        if completion.finish_reason != "abort":
            return completion
        self.aborts += 1
        if self.aborts > self._abort_attempts:
            raise EngineError(f"request aborted {self.aborts} times{where}; giving up", retriable=False)
        return None


async def run_sample(http: HTTPSession, servers: RoundRobin, endpoint: Endpoint, rollout: Rollout, *,
                     retry: RetryPolicy, deadline: Deadline, rng: random.Random) -> Completion:
    """One sample to its end, as the module docstring says.

    Raises:
        EngineError: not retriable after `retry.attempts` failed tries (the engine already retried), on a
            4xx, or when the rollout gives up; retriable when the deadline ran out (or the rollout says so).
    """
    failures = waits = 0
    error: str | None = None
    while True:
        if deadline.expired:
            raise deadline.error(endpoint.label, error)
        url = servers.pick()
        completion, note, error, waiting = await _try(http, url, endpoint, rollout.payload(), deadline)
        if waiting:  # a weight update or a restart: wait it out within the deadline, whatever it takes
            waits += 1
            if waits == 1:
                log.info("%s: %s %s; waiting for it within the group's deadline", endpoint.label, url, waiting)
            await retry.backoff.sleep(waits, rng, deadline)
            continue
        waits = 0
        if completion is None:
            failures += 1
            if failures >= retry.attempts:
                raise EngineError(f"{endpoint.label} failed {failures} times; last: {error}", retriable=False)
            log.warning("%s failed (%s); retry %d/%d", endpoint.label, error, failures, retry.attempts - 1)
            await retry.backoff.sleep(failures, rng, deadline)
            continue
        aborts = rollout.aborts
        done = rollout.add(completion, f" (last by {url}: {note or 'abort'})")
        if done is not None:
            return done
        error = f"{url}: aborted ({note or 'abort'})"
        if rollout.aborts > aborts:  # issued again from scratch: back off, the server may be busy updating
            log.info("%s: request aborted by %s (%s); issuing it again", endpoint.label, url, note or "abort")
            await retry.backoff.sleep(min(rollout.aborts, 3), rng, deadline)
        else:
            log.info("%s: request aborted by %s after %d tokens (%s); continuing it", endpoint.label, url,
                     len(completion.tokens), note or "abort")


async def _try(http: HTTPSession, url: str, endpoint: Endpoint, body: Mapping[str, Any],
               deadline: Deadline) -> tuple[Completion | None, str, str | None, str]:
    """One POST: (completion, abort note, None, ""), or (None, "", why, waiting) when another try may work;
    `waiting` says why the server could not take the request at all ("is paused (a weight update?)": it
    refused it, `Endpoint.paused`; "is unreachable (down or restarting?)": no connection), else "".

    Raises:
        EngineError (not retriable): a 4xx the server will refuse again, or an answer that never fits.
    """
    answer = await post_json(http.client, url, endpoint.path, body, timeout=http.timeout_within(deadline))
    if answer.error is not None:
        if not answer.reached:
            return None, "", answer.error, "is unreachable (down or restarting?)"
        paused = (answer.status is not None and endpoint.paused is not None
                  and endpoint.paused(answer.status, answer.error))
        return None, "", answer.error, "is paused (a weight update?)" if paused else ""
    try:
        completion, note = endpoint.parse(answer.out)
    except EngineError as exc:
        if exc.retriable:
            return None, "", f"{url}: {exc}", ""
        raise
    return completion, note, None, ""


async def gather_or_cancel(coros: Sequence[Awaitable[_T]]) -> list[_T]:
    """Run all; on the first failure cancel the rest and raise that failure (not an ExceptionGroup)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
