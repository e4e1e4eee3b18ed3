"""verl's `RolloutSample` as a `ScoredGroup` and back, without pickles: encoding ``rollstream.verl/1``.

One verl ``RolloutSample`` (verl 0.9.1, experimental/fully_async_policy/detach_utils.py:27-39) is one prompt
with ``rollout.n`` responses, so it is one group. Its ``full_batch`` is the `DataProto` the agent loop built
(experimental/agent_loop/agent_loop.py:1057-1149, ``_postprocess``). What rollstream's own fields carry:

- ``prompt_id`` = ``sample_id`` (``sample_{epoch}_{n}``, the rollouter's counter), ``epoch``; ``prompt_tokens``:
  the unpadded prompt (every row of one sample has the same prompt, else `VerlEncodingError`);
- ``group_id`` (`group_id_of`) = ``{sample_id}.r{run}.{digest}#{epoch}``: the counter, the trainer run the
  rollouter serves (``policy_run``, also stamped on the group) and a digest of the prompt's token ids. Not the
  counter alone: a resumed rollouter counts again from ``checkpoint version x required samples`` while its
  dataloader continues after every prompt it had fed, so one counter value names another prompt, and the
  trainer's dedupe would have dropped the new group as a duplicate of the old one;
- per sample: ``tokens`` = the response up to its length (``attention_mask[P:].sum()``, as verl counts it),
  ``logprobs`` = ``rollout_log_probs`` (None when absent), ``loss_mask`` = ``response_mask``, ``reward`` =
  the row sum of ``rm_scores`` (None when absent), ``weight_versions`` = ``min_global_steps`` and
  ``max_global_steps`` (verl's param versions the trajectory started and ended on), ``finish_reason``
  ``length`` when the response fills the padded width, else ``stop``.

Everything else rides in the group's metadata, as JSON (documented and versioned, never pickled):

- ``verl.encoding``: ``rollstream.verl/1``. A reader refuses a version it does not know.
- ``verl.layout``: ``{"prompt_width", "response_width", "prompt_pad", "response_pad", "rm_scores",
  "position_ids": "derived"|"carried"}``: how to rebuild the padded tensors exactly (prompts left-padded,
  responses right-padded, ``input_ids`` = prompts then responses, ``attention_mask`` 1 on real tokens,
  ``position_ids`` = ``clip(cumsum(attention_mask) - 1, 0)`` unless carried, ``rm_scores`` the reward on
  the last response token, as the agent loop places it).
- ``verl.tensors``: every other tensor of the batch (``routed_experts``, ``teacher_*``, non-derivable
  ``position_ids``) as ``{name: {"dtype", "shape", "data": base64 of the little-endian bytes}}``.
- ``verl.non_tensor``: ``{key: {"dtype": numpy dtype name, "values": [one JSON value per row]}}``
  (``uid``, ``raw_prompt``, ``reward_model``, ``extra_info``, ``__num_turns__``, ...). A value JSON cannot hold
  (``multi_modal_inputs`` tensors) raises `VerlEncodingError`: multimodal samples are not carried by v1.
- ``verl.meta_info`` and ``verl.rollout_status``: the DataProto's ``meta_info`` and the sample's
  ``rollout_status``, JSON.

Pinned by tests/unit/test_verl_codec.py against verl's own DataProto and
``assemble_batch_from_rollout_samples``: a decoded batch assembles to the same tensors as the original.
"""

from __future__ import annotations

import base64
import hashlib
import json
import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from rollstream.schemas import RollstreamError, ScoredGroup, make_group_id, now_ms, packed_samples
from tensordict import TensorDict
from verl import DataProto
from verl.experimental.fully_async_policy.detach_utils import RolloutSample

ENCODING = "rollstream.verl/1"
END_KEY = "verl.end"  # metadata of the end-of-stream marker (`_verl_rollouter.end_marker`)
_LEAVES = frozenset({str, int, float, bool, type(None)})
_NOTHING = object()  # no row yet (`_column`)
_CORE = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "rollout_log_probs", "rm_scores")


class VerlEncodingError(RollstreamError):
    """A verl sample rollstream cannot carry (or a record it cannot read back as one). Not retriable."""


