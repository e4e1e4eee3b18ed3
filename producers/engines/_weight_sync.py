"""What the engines that update their own servers' weights share (`SGLangSyncEngine`, `VLLMSyncEngine`), written
once: their `ReloadableEngine` side (`FleetEngine`), which version each server serves (`ServerFleet`), the
update of every server to an announced version with the failures gathered into one error, one server's
update (pause, load, label, record, resume: resume whatever happened, so no server stays paused), the
control calls (`control`) and reading a server's version at start (`read_version`). What differs per engine
is only its `UpdateSteps` and the route its servers report their version on. Loop-only.

Which version served a request, for servers that report no per-token versions (vLLM before 0.33:
`ServerFleet.ticket`). Updates pause with mode ``abort``. vLLM's engine core handles that pause in one step
(vllm/v1/engine/core.py ``pause_scheduler``, 0.32.0): it aborts every request it holds, running or still
waiting (their answers come back with finish reason ``abort`` and the tokens they had, maybe none), then
sets PAUSED_NEW, under which a new request is queued (0.32) or refused HTTP 503 (0.33) until ``/resume``.
So the tokens of one request all come from one *era* of its server, the time between two resumes, and a
request runs in the era it was sent in or, queued by a pause, in the next one. The fleet numbers each
server's eras and records the version of the next era once the reload is done (the new version, or the old
one when the reload failed) and before ``/resume`` lets anything run on it. A request's era is then known
from both ends: no earlier than the era it was sent in (the next one when it was sent while the server was
known to be paused: it queues), no later than the era its answer arrived in (nothing runs in an era before
its resume). When every era in that range served one known version, the answer is stamped with it;
otherwise it is left without a version (the producer then stamps the announced one, `rollstream.producers.
policy`). A request is not sent while a pause is on its way to its server (between ``/pause`` sent and
answered: it could run before the pause or after it): its ticket waits the pause out, which costs nothing,
since the server runs nothing then. So the continuation of a sample the pause aborted, which goes out at
once (to whichever server is next), is queued for the new era and stamped with the new version. Taking "the
version when the answer arrives" instead would stamp the new version on an answer that finished on the old
weights but was read after the reload (a busy event loop), and the old version on a request queued by the
pause and run on the new weights; here such an answer, arriving an era later than it was sent, stays
unstamped unless both eras served one version.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import httpx
from rollstream.producers.engines._sglang_format import parse_policy_version
from rollstream.producers.engines.base import Completion, EngineError
from rollstream.schemas import VersionSpan

log = logging.getLogger(__name__)
_TRANSPORT_TRIES = 3  # a control call whose connection the server closed (vLLM after a 500) is sent again
_TRANSPORT_BACKOFF_S = 0.2


class UpdateSteps(Protocol):
    """One engine's steps of a server's weight update; each raises EngineError naming the server."""

    label: str  # "SGLang", "vLLM": names the servers in logs and errors

    async def pause(self, url: str) -> None: ...

    async def load(self, url: str, weights_path: str, version: int) -> None:
        """Load the weights (the server keeps its old ones when this raises)."""

    async def label_version(self, url: str, version: int) -> None:
        """Have the server report `version` from now on (a no-op where `load` did it)."""

    async def resume(self, url: str) -> None: ...


@dataclass
class _Server:
    eras: list[int | None] = field(default_factory=lambda: [None])  # the version each era served; [-1]: now
    paused: bool = False  # a pause of ours is in effect (its /pause answered) until the next era begins
    pausing: asyncio.Event | None = None  # while a /pause of ours is on its way: set once it answered (or failed)
    loaded: tuple[int, str] | None = None  # (version, weights_path) this fleet last updated it to, fully

    def record(self, version: int | None) -> None:
        """A new era begins (before its resume), serving `version`."""
        self.eras.append(version)
        self.paused = False
        self.settle()

    def settle(self) -> None:
        if self.pausing is not None:
            self.pausing.set()
            self.pausing = None


class ServerFleet:
    """The servers of one engine and the version each serves, as far as the engine knows. Loop-only."""

    def __init__(self, urls: Sequence[str]) -> None:
        self._servers = {url: _Server() for url in urls}

    async def start(self, read_version: Callable[[str], Awaitable[int | None]]) -> None:
        """Read the version each server serves at start, concurrently (None: unknown)."""
        urls = list(self._servers)
        for url, version in zip(urls, await asyncio.gather(*(read_version(u) for u in urls)), strict=True):
            self._servers[url].eras[-1] = version

    def serving(self) -> dict[str, int | None]:
        """The version each server serves (None: unknown), a copy."""
        return {url: server.eras[-1] for url, server in self._servers.items()}

    @property
    def policy_version(self) -> int | None:
        """The oldest version any server serves (None while one is unknown)."""
        versions = [server.eras[-1] for server in self._servers.values()]
        return None if None in versions else min(v for v in versions if v is not None)

    async def reload(self, weights_path: str, version: int, steps: UpdateSteps) -> bool:
        """Update every server to `version` (concurrently; each one paused only for its own update),
        whatever the number each reports (a new trainer run's may be lower, or equal with other weights;
        the producer skips what is served already), except the servers this fleet fully updated to this
        very `version` from this very `weights_path` (a retry after some servers failed updates only those).
        A server whose load fails keeps serving its weights and its version, and is resumed. Returns True.

        Raises:
            EngineError: some servers failed (named, with the server's message; retriable unless one
                failure is not); the others serve `version`.
        """
        urls = [u for u, s in self._servers.items() if s.loaded != (version, weights_path)]
        results = await asyncio.gather(*(self._update(u, weights_path, version, steps) for u in urls),
                                       return_exceptions=True)
        failed: list[EngineError] = []
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, EngineError):
                failed.append(result)
            elif isinstance(result, BaseException):
                raise result
            else:
                self._servers[url].loaded = (version, weights_path)
        if failed:
            raise EngineError(f"policy version {version} ({weights_path}) not loaded on {len(failed)} of "
                              f"{len(urls)} {steps.label} servers, which keep serving their weights: "
                              f"{'; '.join(map(str, failed))}", retriable=all(e.retriable for e in failed))
        log.info("policy version %d from %s loaded on %d %s servers", version, weights_path, len(urls), steps.label)
        return True

    async def _update(self, url: str, weights_path: str, version: int, steps: UpdateSteps) -> None:
        """Pause, load, label, record the next era's version, resume one server; resume runs whatever
        happened before it, so no server stays paused."""
        server = self._servers[url]
        old, next_version = server.eras[-1], server.eras[-1]
        error: EngineError | None = None
        server.pausing = asyncio.Event()
        try:
            await steps.pause(url)
            server.paused = True
            server.settle()
            await steps.load(url, weights_path, version)
            next_version = None  # new weights, not yet labelled: unknown until the label is set
            await steps.label_version(url, version)
            next_version = version
        except EngineError as exc:
            error = exc
        finally:  # also when cancelled (the producer stops): no server stays paused, no ticket waits
            server.record(next_version)
            try:
                await steps.resume(url)
            except EngineError as exc:
                log.error("%s may still be paused: %s", url, exc)
                error = error or exc
        if error is not None:
            if next_version != old:
                log.error("%s serves version %s after a failed update", url, next_version)
            raise error

    async def ticket(self, url: str) -> Callable[[Completion], Completion]:
        """Taken as a request is sent to `url` (after a pause on its way there, if one is): stamps that
        server's answer with the version it ran on, when that is certain (see the module docstring); an
        answer with its own version spans is left as it is."""
        server = self._servers[url]
        while server.pausing is not None:
            await server.pausing.wait()  # bounded: the /pause call has its timeout, and records an era after
        first = len(server.eras) - 1 + (1 if server.paused else 0)

        def stamp(completion: Completion) -> Completion:
            if completion.version_spans or not len(completion.tokens):
                return completion
            last = min(len(server.eras) - 1, first + 1)
            versions = set(server.eras[first:last + 1])
            if len(versions) != 1 or None in versions:
                return completion
            (version,) = versions
            return replace(completion, policy_version=version,
                           version_spans=(VersionSpan(int(version), 0, len(completion.tokens)),))
        return stamp


class FleetEngine:
    """The `ReloadableEngine` side of an HTTP engine that updates its own servers' weights, mixed in before
    that engine (`SGLangSyncEngine`, `VLLMSyncEngine`): it sets `_fleet` and `_steps` and says how a server
    reports its version (`_read_version`)."""

    _fleet: ServerFleet
    _steps: UpdateSteps

    async def start(self) -> None:
        """Start the engine, then read the version each server serves (best effort: unknown on failure)."""
        await super().start()  # type: ignore[misc]
        await self._fleet.start(self._read_version)

    @property
    def policy_version(self) -> int | None:
        """The oldest version any server serves (None while one is unknown)."""
        return self._fleet.policy_version

    def serving(self) -> dict[str, int | None]:
        """The version each server serves, as far as this engine knows (a copy)."""
        return self._fleet.serving()

    async def reload(self, weights_path: str, version: int) -> bool:
        """Update every server to `version` from `weights_path` (`ServerFleet.reload`: concurrently, each one
        paused only for its own update; a server whose load fails keeps its weights and its version, and is
        resumed). Returns True.

        Raises:
            EngineError: some servers failed (named, with the server's message); the others serve `version`.
        """
        return await self._fleet.reload(weights_path, version, self._steps)

    async def _read_version(self, url: str) -> int | None:
        raise NotImplementedError


def _message(resp: httpx.Response) -> str:
    """The server's own words in an error answer: SGLang's ``message``, vLLM's ``error.message`` or
    ``error``, FastAPI's ``detail``, else the body's start."""
    try:
        out = resp.json()
    except ValueError:
        return resp.text[:300]
    if isinstance(out, dict):
        error = out.get("error")
        found = out.get("message") or (error.get("message") if isinstance(error, dict) else error) or out.get(
            "detail")
        if found:
            return str(found)[:500]
    return resp.text[:300]


async def control(client: httpx.AsyncClient | None, url: str, path: str, body: Mapping[str, Any] | None, *,
                  timeout_s: float, connect_timeout_s: float, not_found: str = "") -> Any:
    """POST one control request (JSON `body`; None: no body) to `url` + `path`, waiting up to `timeout_s`;
    sent again, at most 3 times, when the connection broke before an answer (a server closes a kept-alive
    connection after an error). Returns the decoded JSON answer ({} when it is not JSON).

    Raises:
        EngineError: naming the server and its message: on an HTTP error or ``success: false`` (not
            retriable on a 404, with `not_found` as the fix), a timeout or a connection that kept breaking.
    """
    if client is None:
        raise EngineError(f"{url}{path}: the engine is not started", retriable=False)
    timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
    for attempt in range(1, _TRANSPORT_TRIES + 1):
        try:
            resp = await client.post(f"{url}{path}", json=None if body is None else dict(body), timeout=timeout)
            break
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            if attempt == _TRANSPORT_TRIES:
                raise EngineError(f"{url}{path}: {type(exc).__name__}: {exc}", retriable=True) from exc
            await asyncio.sleep(_TRANSPORT_BACKOFF_S * attempt)
        except httpx.HTTPError as exc:
            raise EngineError(f"{url}{path}: {type(exc).__name__}: {exc}", retriable=True) from exc
    try:
        out = resp.json()
    except ValueError:
        out = {}
    if resp.status_code == 404 and not_found:
        raise EngineError(f"{url}{path}: HTTP 404: {not_found}", retriable=False)
    if resp.status_code >= 400 or (isinstance(out, dict) and out.get("success") is False):
        raise EngineError(f"{url}{path}: HTTP {resp.status_code}: {_message(resp)}", retriable=True)
    return out


async def read_version(client: httpx.AsyncClient | None, url: str, route: str, *, timeout_s: float,
                       connect_timeout_s: float) -> tuple[bool, int | None]:
    """(whether `route` answered, the ``weight_version`` it gave: a number, else None) from ``GET url+route``.
    A 404 is (False, None): the server has no such route. Best effort: another failure is logged, (True, None)."""
    if client is None:
        return True, None
    try:
        resp = await client.get(f"{url}{route}", timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s))
        if resp.status_code == 404:
            return False, None
        resp.raise_for_status()
        return True, parse_policy_version(resp.json().get("weight_version"))
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        log.warning("could not read the weight version of %s from %s (%s): taken as unknown", url, route, exc)
        return True, None
