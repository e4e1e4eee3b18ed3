"""What the trainer's dedupe ledger costs per group it remembers (docs/benchmarks.md), without a broker.

``python -m tests.bench.ledger_memory [GROUPS]``: feeds a `StepLedger` (the consumer's, without manifests)
GROUPS taken groups (default 2,000,000: past the default window at 400 groups/s) in steps of 64 spread over
3 partitions, as committed manifests, and prints one JSON line: the bytes tracemalloc sees held after the last
step, per million groups remembered, for a ledger that remembers everything (``window=None``) and for the
default window at 400 groups/s (where it plateaus). ``--rss``: instead, the default window only, without
tracemalloc: the process's resident memory (``VmRSS``) after the first 10,000 groups, after all of them, and
its high-water mark (``VmHWM``), allocator included, and the time one `add` of a 64-group step takes.
Not part of `make bench`.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import tracemalloc

from rollstream.consumers import DedupeWindow
from rollstream.consumers._ledger import StepLedger
from rollstream.schemas import OffsetDisposition, PartitionRange, StepManifest

STEP = 64
PARTITIONS = 3
RATE = 400.0  # groups/s: the manifests' created_at_ms advance by STEP / RATE per step


def _manifest(step: int) -> StepManifest:
    """Step `step`: STEP groups, round-robin over PARTITIONS, ids as `make_group_id` writes them."""
    per = STEP // PARTITIONS + 1
    disps, ranges = [], []
    for p in range(PARTITIONS):
        start = step * per
        ranges.append(PartitionRange(p, start, start + per))
        disps += [OffsetDisposition(p, o, "taken", group_id=f"prompt-{p}-{o:09d}#0") for o in range(start, start + per)]
    return StepManifest(step=step, consumer_group="g", topic="t", created_at_ms=int(step * STEP / RATE * 1000),
                        ranges=ranges, dispositions=disps[:STEP] if len(disps) > STEP else disps)


def _held(window: DedupeWindow | None, groups: int) -> tuple[int, int]:
    """Bytes tracemalloc sees held by the ledger after `groups` groups, and the ids it remembers."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ledger = StepLedger(window=window)
    for k in range(groups // STEP):
        ledger.add(_manifest(k))
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held, ledger.remembered


def _rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(field + ":")).split()[1]) / 1024


def rss(groups: int) -> None:
    """The default window's plateau as resident memory: warm-up (10,000 groups) to the end, and the peak."""
    ledger = StepLedger(window=DedupeWindow())
    steps = groups // STEP
    warm = 10_000 // STEP
    for k in range(warm):
        ledger.add(_manifest(k))
    gc.collect()
    warm_mib = _rss_mib()
    manifests = spent = 0.0
    for k in range(warm, steps):
        started = time.perf_counter()
        m = _manifest(k)
        made = time.perf_counter()
        ledger.add(m)
        manifests, spent = manifests + made - started, spent + time.perf_counter() - made
    gc.collect()
    print(json.dumps({"groups": groups, "remembered": ledger.remembered, "warmup_rss_mib": round(warm_mib, 1),
                      "end_rss_mib": round(_rss_mib(), 1), "growth_mib": round(_rss_mib() - warm_mib, 1),
                      "peak_rss_mib": round(_rss_mib("VmHWM"), 1),
                      "add_us_per_step": round(spent / (steps - warm) * 1e6, 1)}))


def main(groups: int) -> None:
    everything, remembered = _held(None, groups)
    windowed, plateau = _held(DedupeWindow(), groups)
    print(json.dumps({
        "groups": groups,
        "no_window": {"remembered": remembered, "bytes": everything,
                      "bytes_per_million": round(everything / remembered * 1e6)},
        "default_window_at_400_per_s": {"remembered": plateau, "bytes": windowed,
                                        "bytes_per_million": round(windowed / max(plateau, 1) * 1e6)},
    }))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--rss"]
    (rss if "--rss" in sys.argv else main)(int(args[0]) if args else 2_000_000)
