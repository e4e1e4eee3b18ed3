"""AReaL's trajectory as a `ScoredGroup` and back, without pickles: encoding ``rollstream.areal/1``.

An AReaL trajectory is what ``RolloutWorkflow.arun_episode(engine, data)`` returns (AReaL 1.0.4,
``areal/api/workflow_api.py``) once the executor made it a tensor dict: ``input_ids`` and ``attention_mask``
``[B, L]``, usually ``loss_mask`` (0 on prompt and environment tokens), ``logprobs``, ``versions`` (the policy
version of each generated token, -1 on the prompt) and ``rewards`` ``[B]`` (``areal/workflow/rlvr.py``), the B
rows of one prompt right-padded to one width (``areal/utils/data.py: concat_padded_tensors``). One trajectory
is one group; its rows are the samples:

- ``prompt_tokens``: the tokens before the first ``loss_mask`` 1 (every row must have the same prompt, else
  `ArealEncodingError`); without ``loss_mask`` the prompt is empty and every token is a response token.
- per sample: ``tokens`` = the response (up to the row's ``attention_mask`` length), ``loss_mask`` and
  ``logprobs`` over it, ``reward`` = ``rewards[i]``, ``version_spans`` = the runs of ``versions`` over the
  response (so ``weight_versions``, and the trainer's staleness, come from the tokens' own versions),
  ``finish_reason`` ``length`` when the row fills the width, else ``stop``.
- the group's metadata: ``areal.encoding`` (``rollstream.areal/1``; a reader refuses any other), ``areal.layout``
  (the keys in order, each tensor's dtype and shape, the padding and prompt fill values: what rebuilds the
  padded tensors) and ``areal.carried``: every value the fields above do not rebuild exactly, as JSON
  (tensors as ``{"dtype", "shape", "data": base64 of the little-endian bytes}``). `encode_trajectory` rebuilds
  each tensor from the record and carries any that differs, so the round trip is exact for any trajectory
  (dtypes, shapes and values); the common one carries nothing.

Pinned by tests/unit/test_areal_codec.py (with AReaL's own ``concat_padded_tensors`` where AReaL imports).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from rollstream.schemas import RollstreamError, Sample, Samples, ScoredGroup, VersionSpan, now_ms

ENCODING = "rollstream.areal/1"
_DERIVED = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions", "rewards")


class ArealEncodingError(RollstreamError):
    """An AReaL trajectory rollstream cannot carry (or a record it cannot read back as one). Not retriable."""


def encode_trajectory(traj: Mapping[str, Any], *, group_id: str, prompt_id: str, producer_id: str,
                      policy_run: int = 0, epoch: int = 0, started_at_ms: int | None = None) -> ScoredGroup:
    """`traj` as one ScoredGroup (this module's docstring says where each value goes).

    Raises:
        ArealEncodingError: no 2-D ``input_ids`` / ``attention_mask``, an attention mask that is not a prefix of
            ones per row, rows with different prompts, or a value JSON cannot hold.
    """
    ids, attention = traj.get("input_ids"), traj.get("attention_mask")
    if not (torch.is_tensor(ids) and torch.is_tensor(attention) and ids.dim() == 2 and attention.shape == ids.shape):
        raise ArealEncodingError(f"trajectory {prompt_id}: needs 2-D input_ids and attention_mask of one shape "
                                 "(AReaL's tensor format, [batch, seqlen])")
    rows, width = ids.shape
    lengths = [int(n) for n in (attention != 0).sum(dim=1)]
    if any(bool((attention[i, :n] == 0).any()) for i, n in enumerate(lengths)):
        raise ArealEncodingError(f"trajectory {prompt_id}: attention_mask is not right-padded (ones, then zeros) "
                                 "in every row; rollstream.areal/1 carries right-padded rows only")
    loss = traj.get("loss_mask")
    starts = [_prompt_length(loss, i, n) for i, n in enumerate(lengths)]
    prompt = ids[0, :starts[0]] if rows else ids.new_zeros(0)
    if any(not torch.equal(ids[i, :starts[i]], prompt) for i in range(rows)):
        raise ArealEncodingError(f"trajectory {prompt_id}: its rows have different prompts; rollstream.areal/1 "
                                 "carries one prompt per trajectory (one trajectory is one group)")
    samples = [_sample(traj, i, starts[i], n, width) for i, n in enumerate(lengths)]
    layout = {"keys": list(traj), "rows": rows, "width": width,
              "tensors": {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                              "pad": _first(v, attention, pad=True), "fill": _first(v, attention, pad=False)}
                          for k, v in traj.items() if k in _DERIVED and torch.is_tensor(v)}}
    finished = now_ms()
    group = ScoredGroup(group_id=group_id, prompt_id=prompt_id, epoch=epoch,
                        prompt_tokens=prompt.numpy().astype(np.int32), samples=Samples.of(samples),
                        started_at_ms=started_at_ms or finished, finished_at_ms=finished, producer_id=producer_id,
                        metadata={"areal.encoding": ENCODING, "areal.layout": json.dumps(layout)},
                        policy_run=policy_run)
    rebuilt = _rebuild(group, layout)
    carried = {k: _value_json(prompt_id, k, v) for k, v in traj.items()
               if k not in rebuilt or not _same(rebuilt[k], v)}
    if not carried:
        return group
    return dataclasses.replace(group, metadata={**group.metadata, "areal.carried": json.dumps(carried)})


def decode_trajectory(group: ScoredGroup) -> dict[str, Any]:
    """The trajectory `group` was encoded from: the same keys in the same order, each tensor of the same dtype,
    shape and values, every other value equal.

    Raises:
        ArealEncodingError: the group was not written by `encode_trajectory`, or by a version this one cannot read.
    """
    md = group.metadata
    if md.get("areal.encoding") != ENCODING:
        raise ArealEncodingError(f"group {group.group_id}: encoding {md.get('areal.encoding')!r}, this reader knows "
                                 f"{ENCODING!r} (was it published by rollstream.consumers.areal's workflow?)")
    layout = json.loads(md["areal.layout"])
    values = _rebuild(group, layout)
    values.update({k: _value_of(v) for k, v in json.loads(md.get("areal.carried", "{}")).items()})
    return {k: values[k] for k in layout["keys"]}


def _prompt_length(loss: Any, row: int, length: int) -> int:
    if not torch.is_tensor(loss) or loss.dim() != 2:
        return 0
    hits = torch.nonzero(loss[row, :length] != 0)
    return int(hits[0, 0]) if len(hits) else length


def _sample(traj: Mapping[str, Any], i: int, start: int, end: int, width: int) -> Sample:
    def part(key: str) -> torch.Tensor | None:
        value = traj.get(key)
        return value[i, start:end] if torch.is_tensor(value) and value.dim() == 2 else None

    loss, logprobs, versions, rewards = part("loss_mask"), part("logprobs"), part("versions"), traj.get("rewards")
    mask = loss.numpy().astype(np.uint8) if loss is not None and bool(((loss == 0) | (loss == 1)).all()) else None
    reward = float(rewards[i]) if torch.is_tensor(rewards) and rewards.dim() == 1 else None
    return Sample(tokens=traj["input_ids"][i, start:end].numpy().astype(np.int32),
                  logprobs=None if logprobs is None else logprobs.float().numpy(), reward=reward,
                  finish_reason="length" if end >= width else "stop", loss_mask=mask,
                  version_spans=_spans(versions))


def _spans(versions: torch.Tensor | None) -> tuple[VersionSpan, ...]:
    """Runs of equal versions over the response, when they are >= 0 and never decrease (else none: carried)."""
    if versions is None or len(versions) == 0:
        return ()
    values = [int(v) for v in versions]
    if min(values) < 0 or any(b < a for a, b in zip(values, values[1:], strict=False)):
        return ()
    spans, start = [], 0
    for k in range(1, len(values) + 1):
        if k == len(values) or values[k] != values[start]:
            spans.append(VersionSpan(values[start], start, k))
            start = k
    return tuple(spans)


def _first(value: torch.Tensor, attention: torch.Tensor, *, pad: bool) -> float | int:
    """The first value of `value` on padding (`pad`) or on real tokens (else), 0 when there is none."""
    if value.shape != attention.shape:
        return 0
    where = (attention == 0) if pad else (attention != 0)
    hits = value[where]
    return hits[0].item() if len(hits) else 0


def _rebuild(group: ScoredGroup, layout: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of `_DERIVED` as the record's fields give them (carried values are put over them after)."""
    rows, width, specs = layout["rows"], layout["width"], layout["tensors"]
    prompt = torch.from_numpy(group.prompt_tokens.astype(np.int64))
    out: dict[str, torch.Tensor] = {}
    for key, spec in specs.items():
        dtype = getattr(torch, spec["dtype"])
        if key == "rewards":
            if list(spec["shape"]) == [rows]:
                out[key] = torch.tensor([0.0 if s.reward is None else s.reward for s in group.samples], dtype=dtype)
            continue
        if list(spec["shape"]) != [rows, width]:
            continue
        t = torch.full((rows, width), spec["pad"], dtype=dtype)
        for i, s in enumerate(group.samples):
            t[i, :len(prompt) + len(s.tokens)] = _row(key, s, prompt, spec["fill"], dtype)
        out[key] = t
    return out


def _row(key: str, s: Sample, prompt: torch.Tensor, fill: float | int, dtype: torch.dtype) -> torch.Tensor:
    p, k = len(prompt), len(s.tokens)
    if key == "input_ids":
        return torch.cat([prompt, torch.from_numpy(s.tokens.astype(np.int64))]).to(dtype)
    if key == "attention_mask":
        return torch.ones(p + k, dtype=dtype)
    if key == "loss_mask":
        mask = np.ones(k) if s.loss_mask is None else s.loss_mask
        return torch.cat([torch.zeros(p, dtype=dtype), torch.from_numpy(mask.astype(np.int64)).to(dtype)])
    response = torch.full((k,), fill, dtype=dtype)
    if key == "logprobs" and s.logprobs is not None:
        response = torch.from_numpy(np.array(s.logprobs)).to(dtype)
    if key == "versions":
        for span in s.version_spans:
            response[span.start:span.end] = span.version
    prompt_fill = -1 if key == "versions" else fill
    return torch.cat([torch.full((p,), prompt_fill, dtype=dtype), response])


def _same(a: Any, b: Any) -> bool:
    return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
            and bool(torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()],
                                                                                            b[~b.isnan()])))


