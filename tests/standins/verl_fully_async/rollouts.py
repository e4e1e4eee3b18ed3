"""What verl's rollouter hands to its queue, built without a GPU: a stand-in for the agent loop's output.

`agent_loop_output` follows verl 0.9.1's experimental/agent_loop/agent_loop.py:1057-1149
(``AgentLoopWorker._postprocess``): prompts left-padded, responses right-padded, ``input_ids`` = both,
``attention_mask``, ``position_ids`` = ``compute_position_id_with_mask``, ``rollout_log_probs``,
``rm_scores`` (the reward on the last response token), ``__num_turns__``, the input's non-tensor columns,
the extra fields (``min_global_steps``, ``max_global_steps``, ``turn_scores``, ``tool_rewards``, ``extras``)
and ``meta_info["metrics"]`` (one ``AgentLoopMetrics`` dict per row). `rollout_sample` wraps it as the
rollouter does (fully_async_rollouter.py:868-873, :996-1005), on verl's real `DataProto` and `RolloutSample`.
"""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.experimental.fully_async_policy.detach_utils import RolloutSample
from verl.utils.model import compute_position_id_with_mask

PROMPT_WIDTH = 16
RESPONSE_WIDTH = 24
PAD = 0


def agent_loop_output(index: int, n: int = 4, *, version: int = 0, partial: bool = False,
                      prompt_width: int = PROMPT_WIDTH, response_width: int = RESPONSE_WIDTH) -> DataProto:
    """One prompt's `n` responses as verl's agent loop returns them (deterministic in `index`)."""
    rng = np.random.default_rng(index)
    prompt = torch.tensor(rng.integers(5, 1000, size=3 + index % 5))
    prompts = torch.full((n, prompt_width), PAD, dtype=torch.int64)
    prompts[:, prompt_width - len(prompt):] = prompt
    responses = torch.full((n, response_width), PAD, dtype=torch.int64)
    response_mask = torch.zeros((n, response_width), dtype=torch.int64)
    logprobs = torch.zeros((n, response_width), dtype=torch.float32)
    attention = torch.zeros((n, prompt_width + response_width), dtype=torch.int64)
    attention[:, prompt_width - len(prompt):prompt_width] = 1
    scores = []
    for i in range(n):
        k = int(rng.integers(1, response_width + 1))
        responses[i, :k] = torch.tensor(rng.integers(5, 1000, size=k))
        response_mask[i, :k] = 1
        if k > 4:
            response_mask[i, 2:4] = 0  # a tool observation inside a multi-turn response
        logprobs[i, :k] = torch.tensor(-rng.random(k), dtype=torch.float32)
        attention[i, prompt_width:prompt_width + k] = 1
        scores.append(float(rng.integers(0, 2)))
    rm_scores = torch.zeros_like(response_mask, dtype=torch.float32)
    last = attention[:, prompt_width:].sum(dim=1) - 1
    rm_scores[torch.arange(n), last] = torch.tensor(scores)
    batch = TensorDict({"prompts": prompts, "responses": responses, "response_mask": response_mask,
                        "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention,
                        "position_ids": compute_position_id_with_mask(attention), "rollout_log_probs": logprobs,
                        "rm_scores": rm_scores}, batch_size=n)
    non_tensor = {"__num_turns__": np.full(n, 2, dtype=np.int32),
                  "data_source": np.array(["openai/gsm8k"] * n, dtype=object),
                  "raw_prompt": _objects([[{"role": "user", "content": f"question {index}"}]] * n),
                  "reward_model": _objects([{"style": "rule", "ground_truth": str(index)}] * n),
                  "extra_info": _objects([{"index": index, "split": "train"}] * n),
                  "index": np.array([index] * n, dtype=object),
                  "agent_name": np.array(["single_turn_agent"] * n, dtype=object),
                  "acc": np.array(scores),
                  "min_global_steps": _objects([version] * n),
                  "max_global_steps": _objects([version + 1 if partial else version] * n),
                  "turn_scores": _objects([[]] * n), "tool_rewards": _objects([[]] * n),
                  "extras": _objects([None] * n)}
    metrics = [{"generate_sequences": 0.5 + i, "tool_calls": 0.0, "num_preempted": -1} for i in range(n)]
    return DataProto(batch=batch, non_tensor_batch=non_tensor,
                     meta_info={"metrics": metrics, "reward_extra_keys": ["acc"]})


def rollout_sample(index: int, epoch: int = 0, n: int = 4, *, version: int = 0, partial: bool = False) -> RolloutSample:
    """A RolloutSample as the rollouter puts it on the queue after generating prompt `index`."""
    full = agent_loop_output(index, n, version=version, partial=partial)
    sample_id = f"sample_{epoch}_{index}"
    full.non_tensor_batch["uid"] = np.array([f"uid_{sample_id}"] * n, dtype=object)
    return RolloutSample(full_batch=full, sample_id=sample_id, epoch=epoch,
                         rollout_status={"monitor/queue/mq_queue_size": 3, "count/staleness_samples": 5})


def _objects(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out
