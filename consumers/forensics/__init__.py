"""Forensics: what happened to every group, read back from the topics after the fact. Nothing here takes or
commits for a trainer; each reader opens its own clients with explicit assignment and no group membership.

- `audit`: every committed offset of a trainer group accounted for exactly once, from the step manifests.
- `audit_epochs`: every loaded prompt taken once or ended with a terminal reason (in flight listed apart).
- `replay_step` / `replay_range` / `replay_since`: the batch a step took, or what was published, read again.
- `export_steps` / `export_range`: steps or offset ranges as a Parquet file, one row per sample (`_export`).
- `write_report`: a range of steps as one self-contained HTML page (`_report`).
- `status`: why a trainer would wait now (producers, prompts left, lag, recent steps); `TimeoutDiagnoser`
  (`_diagnose`) builds the same diagnosis for a `TakeTimeout`.
"""

from rollstream.consumers.forensics._audit import AuditReport, audit
from rollstream.consumers.forensics._epoch_audit import EpochAuditReport, audit_epochs
from rollstream.consumers.forensics._export import COLUMNS, ExportSummary, export_range, export_steps
from rollstream.consumers.forensics._replay import (
    ReplayedRecord,
    ReplayedStep,
    group_to_json,
    parse_time,
    replay_range,
    replay_since,
    replay_step,
    since_bounds,
)
from rollstream.consumers.forensics._report import ReportSummary, write_report
from rollstream.consumers.forensics._status import status
from rollstream.consumers.forensics._status_report import Diagnosis, StatusReport

__all__ = [
    "COLUMNS", "AuditReport", "Diagnosis", "EpochAuditReport", "ExportSummary", "ReplayedRecord", "ReplayedStep",
    "ReportSummary", "StatusReport", "audit", "audit_epochs", "export_range", "export_steps", "group_to_json",
    "parse_time", "replay_range", "replay_since", "replay_step", "since_bounds", "status", "write_report",
]