def _value_json(prompt_id: str, key: str, value: Any) -> dict[str, Any]:
    if torch.is_tensor(value):
        array = value.detach().cpu().contiguous()
        raw = array.view(torch.int16) if array.dtype == torch.bfloat16 else array  # numpy has no bfloat16
        data = raw.numpy()
        little = data.astype(data.dtype.newbyteorder("<"), copy=False)
        return {"tensor": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                "data": base64.b64encode(little.tobytes()).decode()}
    try:
        json.dumps(value, allow_nan=True)
    except TypeError as exc:
        raise ArealEncodingError(f"trajectory {prompt_id}: value of {key!r}: {exc}; rollstream.areal/1 carries "
                                 "tensors and JSON values only (multimodal inputs are not supported)") from exc
    return {"json": value}


def _value_of(spec: Mapping[str, Any]) -> Any:
    if "json" in spec:
        return spec["json"]
    dtype = getattr(torch, spec["tensor"])
    raw_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    numpy_dtype = torch.empty(0, dtype=raw_dtype).numpy().dtype.newbyteorder("<")
    array = np.frombuffer(base64.b64decode(spec["data"]), dtype=numpy_dtype).reshape(spec["shape"])
    t = torch.from_numpy(array.astype(numpy_dtype.newbyteorder("="), copy=True))
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
