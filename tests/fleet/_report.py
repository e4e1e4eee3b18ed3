"""The fleet report: a text table (printed), ``fleet.json`` and ``fleet.png`` (lag over time per phase, and
the broker requests backpressure causes per second, by mode and fleet size)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.fleet._churn import render as churn_lines


def render(run: dict[str, Any]) -> str:
    lines = [f"fleet: {run['command']}",
             f"cluster: 3 KRaft nodes on {run['bootstrap']} ({run.get('security', 'plaintext')}; RF 3, min.insync 2); "
             f"{run['partitions']} partitions; calibrated lag read = {run['calibration_total']:g} requests"]
    head = (f"{'phase':<16}{'groups/s':>9}{'steps/s':>8}{'lag max':>8}{'p99':>6}{'bound':>7}{'loop p99':>9}"
            f"{'loop max':>9}{'gate rd/s':>10}{'fail':>6}{'gate req/s':>11}{'/producer':>10}{'pos/s':>7}"
            f"{'ctl fetch/s':>12}"
            f"{'  lost dup audit'}")
    lines += ["", head, "-" * len(head)]
    for phase in run["phases"]:
        if "error" in phase:
            lines.append(f"{phase['label']:<16} ERROR: {phase['error'].splitlines()[0][:160]}")
            continue
        bp, lag, loop, c = phase["backpressure"], phase["lag"], phase["loop_lag_ms"], phase["checks"]
        lines.append(f"{phase['label']:<16}{phase['groups_per_s']:>9.0f}{phase['steps_per_s']:>8.1f}{lag['max']:>8}"
                     f"{lag['p99']:>6}{lag['bound']:>7}{loop['p99']:>9.1f}{loop['max']:>9.1f}"
                     f"{bp['gate_reads_per_s']:>10.1f}{bp['gate_reads_failed_fraction']:>6.0%}"
                     f"{bp['gate_requests_per_s']:>11.0f}"
                     f"{bp['gate_requests_per_s_per_producer']:>10.1f}{bp['positions_per_s']:>7.1f}"
                     f"{bp['control_fetch_per_s']:>12.0f}  {c['lost']:>4} {c['duplicated']:>3} "
                     f"{'ok' if c['audit_ok'] else 'FAIL'}" + ("  STALLED*" if phase.get("stalled") else "")
                     + ("" if lag["within_bound"] else "  OVER BOUND"))
    lines += ["", "lag max/p99: the trainer group's committed lag in the window; bound: max_lag + producers x",
              "  concurrency (-old: the gate rule before issue 25, max_lag per producer, for comparison);",
              "  gate rd/s: lag reads by the producers' gates (LagReader.group_lag, counted in each",
              "  process); fail: the share that raised (timed out); gate req/s: their Metadata/OffsetFetch/ListOffsets",
              "  calls x the requests per call librdkafka's statistics counted for one read (a lower bound for reads",
              "  that timed out);",
              "pos/s: trainer positions written to NS.control (one record per commit: the pushed signal);",
              "ctl fetch/s: Fetch requests of the producers' NS.control watchers (librdkafka statistics),",
              "  which follow policy versions in both modes; loop p99/max: the producer processes' event loops."]
    for phase in run["phases"]:
        if phase.get("churn"):
            lines += churn_lines(phase)
    if any(p.get("broker") for p in run["phases"]) or not any(p.get("churn") for p in run["phases"]):
        lines += _broker_table(run["phases"])
    lines += _scaling(run["phases"])
    for idle in run.get("control_idle", []):
        lines.append(f"idle NS.control watchers x{idle['watchers']}: {idle['fetch_per_s']:.0f} Fetch/s, "
                     f"{idle['fetch_per_s_per_watcher']:.2f} per watcher (nothing announced, {idle['seconds']:g} s)")
    for phase in run["phases"]:
        if phase.get("stalled"):
            st = phase["stalled"]
            lines.append(f"* {phase['label']}: the drain stalled ({st['uncommitted']} prompts uncommitted, none "
                         f"committed for {st['stall_s']:g} s, {st['after_drain_s']:g} s into the drain; "
                         f"{st['gate_reads_failed']} of {st['gate_reads']} gate lag reads had failed); "
                         f"{st['finishers']} fresh pushed-mode producers finished the prompts, then the checks ran")
        if "checks" in phase and not phase["checks"]["ok"]:
            c = phase["checks"]
            lines.append(f"{phase['label']}: FAILED checks: lost {c['lost_ids']}, duplicated {c['duplicated_ids']}, "
                         f"unexpected {c['unexpected']}, audit {c['audit']}, errors {c['errors'][:3]}")
    lines.append(f"verdict: {'PASS' if run['ok'] else 'FAIL'}")
    return "\n".join(lines)


_BROKER_COLUMNS = ("ListOffsets", "OffsetFetch", "Metadata", "FetchConsumer", "FetchFollower", "Produce",
                   "OffsetCommit", "Heartbeat")


def _broker_table(phases: list[dict[str, Any]]) -> list[str]:
    """Requests per second as the brokers counted them (JMX), every client included."""
    rows = [p for p in phases if p.get("broker")]
    if not rows:
        return ["", "broker-side request counts: not available (needs a JDK: java with jdk.attach)"]
    head = f"{'phase':<16}{'all':>7}{'lag-read APIs':>14}" + "".join(f"{c:>14}" for c in _BROKER_COLUMNS)
    lines = ["", "requests/s as the 3 brokers counted them (JMX RequestMetrics, every client; lag-read APIs =",
             "ListOffsets + OffsetFetch + Metadata; FetchConsumer/FetchFollower: clients' / replicas' fetches):",
             head, "-" * len(head)]
    for p in rows:
        b = p["broker"]
        lines.append(f"{p['label']:<16}{b['total_requests_per_s']:>7.0f}{b['lag_read_apis_per_s']:>14.0f}"
                     + "".join(f"{b['requests_per_s'].get(c, 0.0):>14.0f}" for c in _BROKER_COLUMNS))
    return lines


def _ratio(small: dict[str, Any], large: dict[str, Any], *path: str) -> str:
    """large / small of the figure at `path` (e.g. "backpressure", "gate_reads_per_s"), as "x1.23"."""
    def at(phase: dict[str, Any]) -> float:
        value: Any = phase
        for key in path:
            value = value[key]
        return float(value)
    return f"x{at(large) / at(small):.2f}" if at(small) else "-"


def _scaling(phases: list[dict[str, Any]]) -> list[str]:
    """Per mode, how each request rate changed from the small fleet to the large one."""
    done = [p for p in phases if "backpressure" in p]
    lines: list[str] = []
    for mode in ("poll", "pushed"):
        runs = sorted((p for p in done if p["spec"]["mode"] == mode and p["spec"].get("rule", "share") == "share"),
                      key=lambda p: p["spec"]["producers"])
        if len(runs) < 2:
            continue
        small, large = runs[0], runs[-1]
        line = (f"{mode}: producers x{large['spec']['producers'] / small['spec']['producers']:g} -> gate lag reads "
                f"{_ratio(small, large, 'backpressure', 'gate_reads_per_s')}, their requests "
                f"{_ratio(small, large, 'backpressure', 'gate_requests_per_s')}, positions "
                f"{_ratio(small, large, 'backpressure', 'positions_per_s')} (trainer steps/s "
                f"{_ratio(small, large, 'steps_per_s')}), control fetches "
                f"{_ratio(small, large, 'backpressure', 'control_fetch_per_s')}")
        if small.get("broker") and large.get("broker"):
            line += f"; brokers' lag-read APIs {_ratio(small, large, 'broker', 'lag_read_apis_per_s')}"
        lines.append(line)
    return ["", "scaling, small fleet -> large fleet:", *lines] if lines else []


def write(run: dict[str, Any], out: Path) -> tuple[Path, Path | None]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "fleet.json"
    path.write_text(json.dumps(run, indent=1))
    return path, plot(run, out / "fleet.png")


def plot(run: dict[str, Any], path: Path) -> Path | None:
    """Lag over time per phase against max_lag and max_lag + in-flight; then requests/s by phase."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    phases = [p for p in run["phases"] if "series" in p]
    if not phases:
        return None
    fig, axes = plt.subplots(len(phases) + 1, 1, figsize=(11, 3.0 * (len(phases) + 1)), squeeze=False)
    for ax, phase in zip(axes[:, 0], phases, strict=False):
        lag = phase["series"]["lag"]
        ax.plot([t for t, _ in lag], [v for _, v in lag], lw=0.8, label="trainer lag (sampled every 0.1 s)")
        during = phase["series"].get("lag_during_commits", [])
        if during and phase.get("churn"):
            ax.scatter([t for t, _ in during], [v for _, v in during], s=3, color="tab:blue", alpha=0.4,
                       label="lag read during a commit (at most a step high)")
        flight = phase["series"]["in_flight"]
        ax.plot([t for t, _ in flight], [v for _, v in flight], lw=0.8, color="tab:green", label="groups in flight")
        ax.axhline(phase["lag"]["max_lag"], color="tab:orange", ls="--", lw=1, label="max_lag")
        if phase.get("churn"):
            steps = phase["churn"]["bound_series"]
            ax.step([t for t, _ in steps], [b for _, b in steps], where="post", color="tab:red", ls=":", lw=1,
                    label="bound of the moment (max_lag + in flight + leavers)")
            for e in phase["churn"]["events"][1:]:
                ax.axvline(e["at_s"], color="black", lw=0.6)
                ax.text(e["at_s"], 0, " " + e["event"], rotation=90, fontsize=6, va="bottom")
        else:
            ax.axhline(phase["lag"]["bound"], color="tab:red", ls=":", lw=1, label="max_lag + in-flight bound")
        ax.axvspan(phase["window"][0], phase["window"][1], color="grey", alpha=0.1, label="measured window")
        ax.set_title(f"{phase['label']}: {phase['groups_per_s']:.0f} groups/s, lag max {phase['lag']['max']} "
                     f"(bound {phase['lag']['bound']}), gate {phase['backpressure']['gate_requests_per_s']:.0f} req/s",
                     fontsize=10)
        ax.set_xlabel("s since the phase started")
        ax.set_ylabel("groups")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="upper right")
    ax = axes[-1, 0]
    labels = [p["label"] for p in phases]
    gate = [p["backpressure"]["gate_requests_per_s"] for p in phases]
    signal = [p["backpressure"]["signal_requests_per_s"] for p in phases]
    xs = range(len(phases))
    fetch = [p["backpressure"]["control_fetch_per_s"] for p in phases]
    ax.bar(xs, gate, label="gate lag reads (requests/s)")
    ax.bar(xs, signal, bottom=gate, label="pushed positions (records/s)")
    tops = [g + s for g, s in zip(gate, signal, strict=True)]
    ax.bar(xs, fetch, bottom=tops, color="none", edgecolor="grey", hatch="//",
           label="NS.control watchers' fetches (both modes; they follow policy versions too)")
    for x, top, f in zip(xs, tops, fetch, strict=True):
        ax.text(x, top + f, f"{top:.0f} (+{f:.0f} fetches)", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(top=3 * max(t + f for t, f in zip(tops, fetch, strict=True)) + 10)
    ax.set_xticks(list(xs), labels)
    ax.set_yscale("symlog", linthresh=10)
    ax.set_ylabel("broker requests/s")
    ax.set_title("broker requests per second caused by backpressure", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
