"""The trainer side of rollstream, in three roles a reader finds by name:

- **The take path** (this folder's private modules): `RolloutConsumer` (`_consumer.py`) takes exactly N
  groups from NS.rollouts (`_fetched.py` buffers the records, `_gather.py` judges each one, `filters.py`
  decides what is skipped: always recorded, never dropped silently), writes the step's manifest and commits
  exactly what it took (`_committing.py`, `_commit.py`, `_manifests.py`, `_requeue.py`), works out where
  the group stands after a start or a seek and takes the same batch again after a crash (`_resume.py`,
  `_ledger.py`) and tells the producers where it is (`_position.py`). `Batch` is one step (with
  `to_tensors`).
- **Forensics** (`rollstream.consumers.forensics`): `audit`, `audit_epochs`, `replay_*`, `export_*`,
  `write_report`, `status`: read back what happened, never taking or committing.
- **Trainer adapters**: `rollstream.consumers.slime` (slime's `--rollout-function-path` and
  `--data-source-path`), `rollstream.consumers.trl` (TRL's AsyncGRPOTrainer rollout worker); what they share
  (settings readers, the group-size filter, the per-step metrics) is `_adapters.py`.
"""

from rollstream.consumers._batch import Batch, TensorBatch, grpo_advantages
from rollstream.consumers._commit import commit_until_committed
from rollstream.consumers._consumer import DEFAULT_GROUP, RolloutConsumer
from rollstream.consumers._errors import CommitError, FilterError, GroupConflictError, TakeTimeout
from rollstream.consumers._ledger import DedupeWindow
from rollstream.consumers._metrics import ConsumerMetrics
from rollstream.consumers.filters import (
    FilterContext,
    GroupFilter,
    all_rewards_equal,
    default_filters,
    failed_group,
    reward_missing,
    stale,
)
from rollstream.consumers.forensics import (
    AuditReport,
    Diagnosis,
    EpochAuditReport,
    ExportSummary,
    ReplayedRecord,
    ReplayedStep,
    ReportSummary,
    StatusReport,
    audit,
    audit_epochs,
    export_range,
    export_steps,
    group_to_json,
    parse_time,
    replay_range,
    replay_since,
    replay_step,
    since_bounds,
    status,
    write_report,
)

__all__ = [
    # the take path
    "DEFAULT_GROUP", "Batch", "CommitError", "ConsumerMetrics", "DedupeWindow", "FilterContext", "FilterError",
    "GroupConflictError", "GroupFilter", "RolloutConsumer", "TakeTimeout", "TensorBatch", "all_rewards_equal",
    "commit_until_committed", "default_filters", "failed_group", "grpo_advantages", "reward_missing", "stale",
    # forensics (rollstream.consumers.forensics)
    "AuditReport", "Diagnosis", "EpochAuditReport", "ExportSummary", "ReplayedRecord", "ReplayedStep",
    "ReportSummary", "StatusReport", "audit", "audit_epochs", "export_range", "export_steps", "group_to_json",
    "parse_time", "replay_range", "replay_since", "replay_step", "since_bounds", "status", "write_report",
]
