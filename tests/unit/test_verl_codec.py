"""`rollstream.consumers._verl_codec` (encoding rollstream.verl/1) against verl 0.9.1's own DataProto,
RolloutSample and assemble_batch_from_rollout_samples: a sample survives the wire exactly."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'rollstream[verl]')")

import dataclasses  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402
from rollstream.consumers import _verl_codec  # noqa: E402
from rollstream.consumers._ledger import epoch_of  # noqa: E402
from rollstream.consumers._verl_codec import (  # noqa: E402
    ENCODING,
    VerlEncodingError,
    decode_sample,
    encode_sample,
    handover,
)
from rollstream.schemas import Sample, Samples, ScoredGroup, decode, encode  # noqa: E402
from verl.experimental.fully_async_policy.detach_utils import assemble_batch_from_rollout_samples  # noqa: E402

from tests.standins.verl_fully_async.rollouts import rollout_sample  # noqa: E402


def wire(rs):
    return decode_sample(decode(encode(encode_sample(rs)), ScoredGroup))


def test_fields_and_exact_round_trip() -> None:
    rs = rollout_sample(7, epoch=2, n=4, version=3, partial=True)
    group = encode_sample(rs, policy_run=3)
    assert (group.prompt_id, group.epoch, group.policy_run, group.metadata["verl.encoding"]) == \
        ("sample_2_7", 2, 3, ENCODING)
    assert group.group_id.startswith("sample_2_7.r3.") and group.group_id.endswith("#2")
    b = rs.full_batch.batch
    for i, s in enumerate(group.samples):
        n = int(b["attention_mask"][i, b["prompts"].shape[1]:].sum())
        assert s.tokens.tolist() == b["responses"][i, :n].tolist()
        assert s.reward == float(b["rm_scores"][i].sum()) and s.weight_versions == (3, 4)
        assert s.loss_mask.tolist() == b["response_mask"][i, :n].tolist()
        assert np.allclose(s.logprobs, b["rollout_log_probs"][i, :n].numpy())
    back = wire(rs)
    assert (back.sample_id, back.epoch, back.rollout_status) == (rs.sample_id, rs.epoch, rs.rollout_status)
    assert set(back.full_batch.batch.keys()) == set(b.keys())
    for key in b.keys():
        assert back.full_batch.batch[key].dtype == b[key].dtype, key
        assert torch.equal(back.full_batch.batch[key], b[key]), key
    for key, column in rs.full_batch.non_tensor_batch.items():
        got = back.full_batch.non_tensor_batch[key]
        assert got.dtype == column.dtype and got.tolist() == column.tolist(), key
    assert back.full_batch.meta_info == rs.full_batch.meta_info


def one_sample_per_row(rs) -> Samples:
    """The samples of `rs` as the module docstring defines them, one `Sample` per row: what encode_sample's
    columns (cut out of the padded batch at once) must encode to, byte for byte."""
    b, nt = rs.full_batch.batch, rs.full_batch.non_tensor_batch
    width_p, width_r = b["prompts"].shape[1], b["responses"].shape[1]
    rows = []
    for i in range(len(b["prompts"])):
        n = int(b["attention_mask"][i, width_p:].sum())
        versions = sorted({int(c[i]) for c in (nt.get("min_global_steps"), nt.get("max_global_steps"))
                           if c is not None and c[i] is not None})
        rows.append(Sample(tokens=b["responses"][i, :n].numpy(),
                           logprobs=b["rollout_log_probs"][i, :n].numpy() if "rollout_log_probs" in b.keys() else None,
                           reward=float(b["rm_scores"][i].sum()) if "rm_scores" in b.keys() else None,
                           finish_reason="length" if n >= width_r else "stop", weight_versions=tuple(versions),
                           loss_mask=b["response_mask"][i, :n].numpy().astype(np.uint8)))
    return Samples(rows)


def edge_samples():
    yield rollout_sample(1, n=3, version=2, partial=True)
    rs = rollout_sample(2, n=3)
    del rs.full_batch.batch["rollout_log_probs"], rs.full_batch.batch["rm_scores"]
    yield rs
    rs = rollout_sample(3, n=3)
    b, width_p = rs.full_batch.batch, rs.full_batch.batch["prompts"].shape[1]
    b["attention_mask"][0, width_p:], b["response_mask"][0] = 0, 0  # an empty response
    b["attention_mask"][1, width_p:], b["response_mask"][1] = 1, 1  # one filling the padded width
    b["rm_scores"][2] = float("nan")  # no score
    yield rs
    rs = rollout_sample(4, n=2)
    rs.full_batch.non_tensor_batch["min_global_steps"] = np.array([None, 3], dtype=object)
    del rs.full_batch.non_tensor_batch["max_global_steps"]
    yield rs


def test_record_is_the_one_sample_objects_per_row_give(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_verl_codec, "now_ms", lambda: 1234)
    for rs in edge_samples():
        group = encode_sample(rs, policy_run=2)
        assert encode(group) == encode(dataclasses.replace(group, samples=one_sample_per_row(rs))), rs.sample_id


def renamed(rs, sample_id: str):
    """`rs` under another counter value: what a resumed rollouter, counting again, names another prompt."""
    rs.sample_id = sample_id
    return rs


def test_group_ids_tell_prompts_and_runs_apart_where_the_counter_does_not() -> None:
    """verl's counter restarts at ``checkpoint version x required samples`` on resume while its dataloader
    continues: the same ``sample_id`` then names another prompt. The group id differs, so dedupe keeps it."""
    first = encode_sample(rollout_sample(5), policy_run=1).group_id
    assert encode_sample(rollout_sample(5), policy_run=1).group_id == first  # deterministic
    other_prompt = encode_sample(renamed(rollout_sample(6), "sample_0_5"), policy_run=1).group_id
    other_run = encode_sample(rollout_sample(5), policy_run=2).group_id
    assert len({first, other_prompt, other_run}) == 3
    assert epoch_of(encode_sample(rollout_sample(5, epoch=3)).group_id) == 3  # the dedupe window reads the epoch


def test_assembled_batch_is_the_same() -> None:
    originals = [rollout_sample(i, n=2, version=1) for i in range(3)]
    decoded = [wire(rollout_sample(i, n=2, version=1)) for i in range(3)]
    want = assemble_batch_from_rollout_samples(originals, tokenizer=None, config=None)
    got = assemble_batch_from_rollout_samples(decoded, tokenizer=None, config=None)
    for key in want.batch.keys():
        assert torch.equal(got.batch[key], want.batch[key]), key
    assert got.non_tensor_batch["uid"].tolist() == want.non_tensor_batch["uid"].tolist()
    assert got.meta_info["trajectory_param_versions"].tolist() == want.meta_info["trajectory_param_versions"].tolist()


def test_carried_tensors_and_refusals() -> None:
    rs = rollout_sample(1, n=2)
    rs.full_batch.batch["routed_experts"] = torch.arange(2 * 40 * 3, dtype=torch.int32).reshape(2, 40, 3)
    rs.full_batch.batch["position_ids"] = rs.full_batch.batch["position_ids"] + 5  # not derivable: carried
    back = wire(rs)
    for key in ("routed_experts", "position_ids"):
        assert torch.equal(back.full_batch.batch[key], rs.full_batch.batch[key])
    mm = rollout_sample(2, n=2)
    mm.full_batch.non_tensor_batch["multi_modal_inputs"] = np.array([{"pixel_values": torch.ones(2)}] * 2,
                                                                    dtype=object)
    with pytest.raises(VerlEncodingError, match="multimodal"):
        encode_sample(mm)
    plain = encode_sample(rollout_sample(3, n=2))
    foreign = ScoredGroup(group_id=plain.group_id, prompt_id=plain.prompt_id, epoch=0,
                          prompt_tokens=plain.prompt_tokens, samples=plain.samples, started_at_ms=1, finished_at_ms=1)
    with pytest.raises(VerlEncodingError, match="encoding None"):
        decode_sample(foreign)


def test_handover_is_bit_for_bit_what_verl_unpickled_before() -> None:
    """get_sample's bytes (`handover`) load, through verl's own ray.cloudpickle.loads, to exactly what the
    former hand-over (ray.cloudpickle of the RolloutSample) loaded to; so does the assembled batch."""
    decoded = [wire(rollout_sample(i, n=3, version=2, partial=i % 2 == 1)) for i in range(4)]
    for rs in decoded:  # a carried tensor too
        rs.full_batch.batch["routed_experts"] = torch.arange(3 * 40 * 2, dtype=torch.int32).reshape(3, 40, 2)
    before = [ray.cloudpickle.loads(ray.cloudpickle.dumps(rs)) for rs in decoded]
    after = [ray.cloudpickle.loads(handover(rs)) for rs in decoded]
    for old, new in zip(before, after, strict=True):
        assert (new.sample_id, new.epoch, new.rollout_status) == (old.sample_id, old.epoch, old.rollout_status)
        assert new.full_batch.meta_info == old.full_batch.meta_info
        assert list(new.full_batch.batch.keys()) == list(old.full_batch.batch.keys())
        assert new.full_batch.batch.batch_size == old.full_batch.batch.batch_size
        for key in old.full_batch.batch.keys():
            a, b = old.full_batch.batch[key], new.full_batch.batch[key]
            assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), key
            assert torch.equal(a, b), key
        for key, column in old.full_batch.non_tensor_batch.items():
            got = new.full_batch.non_tensor_batch[key]
            assert got.dtype == column.dtype and got.tolist() == column.tolist(), key
    want = assemble_batch_from_rollout_samples(before, tokenizer=None, config=None)
    got = assemble_batch_from_rollout_samples(after, tokenizer=None, config=None)
    for key in want.batch.keys():
        assert torch.equal(got.batch[key], want.batch[key]), key
