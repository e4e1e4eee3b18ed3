"""Codec speed, side by side in one run: rollstream's packed single-object Avro vs fastavro with
Avro arrays for the same tokens vs a plain memory copy of the same bytes (the ceiling).

Run alone: ``python -m tests.bench.bench_codec``.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable

import fastavro
import numpy as np

from schemas import Sample, ScoredGroup, decode, encode

ARRAY_SCHEMA = fastavro.parse_schema({
    "type": "record", "name": "ArrayGroup", "fields": [
        {"name": "samples", "type": {"type": "array", "items": {
            "type": "record", "name": "ArraySample", "fields": [
                {"name": "tokens", "type": {"type": "array", "items": "int"}},
                {"name": "logprobs", "type": {"type": "array", "items": "float"}}]}}}]})


def make_group(n_samples: int = 8, n_tokens: int = 4096) -> ScoredGroup:
    rng = np.random.default_rng(0)
    samples = [Sample(tokens=rng.integers(0, 150_000, n_tokens), logprobs=-rng.random(n_tokens),
                      text="x" * 64, reward=1.0, weight_versions=(1,)) for _ in range(n_samples)]
    return ScoredGroup(group_id="g#0", prompt_id="g", epoch=0, prompt_tokens=np.arange(256), samples=samples,
                       started_at_ms=0, finished_at_ms=1)


def _rate(fn: Callable[[], object], nbytes: int, min_seconds: float = 1.0) -> float:
    """MB/s of `fn` over at least `min_seconds` (after one warm-up call)."""
    fn()
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds:
        fn()
        count += 1
    return nbytes * count / elapsed / 1e6


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
    ours_enc = _rate(lambda: encode(group), payload, min_seconds)
    ours_dec = _rate(lambda: decode(data).samples.items(), payload, min_seconds)  # Sample objects built too
    arr_enc = _rate(array_encode, payload, min_seconds)
    arr_dec = _rate(array_decode, payload, min_seconds)
    memcpy = _rate(lambda: bytes(copy_source), payload, min_seconds)
    return [
        ("codec payload (8 x 4096 tokens + logprobs)", f"{payload / 1e6:.2f} MB, {len(data) / 1e6:.2f} MB encoded"),
        ("codec encode MB/s (rollstream packed)", f"{ours_enc:,.0f}"),
        ("codec decode MB/s (rollstream packed)", f"{ours_dec:,.0f}"),
        ("codec encode MB/s (fastavro Avro arrays)", f"{arr_enc:,.1f}"),
        ("codec decode MB/s (fastavro Avro arrays)", f"{arr_dec:,.1f}"),
        ("memory copy MB/s (same bytes)", f"{memcpy:,.0f}"),
        ("ratio encode: rollstream / Avro arrays", f"{ours_enc / arr_enc:,.0f}x"),
        ("ratio decode: rollstream / Avro arrays", f"{ours_dec / arr_dec:,.0f}x"),
        ("ratio encode: rollstream / memory copy", f"{ours_enc / memcpy:.2f}"),
    ]


if __name__ == "__main__":
    for name, value in run():
        print(f"| {name} | {value} |")
