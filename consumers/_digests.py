"""The group ids the trainer's dedupe remembers, compact: 12 bytes per id (`rollstream.consumers._ledger`).

A Python ``dict[str, ...]`` costs ~130 bytes per group id (the str, the entry, the table). Here an id is its
64-bit digest (`digest_of`: Python's keyed SipHash of the str, randomised per process and never stored), kept
with the *part* that holds it: each `add` is one part (the ledger adds a step's ids on one partition as one, so
a step can let go of one partition's ids and keep the others'). Digests live in one sorted ``int64`` array,
their parts in a parallel ``int32`` array. Letting go of a part is O(1): it joins a small set of dropped parts
that lookups ignore. New ids wait in a small dict; every `MERGE_AT` ids (or dropped parts) one pass merges them
into the arrays and removes the dropped parts' entries (O(size): a few ms for a million ids), in place: the
arrays keep spare room (grown by half when full) and a steady window reallocates nothing, so the allocator
keeps no holes of old copies (a fresh copy per merge cost ~20 MB of resident memory more at 1.4 M ids). A part
number is reused only after that pass, so the numbers stay below the number of parts alive, however long the
run.

An id held by two parts (a duplicate the epoch bound had let through, an audit reading a log with one) stays
taken until both let it go. A false "taken" needs two ids of one process with the same 64-bit digest: at most
``remembered / 2**64`` per lookup (< 1e-13 for 1.5 M ids); the step's manifest would then record the group as a
duplicate (accounted for, and named by ``rollstream audit --epochs``), never drop it silently.

Not thread-safe (the consumer's one take thread owns it).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

MERGE_AT = 8192  # ids added since the last merge: the dict costs ~100 bytes each until then
_FIRST = 1 << 14  # entries the arrays start with
_CHUNK = 1 << 16  # entries compacted at a time (the temporary copies stay small)


def digest_of(group_id: str) -> int:
    """The 64-bit digest that stands for `group_id` in this process (stable while the process lives)."""
    return hash(group_id)


class TakenDigests:
    """Digests of taken ids, each held by the part (`add`) that took it.

    Args:
        merge_at: ids added (or parts dropped) since the last merge that trigger the next one.
    """

    def __init__(self, *, merge_at: int = MERGE_AT) -> None:
        self._keys = np.empty(_FIRST, np.int64)  # sorted digests (as of the last merge), the first `_size`
        self._parts = np.empty(_FIRST, np.int32)  # the part holding each of `_keys`
        self._size = 0
        self._pending: dict[int, list[int]] = {}  # digest -> parts that added it since the last merge
        self._added = 0  # ids in `_pending`
        self._dropped: set[int] = set()  # parts let go of whose entries are still stored
        self._held = 0
        self._free: list[int] = []  # part numbers with no entry left
        self._next_part = 0
        self._merge_at = merge_at

    def __len__(self) -> int:
        """Ids held, counted once per part holding them."""
        return self._held

    def __contains__(self, digest: int) -> bool:
        dropped = self._dropped
        if any(part not in dropped for part in self._pending.get(digest, ())):
            return True
        keys = self._keys[:self._size]
        low = int(np.searchsorted(keys, digest, side="left"))
        high = low
        while high < len(keys) and keys[high] == digest:
            high += 1
        return any(part not in dropped for part in self._parts[low:high].tolist())

    def add(self, group_ids: Iterable[str]) -> tuple[int, int]:
        """Hold `group_ids` as a new part; return the part and how many ids it holds (what `drop` takes)."""
        part = self._free.pop() if self._free else self._new_part()
        pending = self._pending
        added = 0
        for digest in map(digest_of, group_ids):
            pending.setdefault(digest, []).append(part)
            added += 1
        self._added += added
        self._held += added
        if self._added >= self._merge_at:
            self._merge()
        return part, added

    def drop(self, part: int, size: int) -> None:
        """`part`, which `add` returned with `size`, lets go of its ids (once)."""
        self._dropped.add(part)
        self._held -= size
        if len(self._dropped) >= self._merge_at:
            self._merge()

    def _merge(self) -> None:
        """Fold the pending ids into the sorted arrays and remove every dropped part's entries, in place."""
        if self._dropped:
            self._compact(np.fromiter(self._dropped, np.int32, len(self._dropped)))
        fresh = [(d, p) for d, ps in self._pending.items() for p in ps if p not in self._dropped]
        if fresh:
            new_keys = np.fromiter((d for d, _ in fresh), np.int64, len(fresh))
            new_parts = np.fromiter((p for _, p in fresh), np.int32, len(fresh))
            order = np.argsort(new_keys, kind="stable")
            self._insert(new_keys[order], new_parts[order])
        self._free.extend(self._dropped)
        self._pending.clear()
        self._dropped.clear()
        self._added = 0

    def _compact(self, dropped: np.ndarray) -> None:
        """Remove the entries of `dropped` parts, a `_CHUNK` at a time (the writes stay behind the reads)."""
        keys, parts, size = self._keys, self._parts, self._size
        kept = 0
        for low in range(0, size, _CHUNK):
            high = min(low + _CHUNK, size)
            alive = ~np.isin(parts[low:high], dropped)
            count = int(alive.sum())
            keys[kept:kept + count] = keys[low:high][alive]
            parts[kept:kept + count] = parts[low:high][alive]
            kept += count
        self._size = kept

    def _insert(self, new_keys: np.ndarray, new_parts: np.ndarray) -> None:
        """Merge sorted `new_keys` (and their parts) into the arrays: the entries between two insertion
        points move right by the number inserted before them, the last run first."""
        size, added = self._size, len(new_keys)
        self._reserve(size + added)
        keys, parts = self._keys, self._parts
        at = np.searchsorted(keys[:size], new_keys).tolist()
        for j in range(added, -1, -1):
            low, high = (at[j - 1] if j else 0), (at[j] if j < added else size)
            if high > low and j:
                keys[low + j:high + j] = keys[low:high]  # numpy copies overlapping slices correctly
                parts[low + j:high + j] = parts[low:high]
        final = np.asarray(at, np.int64) + np.arange(added)
        keys[final], parts[final] = new_keys, new_parts
        self._size = size + added

    def _reserve(self, size: int) -> None:
        """Room for `size` entries: grown by half when full, halved when a quarter full (never per merge: a
        steady window reallocates nothing, so the allocator keeps no holes of old copies)."""
        capacity = len(self._keys)
        if size <= capacity and (capacity <= _FIRST or size * 4 > capacity):
            return
        wanted = max(_FIRST, size * 3 // 2 if size > capacity else size * 2)
        keys, parts = np.empty(wanted, np.int64), np.empty(wanted, np.int32)
        keys[:self._size], parts[:self._size] = self._keys[:self._size], self._parts[:self._size]
        self._keys, self._parts = keys, parts

    def _new_part(self) -> int:
        if self._next_part >= 2**31 - 1:
            raise OverflowError("more than 2**31 parts alive at once")
        self._next_part += 1
        return self._next_part - 1
