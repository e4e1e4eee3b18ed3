"""``python -m rollstream.consumers.verl``: verl 0.9.1's ``fully_async_main`` with rollstream as the queue.

Three subclasses of verl's Ray actors, no fork (the contract is `rollstream.consumers.verl`'s docstring):

- `_Trainer` (``FullyAsyncTrainer``): its queue client is a `VerlTrainerQueue`; it commits a step right after
  ``_fit_update_actor`` (called by ``fit_step``, fully_async_trainer.py:591, before ``_fit_update_weights``,
  the checkpoint and the next ``_fit_generate``), announces each param version after ``_fit_update_weights``
  and hands its trainer run to the rollouter (``serve_run``; the first sync runs before the rollouter's ``fit``),
  writes ``rollstream.json`` into a checkpoint folder *before* verl marks the checkpoint complete
  (``latest_checkpointed_iteration.txt``), and seeks there after ``load_checkpoint``. The commit blocks the
  trainer's loop for its duration, as verl's own ``ray.get`` calls in ``fit_step`` do.
- `_Rollouter` (``FullyAsyncRollouter``): its queue client is a `VerlRolloutQueue`; ``max_queue_size`` is
  raised by ``required_samples`` (the lag it compares against counts the step in training); ``serve_run``
  sets the trainer run its groups are stamped with.
- `_TaskRunner` (``FullyAsyncTaskRunner``): creates those two instead of verl's (``_create_trainer`` and
  ``_create_rollouter`` follow fully_async_main.py:119-163 with the class swapped). verl's ``MessageQueue``
  actor is still created and stays idle (its clients are replaced in ``set_message_queue_client``).

tests/unit/test_verl_runner.py pins the upstream seams (method names, the order in ``fit_step``, the
copied methods) so a verl upgrade that moves them fails there, not in a training run.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import hydra
import ray
from rollstream.consumers._verl_rollouter import VerlRolloutQueue
from rollstream.consumers.verl import VerlSettings, VerlTrainerQueue
from verl.experimental.fully_async_policy import fully_async_main as upstream
from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter
from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer
from verl.experimental.separation.utils import create_resource_pool_manager
from verl.trainer.ppo.utils import Role
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

log = logging.getLogger(__name__)
CONFIG_DIR = str(Path(upstream.__file__).resolve().parent / "config")


def settings_of(config: Any) -> VerlSettings:
    return VerlSettings.of(config.get("rollstream"))


def checkpoint_folder(config: Any) -> str | None:
    """The ``global_step_k`` folder verl's ``load_checkpoint`` loads (fully_async_trainer.py:980-1008), or None."""
    trainer = config.trainer
    if trainer.resume_mode == "disable":
        return None
    if trainer.resume_mode == "resume_path":
        return os.path.abspath(trainer.resume_from_path)
    return find_latest_ckpt_path(os.path.abspath(trainer.default_local_dir))


class _Trainer(FullyAsyncTrainer.__ray_actor_class__):
    def set_message_queue_client(self, message_queue_client: Any) -> None:
        self.message_queue_client = VerlTrainerQueue(settings_of(self.config), groups_per_step=self.required_samples,
                                                     group_size=self.config.actor_rollout_ref.rollout.n,
                                                     staleness_threshold=self.staleness_threshold)

    def _fit_update_actor(self, batch: Any) -> Any:
        batch = super()._fit_update_actor(batch)
        self.message_queue_client.commit_trained()  # verl trained on it: the earliest point that is true
        self.metrics.update(self.message_queue_client.metrics())
        return batch

    async def _fit_update_weights(self) -> dict | None:
        timing = await super()._fit_update_weights()
        if timing is not None:  # the weights were synced as current_param_version
            run = self.message_queue_client.announce(self.current_param_version)
            await asyncio.wrap_future(self.rollouter.serve_run.remote(run).future())  # the groups it stamps
        return timing

    def _save_checkpoint(self) -> None:
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.current_param_version}")
        self.message_queue_client.save_position(folder)  # before verl marks the checkpoint complete
        super()._save_checkpoint()

    async def load_checkpoint(self) -> int:
        version = await super().load_checkpoint()
        self.message_queue_client.resume_from(checkpoint_folder(self.config) if version else None)
        return version


class _Rollouter(FullyAsyncRollouter.__ray_actor_class__):
    async def set_message_queue_client(self, message_queue_client: Any) -> None:
        async with self.lock:
            self.message_queue_client = VerlRolloutQueue(settings_of(self.config))

    async def serve_run(self, run: int) -> None:
        self.message_queue_client.serve_run(run)

    async def set_max_required_samples(self) -> None:
        await super().set_max_required_samples()
        async with self.lock:
            self.max_queue_size += self.required_samples


RollstreamFullyAsyncTrainer = ray.remote(num_cpus=10)(_Trainer)
RollstreamFullyAsyncRollouter = ray.remote(num_cpus=10, max_concurrency=100)(_Rollouter)


class _TaskRunner(upstream.FullyAsyncTaskRunner.__ray_actor_class__):
    def _create_rollouter(self, config: Any) -> None:
        rollouter = RollstreamFullyAsyncRollouter.remote(config=config, tokenizer=self.components["tokenizer"],
                                                         processor=self.components["processor"],
                                                         device_name=config.trainer.device)
        if "hybrid_worker_group" in self.components:  # before init_workers, as upstream
            ray.get(rollouter.set_hybrid_worker_group.remote(self.components["hybrid_worker_group"]))
        ray.get(rollouter.init_workers.remote())
        ray.get(rollouter.set_max_required_samples.remote())
        self.components["rollouter"] = rollouter

    def _create_trainer(self, config: Any) -> None:
        roles = {role: cls for role, cls in self.components["role_worker_mapping"].items() if role != Role.Rollout}
        trainer = RollstreamFullyAsyncTrainer.remote(
            config=config, tokenizer=self.components["tokenizer"], role_worker_mapping=roles,
            resource_pool_manager=create_resource_pool_manager(config, roles=list(roles.keys())),
            ray_worker_group_cls=self.components["ray_worker_group_cls"], device_name=config.trainer.device)
        ray.get(trainer.init_workers.remote())
        self.components["trainer"] = trainer


RollstreamTaskRunner = ray.remote(num_cpus=1)(_TaskRunner)


@hydra.main(config_path=CONFIG_DIR, config_name="fully_async_ppo_trainer", version_base=None)
def main(config: Any) -> None:
    """verl's ``fully_async_main.main`` (fully_async_main.py:223-240) with `RollstreamTaskRunner`."""
    from verl.experimental.reward_loop import migrate_legacy_reward_impl
    from verl.trainer.main_ppo import run_ppo
    from verl.utils.device import auto_set_device

    if not hasattr(config, "async_training"):
        raise RuntimeError("must set async_training config")
    settings_of(config)  # a bad rollstream setting fails here, before Ray starts anything
    auto_set_device(config)
    config.actor_rollout_ref.rollout.nnodes = config.rollout.nnodes
    config.actor_rollout_ref.rollout.n_gpus_per_node = config.rollout.n_gpus_per_node
    config = migrate_legacy_reward_impl(config)
    run_ppo(config, task_runner_class=RollstreamTaskRunner)
