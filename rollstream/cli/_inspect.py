"""`rollstream export | report`: look at what the trainer took, as a Parquet file or a page a person opens
(thin: calls `rollstream.consumers.forensics`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from rollstream.cli._common import (
    DEFAULT_NAMESPACE,
    DEFAULT_TRAINER_GROUP,
    BootstrapOpt,
    KafkaConfigOpt,
    NamespaceOpt,
    TrainerGroupOpt,
    examples,
    kafka_config,
    require_reachable,
    topic_names,
)
from rollstream.cli._consume import _help, _progress, _range_bounds
from rollstream.consumers.forensics import export_range, export_steps, parse_time, since_bounds, write_report

StepsOpt = Annotated[str | None, typer.Option(
    "--steps", metavar="A:B",
    help="Steps A to B of the trainer group, both included; A: or :B leaves that end open.")]


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """``A:B`` (both included), ``A:`` or ``:B`` as (first, last); None is an open end.

    Raises:
        typer.BadParameter: anything else, or B before A.
    """
    first, sep, last = text.partition(":")
    try:
        bounds = (int(first) if first.strip() else None, int(last) if last.strip() else None)
    except ValueError:
        bounds = None
    if not sep or bounds is None or (None not in bounds and bounds[1] < bounds[0]):  # type: ignore[operator]
        raise typer.BadParameter(f"--steps takes A:B (both included, A <= B), A: or :B, e.g. 100:200; got {text!r}")
    return bounds


def export(
    out: Annotated[Path, typer.Option(
        "--out", "-o", dir_okay=False, help="The Parquet file to write (replaced; written as F.partial first).")],
    step: Annotated[int | None, typer.Option(help="Export step K of the trainer group (every offset it covered).")
                    ] = None,
    steps: StepsOpt = None,
    from_: Annotated[str | None, typer.Option(
        "--from", help="Export records from PARTITION:OFFSET (inclusive), with the step that covered each.")] = None,
    to: Annotated[str | None, typer.Option(
        "--to", help="With --from: up to PARTITION:OFFSET (exclusive, same partition; default: the end).")] = None,
    since: Annotated[str | None, typer.Option(
        help="Export records published since TIME: ISO 8601 (naive = local time) or relative (90s, 10m, 2h, 1d).")
    ] = None,
    group: TrainerGroupOpt = DEFAULT_TRAINER_GROUP,
    namespace: NamespaceOpt = DEFAULT_NAMESPACE,
    bootstrap_servers: BootstrapOpt = None,
    kafka_config_file: KafkaConfigOpt = None,
) -> None:
    """Write steps (--step, --steps) or records (--from/--to, --since) of NS.rollouts to a Parquet file: one
    row per sample, readable as it is by pandas, DuckDB and datasets.load_dataset("parquet").

    Columns: step, disposition (taken / filtered / duplicate / undecodable / requeued; null: no step of
    --group covered the record yet), reason, group_id, prompt_id, epoch, attempt, producer_id, policy_run,
    sample_index, prompt, text, reward, advantage (group-normalised, as Batch.to_tensors), finish_reason,
    weight_version (the sample's oldest), trainer_version (at the step), staleness, resumed (from another
    producer's in-flight checkpoint), the list columns tokens, logprobs, loss_mask, token_versions,
    resume_points, resumed_from, and partition, offset, timestamp_ms, status, error, started_at_ms,
    finished_at_ms, step_created_at_ms, metadata. A record without samples (undecodable, failed) is one row.

    Reads as replay does, a chunk of steps at a time, and writes a row group at a time: memory stays
    bounded for any range. Read-only: never commits, never joins the trainer's group. Needs pyarrow, which
    the 'export' extra of rollstream installs.
    """
    if sum(x is not None for x in (step, steps, from_, since)) != 1 or (to is not None and from_ is None):
        raise typer.BadParameter("give exactly one of --step K, --steps A:B, --from P:O [--to P:O], --since TIME")
    config = kafka_config(bootstrap_servers, kafka_config_file, "rollstream-export")
    names = topic_names(namespace)
    require_reachable(config, [names.rollouts, names.steps], namespace)
    with _progress(None, "export") as advance:
        if step is not None or steps is not None:
            first, last = (step, step) if step is not None else parse_steps(steps or "")
            summary = export_steps(config, namespace, group, first, last, out, progress=advance)
        else:
            bounds = (_range_bounds(from_, to) if from_ is not None
                      else since_bounds(config, namespace, parse_time(since or "")))
            summary = export_range(config, namespace, group, bounds, out, progress=advance)
    typer.echo(f"wrote {summary.rows} rows ({summary.records} records, {summary.steps} steps, "
               f"{summary.row_groups} row groups, {summary.bytes / 1e6:.1f} MB) to {summary.path}")


def report(
    out: Annotated[Path, typer.Option(
        "--out", "-o", dir_okay=False, help="The HTML file to write (one self-contained page; replaced).")],
    steps: StepsOpt = None,
    detail_step: Annotated[list[int] | None, typer.Option(
        "--detail-step", metavar="K",
        help="A step whose groups, responses and tokens the page holds in full; repeat for more (default: the "
             "first, middle and last step of the range; steps outside --steps are left out).")] = None,
    tokenizer: Annotated[Path | None, typer.Option(
        exists=True, file_okay=False,
        help="A model or tokenizer directory (transformers): the token view shows each token's text, not its id.")
    ] = None,
    group: TrainerGroupOpt = DEFAULT_TRAINER_GROUP,
    namespace: NamespaceOpt = DEFAULT_NAMESPACE,
    bootstrap_servers: BootstrapOpt = None,
    kafka_config_file: KafkaConfigOpt = None,
) -> None:
    """Write one self-contained HTML page about the trainer group's steps (--steps; default every step):
    open it in a browser, no server and no network needed.

    Per step, as plots: mean reward, staleness (mean, max), lag (approximate), offsets filtered, requeued and
    duplicate, taken groups with equal rewards, wait before taken and generation time, response length; the
    reasons offsets were not taken; the prompts whose every sample got reward 0. For the --detail-step
    steps: every group with its prompt, responses, rewards and advantages; click a response to see its tokens
    coloured by logprob, by policy version or by loss mask. Read-only: never commits.
    """
    first, last = parse_steps(steps) if steps is not None else (None, None)
    config = kafka_config(bootstrap_servers, kafka_config_file, "rollstream-report")
    names = topic_names(namespace)
    require_reachable(config, [names.rollouts, names.steps], namespace)
    token_text = None if tokenizer is None else _token_text(tokenizer)
    with _progress(None, "report") as advance:
        summary = write_report(config, namespace, group, first, last, out, detail=detail_step or None,
                               token_text=token_text, progress=advance)
    shown = ", ".join(map(str, summary.detail)) or "none"
    typer.echo(f"wrote {summary.path} ({summary.steps} steps; in full: {shown}; {summary.bytes / 1e6:.1f} MB)")


def _token_text(path: Path):  # noqa: ANN202 - a TokenText
    from rollstream.producers.engines._tokenize import load_tokenizer

    tok = load_tokenizer(path)

    def pieces(ids: Sequence[int]) -> list[str]:
        return [tok.decode([i], skip_special_tokens=False) for i in ids]

    return pieces


EXAMPLES = {
    "export": examples("rollstream export --namespace demo --steps 100:200 --out steps.parquet",
                       "rollstream export --namespace demo --since 2h --out last2h.parquet"),
    "report": examples("rollstream report --namespace demo --out report.html",
                       "rollstream report --namespace demo --steps 100:200 --detail-step 150 --tokenizer ./model "
                       "--out report.html"),
}


def register(app: typer.Typer) -> None:
    """Add export and report to the root `rollstream` app."""
    for name, fn in (("export", export), ("report", report)):
        app.command(name, help=_help(fn), epilog=EXAMPLES[name])(fn)