def encode_sample(rs: RolloutSample, *, producer_id: str = "verl-rollouter", started_at_ms: int | None = None,
                  policy_run: int = 0) -> ScoredGroup:
    """`rs` as one ScoredGroup of trainer run `policy_run` (this module's docstring says where each field goes).

    Works on numpy views of the batch's tensors (no copy) and builds the group's samples as columns
    (`packed_samples`: the responses cut out of the padded batch at once, no `Sample` per row): ~0.4 ms for
    8 x (1024 + 2048) where `Sample` objects row by row took ~1.2 ms. The same record, byte for byte.

    Raises:
        VerlEncodingError: rows with different prompts, or a value JSON cannot hold.
    """
    full = rs.full_batch
    batch, nt = dict(full.batch.items()), full.non_tensor_batch
    prompts, responses = batch["prompts"].numpy(), batch["responses"].numpy()
    attention = batch["attention_mask"].numpy()
    width_p, width_r = prompts.shape[1], responses.shape[1]
    prompt_mask, response_real = attention[:, :width_p].astype(bool), attention[:, width_p:].astype(bool)
    lengths = attention[:, width_p:].sum(axis=1)
    first = prompts[0][prompt_mask[0]]
    if not _same_prompts(prompts, prompt_mask, first):
        raise VerlEncodingError(f"verl sample {rs.sample_id}: its rows have different prompts; rollstream.verl/1 "
                                "carries one prompt per sample (one RolloutSample is one group)")
    # torch's row sums, not numpy's: the same float32 additions as ever, so the same rewards bit for bit
    rewards = batch["rm_scores"].sum(dim=1).tolist() if "rm_scores" in batch else None
    kept = np.arange(width_r) < lengths[:, None]  # each row's response up to its length: tokens back to back
    logprobs = batch["rollout_log_probs"].numpy()[kept] if "rollout_log_probs" in batch else None
    samples = packed_samples(responses[kept], lengths.tolist(), logprobs=logprobs,
                             loss_masks=batch["response_mask"].numpy()[kept].astype(np.uint8),
                             rewards=[None] * len(lengths) if rewards is None else rewards,
                             finish_reasons=["length" if n >= width_r else "stop" for n in lengths.tolist()],
                             weight_versions=[_versions(nt, i) for i in range(len(lengths))])
    carried = {k: _tensor_json(t) for k, t in batch.items() if k not in _CORE and k != "position_ids"}
    positions = batch["position_ids"].numpy() if "position_ids" in batch else None
    # values, not dtypes, as torch.equal compared them (int32 positions of the derived values are "derived")
    positions_derived = positions is not None and np.array_equal(positions, _derived_positions_np(attention))
    if positions is not None and not positions_derived:
        carried["position_ids"] = _tensor_json(batch["position_ids"])
    layout = {"prompt_width": width_p, "response_width": width_r, "prompt_pad": _pad(prompts, prompt_mask),
              "response_pad": _pad(responses, response_real), "rm_scores": rewards is not None,
              "rollout_log_probs": logprobs is not None,
              "position_ids": "derived" if positions_derived else "carried" if positions is not None else "absent"}
    metadata = {"verl.encoding": ENCODING, "verl.layout": json.dumps(layout), "verl.tensors": json.dumps(carried),
                "verl.non_tensor": _dumps(rs.sample_id, {str(k): _column(v) for k, v in nt.items()}),
                "verl.meta_info": _json(rs.sample_id, full.meta_info),
                "verl.rollout_status": _json(rs.sample_id, rs.rollout_status)}
    finished = now_ms()
    return ScoredGroup(group_id=group_id_of(rs.sample_id, rs.epoch, first, policy_run), prompt_id=rs.sample_id,
                       epoch=rs.epoch, prompt_tokens=first, samples=samples,
                       started_at_ms=started_at_ms or finished, finished_at_ms=finished, producer_id=producer_id,
                       metadata=metadata, policy_run=policy_run)


def group_id_of(sample_id: str, epoch: int, prompt: np.ndarray, policy_run: int) -> str:
    """The group id of verl sample `sample_id` (of `epoch`) for the unpadded `prompt` token ids under trainer run
    `policy_run`: equal only for the same counter, prompt and run (a ``make_group_id`` id, its epoch after ``#``)."""
    digest = hashlib.blake2b(np.asarray(prompt).astype("<i8").tobytes(), digest_size=8).hexdigest()
    return make_group_id(f"{sample_id}.r{policy_run}.{digest}", epoch)


