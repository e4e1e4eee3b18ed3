"""Stand-ins for the GPU parts of OpenRLHF 0.11.2's async PPO trainer (``openrlhf/trainer/ppo_trainer_async.py``,
``ppo_utils/samples_generator.py``), which import vLLM and DeepSpeed and cannot run on CPU.

- `experience`: the Experience ``SamplesGenerator._process_response_into_experience`` builds from one vLLM
  response (samples_generator.py:243-306), with made-up tokens: the real ``Experience`` class, the same dtypes.
- `generate_loop`: ``GenerateSamplesActor.fit``'s queue protocol (ppo_trainer_async.py:99-158): take a slot
  (`rollout_slots.get`), generate, put ``(samples, client_states, filter_pass_rate, generation_time)``, "done"
  at the end. `train_loop`: ``TrainingActor.fit``'s (:193-237): get, return a slot, train (``train_step``
  stood in by a callback), ``client_states.update(global_step=...)``, checkpoint (``save_logs_and_checkpoints``
  stood in by a callback that keeps the client_states), with its eval branch (`on_eval`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from openrlhf.trainer.ppo_utils.experience import Experience


def experience(prompt: int, sample: int, *, prompt_len: int, response_len: int = 5, turns: int = 1) -> Experience:
    """Sample `sample` of prompt `prompt`: prompt tokens depend on the prompt only; `turns` > 1 puts an
    observation (not an action) of 2 tokens between the turns, as a multi-turn agent's ``action_ranges`` do."""
    prompt_ids = [100 + prompt * 10 + j for j in range(prompt_len)]
    observation, ranges = list(prompt_ids), []
    for t in range(turns):
        start = len(observation)
        observation += [1000 + sample * 50 + t * 10 + j for j in range(response_len)]
        ranges.append((start, len(observation)))
        if t < turns - 1:
            observation += [7, 8]
    sequences = torch.tensor(observation, dtype=torch.long)
    attention_mask = torch.ones(len(observation), dtype=torch.long)
    action_mask = torch.zeros_like(attention_mask)
    for start, end in ranges:
        action_mask[start:end] = 1
    action_mask = action_mask[1:]
    logprobs = torch.tensor([-0.01 * (j + sample) for j in range(len(observation))])[1:]
    ones = torch.where(action_mask)[0]
    reward = float(sample % 2)
    return Experience(
        sequences=sequences.unsqueeze(0), attention_mask=attention_mask.unsqueeze(0),
        action_mask=action_mask.unsqueeze(0), rollout_log_probs=logprobs.unsqueeze(0),
        prompts=[f"prompt {prompt}"], labels=[str(prompt)], images=[None], mm_train_inputs=[None],
        rewards=torch.tensor([reward]), scores=torch.tensor([reward]),
        response_length=torch.tensor([(ones[-1] - ones[0] + 1).item()]), truncated=torch.tensor([False]),
        total_length=torch.tensor([attention_mask.float().sum()]),
        info={"response_clip_ratio": torch.tensor([False]), "reward": torch.tensor([reward])})


def step_experiences(first_prompt: int, prompts: int, n: int) -> list[Experience]:
    return [experience(p, i, prompt_len=3) for p in range(first_prompt, first_prompt + prompts) for i in range(n)]


def generate_loop(queue: Any, slots: Any, steps: int, *, prompts_per_step: int, n: int, episode: int = 0,
                  consumed: int = 0, done: bool = True) -> int:
    """`steps` batches as ``GenerateSamplesActor.fit`` puts them, from prompt `consumed` on; returns the prompts
    consumed."""
    for _ in range(steps):
        slots.get(block=True)
        t0 = time.time()
        samples = step_experiences(consumed, prompts_per_step, n)
        consumed += prompts_per_step
        client_states = {"episode": episode, "total_consumed_prompts": consumed,
                         "data_loader_state_dict": {"samples_yielded": consumed}}
        queue.put((samples, client_states, None, time.time() - t0), block=True)
    if done:
        queue.put("done", block=True)
    return consumed


def train_loop(queue: Any, slots: Any, global_step: int, *, train: Callable[[list[Experience], int], None],
               save: Callable[[int, dict], None], steps: int | None = None,
               on_eval: Callable[[int, dict], None] | None = None) -> int:
    """``TrainingActor.fit``: up to `steps` steps (None: until "done"); returns the global step reached. An eval
    result (``("eval", step, metrics)``) returns a slot and goes to `on_eval` (upstream logs it)."""
    done = 0
    while steps is None or done < steps:
        payload = queue.get(block=True)
        if payload == "done":
            break
        if payload[0] == "eval":
            slots.put(global_step, block=True)
            if on_eval is not None:
                on_eval(payload[1], payload[2])
            continue
        samples, client_states, _rate, _gen_time = payload
        slots.put(global_step, block=True)
        train(samples, global_step)  # train_step: one PPO update
        global_step += 1
        client_states.update({"global_step": global_step})
        save(global_step, client_states)
        done += 1
    return global_step
