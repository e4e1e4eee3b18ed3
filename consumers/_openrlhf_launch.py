"""``python -m rollstream.consumers.openrlhf <train_ppo_ray arguments>``: OpenRLHF's own launcher with its async
trainer on rollstream. The one change to a launch script: ``python -m openrlhf.cli.train_ppo_ray`` becomes
``python -m rollstream.consumers.openrlhf``; every argument stays (``--train.async_enable`` among them), and
the broker, namespace and trainer group come from ``ROLLSTREAM_*`` variables (`OpenRLHFSettings.of`).

`install` swaps ``openrlhf.trainer.ppo_trainer_async.PPOTrainerAsync`` (which ``train_ppo_ray`` imports when
``--train.async_enable`` is set) for `rollstream_trainer`'s subclass, then ``train_ppo_ray`` runs as its
``__main__``. The subclass changes two things of OpenRLHF 0.11.2's trainer:

- its two Ray queues (``rollout_queue``, ``rollout_slots``: ``Queue(maxsize=async_queue_size)``, built in
  ``__init__``) are a `RolloutQueue` and a `RolloutSlots`, handed to both actors as the queues were;
- its ``fit`` resumes from rollstream (`RolloutQueue.resume`): the trainer continues after the rollstream step
  its checkpoint recorded, and the generator after the newest group published (its dataloader state loaded
  also when no checkpoint was saved yet), then both actors' ``fit`` run as OpenRLHF's do.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

from rollstream.consumers.openrlhf import OpenRLHFSettings, RolloutQueue, RolloutSlots
from rollstream.infra.config import ConfigError

ASYNC_FLAG = "--train.async_enable"
LAUNCHER = "openrlhf.cli.train_ppo_ray"
TESTED = "0.11.2"


def main(argv: Sequence[str]) -> None:
    """Run OpenRLHF's ``train_ppo_ray`` with `argv`, its async trainer on rollstream. Blocks for the whole
    training. Raises SystemExit (2, one line) without ``--train.async_enable``: only the async trainer has the
    queues rollstream stands in for."""
    if ASYNC_FLAG not in argv:
        raise SystemExit(f"rollstream.consumers.openrlhf runs OpenRLHF's async trainer: add {ASYNC_FLAG} (the "
                         "synchronous trainer passes no rollouts through queues rollstream could stand in for)")
    install()
    sys.argv = [LAUNCHER, *argv]
    runpy.run_module(LAUNCHER, run_name="__main__", alter_sys=True)


def install() -> None:
    """Make ``openrlhf.trainer.ppo_trainer_async.PPOTrainerAsync`` rollstream's (`rollstream_trainer`). Imports
    OpenRLHF's trainer module (Ray, vLLM, DeepSpeed: OpenRLHF's own dependencies). Idempotent."""
    from openrlhf.trainer import ppo_trainer_async

    if getattr(ppo_trainer_async, "ROLLSTREAM_TRAINER", None) is not ppo_trainer_async.PPOTrainerAsync:
        ppo_trainer_async.PPOTrainerAsync = ppo_trainer_async.ROLLSTREAM_TRAINER = rollstream_trainer(ppo_trainer_async)


def rollstream_trainer(module: ModuleType) -> Any:
    """`module`'s ``PPOTrainerAsync`` on rollstream (see the module docstring): a subclass of its class, made a
    Ray actor class as OpenRLHF's is (``@ray.remote``, with its options; Ray forbids subclassing an actor class,
    so the subclass derives from the class it decorates). `module` is OpenRLHF's ``ppo_trainer_async`` (its
    ``Queue``, ``ray`` and ``PPOTrainerAsync``)."""
    declared: Any = module.PPOTrainerAsync
    metadata = getattr(declared, "__ray_metadata__", None)
    base = declared if metadata is None else metadata.modified_class.__ray_actor_class__

    class RollstreamPPOTrainerAsync(base):  # type: ignore[misc, valid-type]
        def __init__(self, pretrain: Any, strategy: Any, *args: Any, **kwargs: Any) -> None:
            settings = OpenRLHFSettings.of(strategy.args)
            with _queues(module, RolloutQueue(settings), RolloutSlots(settings)):
                super().__init__(pretrain, strategy, *args, **kwargs)

        def fit(self) -> None:
            """Resume from rollstream, then run both actors' ``fit`` until the generator's data ends. Blocks."""
            get = module.ray.get
            trainer, generator = self.trainer_actor, self.generator_actor
            states = get(trainer.init_checkpoint_states.remote())
            get(trainer.restore_best_checkpoint_state.remote(states))
            states = self.rollout_queue.resume(states)
            global_step = int(states.get("global_step", 0))
            loading = [generator.load_state_dict.remote(states["data_loader_state_dict"])
                       if "data_loader_state_dict" in states else None,
                       trainer.broadcast_to_vllm.remote() if global_step > 0 else None]
            get([ref for ref in loading if ref is not None])
            get([generator.fit.remote(episode=int(states.get("episode", 0)),
                                      total_consumed_prompts=int(states.get("total_consumed_prompts", 0))),
                 trainer.fit.remote(global_step=global_step)])

    if metadata is None:
        return RollstreamPPOTrainerAsync
    options = getattr(declared, "_default_options", None) or {}
    return module.ray.remote(**options)(RollstreamPPOTrainerAsync) if options else \
        module.ray.remote(RollstreamPPOTrainerAsync)


@contextlib.contextmanager
def _queues(module: ModuleType, queue: RolloutQueue, slots: RolloutSlots) -> Iterator[None]:
    """While inside, `module`'s ``Queue(maxsize=...)`` gives `queue`, then `slots` (the order OpenRLHF builds
    ``rollout_queue`` and ``rollout_slots`` in). Raises ConfigError when OpenRLHF built other than those two."""
    made: list[RolloutQueue | RolloutSlots] = [queue, slots]
    original = getattr(module, "Queue")  # noqa: B009 - OpenRLHF's module, typed as any module

    def next_queue(*_: Any, **__: Any) -> RolloutQueue | RolloutSlots:
        if not made:
            raise ConfigError(f"OpenRLHF's PPOTrainerAsync built more than its two rollout queues: this OpenRLHF "
                              f"is not the one rollstream.consumers.openrlhf supports (tested: {TESTED})")
        return made.pop(0)

    setattr(module, "Queue", next_queue)  # noqa: B010
    try:
        yield
    finally:
        setattr(module, "Queue", original)  # noqa: B010
    if made:
        raise ConfigError(f"OpenRLHF's PPOTrainerAsync did not build its two rollout queues: this OpenRLHF is not the "
                          f"one rollstream.consumers.openrlhf supports (tested: {TESTED})")
