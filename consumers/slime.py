"""Use rollstream as the rollout source of slime (THUDM's RL framework).

Point slime at it with ``--rollout-function-path consumers.slime.generate_rollout``. Each call takes
exactly ``args.rollout_batch_size`` groups from NS.rollouts and returns them as slime expects from a
rollout function: a list of groups, each a list of slime ``Sample`` objects. When slime is installed
its own ``slime.utils.types.Sample`` is built; otherwise `SlimeSample`, a stand-in with the same field
names and meaning:

- ``tokens``: prompt token ids followed by response token ids; ``response_length``: response tokens;
- ``loss_mask``: ``[1] * response_length`` (every response token is model-generated);
- ``rollout_log_probs``: one logprob per response token (None when the engine returned none);
- ``reward``: the sample's reward; ``status``: COMPLETED / TRUNCATED / ABORTED from the finish reason,
  FAILED for a failed group; ``weight_versions``: the policy versions, as strings (as SGLang reports);
- ``prompt``, ``response``, ``label`` (``metadata["label"]``), ``group_index``, ``index``, and
  ``metadata`` with group_id, prompt_id, epoch, partition and offset.

Settings come from ``args`` attributes, else environment variables:
``rollstream_bootstrap_servers`` / ``ROLLSTREAM_BOOTSTRAP_SERVERS``, ``rollstream_namespace`` /
``ROLLSTREAM_NAMESPACE``, ``rollstream_group`` / ``ROLLSTREAM_TRAINER_GROUP``,
``rollstream_take_timeout`` / ``ROLLSTREAM_TAKE_TIMEOUT`` (seconds, default: wait),
``rollstream_max_staleness`` / ``ROLLSTREAM_MAX_STALENESS`` (the policy version is slime's
``rollout_id``), ``rollstream_dynamic_sampling`` / ``ROLLSTREAM_DYNAMIC_SAMPLING`` (default on),
``rollstream_commit`` / ``ROLLSTREAM_COMMIT``: ``next`` (default) commits a rollout's batch when slime
asks for the next one, i.e. once it has been handed on; ``take`` commits at once.

Groups whose size differs from ``args.n_samples_per_prompt`` are skipped (reason ``group_size``),
because slime reshapes rewards by that number. The consumer lives on ``args`` (one per slime rollout
manager); it is not shared through module state.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from consumers._batch import Batch
from consumers._consumer import DEFAULT_GROUP, RolloutConsumer
from consumers.filters import FilterContext, default_filters
from schemas import RollstreamError, ScoredGroup

_STATE_ATTR = "_rollstream_slime_rollout"
_STATUS_BY_FINISH = {"stop": "completed", "length": "truncated", "abort": "aborted"}


@dataclass
class SlimeSample:
    """Stand-in for ``slime.utils.types.Sample`` when slime is not installed: same field names and meaning."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    prompt: str = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False
    status: SlimeSample.Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)


def sample_class() -> type:
    """slime's own Sample class when slime is importable, else `SlimeSample`."""
    try:
        from slime.utils.types import Sample  # type: ignore[import-not-found]
    except ImportError:
        return SlimeSample
    return Sample


def to_slime_group(group: ScoredGroup, group_index: int, position: tuple[int, int] = (-1, -1),
                   sample_cls: type | None = None) -> list[Any]:
    """The samples of one group as slime Samples (see the module docstring for each field)."""
    cls: Any = sample_cls or sample_class()  # slime's Sample or ours: both have a nested Status enum
    prompt = group.prompt_tokens.tolist()
    out = []
    for j, s in enumerate(group.samples):
        response = s.tokens.tolist()
        status = "failed" if group.status == "failed" else _STATUS_BY_FINISH.get(s.finish_reason, "completed")
        out.append(cls(
            group_index=group_index, index=group_index * len(group.samples) + j, prompt=group.prompt,
            tokens=prompt + response, response=s.text, response_length=len(response),
            label=group.metadata.get("label"), reward=s.reward, loss_mask=[1] * len(response),
            weight_versions=[str(v) for v in s.weight_versions],
            rollout_log_probs=None if s.logprobs is None else s.logprobs.tolist(),
            status=cls.Status(status),
            metadata={"group_id": group.group_id, "prompt_id": group.prompt_id, "epoch": group.epoch,
                      "partition": position[0], "offset": position[1], "producer_id": group.producer_id},
        ))
    return out


