"""rollstream.openrlhf/1 against OpenRLHF 0.11.2's own ``Experience`` (installed in .venv-openrlhf: Makefile).

Pinned: an Experience as OpenRLHF's generator builds it (samples_generator.py, ``_process_response_into_experience``:
long masks, float rewards, bool ``truncated``, float ``total_length``, ``info`` tensors), a multi-turn one (tool
tokens masked out), and one with fields only the trainer fills (values, advantages, bf16 log-probs) come back
field for field, dtypes included; one prompt's samples are one group; positions keep the dataloader's tensors.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("openrlhf", reason="the openrlhf extra is not installed (make install-openrlhf)")
torch = pytest.importorskip("torch")

from openrlhf.trainer.ppo_utils.experience import Experience, make_experience_batch  # noqa: E402
from rollstream.consumers._openrlhf_codec import (  # noqa: E402
    OpenRLHFEncodingError,
    decode_group,
    encode_groups,
    position_of,
)
from rollstream.schemas import ScoredGroup, decode, encode  # noqa: E402

from tests.standins.openrlhf_async import experience  # noqa: E402


def same(a: Experience, b: Experience) -> None:
    for f in dataclasses.fields(Experience):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), f.name
        elif f.name == "info":
            assert x.keys() == y.keys()
            for k in x:
                assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
        else:
            assert x == y, f.name


def test_a_step_round_trips_field_for_field_through_the_wire() -> None:
    step = [experience(p, i, prompt_len=3 + p) for p in range(2) for i in range(3)]
    step[4] = experience(1, 1, prompt_len=4, turns=2)  # a tool call: its observation tokens are not actions
    step[5].values = torch.randn(1, step[5].action_mask.shape[1])
    step[5].advantages = torch.randn(1, step[5].action_mask.shape[1])
    step[5].action_log_probs = torch.randn(1, step[5].action_mask.shape[1]).to(torch.bfloat16)
    position = {"episode": 2, "total_consumed_prompts": 7, "data_loader_state_dict": {"rng": torch.arange(4)}}
    groups = encode_groups(step, position=position, producer_id="g", first_seq=10, version=5, policy_run=3)
    assert [len(g.samples) for g in groups] == [3, 3]
    assert [g.group_id for g in groups] == ["openrlhf.g.10#2", "openrlhf.g.11#2"]
    wire = [decode(encode(g), ScoredGroup) for g in groups]
    back = [e for g in wire for e in decode_group(g)]
    for original, decoded in zip(step, back, strict=True):
        same(original, decoded)
    assert wire[1].samples[1].loss_mask.tolist().count(0) > 0  # the tool tokens are out of the loss
    assert wire[0].samples[0].weight_versions == (5,) and wire[0].policy_run == 3
    assert torch.equal(position_of(wire[0])["data_loader_state_dict"]["rng"], torch.arange(4))
    batch = make_experience_batch(back[:3])  # what OpenRLHF's trainer does with them
    assert batch.sequences.shape[0] == 3


def test_a_batched_experience_is_refused_with_the_fix() -> None:
    batched = make_experience_batch([experience(0, 0, prompt_len=3), experience(0, 1, prompt_len=3)])
    with pytest.raises(OpenRLHFEncodingError, match="split_experience_batch"):
        encode_groups([batched], position={}, producer_id="g", first_seq=0)
