"""The trainer side of rollstream: take exactly N scored groups per step, replay any step, audit them all.

`RolloutConsumer` takes groups from NS.rollouts and commits exactly what it took; `Batch` is one
step (with `to_tensors`); filters decide what is skipped (always recorded, never dropped silently);
`replay_step` / `replay_range` / `replay_since` read back what was published or taken; `audit` proves
every committed offset was accounted for once; `status` says why a trainer would wait (`TakeTimeout` too).
`rollstream.consumers.slime.generate_rollout` plugs it into slime.
"""

from rollstream.consumers._audit import AuditReport, audit
from rollstream.consumers._batch import Batch, TensorBatch, grpo_advantages
from rollstream.consumers._consumer import DEFAULT_GROUP, RolloutConsumer
from rollstream.consumers._epoch_audit import EpochAuditReport, audit_epochs
from rollstream.consumers._errors import CommitError, FilterError, GroupConflictError, TakeTimeout
from rollstream.consumers._metrics import ConsumerMetrics
from rollstream.consumers._replay import (
    ReplayedRecord,
    ReplayedStep,
    group_to_json,
    parse_time,
    replay_range,
    replay_since,
    replay_step,
    since_bounds,
)
from rollstream.consumers._status import status
from rollstream.consumers._status_report import Diagnosis, StatusReport
from rollstream.consumers.filters import (
    FilterContext,
    GroupFilter,
    all_rewards_equal,
    default_filters,
    failed_group,
    reward_missing,
    stale,
)

__all__ = [
    "DEFAULT_GROUP", "AuditReport", "Batch", "CommitError", "ConsumerMetrics", "Diagnosis", "FilterContext",
    "FilterError", "GroupConflictError", "GroupFilter", "ReplayedRecord", "ReplayedStep", "RolloutConsumer",
    "TakeTimeout",
    "TensorBatch", "all_rewards_equal", "audit", "default_filters", "failed_group", "group_to_json", "grpo_advantages",
    "parse_time", "replay_range", "replay_since", "replay_step", "reward_missing", "since_bounds", "stale",
    "status", "StatusReport",
    "EpochAuditReport", "audit_epochs",
]
