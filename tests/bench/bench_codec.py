"""Codec speed, side by side in one run: rollstream's packed single-object Avro (schema v4, and the same
groups written as v3), vs fastavro with Avro arrays for the same tokens vs a plain memory copy of the same
bytes (the ceiling).

v3 vs v4: the same group encoded with the v3 schema (a codec whose current ScoredGroup schema is
``avro/history/scored_group.v3.avsc``) and with v4, and those bytes decoded by the shared codec (v3 through
its upgrader, as a trainer reads old records), timed in alternating rounds, best of each. v4 must stay
within 20% of v3 (issue 11). A second v4 group carries what v3 cannot: a loss mask and two version spans
on every sample.

Run alone: ``python -m tests.bench.bench_codec``.
"""

from __future__ import annotations

import io
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import fastavro
import numpy as np
from rollstream.schemas import Codec, Sample, Sampling, ScoredGroup, VersionSpan, decode, encode
from rollstream.schemas.codec import SCHEMA_DIR

ARRAY_SCHEMA = fastavro.parse_schema({
    "type": "record", "name": "ArrayGroup", "fields": [
        {"name": "samples", "type": {"type": "array", "items": {
            "type": "record", "name": "ArraySample", "fields": [
                {"name": "tokens", "type": {"type": "array", "items": "int"}},
                {"name": "logprobs", "type": {"type": "array", "items": "float"}}]}}}]})
ROUNDS = 10  # alternating v3 / v4 rounds of 0.1 s; the best of each is reported (short rounds dodge load bursts)