def decode_sample(group: ScoredGroup) -> RolloutSample:
    """The RolloutSample `group` was encoded from: the same tensors (dtypes, shapes, values), non-tensor
    columns and meta_info.

    Raises:
        VerlEncodingError: the group was not written by `encode_sample`, or by a version this one cannot read.
    """
    md = group.metadata
    if md.get("verl.encoding") != ENCODING:
        raise VerlEncodingError(f"group {group.group_id}: encoding {md.get('verl.encoding')!r}, this reader knows "
                                f"{ENCODING!r} (was it published by rollstream.consumers.verl's rollouter?)")
    layout = json.loads(md["verl.layout"])
    width_p, width_r, n = layout["prompt_width"], layout["response_width"], len(group.samples)
    prompt = torch.from_numpy(group.prompt_tokens.astype(np.int64))
    prompts = torch.full((n, width_p), layout["prompt_pad"], dtype=torch.int64)
    prompts[:, width_p - len(prompt):] = prompt
    responses = torch.full((n, width_r), layout["response_pad"], dtype=torch.int64)
    response_mask = torch.zeros((n, width_r), dtype=torch.int64)
    attention = torch.zeros((n, width_p + width_r), dtype=torch.int64)
    attention[:, width_p - len(prompt):width_p] = 1
    tensors: dict[str, torch.Tensor] = {}
    logprobs = torch.zeros((n, width_r), dtype=torch.float32) if layout["rollout_log_probs"] else None
    rm_scores = torch.zeros((n, width_r), dtype=torch.float32) if layout["rm_scores"] else None
    for i, s in enumerate(group.samples):
        k = len(s.tokens)
        responses[i, :k] = torch.from_numpy(s.tokens.astype(np.int64))
        attention[i, width_p:width_p + k] = 1
        response_mask[i, :k] = torch.from_numpy((np.ones(k) if s.loss_mask is None else s.loss_mask).astype(np.int64))
        if logprobs is not None and s.logprobs is not None:
            logprobs[i, :k] = torch.from_numpy(s.logprobs)
        if rm_scores is not None and k:
            rm_scores[i, k - 1] = 0.0 if s.reward is None else s.reward
    tensors.update(prompts=prompts, responses=responses, response_mask=response_mask,
                   input_ids=torch.cat([prompts, responses], dim=1), attention_mask=attention)
    if logprobs is not None:
        tensors["rollout_log_probs"] = logprobs
    if rm_scores is not None:
        tensors["rm_scores"] = rm_scores
    if layout["position_ids"] == "derived":
        tensors["position_ids"] = _derived_positions(attention)
    tensors.update({k: _tensor_of(v) for k, v in json.loads(md["verl.tensors"]).items()})
    order = json.loads(md["verl.non_tensor"])
    non_tensor = {k: _column_of(v) for k, v in order.items()}
    full = DataProto(batch=TensorDict(tensors, batch_size=n), non_tensor_batch=non_tensor,
                     meta_info=json.loads(md["verl.meta_info"]))
    return RolloutSample(full_batch=full, sample_id=group.prompt_id, epoch=group.epoch,
                         rollout_status=json.loads(md["verl.rollout_status"]))


def handover(rs: RolloutSample) -> bytes:
    """`rs` as bytes ``ray.cloudpickle.loads`` (or ``pickle.loads``) turns back into an equal RolloutSample in
    this process: verl's trainer unpickles what its queue hands over (fully_async_trainer.py:439). The tensors
    travel as numpy arrays, not through DataProto's own pickling (``torch.save`` of a consolidated TensorDict,
    half or more of a 32 x 8 step's rebuild). In-process only: never written anywhere.
    """
    full = rs.full_batch
    arrays = {k: full.batch[k].numpy() for k in full.batch.keys()}
    return pickle.dumps(_Handover((arrays, full.non_tensor_batch, full.meta_info, rs.sample_id, rs.epoch,
                                   rs.rollout_status)), protocol=pickle.HIGHEST_PROTOCOL)


class _Handover:
    def __init__(self, args: tuple[Any, ...]) -> None:
        self.args = args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _rebuild, self.args


def _rebuild(arrays: dict[str, np.ndarray], non_tensor: dict[str, np.ndarray], meta_info: dict[str, Any],
             sample_id: str, epoch: int, rollout_status: Any) -> RolloutSample:
    tensors = {k: torch.from_numpy(a) for k, a in arrays.items()}
    full = DataProto(batch=TensorDict(tensors, batch_size=len(next(iter(arrays.values())))),
                     non_tensor_batch=non_tensor, meta_info=meta_info)
    return RolloutSample(full_batch=full, sample_id=sample_id, epoch=epoch, rollout_status=rollout_status)


