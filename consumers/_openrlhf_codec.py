"""OpenRLHF 0.11.2's ``Experience`` <-> rollstream's ScoredGroup, exactly, without pickles (encoding
``rollstream.openrlhf/1``).

OpenRLHF's async generator hands the trainer a list of single-sample Experiences (batch size 1 each, the
``n_samples_per_prompt`` samples of one prompt next to each other: samples_generator.py, ``_generate_vllm`` and
``_process_response_into_experience``). One prompt's run of samples is one group. rollstream's own fields carry
the hot tensors, so the audit, export and filters read them as for any producer:

- ``prompt_tokens`` = ``sequences[:P]``, P the position of the first action token (``action_mask[j]`` marks token
  ``j + 1``, OpenRLHF's shift by one); every sample of a group has the same prompt, else `OpenRLHFEncodingError`;
- per sample: ``tokens`` = ``sequences[P:]``, ``loss_mask`` = ``action_mask[P-1:]`` (0 on tool and environment
  tokens of a multi-turn rollout), ``logprobs`` = ``rollout_log_probs[P-1:]``, ``reward`` = ``rewards[0]``,
  ``finish_reason`` ``length`` when ``truncated``, ``weight_versions`` the trainer step the generator served.

Each tensor field is rebuilt from those ("derived", with its dtype) when that gives it back exactly (checked
when encoding); any other tensor, and every tensor of ``info``, travels in the group's metadata as
``{"dtype", "shape", "data": base64 of the little-endian bytes}``; ``index``, ``prompts``, ``labels``,
``images`` and ``mm_train_inputs`` as JSON (a value JSON cannot hold, e.g. multimodal pixel tensors, raises
`OpenRLHFEncodingError`: not carried by v1). Metadata keys: ``openrlhf.encoding``, ``openrlhf.samples`` (one
entry per sample) and ``openrlhf.position`` (the generator's ``client_states``: episode, prompts consumed,
dataloader state, its tensors tagged ``{"__tensor__": ...}``), written by `encode_groups`.

Pinned by tests/unit/test_openrlhf_codec.py against OpenRLHF's own ``Experience``.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from openrlhf.trainer.ppo_utils.experience import Experience
from rollstream.schemas import RollstreamError, Sample, Samples, ScoredGroup, make_group_id, now_ms

ENCODING = "rollstream.openrlhf/1"
_JSON_FIELDS = ("index", "prompts", "labels", "images", "mm_train_inputs")
_STEP_FIELDS = ("sequences", "attention_mask", "action_mask", "rollout_log_probs", "rewards")


class OpenRLHFEncodingError(RollstreamError):
    """An Experience rollstream cannot carry, or a record it cannot read back as one. Not retriable."""


def encode_groups(experiences: Sequence[Experience], *, position: Mapping[str, Any], producer_id: str,
                  first_seq: int, version: int = 0, policy_run: int = 0) -> list[ScoredGroup]:
    """One ScoredGroup per run of samples with the same prompt, in order; `position` (the generator's
    ``client_states``) stamped on each; group ids ``openrlhf.<producer_id>.<first_seq + i>#<episode>``.

    Raises:
        OpenRLHFEncodingError: an Experience of batch size other than 1, or a value JSON cannot hold.
    """
    runs: list[list[Experience]] = []
    for e in experiences:
        if e.sequences is None or len(e.sequences) != 1:
            raise OpenRLHFEncodingError("rollstream.openrlhf/1 carries single-sample Experiences (as OpenRLHF's "
                                        "generator makes them); split batches with split_experience_batch first")
        if runs and _prompt_key(runs[-1][0]) == _prompt_key(e):
            runs[-1].append(e)
        else:
            runs.append([e])
    stamp = json.dumps(_tagged(position))
    episode = int(position.get("episode", 0))
    return [_group(run, f"openrlhf.{producer_id}.{first_seq + i}", episode, stamp, producer_id, version, policy_run)
            for i, run in enumerate(runs)]


def decode_group(group: ScoredGroup) -> list[Experience]:
    """The Experiences `group` was encoded from: the same fields (tensor dtypes, shapes, values).

    Raises:
        OpenRLHFEncodingError: the group was not written by `encode_groups`, or by a version this one cannot read.
    """
    if group.metadata.get("openrlhf.encoding") != ENCODING:
        raise OpenRLHFEncodingError(f"group {group.group_id}: encoding {group.metadata.get('openrlhf.encoding')!r}, "
                                    f"this reader knows {ENCODING!r} (published by rollstream.consumers.openrlhf?)")
    prompt = torch.from_numpy(group.prompt_tokens.astype(np.int64))
    specs = json.loads(group.metadata["openrlhf.samples"])
    return [_experience(prompt, s, spec) for s, spec in zip(group.samples, specs, strict=True)]


def position_of(group: ScoredGroup) -> dict[str, Any] | None:
    """The generator's ``client_states`` stamped on `group` (tensors restored), or None."""
    stamp = group.metadata.get("openrlhf.position")
    return None if stamp is None else _untagged(json.loads(stamp))


