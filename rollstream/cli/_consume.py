"""`rollstream take | lag | replay | audit`: the trainer side on the command line (thin: calls `consumers`)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import signal
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Annotated, Any, NoReturn

import typer

from rollstream.cli._common import (
    DEFAULT_NAMESPACE,
    BootstrapOpt,
    KafkaConfigOpt,
    NamespaceOpt,
    TrainerGroupOpt,
    examples,
    fail,
    kafka_config,
    require_reachable,
    topic_names,
)
from rollstream.cli._stopping import StopSignals
from rollstream.cli._waiting import WaitNotices, take_saying_why, why_in_one_line
from rollstream.consumers import (
    Batch,
    CommitError,
    DedupeWindow,
    GroupConflictError,
    ReplayedRecord,
    RolloutConsumer,
    TakeTimeout,
    audit,
    audit_epochs,
    commit_until_committed,
    default_filters,
    group_to_json,
    parse_time,
    replay_range,
    replay_step,
    since_bounds,
)
from rollstream.infra import DEFAULT_TRAINER_GROUP, LagReader, RunSupersededError
from rollstream.schemas import ConfigError

OutOpt = Annotated[Path | None, typer.Option("--out", "-o", dir_okay=False,
                                             help="Write JSON lines to this file instead of stdout.")]
TakeOutOpt = Annotated[Path | None, typer.Option(
    "--out", "-o", dir_okay=False,
    help="Append JSON lines to this file instead of stdout (a step re-taken after a crash repeats its step).")]
_PROGRESS_MIN_RECORDS = 500
EXIT_SUPERSEDED = 3  # a newer run of the group took over: `take` stopped, and should stay stopped


@contextlib.contextmanager
def _output(path: Path | None) -> Iterator[IO[str]]:
    if path is None:
        yield sys.stdout
        return
    with path.open("w") as f:
        yield f


@contextlib.contextmanager
def _appending(path: Path | None) -> Iterator[tuple[IO[str], bool]]:
    """stdout, or `path` opened for appending (a restarted `take` adds to what earlier runs wrote); and
    whether it is a regular file, which `os.fsync` can make durable (a pipe or a tty cannot be)."""
    if path is None:
        yield sys.stdout, False
        return
    with path.open("a") as f:
        regular = stat.S_ISREG(os.fstat(f.fileno()).st_mode)
        if regular and f.tell() > 0 and not _ends_with_newline(path):
            f.write("\n")  # a run killed mid-line (an uncommitted step): keep its torn line on its own
        yield f, regular


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _write_step(sink: IO[str], batch: Batch, durable: bool) -> None:
    """The step's lines in one write, flushed (and fsync'd when `durable`) before the caller commits."""
    sink.write("".join(json.dumps({"step": batch.step, "group_id": g.group_id, "prompt_id": g.prompt_id,
                                   "epoch": g.epoch, "rewards": g.rewards}) + "\n" for g in batch.groups))
    sink.flush()
    if durable:
        os.fsync(sink.fileno())


def _dedupe_window(text: str) -> DedupeWindow | None:
    if text.strip().lower() == "none":
        return None
    offsets, _, seconds = text.partition(",")
    try:
        return DedupeWindow(int(offsets), float(seconds or "0"))
    except (ValueError, ConfigError) as exc:
        raise typer.BadParameter(f"{text!r}: give OFFSETS,SECONDS, e.g. 20000,3600, or none ({exc})",
                                 param_hint="--dedupe-window") from None


def take(
    n: Annotated[int, typer.Option("-n", "--n", min=1, help="Groups per step (exactly this many per batch).")],
    steps: Annotated[int, typer.Option(min=0, help="Batches to take; 0 takes until interrupted.")] = 1,
    group: TrainerGroupOpt = DEFAULT_TRAINER_GROUP,
    namespace: NamespaceOpt = DEFAULT_NAMESPACE,
    out: TakeOutOpt = None,
    timeout: Annotated[float | None, typer.Option(
        help="Seconds to wait for each batch, connecting included; on timeout (a stopped or unreachable broker "
             "too) exit 2 and leave what was gathered uncommitted.")] = None,
    max_staleness: Annotated[int | None, typer.Option(
        help="Skip groups more than this many policy versions behind --policy-version.")] = None,
    policy_version: Annotated[int | None, typer.Option(help="The trainer's current policy version.")] = None,
    dynamic_sampling: Annotated[bool, typer.Option(
        help="Skip groups whose rewards are all equal (DAPO dynamic sampling).")] = True,
    metrics_port: Annotated[int | None, typer.Option(
        help="Serve Prometheus metrics on this port while taking.")] = None,
    dedupe_window: Annotated[str, typer.Option(
        help="OFFSETS,SECONDS: forget a taken group id once the position on its partition is OFFSETS records "
             "past it and its step SECONDS older than the newest; 'none' remembers every id (memory grows).")
    ] = f"{DedupeWindow().offsets},{DedupeWindow().seconds:g}",
    fence: Annotated[bool, typer.Option(
        help="Be a run of the group: fence every older take or consumer of it when starting, commit in the "
             "group run's transactions. --no-fence: plain commits (a cluster without transactions).")] = True,
    bootstrap_servers: BootstrapOpt = None,
    kafka_config_file: KafkaConfigOpt = None,
) -> None:
    """A stand-in trainer: take STEPS batches of exactly N groups and commit each one.

    Writes one JSON line per taken group (step, group_id, prompt_id, epoch, rewards). Every skipped
    record (filtered, duplicate, undecodable) is recorded in the step's manifest on NS.steps, written
    before the offsets are committed; see `rollstream audit` and `rollstream replay --step`.

    A step's lines are written and flushed (fsync'd when --out is a file) before the step is committed,
    so a kill at any moment leaves every committed step in the output. --out appends: a step written but
    not committed when a run was killed is taken again by the next run with the same step number, so a
    step number that repeats in the file is a re-taken step; only its last copy can be the committed one.

    Ctrl-C (SIGINT) or SIGTERM stops it: the step in hand is left uncommitted (taken again next run), the
    clients are closed (each close bounded), and it exits 130 (SIGINT) or 143 (SIGTERM) within 15 s, whatever
    the broker does; a second signal exits at once.

    While it waits for a step it says so on stderr, first after 30 s and then less often (every 5 min at most):
    how long, how many of the N groups it has, and the likely cause with its fix (as `rollstream status`). A
    commit the broker cannot take (a restart, a stall) is tried again until it goes through, a line on stderr
    for each failed try: the step stays in hand meanwhile. Connecting is tried again the same way when the
    cluster answers but not yet in full (a broker still loading its groups after a restart): for ever without
    --timeout, else until it runs out (exit 2). A cluster that does not answer at all, a missing namespace or a
    refused authorization exits 2 at once.

    It is a run of its group: starting, it fences every older `rollstream take` (or RolloutConsumer) of the group,
    whose commits the broker refuses from then on, so a restarted job takes over from the one it replaces. A take
    that a newer one superseded stops at its next take or commit and exits 3 with one line on stderr; its step in
    hand stays uncommitted and the newer one takes it. Needs Kafka transactions (with ACLs: Write, Describe on
    the transactional id rollstream.NS.group-run.GROUP, see `rollstream acls`); --no-fence turns this off.
    """
    config = kafka_config(bootstrap_servers, kafka_config_file, f"rollstream-take-{group}")
    notices = WaitNotices.from_env()
    consumer = RolloutConsumer(config=config, group_id=group, namespace=namespace, max_staleness=max_staleness,
                               policy_version=policy_version, dedupe_window=_dedupe_window(dedupe_window),
                               filters=default_filters(dynamic_sampling=dynamic_sampling), fence=fence)
    if metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, registry=consumer.metrics.registry)
    taken = 0
    stop = StopSignals("rollstream take")
    try:
        with stop, consumer, _appending(out) as (sink, durable):
            while steps == 0 or taken < steps:
                try:
                    batch = take_saying_why(consumer, n, timeout, notices, lambda line: typer.echo(line, err=True),
                                            committed=taken)
                except TakeTimeout as exc:
                    fail(_timed_out(exc, taken))
                _write_step(sink, batch, durable)
                commit_until_committed(consumer.commit, batch, _say_commit_failed)  # a kill before it: taken again
                taken += 1
    except (RunSupersededError, GroupConflictError) as exc:
        if stop.signalled is not None:
            stop.exit_now(f"interrupted ({signal.Signals(stop.signalled).name}) after {taken} committed step(s)")
        _superseded(exc, group, namespace, taken)
    except BaseException as exc:  # noqa: BLE001 - after a stop signal, whatever it became on the way out
        if stop.signalled is None:
            if isinstance(exc, KeyboardInterrupt):
                typer.echo(f"interrupted after {taken} committed step(s)", err=True)
                raise typer.Exit(130) from None
            raise
        how = "" if isinstance(exc, KeyboardInterrupt) else f"; on the way out: {type(exc).__name__}: {exc}"
        stop.exit_now(f"interrupted ({signal.Signals(stop.signalled).name}) after {taken} committed step(s){how}")


def _say_commit_failed(exc: CommitError) -> None:
    typer.echo(f"commit failed, trying again (the step is in hand, nothing is lost): {' '.join(str(exc).split())}",
               err=True)


def _superseded(exc: RunSupersededError | GroupConflictError, group: str, namespace: str, committed: int) -> NoReturn:
    """Exit `EXIT_SUPERSEDED` with one line: which newer consumer took the group over, what is left, what to do."""
    steps = f"{committed} step{'s' if committed != 1 else ''}"
    if isinstance(exc, RunSupersededError):
        who = "a newer run of the group took over (a rollstream take or RolloutConsumer of it started since)"
    else:  # a consumer that does not fence (--no-fence, an older rollstream) committed for the group
        who = f"another consumer committed for the group since this one did ({' '.join(str(exc).split())})"
    typer.secho(f"error: superseded: take of group {group} on namespace {namespace} stopped after {steps} committed: "
                f"{who}; its step in hand is left uncommitted for the newer one to take. Nothing to do if the newer "
                "one should run; else stop it and start this take again (it takes over).",
                fg=typer.colors.RED, err=True)
    sys.exit(EXIT_SUPERSEDED)


def _timed_out(exc: TakeTimeout, committed: int) -> str:
    """A timed-out take in one line: what came, the likely causes with their fixes, what the take looked at."""
    head = (f"take timed out after {exc.timeout:g} s with {exc.gathered} of {exc.wanted} groups (this step not "
            f"committed; {committed} step{'s' if committed != 1 else ''} committed before)")
    return f"{head}: {why_in_one_line(exc)}"


def lag(
    group: TrainerGroupOpt = DEFAULT_TRAINER_GROUP,
    namespace: NamespaceOpt = DEFAULT_NAMESPACE,
    bootstrap_servers: BootstrapOpt = None,
    kafka_config_file: KafkaConfigOpt = None,
) -> None:
    """Show the trainer group's lag on NS.rollouts: per partition, end offset minus committed offset."""
    config = kafka_config(bootstrap_servers, kafka_config_file, "rollstream-lag")
    require_reachable(config, [topic_names(namespace).rollouts], namespace)
    with LagReader(config) as reader:
        result = reader.group_lag(group, topic_names(namespace).rollouts)
    for p in result.partitions:
        committed = "-" if p.committed is None else p.committed
        typer.echo(f"partition {p.partition}: committed {committed}  start {p.start}  end {p.end}  lag {p.lag}")
    typer.echo(f"total lag {result.total} (group {group}, topic {result.topic})")


