"""The per-sample loop of the HTTP engines (SGLang's ``/generate``, vLLM's ``/v1/completions``), written once.

One sample is one request, sent to the next server in turn. A try that fails for a passing reason
(connection, timeout, HTTP 408/429/5xx, a body that is not the engine's shape in a way another try may
fix) is tried again after a `Backoff`, at most `RetryPolicy.attempts` tries; any other 4xx fails at once.
A server that could not take the request at all is asked again after a backoff for as long as the deadline
lasts, and those tries count against nothing else: one refusing it because it is paused (vLLM 0.33's 503
around a weight update, `Endpoint.paused`), one answering it without having run any of it (vLLM's abort
before the first token, `Endpoint.not_run`), or one that no connection reached (down, or restarting: a vLLM
server takes a minute to start again). An answer that finished is the sample. An aborted answer with output
(a weight update) goes to the sample's `Rollout`, which says what to send next: the continuation of its
partial output or the same request again (`PartialRollout`, one implementation for every engine: what
differs is only how an engine's continuation body is built), bounded by its own counts.

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
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, TypeVar

from rollstream.producers.engines._http import HTTPSession, RoundRobin, Stream, post_json
from rollstream.producers.engines._retry import Deadline, RetryPolicy, out_of_time
from rollstream.producers.engines.base import Completion, EngineError
from rollstream.schemas import VersionSpan

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_PAUSED = "is paused (a weight update?)"

PartialRollouts = Literal["continue", "restart"]
PARTIAL_ROLLOUTS: tuple[PartialRollouts, ...] = ("continue", "restart")


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
    # an answer that says the server ran none of the request (vLLM: aborted before its first token, as a
    # request queued or just admitted when a weight update paused it): waited out as `paused` is
    not_run: Callable[[Completion], bool] | None = None
    # awaited with a server's URL as a request is about to be sent (it may hold the request back a moment);
    # what it returns gets that server's parsed answer and may amend it (`VLLMSyncEngine` stamps the version
    # that server served)
    ticket: Callable[[str], Awaitable[Callable[[Completion], Completion]]] | None = None
    # makes the `Stream` each try's answer is read into, for a body that asks for server-sent events (a sample
    # whose progress is checkpointed as it is generated); None: one JSON answer
    stream: Callable[[], Stream] | None = None


def join_segments(segments: Sequence[Completion]) -> Completion:
    """One completion from the segments of a continued sample: tokens, logprobs and texts concatenated,
    each segment's version spans shifted by its offset (adjacent spans of one version merged), the last
    segment's finish reason. If a segment with tokens has no known version, the result has none."""
    if len(segments) == 1:
        return segments[0]
    tokens = [int(t) for s in segments for t in s.tokens]
    logprobs = None if any(s.logprobs is None for s in segments) else [
        float(p) for s in segments for p in s.logprobs]  # type: ignore[union-attr]
    spans: list[VersionSpan] = []
    offset, known = 0, True
    for segment in segments:
        if len(segment.tokens) and not segment.version_spans:
            known = False
        for span in segment.version_spans:
            if spans and spans[-1].version == span.version and spans[-1].end == offset + span.start:
                spans[-1] = replace(spans[-1], end=offset + span.end)
            else:
                spans.append(VersionSpan(span.version, offset + span.start, offset + span.end))
        offset += len(segment.tokens)
    if not known:
        spans = []
    version = spans[-1].version if spans else (segments[-1].policy_version if not tokens else None)
    return Completion(text="".join(s.text for s in segments), tokens=tokens, logprobs=logprobs,
                      finish_reason=segments[-1].finish_reason, policy_version=version, version_spans=tuple(spans))


