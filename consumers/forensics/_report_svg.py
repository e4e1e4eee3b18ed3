"""Line charts as plain SVG text: what the report page draws its per-step plots with (no plotting library, so
the page needs nothing at view time). Pure: numbers in, markup out."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

WIDTH, HEIGHT = 560, 210
_LEFT, _RIGHT, _TOP, _BOTTOM = 54, 12, 34, 30
_MARKERS_UP_TO = 200  # points drawn as dots (with a hover title) up to this many per series


@dataclass(frozen=True)
class Series:
    """One line: its label, CSS colour and a value per x (None: no value there, the line breaks)."""

    label: str
    color: str
    values: Sequence[float | None]
    dots_only: bool = False


def nice_ticks(low: float, high: float, count: int = 5, *, min_step: float = 0.0) -> list[float]:
    """About `count` round tick values, the first at or below `low`, the last at or above `high`, at least
    `min_step` apart (1 for step numbers)."""
    if high <= low:
        high = low + 1
    raw = max((high - low) / max(1, count - 1), min_step)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    ticks = [math.floor(low / step + 1e-9) * step]
    while ticks[-1] < high - step * 1e-9:
        ticks.append(ticks[0] + step * len(ticks))
    return [round(t, 10) for t in ticks]


def line_chart(chart_id: str, title: str, xs: Sequence[int], series: Sequence[Series], *, y_label: str = "",
               zero_based: bool = True) -> str:
    """An SVG line chart of `series` over the step numbers `xs`; an empty frame saying so when no value."""
    present = [v for s in series for v in s.values if v is not None]
    parts = [f'<svg id="{chart_id}" class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
             f'height="{HEIGHT}" xmlns="http://www.w3.org/2000/svg" role="img">',
             f'<title>{html.escape(title)}</title>',
             f'<text x="{_LEFT}" y="13" class="chart-title">{html.escape(title)}</text>']
    plot_w, plot_h = WIDTH - _LEFT - _RIGHT, HEIGHT - _TOP - _BOTTOM
    parts.append(f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" class="frame"/>')
    if not xs or not present:
        parts.append(f'<text x="{_LEFT + plot_w / 2}" y="{_TOP + plot_h / 2}" class="empty">no data</text></svg>')
        return "".join(parts)
    y_low = min(0.0, min(present)) if zero_based else min(present)
    y_ticks = nice_ticks(y_low, max(present))
    y0, y1 = y_ticks[0], y_ticks[-1] if y_ticks[-1] > y_ticks[0] else y_ticks[0] + 1
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1

    def px(x: float) -> float:
        return _LEFT + (x - x0) / (x1 - x0) * plot_w

    def py(y: float) -> float:
        return _TOP + plot_h - (y - y0) / (y1 - y0) * plot_h

    for t in y_ticks:
        parts.append(f'<line x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{py(t):.1f}" y2="{py(t):.1f}" class="grid"/>'
                     f'<text x="{_LEFT - 4}" y="{py(t) + 3:.1f}" class="tick" text-anchor="end">{_fmt(t)}</text>')
    for t in nice_ticks(x0, x1, 6, min_step=1):
        if x0 <= t <= x1:
            parts.append(f'<text x="{px(t):.1f}" y="{HEIGHT - _BOTTOM + 14}" class="tick" '
                         f'text-anchor="middle">{_fmt(t)}</text>')
    parts.append(f'<text x="{WIDTH - _RIGHT}" y="{HEIGHT - 4}" class="axis" text-anchor="end">step</text>')
    if y_label:
        parts.append(f'<text x="12" y="{_TOP + plot_h / 2}" class="axis" text-anchor="middle" '
                     f'transform="rotate(-90 12 {_TOP + plot_h / 2})">{html.escape(y_label)}</text>')
    legend_x = _LEFT + 6
    for s in series:
        parts.extend(_series(s, xs, px, py))
        parts.append(f'<text x="{legend_x}" y="{_TOP - 4}" class="legend" fill="{s.color}">'
                     f'&#9644; {html.escape(s.label)}</text>')
        legend_x += 22 + 7 * len(s.label)  # ~7 px per character at the legend's 11 px
    parts.append("</svg>")
    return "".join(parts)


def _series(s: Series, xs: Sequence[int], to_x: Callable[[float], float], to_y: Callable[[float], float]
            ) -> list[str]:
    out: list[str] = []
    run: list[str] = []
    points = [(x, v) for x, v in zip(xs, s.values, strict=True) if v is not None]
    for x, v in zip(xs, s.values, strict=True):
        if v is None:
            if len(run) > 1 and not s.dots_only:
                out.append(_polyline(run, s.color))
            run = []
            continue
        run.append(f"{to_x(x):.1f},{to_y(v):.1f}")
    if len(run) > 1 and not s.dots_only:
        out.append(_polyline(run, s.color))
    if s.dots_only or len(points) <= _MARKERS_UP_TO:
        for x, v in points:
            out.append(f'<circle cx="{to_x(x):.1f}" cy="{to_y(v):.1f}" r="2.2" fill="{s.color}" '
                       f'data-step="{x}"><title>step {x}: {html.escape(s.label)} {_fmt(v)}</title></circle>')
    return out


def _polyline(points: list[str], color: str) -> str:
    return f'<polyline points="{" ".join(points)}" fill="none" stroke="{color}" stroke-width="1.6"/>'


def _fmt(value: float) -> str:
    if value == int(value) and abs(value) < 1e9:
        return str(int(value))
    return f"{value:.3g}"
