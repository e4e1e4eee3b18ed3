"""`rollstream report`: a range of steps as one self-contained HTML page a person opens (`_report_data` gathers,
`_report_page` draws). Read-only: commits nothing, joins no group."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rollstream.consumers.forensics._replay import Progress
from rollstream.consumers.forensics._report_data import ReportData, TokenText, collect, with_lags
from rollstream.consumers.forensics._report_page import render
from rollstream.consumers.forensics._step_read import read_steps, steps_between
from rollstream.infra import KafkaConfig
from rollstream.schemas import now_ms


@dataclass(frozen=True)
class ReportSummary:
    """What `write_report` wrote: the page's `path` and `bytes`, the `steps` plotted and the `detail` steps
    shown in full."""

    path: Path
    steps: int
    detail: tuple[int, ...]
    bytes: int


def write_report(config: KafkaConfig, namespace: str, consumer_group: str, first: int | None, last: int | None,
                 path: Path, *, detail: Iterable[int] | None = None, token_text: TokenText | None = None,
                 timeout: float = 30.0, progress: Progress | None = None) -> ReportSummary:
    """Write the report of the group's steps ``first..last`` (inclusive; None: open end) to `path`.

    `detail`: the steps whose groups the page holds in full (prompt, responses, rewards, advantages, tokens);
    default the first, middle and last step of the range; steps outside it are ignored. `token_text` turns
    token ids into their text (a tokenizer's), so the token view shows words instead of ids. Reads the steps
    once (as `export_steps`, bounded memory) plus one offset lookup per step for the lag (see `_report_data`).
    Blocks until written.

    Raises:
        RollstreamError: no step in the range; an offset a step covered is gone (retention) or holds another
            group. KafkaIOError: a read failed or made no progress for `timeout` s. OSError: cannot write `path`.
    """
    manifests = steps_between(config, namespace, consumer_group, first, last, timeout=timeout)
    numbers = manifests.steps
    chosen = set(numbers[i] for i in {0, len(numbers) // 2, len(numbers) - 1}) if detail is None else \
        set(detail) & set(numbers)
    stats, details, zero = collect(read_steps(config, manifests, timeout=timeout, progress=progress), chosen,
                                   token_text=token_text)
    stats = with_lags(config, manifests.heads, stats, timeout=timeout)
    data = ReportData(namespace, consumer_group, tuple(stats), details, zero, now_ms())
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(render(data), encoding="utf-8")
    tmp.replace(path)
    return ReportSummary(path, len(stats), tuple(sorted(details)), path.stat().st_size)