def _prompt_key(e: Experience) -> tuple[str, str]:
    return json.dumps(_plain(e.prompts)), json.dumps(_plain(e.labels))


def _group(run: list[Experience], prompt_id: str, episode: int, stamp: str, producer_id: str, version: int,
           policy_run: int) -> ScoredGroup:
    cut = _prompt_length(run[0])
    prompt = run[0].sequences[0, :cut]
    samples, specs = [], []
    for e in run:
        if not torch.equal(e.sequences[0, :_prompt_length(e)], prompt):
            raise OpenRLHFEncodingError(f"prompt {e.prompts!r}: its samples have different prompt tokens; "
                                        "rollstream.openrlhf/1 carries one prompt per group")
        sample = _sample(e, cut, version)
        samples.append(sample)
        specs.append(_spec(e, prompt, sample))
    digest = hashlib.blake2b(prompt.numpy().astype("<i8").tobytes(), digest_size=8).hexdigest()
    at = now_ms()
    return ScoredGroup(group_id=make_group_id(prompt_id, episode), prompt_id=f"{prompt_id}.{digest}", epoch=episode,
                       prompt_tokens=prompt.numpy().astype(np.int32), samples=Samples.of(samples),
                       started_at_ms=at, finished_at_ms=at, producer_id=producer_id, policy_run=policy_run,
                       metadata={"openrlhf.encoding": ENCODING, "openrlhf.samples": json.dumps(specs),
                                 "openrlhf.position": stamp})


def _prompt_length(e: Experience) -> int:
    length = e.sequences.shape[1]
    if e.action_mask is None:
        return length
    ones = torch.nonzero(e.action_mask[0]).flatten()
    return int(ones[0]) + 1 if len(ones) else length


def _sample(e: Experience, cut: int, version: int) -> Sample:
    def response(t: torch.Tensor | None, start: int) -> np.ndarray | None:
        return None if t is None else t[0, start:].detach().cpu().numpy()

    logprobs = response(e.rollout_log_probs, cut - 1)
    mask = response(e.action_mask, cut - 1)
    return Sample(tokens=response(e.sequences, cut).astype(np.int32),  # type: ignore[union-attr]
                  logprobs=None if logprobs is None else logprobs.astype(np.float32),
                  reward=None if e.rewards is None else float(e.rewards[0]),
                  finish_reason="length" if e.truncated is not None and bool(e.truncated[0]) else "stop",
                  weight_versions=(version,), loss_mask=None if mask is None else mask.astype(np.uint8))


def _spec(e: Experience, prompt: torch.Tensor, sample: Sample) -> dict[str, Any]:
    spec: dict[str, Any] = {"tensors": {}, "json": {}}
    for f in dataclasses.fields(Experience):
        value = getattr(e, f.name)
        if f.name in _JSON_FIELDS:
            spec["json"][f.name] = _checked_json(value, f.name)
        elif f.name == "info":
            spec["info"] = {k: _tensor_json(v) if isinstance(v, torch.Tensor) else {"json": _checked_json(v, k)}
                            for k, v in value.items()}
        elif value is None:
            spec["tensors"][f.name] = None
        elif f.name in _STEP_FIELDS and _same(_derived(f.name, str(value.dtype), prompt, sample), value):
            spec["tensors"][f.name] = {"derived": str(value.dtype)}
        else:
            spec["tensors"][f.name] = _tensor_json(value)
    return spec


