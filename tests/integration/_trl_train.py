"""A real TRL `AsyncGRPOTrainer` on CPU, fed by `rollstream.consumers.trl.RollstreamRolloutWorker`.

TRL 1.16's trainer runs on CPU except for two things, both replaced here and only here:

- Its attention is "tree" attention (trl/experimental/async_grpo/packing.py:168-201), which calls
  FlashAttention-3's ``flash_attn_varlen_func``, fetched from the Hugging Face Hub with the `kernels`
  package (packing.py:159-165): a CUDA (Hopper) kernel, and nothing can be downloaded here.
  `cpu_varlen_attention` computes the same function with torch's SDPA: per segment, causal with
  FlashAttention's bottom-right alignment (a segment's queries are the last positions of its K/V path).
  TRL's own `tree_attention` still gathers the K/V paths and is what the model calls.
- `get_peak_flops_per_device` asks ``torch.cuda.get_device_name`` (async_grpo_trainer.py:1240,
  trl/trainer/utils.py:1824), which raises without a GPU; it is replaced by ``None``, which TRL itself
  returns for an unknown device (MFU metrics off).

Weights: `NoWeightTransfer` follows TRL's `WeightTransferProtocol` and sends nothing: producers load
weights themselves (async_grpo_trainer.py:155-162 allows a no-op implementation).

Run as a script (the crash test): ``python tests/integration/_trl_train.py SPEC_JSON`` trains
``max_steps`` steps and prints one `EVENT` JSON line per finished step; with ``kill_at_step`` it SIGKILLs
itself in that step's ``on_step_end``, after the optimizer step and before the commit callback.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

REPO_ROOT = Path(__file__).resolve().parents[2]
EVENT = "@rollstream-trl "  # prefix of this script's own stdout lines (TRL prints its logs there too)


class _CpuKernel:
    """The one function of FlashAttention's interface that TRL's tree attention calls."""

    @staticmethod
    def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                               softmax_scale: float | None = None, causal: bool = True,
                               window_size: tuple[int, int] = (-1, -1), **_: Any) -> torch.Tensor:
        return cpu_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size)


def cpu_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                         scale: float | None, causal: bool, window_size: tuple[int, int]) -> torch.Tensor:
    """``flash_attn_varlen_func`` semantics: q [Tq, H, D], k/v [Tk, Hkv, D] packed by segment boundaries."""
    if window_size != (-1, -1):
        raise NotImplementedError("sliding-window attention is not needed for the tiny Llama")
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]  # grouped-query attention: each K/V head serves `groups` query heads
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        qs = q[q0:q1].transpose(0, 1)
        ks = k[k0:k1].transpose(0, 1).repeat_interleave(groups, 0)
        vs = v[k0:k1].transpose(0, 1).repeat_interleave(groups, 0)
        mask = None
        if causal:
            lq, lk = q1 - q0, k1 - k0
            mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        out[q0:q1] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                                      scale=scale).transpose(0, 1)
    return out


def patch_trl_for_cpu(setattr_: Any = setattr) -> None:
    """Install the two CPU stand-ins (see the module docstring). `setattr_`: pytest's monkeypatch.setattr."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    setattr_(packing, "_flash_attn", lambda: _CpuKernel)
    setattr_(async_grpo_trainer, "get_peak_flops_per_device", lambda *args, **kwargs: None)


class NoWeightTransfer:
    """TRL's `WeightTransferProtocol`, sending nothing: rollstream producers load weights themselves."""

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        for _ in iterator:  # walk it as TRL's client would, so any collective in it still runs
            pass

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def trl_config(out_dir: str | Path, **overrides: Any) -> Any:
    """A small CPU `AsyncGRPOConfig`: 2 groups of 4 samples per step (4 per micro-batch, 2 micro-batches)."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    base: dict[str, Any] = dict(
        output_dir=str(out_dir), max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_generations=4, token_budget=0, learning_rate=1e-2, use_cpu=True, bf16=False,
        activation_checkpointing=False, report_to=[], save_strategy="no", logging_steps=1, seed=0,
        disable_tqdm=True, heartbeat_stale_after_s=60.0)
    return AsyncGRPOConfig(**{**base, **overrides})


def build_trainer(model_dir: str | Path, args: Any, worker: Any, callbacks: list[Any] | None = None) -> Any:
    """The trainer on the tiny model with the rollstream worker, its commit callback last."""
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    # TRL requires a prompt dataset; with a rollout worker and max_steps it is never read.
    prompts = Dataset.from_dict({"prompt": ["served by rollstream"]})
    return AsyncGRPOTrainer(model=str(model_dir), args=args, train_dataset=prompts, rollout_worker=worker,
                            weight_transfer=NoWeightTransfer(),
                            callbacks=[*(callbacks or []), worker.commit_callback()])


class _Report(TrainerCallback):
    """Prints one JSON line per finished step (before the commit callback runs); kills itself at one."""

    def __init__(self, kill_at_step: int | None) -> None:
        self._kill_at = kill_at_step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        killing = state.global_step == self._kill_at
        print(EVENT + json.dumps({"trained": state.global_step, "killing": killing}), flush=True)
        if killing:
            os.kill(os.getpid(), signal.SIGKILL)  # after optimizer.step(), before the commit callback


def main(spec: dict[str, Any]) -> None:
    from rollstream.consumers.trl import RollstreamRolloutWorker, TRLWorkerSettings

    torch.set_num_threads(1)
    patch_trl_for_cpu()
    args = trl_config(spec["out_dir"], max_steps=spec["max_steps"])
    worker = RollstreamRolloutWorker(args, TRLWorkerSettings(
        bootstrap_servers=spec["bootstrap"], namespace=spec["namespace"], group=spec["group"], take_timeout_s=60))
    trainer = build_trainer(spec["model_dir"], args, worker, callbacks=[_Report(spec.get("kill_at_step"))])
    trainer.train()
    print(EVENT + json.dumps({"done": trainer.state.global_step}), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    main(json.loads(sys.argv[1]))
