"""The dedupe ledger's compact store of taken ids (`rollstream.consumers._digests`), without a broker.

Pinned here: membership and `len` match a plain model (part -> ids) through any sequence of adds and drops,
before and after merges into the sorted arrays (grown, shrunk, compacted in place); an id held by two parts
stays until both drop it; part numbers are reused only once merged away, so they stay below the parts alive.
"""

from __future__ import annotations

import random

import pytest
from rollstream.consumers import _digests
from rollstream.consumers._digests import TakenDigests


@pytest.mark.parametrize(("merge_at", "first", "chunk"), [(1, 1, 1), (3, 2, 3), (3, 1 << 14, 1 << 16),
                                                         (1000, 1 << 14, 1 << 16)])
def test_membership_matches_a_model_through_adds_drops_and_merges(merge_at: int, first: int, chunk: int,
                                                                  monkeypatch) -> None:
    monkeypatch.setattr(_digests, "_FIRST", first)  # tiny arrays: grown and shrunk, compacted a chunk at a time
    monkeypatch.setattr(_digests, "_CHUNK", chunk)
    rng = random.Random(7)
    taken = TakenDigests(merge_at=merge_at)
    model: dict[int, tuple[list[str], int]] = {}  # part -> (ids, size)
    universe = [f"p{i}#{i % 3}" for i in range(40)]
    for _ in range(500):
        if model and rng.random() < 0.45:
            part = rng.choice(sorted(model))
            ids, size = model.pop(part)
            taken.drop(part, size)
        else:
            ids = rng.sample(universe, k=rng.randint(0, 5))
            part, size = taken.add(ids)
            assert part not in model and size == len(ids)
            model[part] = (ids, size)
        held = {g for ids, _ in model.values() for g in ids}
        assert len(taken) == sum(size for _, size in model.values())
        assert all((hash(g) in taken) == (g in held) for g in universe)
    assert max(model, default=0) < 600


def test_an_id_held_twice_stays_until_both_let_go() -> None:
    taken = TakenDigests(merge_at=2)
    first, _ = taken.add(["a#0", "b#0"])
    second, _ = taken.add(["a#0"])
    taken.drop(first, 2)
    assert hash("a#0") in taken and hash("b#0") not in taken and len(taken) == 1
    taken.drop(second, 1)
    assert hash("a#0") not in taken and len(taken) == 0