def _experience(prompt: torch.Tensor, sample: Sample, spec: Mapping[str, Any]) -> Experience:
    kwargs: dict[str, Any] = dict(spec["json"])
    for name, t in spec["tensors"].items():
        kwargs[name] = None if t is None else _derived(name, t["derived"], prompt, sample) if "derived" in t \
            else _tensor_of(t)
    kwargs["info"] = {k: v["json"] if "json" in v else _tensor_of(v) for k, v in spec["info"].items()}
    return Experience(**kwargs)


def _derived(name: str, dtype: str, prompt: torch.Tensor, s: Sample) -> torch.Tensor | None:
    """Field `name` of dtype `dtype` rebuilt from the group's prompt and sample `s` (None: not derivable)."""
    pad = len(prompt) - 1
    zeros = torch.zeros(pad, dtype=torch.float64)
    if name == "sequences":
        row = torch.cat([prompt, torch.from_numpy(s.tokens.astype(np.int64))])
    elif name == "attention_mask":
        row = torch.ones(len(prompt) + len(s.tokens))
    elif name == "action_mask" and s.loss_mask is not None:
        row = torch.cat([zeros, torch.from_numpy(s.loss_mask.astype(np.float64))])
    elif name == "rollout_log_probs" and s.logprobs is not None:
        row = torch.cat([zeros, torch.from_numpy(s.logprobs.astype(np.float64))])
    elif name == "rewards" and s.reward is not None:
        return torch.tensor([s.reward], dtype=getattr(torch, dtype.removeprefix("torch.")))
    else:
        return None
    return row.to(getattr(torch, dtype.removeprefix("torch."))).unsqueeze(0)


def _same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b.cpu()))


def _tensor_json(t: torch.Tensor) -> dict[str, Any]:
    array = t.detach().cpu().contiguous()
    dtype = str(array.dtype)
    if array.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16
        array = array.view(torch.int16)
    data = array.numpy()
    little = data.astype(data.dtype.newbyteorder("<"), copy=False)
    return {"dtype": dtype, "shape": list(data.shape), "data": base64.b64encode(little.tobytes()).decode()}


def _tensor_of(spec: Mapping[str, Any]) -> torch.Tensor:
    bf16 = spec["dtype"] == "torch.bfloat16"
    dtype = torch.int16 if bf16 else getattr(torch, spec["dtype"].removeprefix("torch."))
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype.newbyteorder("<")
    array = np.frombuffer(base64.b64decode(spec["data"]), dtype=np_dtype).reshape(spec["shape"])
    t = torch.from_numpy(array.astype(np_dtype.newbyteorder("="), copy=True))
    return t.view(torch.bfloat16) if bf16 else t


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor | np.ndarray):
        raise TypeError(f"a {type(value).__name__} of shape {tuple(value.shape)}")
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value


def _checked_json(value: Any, name: str) -> Any:
    try:
        plain = _plain(value)
        json.dumps(plain)
        return plain
    except (TypeError, ValueError) as exc:
        raise OpenRLHFEncodingError(f"Experience field {name!r}: {exc}; rollstream.openrlhf/1 carries JSON values "
                                    "there (multimodal train inputs are not carried yet)") from exc


def _tagged(value: Any) -> Any:
    """`value` as JSON data, tensors (a dataloader's RNG state) as ``{"__tensor__": ...}``."""
    if isinstance(value, torch.Tensor):
        return {"__tensor__": _tensor_json(value)}
    if isinstance(value, Mapping):
        return {str(k): _tagged(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_tagged(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value


def _untagged(value: Any) -> Any:
    if isinstance(value, dict):
        return _tensor_of(value["__tensor__"]) if set(value) == {"__tensor__"} else \
            {k: _untagged(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_untagged(v) for v in value]
    return value
