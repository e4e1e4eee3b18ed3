"""One upgrader per old writer schema in ``avro/history/``: it turns a datum decoded with that schema into
a datum of the current layout (`_layout`), so no reader past the codec knows an old layout.

The codec reads a record written with an old schema with that very schema (no Avro schema resolution),
then applies the upgrader `UPGRADERS` names for the schema's file; a history file without an upgrader
stops the codec from being built. An upgrader validates the old rows as the records' constructors do
(an invalid one raises InvalidRecordError, which the codec reports as a DecodeError) and leaves the
current layout's packing to `_layout`.

Adding a schema version: copy the current ``.avsc`` to ``history/NAME.vN.avsc``, add its upgrader here
(the old datum through the change, in the new layout), point the previous upgraders at the new one, and
change the current schema and `_layout`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rollstream.schemas._layout import NOT_RESUMED, dispositions_datum, samples_datum, unmasked_columns
from rollstream.schemas._packing import FLOAT32_LE, INT32_LE, unpack
from rollstream.schemas.records import OffsetDisposition, Sample

Datum = dict[str, Any]


def scored_group_v1(d: Mapping[str, Any]) -> Datum:
    """Version 1 had no prompt text, no group metadata and no weight versions: version 2's defaults fill
    them (as Avro resolution to v2 did), then it upgrades as version 2."""
    samples = [{**s, "weight_versions": []} for s in d["samples"]]
    return scored_group_v2({**d, "prompt": "", "metadata": {}, "samples": samples})


def scored_group_v2(d: Mapping[str, Any]) -> Datum:
    """Version 2 stored one record per sample (packed tokens and logprobs each); version 3 stores the
    samples column by column. The columns are built from `Sample` objects by the current layout, so only
    what version 3 lacked at the group level is added here (as `scored_group_v3` does)."""
    samples = [_sample_v2(s) for s in d["samples"]]
    return scored_group_v4({**{k: v for k, v in d.items() if k != "samples"}, **samples_datum(samples),
                            "sampling": None})


def scored_group_v3(d: Mapping[str, Any]) -> Datum:
    """Version 3 had no loss masks, version spans or sampling parameters: every token is trained, no span
    is known (the samples keep their weight versions) and the sampling is not recorded. Cheap on purpose:
    no `Sample` is built, the packed columns pass through as they are (views of the record's bytes)."""
    return scored_group_v4({**d, **unmasked_columns(len(d["finish_reasons"])), "sampling": None})


def scored_group_v4(d: Mapping[str, Any]) -> Datum:
    """Version 4 knew no attempts: a first attempt of a producer that never requeues, its prompt not kept."""
    return scored_group_v5({**d, "attempt": 0, "max_attempts": 1, "retriable": False, "source_prompt": b""})


def scored_group_v5(d: Mapping[str, Any]) -> Datum:
    """Version 5 knew no trainer runs: run 0 (none known), which no staleness rule of runs applies to."""
    return scored_group_v6({**d, "policy_run": 0})


def scored_group_v6(d: Mapping[str, Any]) -> Datum:
    """Version 6 knew no in-flight checkpoints: no sample resumed from one (the resume columns empty)."""
    return {**d, **NOT_RESUMED}


def _sample_v2(s: Mapping[str, Any]) -> Sample:
    logprobs = s["logprobs"]
    return Sample(tokens=unpack(s["tokens"], INT32_LE, "tokens"), text=s["text"],
                  logprobs=None if logprobs is None else unpack(logprobs, FLOAT32_LE, "logprobs"),
                  reward=s["reward"], finish_reason=s["finish_reason"], weight_versions=tuple(s["weight_versions"]))


def step_manifest_v1(d: Mapping[str, Any]) -> Datum:
    """Version 1 stored one record per offset (kind an enum of upper-case symbols); version 2 stores the
    dispositions column by column."""
    dispositions = [OffsetDisposition(**{**x, "kind": x["kind"].lower()}) for x in d["dispositions"]]
    return {**{k: v for k, v in d.items() if k != "dispositions"}, **dispositions_datum(dispositions)}


def step_manifest_v2(d: Mapping[str, Any]) -> Datum:
    """Version 2 knew no requeues and no attempts: every disposition's attempt is 0."""
    return {**d, "attempts": b""}


def prompt_v1(d: Mapping[str, Any]) -> Datum:
    """Version 1 knew no attempts: a prompt as loaded."""
    return {**d, "attempt": 0}


def policy_version_v1(d: Mapping[str, Any]) -> Datum:
    """Version 1 knew no trainer runs: run 0, which every run of version 2 supersedes."""
    return {**d, "run": 0, "run_id": None}


def inflight_checkpoint_v1(d: Mapping[str, Any]) -> Datum:
    """Version 1 kept no prompt token ids: not known (a text prompt's sample restarts, as it did)."""
    return {**d, "prompt_tokens": b""}


UPGRADERS: dict[str, Callable[[Mapping[str, Any]], Datum]] = {
    "scored_group.v1.avsc": scored_group_v1,
    "scored_group.v2.avsc": scored_group_v2,
    "scored_group.v3.avsc": scored_group_v3,
    "scored_group.v4.avsc": scored_group_v4,
    "scored_group.v5.avsc": scored_group_v5,
    "scored_group.v6.avsc": scored_group_v6,
    "step_manifest.v1.avsc": step_manifest_v1,
    "step_manifest.v2.avsc": step_manifest_v2,
    "prompt.v1.avsc": prompt_v1,
    "policy_version.v1.avsc": policy_version_v1,
    "inflight_checkpoint.v1.avsc": inflight_checkpoint_v1,
}
"""The upgrader of each file in ``avro/history/``, by file name."""