def _versions(nt: Mapping[str, np.ndarray], i: int) -> tuple[int, ...]:
    low, high = nt.get("min_global_steps"), nt.get("max_global_steps")
    found = [int(c[i]) for c in (low, high) if c is not None and c[i] is not None]
    return tuple(dict.fromkeys(sorted(found)))


def _derived_positions(attention: torch.Tensor) -> torch.Tensor:
    return torch.clip(torch.cumsum(attention, dim=-1) - 1, min=0)


def _derived_positions_np(attention: np.ndarray) -> np.ndarray:
    """`_derived_positions` in numpy (the same values; int64 as torch's cumsum gives)."""
    return np.maximum(np.cumsum(attention, axis=-1, dtype=np.int64) - 1, 0)


def _same_prompts(prompts: np.ndarray, real: np.ndarray, first: np.ndarray) -> bool:
    """Whether every row's unpadded prompt (`prompts` where `real`) equals `first`: at once when the rows are
    padded alike (verl pads one prompt one way), else row by row."""
    if bool((real == real[0]).all()):
        return bool((prompts[:, real[0]] == first).all())
    return all(np.array_equal(row[mask], first) for row, mask in zip(prompts, real, strict=True))


def _pad(padded: np.ndarray, real: np.ndarray) -> int:
    """The first padding value in row-major order (0 when there is none). argmin finds the first False
    without building the masked copy (``padded[~real]``, ~5 ms at 8 x 2048)."""
    flat = real.reshape(-1)
    if len(flat) == 0 or bool(flat.all()):
        return 0
    return int(padded.reshape(-1)[int(np.argmin(flat))])


def _tensor_json(t: torch.Tensor) -> dict[str, Any]:
    array = t.detach().cpu().contiguous().numpy()
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return {"dtype": str(array.dtype), "shape": list(array.shape), "data": base64.b64encode(little.tobytes()).decode()}


def _tensor_of(spec: Mapping[str, Any]) -> torch.Tensor:
    dtype = np.dtype(spec["dtype"]).newbyteorder("<")
    array = np.frombuffer(base64.b64decode(spec["data"]), dtype=dtype).reshape(spec["shape"])
    return torch.from_numpy(array.astype(dtype.newbyteorder("="), copy=True))


def _column(values: np.ndarray) -> dict[str, Any]:
    """A non-tensor column as JSON data. A row holding the very object the row before holds reuses its plain
    form: verl repeats one prompt's columns ``rollout.n`` times (``np.repeat`` of an object array: the same
    dicts and lists in every row)."""
    out: list[Any] = []
    last, plain = _NOTHING, None
    for value in values.tolist():
        if value is not last:
            last, plain = value, _plain(value)
        out.append(plain)
    # most columns are objects: str(dtype) runs Python code in numpy (~4 us a call, 14 calls a sample)
    return {"dtype": "object" if values.dtype.kind == "O" else str(values.dtype), "values": out}


def _column_of(spec: Mapping[str, Any]) -> np.ndarray:
    if spec["dtype"] == "object":
        out = np.empty(len(spec["values"]), dtype=object)
        for i, value in enumerate(spec["values"]):  # one by one: equal-length lists must not become a 2-D array
            out[i] = value
        return out
    return np.array(spec["values"], dtype=spec["dtype"])


def _plain(value: Any) -> Any:
    """`value` as plain JSON data (numpy scalars and arrays inside object columns become Python ones)."""
    kind = type(value)
    if kind in _LEAVES:  # exact types first: most values are, and ABC checks (Mapping) cost microseconds each
        return value
    if kind is dict:
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _json(sample_id: str, value: Any) -> str:
    return _dumps(sample_id, _plain(value))


def _dumps(sample_id: str, plain: Any) -> str:
    """`plain` (JSON data already: `_plain`'s, `_column`'s) as JSON text."""
    try:
        return json.dumps(plain, allow_nan=True)
    except TypeError as exc:
        raise VerlEncodingError(f"verl sample {sample_id}: {exc}; rollstream.verl/1 carries JSON values only "
                                "(multimodal inputs are not supported)") from exc
