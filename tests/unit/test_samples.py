"""A group's samples have one representation and one builder that checks; records do not know the wire.

Pinned: `Samples` holds columns whoever built it, and encoding a group reads them without changing the
group; `Samples.from_columns` (what `plain_samples` and decoding call) refuses what `Sample` refuses, with
the same words; a decoded record is held to the invariants a built one is; the prompt dict plug-ins
receive (`Prompt.plugin_dict`) is a contract of its own, with exactly its keys, not the wire datum.
"""

from __future__ import annotations

import copy
import io

import fastavro
import numpy as np
import pytest
from rollstream.schemas import (
    PLUGIN_KEYS,
    DecodeError,
    InvalidRecordError,
    Prompt,
    Sample,
    Samples,
    ScoredGroup,
    VersionSpan,
    decode,
    default_codec,
    encode,
    fingerprint,
)
from rollstream.schemas._layout import LAYOUTS
from rollstream.schemas._samples import SampleColumns
from rollstream.schemas.codec import MAGIC

from tests.records import make_group, make_multi_turn_group


def test_the_prompt_dict_of_plug_ins_has_exactly_the_contract_keys() -> None:
    assert PLUGIN_KEYS == ("id", "prompt", "label", "metadata", "epoch", "attempt")
    prompt = Prompt(id="p", prompt="q", epoch=2, label="4", metadata={"a": "b", "n": 1}, attempt=3)
    given = prompt.plugin_dict()
    assert tuple(given) == PLUGIN_KEYS
    assert given == {"id": "p", "prompt": "q", "label": "4", "metadata": {"a": "b", "n": "1"}, "epoch": 2,
                     "attempt": 3}
    given["metadata"]["a"] = "changed by a plug-in"
    assert prompt.metadata["a"] == "b" and prompt.plugin_dict() is not prompt.plugin_dict()  # a fresh copy each
    chat = Prompt(id="c", prompt=[{"role": "user", "content": "hi"}]).plugin_dict()
    assert chat["prompt"] == [{"role": "user", "content": "hi"}] and chat["label"] is None
    assert prompt.to_dict() == prompt.plugin_dict()  # its former name


def test_the_prompt_datum_is_the_wire_s_not_the_plug_in_dict() -> None:
    to_datum = LAYOUTS[Prompt].to_datum
    assert to_datum is not Prompt.plugin_dict and to_datum is not Prompt.to_dict
    prompt = Prompt(id="c", prompt=[{"role": "user", "content": "hi"}], label="x", metadata={"k": "v"}, attempt=1)
    assert decode(encode(prompt), Prompt) == prompt


def test_samples_hold_columns_whoever_built_them_and_keep_the_given_objects() -> None:
    group = make_multi_turn_group()
    given = tuple(group.samples)
    assert isinstance(group.samples.columns, SampleColumns)
    assert all(a is b for a, b in zip(group.samples, given, strict=True))  # no copies of the given samples
    decoded = decode(encode(group), ScoredGroup)
    assert isinstance(decoded.samples.columns, SampleColumns) and decoded.samples == given


def test_encode_changes_nothing_of_the_group() -> None:
    group = make_multi_turn_group()
    samples, columns, rows = group.samples, group.samples.columns, group.samples.items()
    before = copy.copy(vars(group))
    first = encode(group)
    assert encode(group) == first
    assert vars(group) == before and group.samples is samples
    assert group.samples.columns is columns and group.samples.items() is rows


def test_from_columns_refuses_what_sample_refuses_with_the_same_words() -> None:
    columns = Samples([Sample(tokens=[1, 2, 3], logprobs=[-0.5, -0.25, -1.0])]).columns
    with pytest.raises(InvalidRecordError, match="1 of 3 logprobs are NaN or infinite"):
        Samples.from_columns(columns._replace(logprob_parts=(np.array([-0.5, np.nan, -1.0], np.float32),)))
    with pytest.raises(InvalidRecordError, match="1 of 3 logprobs are NaN or infinite"):
        Sample(tokens=[1, 2, 3], logprobs=[-0.5, np.nan, -1.0])
    with pytest.raises(InvalidRecordError, match="loss_mask has 2 entries for 3 tokens"):
        Samples.from_columns(columns._replace(has_loss_mask=b"\x01", mask_parts=(np.ones(2, np.uint8),)))
    with pytest.raises(InvalidRecordError, match="loss_mask has 2 entries for 3 tokens"):
        Sample(tokens=[1, 2, 3], loss_mask=[1, 1])
    late_first = columns._replace(version_counts=(2,), versions=(4, 3), span_counts=(2,), spans=(4, 0, 1, 3, 1, 3))
    with pytest.raises(InvalidRecordError, match="oldest first"):
        Samples.from_columns(late_first)
    with pytest.raises(InvalidRecordError, match="oldest first"):
        Sample(tokens=[1, 2, 3], version_spans=(VersionSpan(4, 0, 1), VersionSpan(3, 1, 3)))
    assert Samples.from_columns(columns) == Samples([Sample(tokens=[1, 2, 3], logprobs=[-0.5, -0.25, -1.0])])


def test_parts_must_match_their_samples_one_by_one() -> None:
    """Parts of one per sample are checked per sample, not only in total (their sum could hide a swap)."""
    columns = Samples([Sample(tokens=[1, 2, 3], logprobs=[0.0] * 3), Sample(tokens=[4], logprobs=[0.0])]).columns
    swapped = columns._replace(logprob_parts=(np.zeros(1, np.float32), np.zeros(3, np.float32)))
    with pytest.raises(InvalidRecordError, match="4 logprobs do not match"):
        Samples.from_columns(swapped)


def test_a_decoded_record_is_held_to_the_invariants_of_a_built_one() -> None:
    """Spans that name their versions newest first, with weight versions that say the same, once decoded;
    `Sample` refuses them, so decoding does too."""
    schema = default_codec().schema(ScoredGroup)
    datum = fastavro.schemaless_reader(io.BytesIO(encode(make_multi_turn_group())[10:]), schema, None)
    datum |= {"weight_versions": np.array([4, 3, 4], "<i8").tobytes(),
              "version_spans": np.array([4, 0, 2, 3, 2, 5], "<i8").tobytes()}
    body = io.BytesIO()
    fastavro.schemaless_writer(body, schema, datum)
    with pytest.raises(DecodeError, match="sample 0: version spans must be oldest first"):
        decode(MAGIC + fingerprint(schema) + body.getvalue(), ScoredGroup)


def test_decoded_samples_are_built_once_and_agree_with_their_columns() -> None:
    group = decode(encode(make_group("p", rewards=(1.0, None, 0.5))), ScoredGroup)
    first = group.samples.items()
    assert group.samples.items() is first
    assert [s.reward for s in first] == group.rewards == [1.0, None, 0.5]
    assert [len(s.tokens) for s in first] == group.samples.response_lengths
    assert np.concatenate([s.tokens for s in first]).tolist() == group.samples.response_tokens.tolist()