def make_group(n_samples: int = 8, n_tokens: int = 4096, *, multi_turn: bool = False) -> ScoredGroup:
    """8 x 4096 tokens with logprobs; `multi_turn`: every sample also has a loss mask (a tool output of 64
    tokens masked in the middle) and two version spans, and the group its sampling parameters."""
    rng = np.random.default_rng(0)
    mask = np.ones(n_tokens, np.uint8)
    mask[n_tokens // 2:n_tokens // 2 + 64] = 0
    half = n_tokens // 2
    extra = {"loss_mask": mask, "version_spans": (VersionSpan(1, 0, half), VersionSpan(2, half, n_tokens))}
    samples = [Sample(tokens=rng.integers(0, 150_000, n_tokens), logprobs=-rng.random(n_tokens),
                      text="x" * 64, reward=1.0, **(extra if multi_turn else {"weight_versions": (1,)}))
               for _ in range(n_samples)]
    return ScoredGroup(group_id="g#0", prompt_id="g", epoch=0, prompt_tokens=np.arange(256), samples=samples,
                       started_at_ms=0, finished_at_ms=1, sampling=Sampling(0.7, 0.9) if multi_turn else None)


def v3_codec(into: Path) -> Codec:
    """A codec that writes ScoredGroup with schema v3 (the other schemas as bundled), built in `into`."""
    shutil.copytree(SCHEMA_DIR, into, dirs_exist_ok=True)
    (into / "history" / "scored_group.v3.avsc").replace(into / "scored_group.avsc")
    return Codec(into)


def _rate(fn: Callable[[], object], nbytes: int, min_seconds: float = 1.0) -> float:
    """MB/s of `fn` over at least `min_seconds` (after one warm-up call)."""
    fn()
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds:
        fn()
        count += 1
    return nbytes * count / elapsed / 1e6


def _best_alternating(fns: dict[str, Callable[[], object]], nbytes: int, min_seconds: float) -> dict[str, float]:
    """The best MB/s of each of `fns` over `ROUNDS` rounds that run them one after another (load drifts)."""
    best = dict.fromkeys(fns, 0.0)
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            best[name] = max(best[name], _rate(fn, nbytes, min_seconds / ROUNDS))
    return best


def _versions_rows(min_seconds: float) -> list[tuple[str, str]]:
    """v3 vs v4 of the same group, and v4 of a multi-turn group."""
    group, rich = make_group(), make_group(multi_turn=True)
    payload = group.nbytes
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-v3-") as tmp:
        old = v3_codec(Path(tmp))
        v3_bytes, v4_bytes, rich_bytes = old.encode(group), encode(group), encode(rich)
        if decode(v3_bytes) != group or decode(v4_bytes) != group or decode(rich_bytes) != rich:
            raise RuntimeError("bench: a codec round trip changed the group")
        r = _best_alternating({
            "v3 encode": lambda: old.encode(group), "v4 encode": lambda: encode(group),
            "v3 decode": lambda: decode(v3_bytes, ScoredGroup).samples.items(),
            "v4 decode": lambda: decode(v4_bytes, ScoredGroup).samples.items(),
            "v4 multi-turn encode": lambda: encode(rich),
            "v4 multi-turn decode": lambda: decode(rich_bytes, ScoredGroup).samples.items(),
        }, payload, 6 * min_seconds)
    return [
        ("codec encode MB/s (rollstream packed, v4)", f"{r['v4 encode']:,.0f}"),
        ("codec decode MB/s (rollstream packed, v4)", f"{r['v4 decode']:,.0f}"),
        ("codec encode MB/s (same group written as v3)", f"{r['v3 encode']:,.0f}"),
        ("codec decode MB/s (same group written as v3, upgraded on read)", f"{r['v3 decode']:,.0f}"),
        ("ratio encode: v4 / v3 (>= 0.80 required)", f"{r['v4 encode'] / r['v3 encode']:.2f}"),
        ("ratio decode: v4 / v3 (>= 0.80 required)", f"{r['v4 decode'] / r['v3 decode']:.2f}"),
        ("codec encode MB/s (v4, loss mask + 2 version spans per sample)", f"{r['v4 multi-turn encode']:,.0f}"),
        ("codec decode MB/s (v4, loss mask + 2 version spans per sample)", f"{r['v4 multi-turn decode']:,.0f}"),
        ("encoded sizes: v3 / v4 / v4 multi-turn",
         f"{len(v3_bytes):,} / {len(v4_bytes):,} / {len(rich_bytes):,} bytes"),
    ]


def run(min_seconds: float = 1.0) -> list[tuple[str, str]]:
    """Rows (figure, value) for 8 x 4096 tokens with logprobs."""
    group = make_group()
    payload = group.nbytes
    data = encode(group)
    array_datum = {"samples": [{"tokens": s.tokens.tolist(), "logprobs": s.logprobs.tolist()}
                               for s in group.samples]}
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, ARRAY_SCHEMA, array_datum)
    array_bytes = buf.getvalue()

    def array_encode() -> None:
        fastavro.schemaless_writer(io.BytesIO(), ARRAY_SCHEMA, array_datum)

    def array_decode() -> None:
        fastavro.schemaless_reader(io.BytesIO(array_bytes), ARRAY_SCHEMA)

    copy_source = bytearray(data)
    versions = _versions_rows(min_seconds)
    ours_enc = _rate(lambda: encode(group), payload, min_seconds)
    ours_dec = _rate(lambda: decode(data, ScoredGroup).samples.items(), payload, min_seconds)  # Samples built too
    arr_enc = _rate(array_encode, payload, min_seconds)
    arr_dec = _rate(array_decode, payload, min_seconds)
    memcpy = _rate(lambda: bytes(copy_source), payload, min_seconds)
    return [
        ("codec payload (8 x 4096 tokens + logprobs)", f"{payload / 1e6:.2f} MB, {len(data) / 1e6:.2f} MB encoded"),
        *versions,
        ("codec encode MB/s (fastavro Avro arrays)", f"{arr_enc:,.1f}"),
        ("codec decode MB/s (fastavro Avro arrays)", f"{arr_dec:,.1f}"),
        ("memory copy MB/s (same bytes)", f"{memcpy:,.0f}"),
        ("ratio encode: rollstream v4 / Avro arrays", f"{ours_enc / arr_enc:,.0f}x"),
        ("ratio decode: rollstream v4 / Avro arrays", f"{ours_dec / arr_dec:,.0f}x"),
        ("ratio encode: rollstream v4 / memory copy", f"{ours_enc / memcpy:.2f}"),
    ]


if __name__ == "__main__":
    for name, value in run():
        print(f"| {name} | {value} |")
