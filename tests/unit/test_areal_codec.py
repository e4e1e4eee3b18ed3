"""rollstream.areal/1: an AReaL trajectory (RLVR's format, grouped by AReaL's own concat_padded_tensors) survives
the record exactly (dtypes, shapes, values), through Avro bytes; an odd value is carried, not lost."""

from __future__ import annotations

import pytest

pytest.importorskip("areal", reason="AReaL is not installed (.venv-areal)")

import torch  # noqa: E402
from areal.utils.data import concat_padded_tensors  # noqa: E402
from rollstream.consumers._areal_codec import ArealEncodingError, decode_trajectory, encode_trajectory  # noqa: E402
from rollstream.schemas import decode, encode  # noqa: E402


def row(prompt: list[int], response: list[int], versions: list[int]) -> dict[str, torch.Tensor]:
    seq = prompt + response
    one = {"input_ids": torch.tensor(seq, dtype=torch.int32),
           "loss_mask": torch.tensor([0] * len(prompt) + [1] * len(response), dtype=torch.int32),
           "logprobs": torch.tensor([0.0] * len(prompt) + [-0.25 * (i + 1) for i in range(len(response))]),
           "versions": torch.tensor([-1] * len(prompt) + versions, dtype=torch.int32),
           "attention_mask": torch.ones(len(seq), dtype=torch.bool), "rewards": torch.tensor(1.5)}
    return {k: v.unsqueeze(0) for k, v in one.items()}


def round_trip(traj: dict) -> dict:
    group = encode_trajectory(traj, group_id="p.1#0", prompt_id="p.1", producer_id="areal-test", policy_run=2)
    return decode_trajectory(decode(encode(group)))


def test_exact_round_trip_of_a_grouped_trajectory() -> None:
    traj = concat_padded_tensors([row([5, 6, 7], [1, 2, 3, 4], [3, 3, 4, 4]), row([5, 6, 7], [9], [4])])
    group = encode_trajectory(traj, group_id="p.1#0", prompt_id="p.1", producer_id="areal-test")
    assert "areal.carried" not in group.metadata  # every tensor rebuilt from the record's own fields
    assert [s.weight_versions for s in group.samples] == [(3, 4), (4,)]
    assert list(group.prompt_tokens) == [5, 6, 7]
    back = round_trip(traj)
    assert list(back) == list(traj)
    for k, v in traj.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k


def test_values_the_fields_do_not_give_are_carried() -> None:
    traj = concat_padded_tensors([row([5, 6], [1, 2], [2, 1]), row([5, 6], [3], [1])])
    traj["logprobs"] = traj["logprobs"].to(torch.bfloat16)
    traj["routed_experts"] = torch.arange(12, dtype=torch.int64).reshape(2, 2, 3)
    traj["tag"] = ["a", "b"]
    back = round_trip(traj)
    for k, v in traj.items():
        assert (torch.equal(back[k], v) and back[k].dtype == v.dtype) if torch.is_tensor(v) else back[k] == v, k


def test_rows_of_different_prompts_are_refused() -> None:
    traj = concat_padded_tensors([row([5, 6], [1], [0]), row([5, 8], [1], [0])])
    with pytest.raises(ArealEncodingError, match="different prompts"):
        encode_trajectory(traj, group_id="p#0", prompt_id="p", producer_id="x")
