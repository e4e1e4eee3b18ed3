"""slime's side of a batch: rollstream groups as slime ``Sample``s, and what slime checks of a whole batch.

`to_slime_group` builds slime's own ``slime.utils.types.Sample`` (`sample_class`) for each sample of a group
(the fields are listed in `rollstream.consumers.slime`'s docstring); `check_top_p` and `uniform_logprobs`
keep slime's batch-wide assertions from failing deep inside it (read at slime's 2026-08 HEAD). Pure: no I/O.
"""

from __future__ import annotations

import logging
from typing import Any

from rollstream.schemas import ConfigError, RollstreamError, ScoredGroup

log = logging.getLogger("rollstream.consumers.slime")
_STATUS_BY_FINISH = {"stop": "completed", "length": "truncated", "abort": "aborted"}


def sample_class() -> type:
    """slime's own ``slime.utils.types.Sample``.

    Raises:
        RollstreamError: slime is not importable (the adapter runs inside slime's rollout manager).
    """
    try:
        from slime.utils.types import Sample  # type: ignore[import-not-found]
    except ImportError as exc:
        raise RollstreamError(f"rollstream.consumers.slime runs inside slime, which is not importable here ({exc}); "
                              "install slime (github.com/THUDM/slime) in this environment") from exc
    return Sample


def train_output_class() -> type | None:
    """slime's ``RolloutFnTrainOutput`` (slime/rollout/base_types.py), or None in a slime too old to have it
    (a plain list of groups is what its rollout manager took then)."""
    try:
        from slime.rollout.base_types import RolloutFnTrainOutput  # type: ignore[import-not-found]
    except ImportError:
        return None
    return RolloutFnTrainOutput


def to_slime_group(group: ScoredGroup, group_index: int, position: tuple[int, int] = (-1, -1),
                   sample_cls: type | None = None) -> list[Any]:
    """The samples of one group as slime Samples (see the module docstring for each field)."""
    cls: Any = sample_cls or sample_class()
    prompt = group.prompt_tokens.tolist()
    out = []
    for j, s in enumerate(group.samples):
        response = s.tokens.tolist()
        status = "failed" if group.status == "failed" else _STATUS_BY_FINISH.get(s.finish_reason, "completed")
        out.append(cls(
            group_index=group_index, index=group_index * len(group.samples) + j, prompt=group.prompt,
            tokens=prompt + response, response=s.text, response_length=len(response),
            label=group.metadata.get("label"), reward=s.reward,
            loss_mask=[1] * len(response) if s.loss_mask is None else s.loss_mask.tolist(),
            weight_versions=[str(v) for v in s.weight_versions],
            rollout_log_probs=None if s.logprobs is None else s.logprobs.tolist(),
            status=cls.Status(status),
            metadata={"group_id": group.group_id, "prompt_id": group.prompt_id, "epoch": group.epoch,
                      "partition": position[0], "offset": position[1], "producer_id": group.producer_id},
        ))
    return out


def check_top_p(args: Any) -> None:
    """Refuse slime's ``--rollout-top-p`` other than 1.0: slime then asserts top-p replay data
    (``rollout_top_p_token_ids`` / ``_offsets``, the nucleus kept at each response token) on every sample,
    which no rollstream engine reports.

    Raises:
        ConfigError: names the fix.
    """
    top_p = getattr(args, "rollout_top_p", None)
    if top_p is not None and float(top_p) != 1.0:
        raise ConfigError(f"slime's --rollout-top-p {top_p} replays the top-p nucleus of every token "
                          "(rollout_top_p_token_ids), which rollstream's samples do not carry: leave "
                          "--rollout-top-p at 1.0 and set top-p where rollstream samples (rollstream produce "
                          "--top-p)")


def uniform_logprobs(groups: list[list[Any]], args: Any) -> None:
    """Make ``rollout_log_probs`` all present or all None across a batch: slime decides from its first sample
    whether a batch has them (a None later fails deep in slime; a first None drops the others silently).
    Producers on different engines may disagree: the batch then goes without them, with a warning.

    Raises:
        RollstreamError: some samples lack them and slime is told to use them (``use_rollout_logprobs``,
            ``use_tis``).
    """
    samples = [s for group in groups for s in group]
    missing = sum(s.rollout_log_probs is None for s in samples)
    if missing in (0, len(samples)):
        return
    needed = [flag for flag in ("use_rollout_logprobs", "use_tis") if getattr(args, flag, False)]
    if needed:
        raise RollstreamError(f"{missing} of {len(samples)} samples carry no logprobs and slime's "
                              f"{', '.join(needed)} needs them: run every producer on an engine that returns "
                              "logprobs (SGLang, vLLM, hf)")
    log.warning("%d of %d samples carry no logprobs (producers on engines that return none?): the batch goes to "
                "slime without rollout_log_probs", missing, len(samples))
    for sample in samples:
        sample.rollout_log_probs = None
