"""`rollstream status`: why a trainer would wait, for a namespace (thin: calls `rollstream.consumers.status`)."""

from __future__ import annotations

import json
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
from rollstream.consumers import StatusReport, status
from rollstream.consumers.forensics._status_causes import age
from rollstream.consumers.forensics._status_report import ProducerInfo, ProducersReport, PromptsReport, TrainerReport

EXIT_BLOCKED = 1
EXIT_PARTIAL = 3
_IDLE = frozenset({"no_prompts", "prompts_exhausted"})  # no work left: nothing to unblock

HELP = "\n\n".join([
    "Say why a trainer would wait: read the producers, the prompts and the trainer group of a namespace "
    "and name the likely cause. Read-only (commits nothing, joins no group) and bounded by --timeout.",
    "producers: members of the producers' consumer group on NS.prompts (--producer-group, default "
    "NS.producers) with their id (--producer-id, i.e. group.instance.id), member id, host and assigned "
    "partitions, and the group state; each one's backpressure state from the metadata of its prompt-offset "
    "commits: paused or open, since when, its max lag, and how old that state is. Producers that committed "
    "a state but are no longer members are listed as gone.",
    "prompts: records of NS.prompts past the producers' committed offsets (not generated yet or being "
    "generated; no commit: from the log start), exact, and by epoch as far as --max-prompts records were "
    "read ('at least' beyond); requeued prompts (attempt > 0) and undecodable records apart.",
    "trainer: the group's lag on NS.rollouts, its last step, how long ago and at which policy version, "
    "pending steps (manifest written, offsets not committed), and the dispositions of its last "
    "--recent-steps steps by kind and reason (taken, filtered, requeued, duplicate, undecodable); then the "
    "next --peek groups past its committed offsets as a take with the default filters would judge them "
    "(staleness only with --max-staleness, against --policy-version or the last step's).",
    "diagnosis: the likely causes, blocking ones first: NS.prompts empty, 0 prompts left in the last epoch, "
    "0 producers, every producer paused by backpressure, every group waiting filtered. 'unavailable' names "
    "what could not be read and why.",
    "Exit status: 0 healthy or idle (nothing blocks, or no work is left); 1 blocked (work is left that "
    "cannot reach a waiting trainer until someone acts); 3 partial (part of the report could not be read "
    "and nothing blocking was found); 2 a usage or configuration error (no broker answers, the namespace has "
    "no topics).",
])