class PartialRollout:
    """One sample across the aborts of weight updates: what to send next, and when it is finished.

    With ``continue``, an aborted answer that carries tokens is kept and the next request continues it on
    the (new) weights from prompt + tokens so far, its token budget (`max_new`) reduced by what was
    generated, at most `max_continuations` times; the segments are joined (`join_segments`), each with its
    own version spans. `continued` builds that request from the tokens so far, in the engine's terms
    (SGLang: ``input_ids`` and ``sampling_params.max_new_tokens``/``min_new_tokens``; vLLM: ``prompt`` as
    token ids and ``max_tokens``/``min_tokens``), or returns None when it cannot (a prompt sent as text
    whose token ids are not known). With ``restart``, or when `continued` cannot, an aborted answer is
    dropped and the request is issued again as it was, at most `abort_attempts` times; so is an abort
    without tokens in both modes. Pure: no I/O.
    """

    def __init__(self, body: Mapping[str, Any], *, continued: Callable[[Sequence[int]], Mapping[str, Any] | None],
                 max_new: int, mode: PartialRollouts = "continue", max_continuations: int = 4,
                 abort_attempts: int = 20) -> None:
        if mode not in PARTIAL_ROLLOUTS:
            raise EngineError(f"partial rollouts {mode!r}: use continue or restart", retriable=False)
        self._next: Mapping[str, Any] = dict(body)
        self._continued = continued
        self._continue = mode == "continue"
        self._max_new = max_new
        self._max_continuations = max_continuations
        self._abort_attempts = abort_attempts
        self._segments: list[Completion] = []
        self.continuations = 0
        self.aborts = 0

    def payload(self) -> Mapping[str, Any]:
        """The body of the next request: the original one, or its continuation."""
        return self._next

    def so_far(self, partial: Completion) -> Completion:
        """The sample as far as it is generated: the segments kept, then `partial` (the request running)."""
        return join_segments([*self._segments, partial])

    def add(self, completion: Completion, where: str = "") -> Completion | None:
        """Take one answer: the finished sample, or None when the next `payload` must be sent.

        Raises:
            EngineError: aborted more often than allowed (retriable when continuations ran out: the
                producer may try the prompt again).
        """
        if completion.finish_reason != "abort":
            return join_segments([*self._segments, completion])
        prefix = [int(t) for s in (*self._segments, completion) for t in s.tokens]
        following = self._continued(prefix) if self._continue and len(completion.tokens) else None
        if following is not None:
            self.continuations += 1
            if self.continuations > self._max_continuations:
                raise EngineError(f"sample aborted {self.continuations} times with partial output{where}; more "
                                  f"than {self._max_continuations} continuations", retriable=True)
            self._segments.append(completion)
            if len(prefix) >= self._max_new:  # the abort came with the last token: nothing left to generate
                return join_segments([*self._segments[:-1], replace(completion, finish_reason="length")])
            self._next = following
            return None
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
            raise out_of_time(deadline, endpoint.label, error)
        url = servers.pick()
        completion, note, failure, waiting = await _try(http, url, endpoint, rollout.payload(), deadline)
        if completion is None and deadline.expired:  # cut short by the deadline itself: the failure before says why
            raise out_of_time(deadline, endpoint.label, error or failure)
        error = failure
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
    refused it, `Endpoint.paused`, or ran none of it, `Endpoint.not_run`; "is unreachable (down or
    restarting?)": no connection), else "". The completion has passed through the `Endpoint.ticket` taken
    as it was sent.

    Raises:
        EngineError (not retriable): a 4xx the server will refuse again, or an answer that never fits.
    """
    seen = await endpoint.ticket(url) if endpoint.ticket is not None else None
    answer = await post_json(http.client, url, endpoint.path, body, timeout=http.timeout_within(deadline),
                             stream=endpoint.stream() if endpoint.stream is not None else None)
    if answer.error is not None:
        if not answer.reached:
            return None, "", answer.error, "is unreachable (down or restarting?)"
        paused = (answer.status is not None and endpoint.paused is not None
                  and endpoint.paused(answer.status, answer.error))
        return None, "", answer.error, _PAUSED if paused else ""
    try:
        completion, note = endpoint.parse(answer.out)
    except EngineError as exc:
        if exc.retriable:
            return None, "", f"{url}: {exc}", ""
        raise
    if seen is not None:
        completion = seen(completion)
    if endpoint.not_run is not None and endpoint.not_run(completion):
        return None, "", f"{url}: {completion.finish_reason} before the first token ({note or 'paused?'})", _PAUSED
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
