"""The two OpenRLHF queue payloads that are not rollouts, as records on NS.rollouts: the generator's end
(``"done"``) and its async eval results (``("eval", global_step, metrics)``).

Each is a group of no samples (status ``failed``, so nothing else trains it) whose metadata says what it is
(``openrlhf.end``; ``openrlhf.eval``: JSON ``{"step", "metrics"}``). The trainer's filter `MarkerFilter`
notes them as it polls and keeps them out of every step; they are committed with the step they were read in.
Pure: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rollstream.consumers.filters import FilterContext
from rollstream.schemas import Samples, ScoredGroup, now_ms

END_KEY = "openrlhf.end"
EVAL_KEY = "openrlhf.eval"


def end_marker(producer_id: str) -> ScoredGroup:
    """The record of the generator's ``"done"``."""
    return _marker(producer_id, f"openrlhf-end-{producer_id}", "OpenRLHF's generator finished its data (end of "
                   "stream)", {END_KEY: json.dumps(True)})


def eval_marker(producer_id: str, global_step: int, metrics: dict[str, Any]) -> ScoredGroup:
    """The record of the generator's ``("eval", global_step, metrics)``; metric values become floats where
    JSON cannot hold them as they are (tensors, numpy scalars)."""
    body = json.dumps({"step": int(global_step), "metrics": metrics}, default=_number)
    return _marker(producer_id, f"openrlhf-eval-{producer_id}-{global_step}",
                   f"OpenRLHF's eval results at step {global_step}", {EVAL_KEY: body})


@dataclass
class MarkerFilter:
    """A GroupFilter keeping markers out of steps: it notes the end (`ended`) and each eval result once, by
    group id (a take that puts back what it looked at shows it again), for `pop_eval`."""

    ended: bool = False
    _evals: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set)

    def __call__(self, group: ScoredGroup, context: FilterContext) -> str | None:
        if group.metadata.get(END_KEY):
            self.ended = True
            return "end_of_stream: OpenRLHF's generator finished its data"
        body = group.metadata.get(EVAL_KEY)
        if body is None:
            return None
        if group.group_id not in self._seen:
            self._seen.add(group.group_id)
            result = json.loads(body)
            self._evals.append((int(result["step"]), result["metrics"]))
        return "openrlhf_eval: OpenRLHF's eval results, handed to the trainer apart from the steps"

    @property
    def has_eval(self) -> bool:
        return bool(self._evals)

    def pop_eval(self) -> tuple[str, int, dict[str, Any]] | None:
        """The oldest eval result not handed over yet, as OpenRLHF's ``("eval", global_step, metrics)``."""
        return ("eval", *self._evals.pop(0)) if self._evals else None


def _marker(producer_id: str, prompt_id: str, what: str, metadata: dict[str, str]) -> ScoredGroup:
    at = now_ms()
    return ScoredGroup(group_id=f"{prompt_id}-{at}#0", prompt_id=prompt_id, epoch=0,
                       prompt_tokens=np.zeros(0, dtype=np.int32), samples=Samples(), started_at_ms=at,
                       finished_at_ms=at, producer_id=producer_id, status="failed", error=what, metadata=metadata)


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"an OpenRLHF eval metric of type {type(value).__name__} is not a number: {value!r}") \
            from exc