def status_command(
    group: TrainerGroupOpt = DEFAULT_TRAINER_GROUP,
    namespace: NamespaceOpt = DEFAULT_NAMESPACE,
    producer_group: Annotated[str | None, typer.Option(
        help="The producers' consumer group on NS.prompts (default NS.producers).")] = None,
    recent_steps: Annotated[int, typer.Option(min=0, help="Steps whose dispositions are counted.")] = 10,
    max_prompts: Annotated[int, typer.Option(min=0, help="Prompts read at most to count them by epoch.")] = 200_000,
    peek: Annotated[int, typer.Option(min=0, help="Groups past the trainer's committed offsets to judge.")] = 100,
    max_staleness: Annotated[int | None, typer.Option(
        help="Judge staleness in the peek as the trainer does (its --max-staleness).")] = None,
    policy_version: Annotated[int | None, typer.Option(
        help="The trainer's policy version for the staleness check (default: its last step's).")] = None,
    dynamic_sampling: Annotated[bool, typer.Option(
        help="The peek skips groups whose rewards are all equal, as the trainer's default filters do.")] = True,
    timeout: Annotated[float, typer.Option(min=0.5, help="Seconds for the whole report.")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
    bootstrap_servers: BootstrapOpt = None,
    kafka_config_file: KafkaConfigOpt = None,
) -> None:
    config = kafka_config(bootstrap_servers, kafka_config_file, "rollstream-status")
    names = topic_names(namespace)  # a wrong namespace or no broker: one line, not a report of what is unreadable
    require_reachable(config, [names.prompts, names.rollouts], namespace, timeout)
    report = status(config, namespace, trainer_group=group, producer_group=producer_group,
                    recent_steps=recent_steps, max_prompts=max_prompts, peek=peek, max_staleness=max_staleness,
                    policy_version=policy_version, dynamic_sampling=dynamic_sampling, timeout=timeout)
    if as_json:
        typer.echo(json.dumps(report.to_json()))
    else:
        for line in report_lines(report):
            typer.echo(line)
    if report.diagnosis.blocked:
        raise typer.Exit(EXIT_BLOCKED)
    if report.unavailable:
        raise typer.Exit(EXIT_PARTIAL)


def report_lines(report: StatusReport) -> list[str]:
    """The report for people, one part per paragraph."""
    lines = [f"namespace {report.namespace}"]
    if report.producers is not None:
        lines += _producer_lines(report.producers)
    if report.prompts is not None:
        lines += _prompt_lines(report.prompts)
    if report.trainer is not None:
        lines += _trainer_lines(report.trainer)
    d = report.diagnosis
    idle = any(c.code in _IDLE for c in d.causes)
    verdict = "BLOCKED" if d.blocked else "idle" if idle else "ok"
    lines.append(f"diagnosis: {verdict}" + ("" if d.causes else ": nothing found that would stop a trainer"))
    lines += [f"  {'!' if c.blocking else '-'} {c.message}" for c in d.causes]
    lines += [f"unavailable: {part}: {why}" for part, why in report.unavailable.items()]
    return lines


def _producer_lines(p: ProducersReport) -> list[str]:
    lines = [f"producers: {len(p.members)} alive in {p.group} (group {p.group_state}), {len(p.paused)} paused "
             "by backpressure"]
    lines += [f"  {_producer(m)}" for m in p.members]
    lines += [f"  gone {_producer(m)}" for m in p.gone]
    return lines


def _producer(m: ProducerInfo) -> str:
    parts = ",".join(map(str, m.partitions)) or "none"
    where = f" member {m.member_id} host {m.host}" if m.member_id else ""
    s = m.state
    state = ("no state committed yet" if s is None else
             f"{'paused' if s.paused else 'open'} for {age(s.since_ms)} (max lag {s.max_lag}; state written "
             f"{age(s.updated_at_ms)} ago)")
    return f"{m.producer_id or '?'}: {state}; partitions {parts}{where}"


def _prompt_lines(p: PromptsReport) -> list[str]:
    bound = "" if p.complete else f" (epochs from the first {p.read}: at least)"
    epochs = ", ".join(f"epoch {e.epoch}: {e.left}" + (f" ({e.requeued} requeued)" if e.requeued else "")
                       for e in p.epochs)
    lines = [f"prompts: {p.left} left of {p.stored} stored in {p.topic}" + (f"; {epochs}{bound}" if epochs else "")]
    if p.undecodable:
        lines.append(f"  {p.undecodable} undecodable records among them")
    return lines


def _trainer_lines(t: TrainerReport) -> list[str]:
    last = ("no step yet" if t.last_step is None or t.last_step_at_ms is None else
            f"last step {t.last_step}, {age(t.last_step_at_ms)} ago"
            + ("" if t.policy_version is None else f" (policy version {t.policy_version})"))
    lines = [f"trainer: {t.group} on {t.topic}: lag {t.lag}; {last}"]
    if t.followed_version is not None:
        run = f" of trainer run {t.followed_run}" if t.followed_run else ""
        since = f", announced {age(t.followed_at_ms)} ago" if t.followed_at_ms is not None else ""
        ignored = (f"; {t.superseded_announcements} announcements of superseded runs ignored"
                   if t.superseded_announcements else "")
        lines.append(f"  producers follow policy version {t.followed_version}{run}{since}{ignored}")
    if t.pending_steps:
        lines.append(f"  steps {list(t.pending_steps)} taken, not committed yet")
    if t.recent_steps:
        counts = "; ".join(f"{kind} {sum(labels.values())}" + (
            f" ({', '.join(f'{k} {v}' for k, v in labels.items())})" if set(labels) != {kind} else "")
            for kind, labels in t.recent.items())
        n = len(t.recent_steps)
        lines.append(f"  last {n} step{'s' if n != 1 else ''} ({t.recent_steps[0]}..{t.recent_steps[-1]}): {counts}")
    if not t.steps_read_all:
        lines.append("  (steps from the newest records of NS.steps only)")
    w = t.waiting
    if w is not None:
        skipped = ", ".join(f"{k} {v}" for k, v in w.skipped.items())
        lines.append(f"  next {w.looked_at} groups past its committed offsets: {w.acceptable} acceptable"
                     + (f", skipped {skipped}" if skipped else ""))
    return lines


def register(app: typer.Typer) -> None:
    """Add `status` to the root `rollstream` app."""
    app.command("status", help=HELP, epilog=examples(
        "rollstream status --namespace demo", "rollstream status --namespace demo --group my-trainer --json"))(
        status_command)
