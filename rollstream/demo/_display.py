"""What the demo shows and writes: one row per step, the live progress panel, the plot.

The panel is a `rich.live.Live` on stderr, redrawn after each step, when stderr is a terminal;
otherwise (a log file, CI) a plain line is printed every `every` steps. matplotlib draws the plot with
its Agg backend (no display needed) and is imported only when the plot is written.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

from rich.console import Console
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

_WINDOW = 10


@dataclass(frozen=True)
class StepRow:
    """One training step as the demo records it (a line of ``steps.jsonl``).

    Attributes:
        step: the consumer's step number; version: the policy version after the step.
        reward: mean reward of the step's samples; exact: fraction of samples exactly right (reward 1).
        staleness_mean, staleness_max: trainer version minus each taken group's oldest weight version.
        stale_filtered: groups skipped at this step for being more than max_staleness versions old.
        lag: records on NS.rollouts after the trainer's position when the step was taken.
        groups: groups taken; take_s, train_s, publish_s: time waiting in take, in the optimizer step,
            and saving + announcing + committing; elapsed_s: since the trainer started.
        loss, entropy, clip_fraction: from the optimizer step.
    """

    step: int
    version: int
    reward: float
    exact: float
    staleness_mean: float
    staleness_max: int
    stale_filtered: int
    lag: int
    groups: int
    take_s: float
    train_s: float
    publish_s: float
    elapsed_s: float
    loss: float
    entropy: float
    clip_fraction: float

    def to_json(self) -> str:
        return json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()})


def window_mean(values: Sequence[float], n: int = _WINDOW) -> float:
    """Mean of the last `n` values (nan when empty)."""
    tail = list(values)[-n:]
    return sum(tail) / len(tail) if tail else float("nan")


def groups_per_s(rows: Sequence[StepRow], n: int = _WINDOW) -> float:
    """Groups taken per second over the last `n` steps (over all steps when fewer)."""
    if not rows:
        return 0.0
    tail = list(rows)[-n:]
    start = rows[-len(tail) - 1].elapsed_s if len(rows) > len(tail) else 0.0
    span = tail[-1].elapsed_s - start
    return sum(r.groups for r in tail) / span if span > 0 else 0.0


class ProgressDisplay:
    """The demo's progress on stderr: a live panel on a terminal, a line every `every` steps elsewhere.

    A context manager; `update` after each step, `note` for one-off messages (printed above the panel).
    Not thread-safe: call from the trainer's thread.
    """

    def __init__(self, total_steps: int, *, console: Console | None = None, every: int = 10,
                 engine: str = "") -> None:
        self.console = console or Console(stderr=True)
        self.total_steps = total_steps
        self.engine = engine  # what generates, in words ("" shows no engine row)
        self.every = every
        self._live: Live | None = None
        self._rows: list[StepRow] = []

    def __enter__(self) -> ProgressDisplay:
        if self.console.is_terminal:
            self._live = Live(self._panel(), console=self.console, refresh_per_second=4, transient=False)
            self._live.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def note(self, message: str) -> None:
        self.console.print(message, highlight=False, soft_wrap=True)

    def update(self, row: StepRow) -> None:
        self._rows.append(row)
        if self._live is not None:
            self._live.update(self._panel())
        elif len(self._rows) == 1 or len(self._rows) % self.every == 0 or len(self._rows) == self.total_steps:
            self.console.print(self._line(row), highlight=False, soft_wrap=True)

    def _line(self, row: StepRow) -> str:
        rewards = [r.reward for r in self._rows]
        return (f"step {len(self._rows):4d}/{self.total_steps}  v{row.version:<4d} reward {row.reward:.3f} "
                f"(last {_WINDOW}: {window_mean(rewards):.3f})  exact {window_mean([r.exact for r in self._rows]):.3f}"
                f"  lag {row.lag:3d}  staleness {row.staleness_mean:.1f} (max {row.staleness_max}, filtered "
                f"{sum(r.stale_filtered for r in self._rows)})  {groups_per_s(self._rows):.0f} groups/s  "
                f"{row.elapsed_s:.0f} s")

    def _panel(self) -> Panel:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        rows = self._rows
        if self.engine:
            table.add_row("engine", self.engine)
        if not rows:
            table.add_row("step", f"0 / {self.total_steps}   waiting for the first groups...")
            return Panel(table, title="rollstream demo", border_style="cyan")
        last = rows[-1]
        first = window_mean([r.reward for r in rows[:_WINDOW]])
        table.add_row("step", f"{len(rows)} / {self.total_steps}   (policy version {last.version})")
        table.add_row("mean reward", f"{last.reward:.3f}   last {_WINDOW}: "
                                     f"{window_mean([r.reward for r in rows]):.3f}   first {_WINDOW}: {first:.3f}")
        table.add_row("exact match", f"{window_mean([r.exact for r in rows]):.3f}   (last {_WINDOW} steps)")
        table.add_row("lag", f"{last.lag} records on the rollouts topic after the trainer")
        table.add_row("staleness", f"mean {last.staleness_mean:.2f}, max {last.staleness_max} versions; stale "
                                   f"groups filtered: {sum(r.stale_filtered for r in rows)}")
        table.add_row("throughput", f"{groups_per_s(rows):.1f} groups/s   ({sum(r.groups for r in rows)} groups)")
        table.add_row("step time", f"take {1e3 * last.take_s:.0f} ms, train {1e3 * last.train_s:.0f} ms, "
                                   f"save+announce+commit {1e3 * last.publish_s:.0f} ms")
        table.add_row("elapsed", f"{last.elapsed_s:.1f} s")
        return Panel(table, title="rollstream demo", border_style="cyan")


def write_plot(rows: Sequence[StepRow], path: Path, *, title: str, max_staleness: int | None) -> Path:
    """Draw reward, lag and staleness per step into the PNG `path` (matplotlib, Agg). Blocks ~1 s."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    steps = [r.step for r in rows]
    fig = Figure(figsize=(9, 8), constrained_layout=True)
    ax_reward, ax_lag, ax_stale = fig.subplots(3, 1, sharex=True)
    ax_reward.plot(steps, [r.reward for r in rows], color="tab:blue", alpha=0.35, label="mean reward (step)")
    ax_reward.plot(steps, _rolling([r.reward for r in rows]), color="tab:blue",
                   label=f"mean reward ({_WINDOW}-step mean)")
    ax_reward.plot(steps, _rolling([r.exact for r in rows]), color="tab:green", label="exact match")
    ax_reward.set_ylabel("reward")
    ax_reward.set_ylim(0, 1)
    ax_reward.legend(loc="upper left")
    ax_lag.plot(steps, [r.lag for r in rows], color="tab:orange")
    ax_lag.set_ylabel("lag (records)")
    ax_stale.plot(steps, [r.staleness_mean for r in rows], color="tab:red", label="mean")
    ax_stale.plot(steps, [r.staleness_max for r in rows], color="tab:red", alpha=0.35, label="max")
    ax_stale.bar(steps, [r.stale_filtered for r in rows], color="tab:gray", label="stale groups filtered")
    if max_staleness is not None:
        ax_stale.axhline(max_staleness, color="black", linestyle=":", label=f"max staleness ({max_staleness})")
    top = max([r.staleness_max for r in rows] + [max_staleness or 0]) + 2
    ax_stale.set_ylim(0, top)
    ax_stale.set_ylabel("staleness (versions)")
    ax_stale.set_xlabel("trainer step")
    ax_stale.legend(loc="upper center", ncol=4, fontsize="small")
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), dpi=100)
    return path


def _rolling(values: Sequence[float], n: int = _WINDOW) -> list[float]:
    return [window_mean(values[: i + 1], n) for i in range(len(values))]
