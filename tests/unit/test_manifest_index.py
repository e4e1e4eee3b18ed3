"""The index of a group's manifests on NS.steps that its commits carry (`rollstream.consumers._manifests`)."""

from __future__ import annotations

from rollstream.consumers._manifests import MAX_EXTENTS, MERGE_GAP, ManifestIndex, PartIndex


def test_near_manifests_share_a_range_and_far_ones_get_their_own() -> None:
    part = PartIndex(100).added(100).added(101).added(100 + MERGE_GAP + 5).added(101 + MERGE_GAP + 5)
    assert part == PartIndex(102 + MERGE_GAP + 5, ((100, 102), (100 + MERGE_GAP + 5, 102 + MERGE_GAP + 5)))


def test_ranges_are_capped_by_merging_across_the_smallest_gap() -> None:
    part = PartIndex(0)
    offsets = [i * 10 * MERGE_GAP for i in range(MAX_EXTENTS)] + [(MAX_EXTENTS - 1) * 10 * MERGE_GAP + MERGE_GAP + 1]
    for o in offsets:
        part = part.added(o)
    assert len(part.extents) == MAX_EXTENTS
    assert part.extents[-1] == (offsets[-2], offsets[-1] + 1)  # the last two were nearest
    assert all(any(s <= o < e for s, e in part.extents) for o in offsets)


def test_what_a_start_reads_is_the_ranges_then_everything_after_upto() -> None:
    part = PartIndex(500, ((10, 20), (300, 301)))
    assert part.ranges(0, 800) == [(10, 20), (300, 301), (500, 800)]
    assert part.ranges(15, 500) == [(15, 20), (300, 301)]  # retention took the start; nothing after upto
    assert part.ranges(400, 450) == []


def test_metadata_round_trip_and_what_is_not_an_index() -> None:
    index = ManifestIndex({0: PartIndex(42, ((3, 4), (40, 42))), 1: PartIndex(7)})
    assert ManifestIndex.from_metadata(index.to_metadata()) == index
    for text in (None, "", "rollstream/1 {}", "rollstream-steps/1 {not json", "rollstream-steps/1 [1]",
                 'rollstream-steps/1 {"0": [1]}'):
        assert ManifestIndex.from_metadata(text) is None


def test_the_newest_index_wins_per_partition_and_old_commits_mean_none() -> None:
    old = ManifestIndex({0: PartIndex(10, ((1, 2),)), 1: PartIndex(5)}).to_metadata()
    new = ManifestIndex({0: PartIndex(30, ((1, 2), (25, 26)))}).to_metadata()
    assert ManifestIndex.newest([old, None, new]) == ManifestIndex({0: PartIndex(30, ((1, 2), (25, 26))),
                                                                    1: PartIndex(5)})
    assert ManifestIndex.newest([None, "someone else's"]) is None


def test_a_partition_the_index_never_covered_stays_read_whole() -> None:
    index = ManifestIndex({0: PartIndex(10)})
    assert index.added(1, 50) == index
    assert index.added(0, 12).parts[0] == PartIndex(13, ((12, 13),))