def _setting(args: Any, name: str, env: str, default: Any = None) -> Any:
    value = getattr(args, name, None)
    if value is None:
        value = os.environ.get(env)
    return default if value is None or value == "" else value


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() not in ("0", "false", "no", "off")


def _group_size_filter(expected: int | None) -> Callable[[ScoredGroup, FilterContext], str | None]:
    def group_size(group: ScoredGroup, context: FilterContext) -> str | None:
        if expected is not None and len(group.samples) != expected:
            return f"group_size: {len(group.samples)} samples, slime expects n_samples_per_prompt={expected}"
        return None
    return group_size


@dataclass
class _SlimeRollout:
    consumer: RolloutConsumer
    commit_mode: str
    timeout: float | None
    uses_staleness: bool
    previous: Batch | None = None


def _create(args: Any) -> _SlimeRollout:
    commit_mode = str(_setting(args, "rollstream_commit", "ROLLSTREAM_COMMIT", "next"))
    if commit_mode not in ("next", "take"):
        raise RollstreamError(f"rollstream_commit={commit_mode!r}: use 'next' (commit when the next rollout "
                              "is requested) or 'take' (commit at once)")
    max_staleness = _setting(args, "rollstream_max_staleness", "ROLLSTREAM_MAX_STALENESS")
    timeout = _setting(args, "rollstream_take_timeout", "ROLLSTREAM_TAKE_TIMEOUT")
    n_samples = getattr(args, "n_samples_per_prompt", None)
    filters = (*default_filters(dynamic_sampling=_flag(_setting(args, "rollstream_dynamic_sampling",
                                                                 "ROLLSTREAM_DYNAMIC_SAMPLING", True))),
               _group_size_filter(int(n_samples) if n_samples else None))
    consumer = RolloutConsumer(
        _setting(args, "rollstream_bootstrap_servers", "ROLLSTREAM_BOOTSTRAP_SERVERS"),
        str(_setting(args, "rollstream_group", "ROLLSTREAM_TRAINER_GROUP", DEFAULT_GROUP)),
        str(_setting(args, "rollstream_namespace", "ROLLSTREAM_NAMESPACE", "rollstream")),
        filters=filters, max_staleness=None if max_staleness is None else int(max_staleness))
    return _SlimeRollout(consumer, commit_mode, None if timeout is None else float(timeout), max_staleness is not None)


def generate_rollout(args: Any, rollout_id: int, data_buffer: Any = None, evaluation: bool = False) -> list[list[Any]]:
    """slime's rollout function: exactly ``args.rollout_batch_size`` groups of slime Samples.

    Blocks until that many groups passed the filters (or ``rollstream_take_timeout`` s). Commits the
    previous call's batch first (``rollstream_commit=next``) or this batch before returning (``take``).
    `data_buffer` is not used: prompts reach the producers through NS.prompts.

    Raises:
        TakeTimeout: not enough groups in time (nothing lost; the next call continues).
        RollstreamError: ``evaluation=True`` (use slime's own eval function via --eval-function-path),
            or a setting is invalid.
    """
    if evaluation:
        raise RollstreamError("rollstream serves training rollouts only; point slime's --eval-function-path "
                              "at slime's own rollout function for evaluation")
    state: _SlimeRollout | None = getattr(args, _STATE_ATTR, None)
    if state is None:
        state = _create(args)
        setattr(args, _STATE_ATTR, state)
    if state.previous is not None:
        state.consumer.commit(state.previous)
        state.previous = None
    batch = state.consumer.take(int(args.rollout_batch_size), timeout=state.timeout,
                                commit=state.commit_mode == "take",
                                policy_version=rollout_id if state.uses_staleness else None)
    if state.commit_mode == "next":
        state.previous = batch
    cls = sample_class()
    first = rollout_id * len(batch.groups)
    return [to_slime_group(g, first + i, pos, cls) for i, (g, pos) in enumerate(zip(batch.groups, batch.positions,
                                                                                        strict=True))]


def close(args: Any) -> None:
    """Close the consumer kept on `args` (uncommitted batches come back to the next run)."""
    state: _SlimeRollout | None = getattr(args, _STATE_ATTR, None)
    if state is not None:
        state.consumer.close()
        setattr(args, _STATE_ATTR, None)
