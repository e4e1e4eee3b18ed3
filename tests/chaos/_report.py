"""The chaos report: a markdown summary of one run (seed, faults by kind, figures, verdict, fault log)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tests.chaos._check import Verdict
from tests.chaos._nemesis import KINDS
from tests.chaos._rss import Series, render_rss


@dataclass
class RunFacts:
    """What the run did, besides the verdict."""

    seed: int
    nodes: int
    seconds: float
    command: str
    faults: Counter[str]
    events: list[str]
    loads: int = 0
    load_failures: list[str] = field(default_factory=list)
    unexpected_exits: list[str] = field(default_factory=list)
    drain_s: float = 0.0
    drain_problem: str | None = None
    error: str | None = None
    rss: list[Series] = field(default_factory=list)
    exit_failures: list[str] = field(default_factory=list)  # trainer/producer ends the nemesis did not cause

    def passed(self, verdict: Verdict | None) -> bool:
        """Nothing lost or duplicated, audit green, drained, no run error, and no process died wrongly."""
        return (verdict is not None and verdict.ok and self.drain_problem is None and self.error is None
                and not self.exit_failures)


def render(facts: RunFacts, verdict: Verdict | None) -> str:
    ok = facts.passed(verdict)
    lines = [f"# Chaos report: {'PASS' if ok else 'FAIL'}", "",
             f"- seed **{facts.seed}**, {facts.nodes} broker node(s), nemesis {facts.seconds:.0f} s, "
             f"drain {facts.drain_s:.0f} s",
             f"- repeat with: `{facts.command}`", "", "## Faults injected", "",
             "| kind | count |", "|---|---:|"]
    lines += [f"| {k} | {facts.faults.get(k, 0)} |" for k in KINDS]
    lines += [f"| **total** | {sum(facts.faults.values())} |", ""]
    if facts.error:
        lines += ["## Run error", "", "```", facts.error, "```", ""]
    if facts.exit_failures:
        lines += ["## Processes that died of something the nemesis did not send (FAIL)", ""]
        lines += [f"```\n{e}\n```" for e in facts.exit_failures] + [""]
    if facts.drain_problem:
        lines += ["## Drain", "", f"FAILED: {facts.drain_problem}", ""]
    if verdict is not None:
        lines += _figures(facts, verdict)
    lines += render_rss(facts.rss)
    if facts.unexpected_exits:
        lines += ["## Processes that failed on their own", ""]
        lines += [f"```\n{e}\n```" for e in facts.unexpected_exits] + [""]
    if facts.load_failures:
        lines += ["## Prompt loads refused or cut short (what reached NS.prompts is what counts)", ""]
        lines += [f"- {e}" for e in facts.load_failures] + [""]
    lines += ["## Fault log", "", "```", *facts.events, "```", ""]
    return "\n".join(lines)


def _figures(facts: RunFacts, v: Verdict) -> list[str]:
    filtered = ", ".join(f"{reason}: {n}" for reason, n in v.filtered.items()) or "none"
    skipped = ", ".join(f"{kind}: {n}" for kind, n in v.skipped.items()) or "none"
    lines = ["## Figures", "", "| | |", "|---|---:|",
             f"| prompt loads (waves) | {facts.loads} |",
             f"| prompts loaded (on NS.prompts) | {v.loaded} |",
             f"| committed steps | {v.steps} |",
             f"| groups taken by the trainer | {v.taken} |",
             f"| groups filtered (accounted) | {sum(v.filtered.values())} ({filtered}) |",
             f"| records skipped (not groups) | {skipped} |",
             f"| **lost** | **{len(v.lost)}** |",
             f"| **duplicated to the trainer** | **{len(v.duplicated)}** |",
             f"| taken but never loaded | {len(v.unexpected)} |",
             f"| --out: earlier copies of re-taken steps | {v.out_copies} |",
             f"| --out: torn lines | {v.torn_lines} |",
             f"| --out disagrees with the manifests | {len(v.out_mismatch)} |",
             f"| audit | {'green' if v.audit_ok else '**RED**'} |", ""]
    if v.lost:
        lines += [f"Lost ({len(v.lost)}): {', '.join(v.lost[:20])}{' ...' if len(v.lost) > 20 else ''}", ""]
    if v.duplicated:
        dups = [f"{g} (steps {s})" for g, s in list(v.duplicated.items())[:20]]
        lines += [f"Duplicated ({len(v.duplicated)}): {', '.join(dups)}", ""]
    if v.unexpected:
        lines += [f"Taken but never loaded: {', '.join(v.unexpected[:20])}", ""]
    if v.out_mismatch:
        lines += ["--out vs manifests:", *[f"- {m}" for m in v.out_mismatch[:20]], ""]
    lines += ["Audit:", "", "```", v.audit_summary, "```", ""]
    return lines