def _position(text: str, flag: str) -> tuple[int, int]:
    partition, sep, offset = text.partition(":")
    if not sep or not partition.strip().isdigit() or not offset.strip().isdigit():
        raise typer.BadParameter(f"{flag} takes PARTITION:OFFSET, e.g. 0:1200; got {text!r}")
    return int(partition), int(offset)


def _range_bounds(start: str, end: str | None) -> dict[int, tuple[int, int]]:
    p, o = _position(start, "--from")
    if end is None:
        return {p: (o, 2**62)}
    p2, o2 = _position(end, "--to")
    if p2 != p or o2 < o:
        raise typer.BadParameter(f"--from {start} --to {end}: both must name the same partition, "
                                 "and --to must not be before --from")
    return {p: (o, o2)}


@contextlib.contextmanager
def _progress(total: int | None, label: str = "replay") -> Iterator[Any]:
    """A progress bar on stderr (records read), hidden for fewer than a few hundred records."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    disabled = total is not None and total < _PROGRESS_MIN_RECORDS
    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True, disable=disabled) as bar:
        task = bar.add_task(label, total=total)
        yield lambda advanced: bar.advance(task, advanced)


def replay(
    step: Annotated[int | None, typer.Option(
        help="Rebuild exactly the groups the trainer group took at step K.")] = None,
    from_: Annotated[str | None, typer.Option("--from", help="Dump from PARTITION:OFFSET (inclusive).")] = None,
    to: Annotated[str | None, typer.Option(
        "--to", help="Dump up to PARTITION:OFFSET (exclusive, same partition as --from; default: the end).")] = None,
    since: Annotated[str | None, typer.Option(
        help="Dump everything published since TIME: ISO 8601 (naive = local time) or relative "
             "(90s, 10m, 2h, 1d).")] = None,
    group: TrainerGroupOpt = DEFAULT_TRAINER_GROUP,
    namespace: NamespaceOpt = DEFAULT_NAMESPACE,
    out: OutOpt = None,
    bootstrap_servers: BootstrapOpt = None,
    kafka_config_file: KafkaConfigOpt = None,
) -> None:
    """Dump groups from NS.rollouts as JSON lines: a step's batch (--step), an offset range, or by time.

    Each line is one record: partition, offset, timestamp_ms and the whole decoded group (tokens,
    logprobs, rewards, ...), or `undecodable` with the error. Read-only: never commits.
    """
    if sum(x is not None for x in (step, from_, since)) != 1 or (to is not None and from_ is None):
        raise typer.BadParameter("give exactly one of --step K, --from P:O [--to P:O], --since TIME")
    config = kafka_config(bootstrap_servers, kafka_config_file, "rollstream-replay")
    names = topic_names(namespace)
    require_reachable(config, [names.rollouts] + ([names.steps] if step is not None else []), namespace)
    with _output(out) as sink:
        if step is not None:
            with _progress(None) as advance:
                replayed = replay_step(config, namespace, group, step, progress=advance)
            _write(sink, replayed.records, step)
            return
        if from_ is not None:
            bounds = _range_bounds(from_, to)
        else:
            bounds = since_bounds(config, namespace, parse_time(since or ""))
        total = sum(max(0, e - s) for s, e in bounds.values()) if since is not None else None
        with _progress(total) as advance:
            _write(sink, replay_range(config, namespace, bounds, progress=advance), None)


def _write(sink: IO[str], records: Any, step: int | None) -> None:
    record: ReplayedRecord
    for record in records:
        sink.write(json.dumps(group_to_json(record, step)) + "\n")
    sink.flush()


def audit_command(
    group: TrainerGroupOpt = DEFAULT_TRAINER_GROUP,
    namespace: NamespaceOpt = DEFAULT_NAMESPACE,
    from_first_manifest: Annotated[bool, typer.Option(
        help="Start checking at each partition's first manifest instead of the first stored offset.")] = False,
    epochs: Annotated[bool, typer.Option(
        "--epochs", help="Also audit every loaded epoch: each prompt on NS.prompts taken exactly once or ended "
                         "with a terminal reason; prompts still in flight are listed apart and do not fail.")] = False,
    producer_group: Annotated[str | None, typer.Option(
        help="With --epochs: the producers' consumer group on NS.prompts (default NS.producers).")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object (both audits with --epochs, every in-flight prompt listed).")] = False,
    bootstrap_servers: BootstrapOpt = None,
    kafka_config_file: KafkaConfigOpt = None,
) -> None:
    """Verify from the step manifests that every offset the group committed was accounted for exactly once.

    Exits 0 when it was; exits 1 naming the first gap or overlap (partition, offsets, steps).

    With --epochs, the offset audit runs first (the epoch audit trusts the manifests it checks), then the
    epoch audit: for every epoch loaded on NS.prompts, every prompt taken exactly once or ended with a terminal
    reason (filtered); prompts still in flight (not generated yet, published and not taken yet, or in a step
    not committed yet) are listed apart. Exits 1 when either audit fails, naming the first prompt that is
    neither (lost, taken twice, loaded twice). Read-only: commits nothing, joins no group.
    """
    if producer_group is not None and not epochs:
        raise typer.BadParameter("--producer-group applies only with --epochs")
    config = kafka_config(bootstrap_servers, kafka_config_file, "rollstream-audit")
    report = audit(config, namespace, group, from_first_manifest=from_first_manifest)
    epoch_report = audit_epochs(config, namespace, group, producer_group=producer_group) if epochs else None
    if as_json:
        offsets = {"ok": report.ok, **dataclasses.asdict(report)}
        typer.echo(json.dumps(offsets if epoch_report is None
                              else {"ok": report.ok and epoch_report.ok, "offsets": offsets,
                                    "epochs": epoch_report.to_json()}))
    else:
        typer.echo(report.summary())
        if epoch_report is not None:
            typer.echo(epoch_report.summary())
    if not report.ok or (epoch_report is not None and not epoch_report.ok):
        raise typer.Exit(1)


def _help(fn: Any) -> str:
    """The docstring with each paragraph on one line (rich keeps source line breaks in --help)."""
    paragraphs = inspect.cleandoc(fn.__doc__ or "").split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


EXAMPLES = {
    "take": examples("rollstream take --namespace demo -n 8 --steps 3",
                     "rollstream take --namespace demo -n 8 --steps 0 --group my-trainer --timeout 60 "
                     "--out steps.jsonl"),
    "lag": examples("rollstream lag --namespace demo --group my-trainer"),
    "replay": examples("rollstream replay --namespace demo --step 12 --out step12.jsonl",
                       "rollstream replay --namespace demo --from 0:1200 --to 0:1300",
                       "rollstream replay --namespace demo --since 10m"),
    "audit": examples("rollstream audit --namespace demo --group my-trainer",
                      "rollstream audit --namespace demo --epochs --json"),
}


def register(app: typer.Typer) -> None:
    """Add take, lag, replay and audit to the root `rollstream` app."""
    for name, fn in (("take", take), ("lag", lag), ("replay", replay), ("audit", audit_command)):
        app.command(name, help=_help(fn), epilog=EXAMPLES[name])(fn)

