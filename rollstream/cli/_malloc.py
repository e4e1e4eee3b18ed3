"""Fewer glibc malloc arenas for a process with many threads (`rollstream produce`).

glibc gives a thread that allocates while another holds the main arena an arena of its own, up to 8 per core,
each growing in 64 MiB heaps that are seldom given back. A producer runs a thread per generation slot for sync
plug-ins (``--concurrency``, 256 in `make soak`), so its RSS jumped by ~200 MiB a few minutes into a run and kept
creeping, holding little but free space (`make soak`: 194 -> 403 MiB at 240 s, 281 threads, four 64-101 MiB
anonymous heaps). Capping the arenas keeps that memory in a few shared ones; the threads mostly wait (on the
engine, on the broker), so they seldom contend for them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

ARENAS = 4  # per process; MALLOC_ARENA_MAX in the environment wins
_M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


def cap_malloc_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas at `arenas` for this process, unless ``MALLOC_ARENA_MAX`` is set (glibc read it
    at start) or the C library is not glibc. Call it before the process starts threads. Returns whether it did."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
        gnu = getattr(libc, "gnu_get_libc_version", None)
    except OSError:
        return False
    if mallopt is None or gnu is None:  # musl and others: no arenas to cap
        return False
    done = bool(mallopt(_M_ARENA_MAX, arenas))
    log.debug("malloc arenas capped at %d: %s", arenas, done)
    return done
