"""The report as one self-contained HTML page: SVG plots drawn here, the detail steps as inline JSON, the
inline script of `_report_assets` to browse them. Pure: `ReportData` in, text out."""

from __future__ import annotations

import html
import json
import time
from collections import Counter
from typing import Any

from rollstream.consumers.forensics._report_assets import CSS, JS
from rollstream.consumers.forensics._report_data import MAX_LAG_LOOKUPS, ReportData, StepStats
from rollstream.consumers.forensics._report_svg import Series, line_chart

_APPROXIMATE = (
    "Exact: counts, rewards, advantages (group-normalised as to_tensors), staleness (the step's trainer version "
    "minus a taken group's oldest weight version), generation time (the producer's start and finish stamps). "
    "Approximate: <b>wait</b> is the step's manifest time minus the record's timestamp (the trainer's clock "
    "against the producer's); <b>lag</b> counts the records published before the step's manifest was written "
    "(by the records' timestamps) past the group's position after the step, looked up for at most {lookups} "
    "steps spread over the range (dots where looked up).")


def render(data: ReportData) -> str:
    """The whole page for `data`."""
    steps = data.steps
    first, last = (steps[0].step, steps[-1].step) if steps else (0, 0)
    title = f"rollstream report: {data.namespace} / {data.consumer_group}, steps {first}..{last}"
    payload = json.dumps({"details": {str(k): v for k, v in data.details.items()}}, separators=(",", ":"))
    payload = payload.replace("</", "<\\/")  # a response holding "</script>" must not end the data block
    return "".join([
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head>",
        '<body data-ready="0" data-errors="0">',
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="meta">{_summary(data)}</p><div id="errors"></div>',
        '<h2>Per step</h2><div class="grid">', "".join(_charts(steps)), "</div>",
        f'<p class="note">{_APPROXIMATE.format(lookups=MAX_LAG_LOOKUPS)}</p>',
        _reasons(steps), _zero_prompts(data.zero_prompts),
        '<h2>Groups of step <select id="step-select"></select></h2>',
        '<p class="note">Steps shown in full: pick one (or click a dot of a plot at such a step). Every offset the '
        "step covered, in the order the take judged it; click a response to see its tokens.</p>",
        "<table><thead><tr><th>partition:offset</th><th>disposition</th><th>group</th><th>prompt</th>"
        "<th>staleness</th><th>gen s</th><th>#</th><th>response</th><th>reward</th><th>advantage</th>"
        "<th>finish</th><th>version</th><th>tokens</th></tr></thead><tbody id=\"groups-body\"></tbody></table>",
        '<h2>Tokens of the chosen response</h2><p id="sample-head" class="meta"></p>',
        '<p>Colour by <label><input type="radio" name="colour" value="logprob" checked> logprob</label> '
        '<label><input type="radio" name="colour" value="version"> policy version</label> '
        '<label><input type="radio" name="colour" value="mask"> loss mask</label></p>',
        '<p id="token-legend" class="legendbar"></p><div id="tokens"></div>',
        f'<script type="application/json" id="report-data">{payload}</script>',
        f"<script>{JS}</script></body></html>",
    ])


def _summary(data: ReportData) -> str:
    totals: Counter[str] = Counter()
    for s in data.steps:
        totals.update(s.counts)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data.generated_at_ms / 1000))
    counts = ", ".join(f"{n} {kind}" for kind, n in totals.items() if n)
    return html.escape(f"{len(data.steps)} steps; {counts or 'no offsets'}; generated {when}. "
                       f"Export any step with: rollstream export --namespace {data.namespace} "
                       f"--group {data.consumer_group} --step K --out step.parquet")


def _charts(steps: tuple[StepStats, ...]) -> list[str]:
    xs = [s.step for s in steps]

    def col(name: str) -> list[float | None]:
        return [getattr(s, name) for s in steps]

    def count(kind: str) -> list[float | None]:
        return [float(s.counts.get(kind, 0)) for s in steps]

    return [
        line_chart("chart-reward", "Mean reward of the taken samples", xs,
                   [Series("reward", "#4e79a7", col("reward_mean"))], y_label="reward", zero_based=False),
        line_chart("chart-staleness", "Staleness of the taken groups (versions)", xs,
                   [Series("mean", "#59a14f", col("staleness_mean")),
                    Series("max", "#e15759", [None if v is None else float(v) for v in col("staleness_max")])],
                   y_label="versions"),
        line_chart("chart-lag", "Lag after the step (records, approximate)", xs,
                   [Series("lag", "#b07aa1", [None if v is None else float(v) for v in col("lag")],
                           dots_only=True)], y_label="records"),
        line_chart("chart-skipped", "Offsets not taken, per step", xs,
                   [Series("filtered", "#f28e2b", count("filtered")), Series("requeued", "#edc948", count("requeued")),
                    Series("duplicate", "#9c755f", count("duplicate")),
                    Series("taken, equal rewards", "#76b7b2", [float(s.flat_groups) for s in steps])],
                   y_label="offsets"),
        line_chart("chart-time", "Wait before taken, and generation time (s)", xs,
                   [Series("wait (approximate)", "#4e79a7", col("wait_s_mean")),
                    Series("generation", "#e15759", col("generation_s_mean"))], y_label="seconds"),
        line_chart("chart-length", "Mean response length (tokens)", xs,
                   [Series("tokens", "#59a14f", col("response_tokens_mean"))], y_label="tokens"),
    ]


def _reasons(steps: tuple[StepStats, ...]) -> str:
    totals: Counter[str] = Counter()
    for s in steps:
        totals.update(s.reasons)
    if not totals:
        return "<h2>Why offsets were not taken</h2><p class=\"meta\">Every offset of these steps was taken or " \
               "was a duplicate.</p>"
    rows = "".join(f"<tr><td>{html.escape(r)}</td><td class=\"num\">{n}</td></tr>" for r, n in totals.most_common())
    return ("<h2>Why offsets were not taken (filtered and requeued, by reason)</h2>"
            f"<table><thead><tr><th>reason</th><th>offsets</th></tr></thead><tbody>{rows}</tbody></table>")


def _zero_prompts(prompts: list[dict[str, Any]]) -> str:
    if not prompts:
        return ""
    rows = "".join(f"<tr><td>{html.escape(p['prompt_id'])}</td><td class=\"num\">{p['groups']}</td>"
                   f"<td class=\"prompt\">{html.escape(p['prompt'])}</td></tr>" for p in prompts)
    return ("<h2>Prompts whose every sample got reward 0 (most often first)</h2>"
            f"<table><thead><tr><th>prompt id</th><th>groups</th><th>prompt</th></tr></thead><tbody>{rows}"
            "</tbody></table>")
