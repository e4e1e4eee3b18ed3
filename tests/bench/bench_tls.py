"""What encryption costs, side by side in one run: the pipeline of `bench_pipeline` (prompts ->
`RolloutProducer` -> NS.rollouts -> `take(n)`, and raw confluent-kafka moving the same bytes) against two
private local brokers started alike, one plaintext and one with ``--tls`` (``SSL`` listeners, certificates
of a local CA, hostname verification on; clients trust the CA through ``ssl.ca.location``).

Runs alternate (plaintext ours, plaintext raw, TLS ours, TLS raw, ...) on fresh topics; the best run of each
counts. Rows: throughput of each, the TLS/plaintext throughput of ours and of raw (what TLS costs), and the
rollstream/raw ratio under each (whether rollstream's own overhead changes with TLS).

Run alone: ``python -m tests.bench.bench_tls``. ``make bench`` calls `run`.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from rollstream.infra import KafkaConfig, TopicNames
from rollstream.infra.broker import BrokerSpec, client_config_files, free_ports, start_broker, stop_broker

from tests.bench import bench_pipeline
from tests.bench._common import NamesFactory, Rows, topic_factory
from tests.bench.bench_producer import PARTITIONS, encoded_variants, make_variants

KB = bench_pipeline.KB
SIZES = ((10 * KB, 2000), (100 * KB, 1000))  # (group bytes, groups per run)
REPEATS = 3
_SIDES = ("plaintext", "TLS")


@contextlib.contextmanager
def _private_broker(tls: bool) -> Iterator[KafkaConfig]:
    """A one-node local broker of its own (heap 512 MB), plaintext or ``--tls``; stopped on exit."""
    with tempfile.TemporaryDirectory(prefix=f"rollstream-bench-{'tls' if tls else 'plain'}-") as tmp:
        port, controller = free_ports()
        bootstrap = start_broker(BrokerSpec(port=port, controller_port=controller, data_dir=Path(tmp), tls=tls,
                                            heap_mb=512), timeout=180)
        try:
            client_file = client_config_files(Path(tmp)).get("admin") if tls else None
            yield KafkaConfig.load(bootstrap, client_file, client_id="rollstream-bench-tls")
        finally:
            stop_broker(Path(tmp))


def run(_config: KafkaConfig, _names: NamesFactory, *, sizes: tuple[tuple[int, int], ...] = SIZES,
        repeats: int = REPEATS, progress: Callable[[str], None] | None = None) -> Rows:
    """Rows (figure, value): per group size, ours and raw over plaintext and over TLS, and their ratios.

    Starts its own two brokers (the bench's broker is not used: both sides must run on brokers started
    alike); blocks for the whole measurement; raises what a run raises."""
    say = progress or (lambda _msg: None)
    rows: Rows = [("TLS workload", f"the pipeline workload (take(n={bench_pipeline.TAKE_N}), {PARTITIONS} partitions) "
                                   f"on two private one-node brokers, plaintext and --tls; best of {repeats} runs "
                                   f"per side")]
    with contextlib.ExitStack() as stack:
        say("starting a plaintext and a TLS broker")
        configs = {side: stack.enter_context(_private_broker(tls=side == "TLS")) for side in _SIDES}
        factories = {side: topic_factory(configs[side], [], "bench-tls") for side in _SIDES}
        for group_bytes, count in sizes:
            seconds = _alternate(configs, factories, group_bytes, count, repeats, say)
            rows += _size_rows(seconds, group_bytes, count)
    return rows


def _alternate(configs: dict[str, KafkaConfig], factories: dict[str, Callable[..., TopicNames]], group_bytes: int,
               count: int, repeats: int, say: Callable[[str], None]) -> dict[tuple[str, str], list[float]]:
    """Seconds per (side, "ours"|"raw"), `repeats` rounds of the four alternating."""
    variants = make_variants(bench_pipeline.VARIANTS, group_bytes)
    payloads = encoded_variants(variants)
    seconds: dict[tuple[str, str], list[float]] = {(side, who): [] for side in _SIDES for who in ("ours", "raw")}
    for attempt in range(repeats):
        say(f"{group_bytes // KB} KB groups over plaintext and TLS, run {attempt + 1}/{repeats}")
        for side in _SIDES:
            runs = {"ours": functools.partial(bench_pipeline.run_ours, count=count, variants=variants),
                    "raw": functools.partial(bench_pipeline.run_raw, count=count, payloads=payloads)}
            for who, one in runs.items():
                seconds[side, who].append(one(configs[side], factories[side](partitions=PARTITIONS)))
    return seconds


def _size_rows(seconds: dict[tuple[str, str], list[float]], group_bytes: int, count: int) -> Rows:
    label = f"{group_bytes // KB} KB x {count}"
    best = {key: min(values) for key, values in seconds.items()}
    rows = [(f"{label}: {who} over {side} groups/s", f"{count / best[side, who]:,.0f}")
            for side in _SIDES for who in ("ours", "raw")]
    rows += [(f"{label}: {'rollstream' if who == 'ours' else 'raw confluent-kafka'} TLS / plaintext throughput",
              f"{best['plaintext', who] / best['TLS', who]:.2f}") for who in ("ours", "raw")]
    rows += [(f"{label}: ratio rollstream / raw over {side}: best of each / median of paired runs",
              bench_pipeline.ratios(seconds[side, "ours"], seconds[side, "raw"])) for side in _SIDES]
    return rows


if __name__ == "__main__":
    from tests.bench._common import run_standalone

    run_standalone(run, "bench-tls")
