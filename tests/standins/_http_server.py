"""What the HTTP stand-ins of engine servers share: a server on 127.0.0.1 run by its own event loop in a
daemon thread, minimal HTTP/1.1 (keep-alive, Content-Length bodies: what httpx sends; `Events` as server-sent
events, all at once, `LiveEvents` as they come), a request log,
and a condition the simulated engine waits on. A stand-in subclasses `StandInServer` and implements
`_route` (and `_watches_clients` to cancel a request whose client has gone away, as engines abort it)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Self, TypeVar

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error",
            503: "Service Unavailable"}
_WATCH_S = 0.01  # how often a request is checked for its client having gone away (`_watches_clients`)
_T = TypeVar("_T")


class Events(list):
    """A reply sent as server-sent events: ``data: {json}`` per chunk, then ``data: [DONE]``."""


class LiveEvents:
    """A reply sent as server-sent events as `chunks` yields them (chunked transfer encoding), then ``data:
    [DONE]``. Once the client has gone away `chunks` is closed: the generation stops."""

    def __init__(self, chunks: AsyncGenerator[Any, None]) -> None:
        self.chunks = chunks


def _event(chunk: Any) -> bytes:
    return b"data: [DONE]\n\n" if chunk == "[DONE]" else f"data: {json.dumps(chunk)}\n\n".encode()


class StandInServer:
    """Lifecycle and HTTP of one stand-in. `requests` logs ``(path, body)`` of every request in arrival
    order (what `_route` appends). Lifecycle methods may be called from any thread."""

    def __init__(self, label: str) -> None:
        self.label = label  # "vLLM", "SGLang": names the stand-in in its errors
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{label.lower()}-standin", daemon=True)
        self._changed: asyncio.Condition | None = None
        self._server: asyncio.Server | None = None

    # -- lifecycle (any thread) -------------------------------------------------------------------

    def start(self) -> Self:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(10)
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shut(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_until(self, condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"stand-in {self.label}: timed out waiting for {what}")
            time.sleep(0.005)

    async def _open(self) -> None:
        self._changed = asyncio.Condition()
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _shut(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the simulated engine's state changes ----------------------------------------------------

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def _wait_for(self, condition: Callable[[], bool]) -> None:
        assert self._changed is not None
        async with self._changed:
            await self._changed.wait_for(condition)

    # -- HTTP/1.1 -------------------------------------------------------------------------------------

    def _watches_clients(self) -> bool:
        """Whether a request is cancelled once its client has gone away (as vLLM aborts it), not answered."""
        return False

    async def _route(self, method: str, path: str, query: str, raw: bytes) -> tuple[int, Any] | None:
        """The answer to one request: (status, JSON body or None), or None to close the connection
        without answering."""
        raise NotImplementedError

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                method, target, _ = line.decode().split(" ", 2)
                headers = {}
                while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, value = header.decode().split(":", 1)
                    headers[name.strip().lower()] = value.strip()
                raw = await reader.readexactly(int(headers.get("content-length", 0)))
                path, _, query = target.partition("?")
                answering = self._route(method, path, query, raw)
                answer = await (_unless_gone(reader, answering) if self._watches_clients() else answering)
                if answer is None:
                    break  # closed without an answer: httpx sees RemoteProtocolError
                status, reply = answer
                if isinstance(reply, LiveEvents):
                    if not await _send_live(reader, writer, status, reply):
                        break
                    continue
                kind = "text/event-stream" if isinstance(reply, Events) else "application/json"
                if isinstance(reply, Events):
                    data = b"".join(_event(chunk) for chunk in [*reply, "[DONE]"])
                else:
                    data = b"" if reply is None else json.dumps(reply).encode()
                writer.write(f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {kind}\r\n"
                             f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def _unless_gone(reader: asyncio.StreamReader, answering: Awaitable[_T]) -> _T | None:
    """`answering`'s result, or None (it cancelled) once the client has closed its end."""
    task = asyncio.ensure_future(answering)
    while not task.done():
        await asyncio.wait({task}, timeout=_WATCH_S)
        if not task.done() and reader.at_eof():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
    return task.result()


async def _send_live(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int,
                     reply: LiveEvents) -> bool:
    """`reply`'s events, each as its chunk comes; False when the client went away before the end."""
    writer.write(f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: text/event-stream\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n".encode())
    try:
        async for chunk in reply.chunks:
            writer.write(_http_chunk(_event(chunk)))
            await writer.drain()
            if reader.at_eof():  # the client closed its end (a process killed: the kernel closed it)
                return False
        writer.write(_http_chunk(_event("[DONE]")) + b"0\r\n\r\n")
        await writer.drain()
        return True
    finally:
        await reply.chunks.aclose()


def _http_chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"
