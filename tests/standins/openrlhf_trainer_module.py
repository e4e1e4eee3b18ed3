"""A stand-in of OpenRLHF 0.11.2's ``openrlhf/trainer/ppo_trainer_async.py`` as a module, for
`rollstream.consumers._openrlhf_launch.rollstream_trainer`: the real one imports vLLM, DeepSpeed and peft, which
do not install on CPU.

It has what the launcher touches, in upstream's shape: ``Queue`` (``ray.util.queue.Queue``, here a
``queue.Queue``), ``ray`` (``get`` and actor handles whose ``.remote`` calls run on threads: `LocalRay`) and
``PPOTrainerAsync``, whose ``__init__(pretrain, strategy, actor_model_group, critic_model_group,
reward_model_group, reference_model_group, vllm_engines, **generate_kwargs)`` builds ``rollout_queue`` then
``rollout_slots`` with ``Queue(maxsize=async_queue_size)``, fills the slots with ``0`` tokens and hands both
to a ``GenerateSamplesActor`` and a ``TrainingActor`` (each gets its own pickled copy, as from Ray). The actors'
``fit`` loops follow upstream's queue calls (tests.standins.openrlhf_async), with the eval branch (generator:
``("eval", global_step, metrics)`` when a slot token hits ``eval.steps``; trainer: logs it, returns a slot);
``init_checkpoint_states``, ``restore_best_checkpoint_state``, ``load_state_dict`` and ``broadcast_to_vllm``
record their calls in `Checkpoints`, the store a test keeps across trainer restarts.
"""

from __future__ import annotations

import pickle
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from tests.standins.openrlhf_async import generate_loop, train_loop

Queue = queue.Queue


class LocalRay:
    """``ray.get`` and ``.remote`` calls, each on a daemon thread of this process (a generator blocked on a dead
    trainer's lag does not keep the test process alive)."""

    def get(self, refs: Any) -> Any:
        return [r.result() for r in refs] if isinstance(refs, list) else refs.result()

    def handle(self, actor: Any) -> Any:
        """An actor handle: ``handle.method.remote(...)`` runs ``actor.method(...)`` on a thread."""
        return SimpleNamespace(**{name: SimpleNamespace(remote=_remote(getattr(actor, name)))
                                  for name in dir(actor) if not name.startswith("_")})


def _remote(method: Any) -> Any:
    def remote(*args: Any, **kwargs: Any) -> Future:
        result: Future = Future()

        def run() -> None:
            try:
                result.set_result(method(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever gets the result, as Ray does
                result.set_exception(exc)

        threading.Thread(target=run, daemon=True, name=f"actor-{method.__name__}").start()
        return result

    return remote


ray = LocalRay()


@dataclass
class Checkpoints:
    """What the stand-in actors record, kept across trainer restarts. `crash_at`: the trainer raises after
    taking the step that would reach this global step (before training it)."""

    prompts_total: int
    prompts_per_step: int
    n: int
    save_steps: int
    eval_steps: int | None = None
    crash_at: int | None = None
    saved: dict[int, dict] = field(default_factory=dict)
    trained: list[list[str]] = field(default_factory=list)
    evals: list[tuple[int, dict]] = field(default_factory=list)
    loaded: list[dict] = field(default_factory=list)
    broadcasts: int = 0


class Crash(RuntimeError):
    """The trainer process dies."""


class GenerateSamplesActor:
    def __init__(self, rollout_queue: Any, rollout_slots: Any, store: Checkpoints) -> None:
        self.rollout_queue, self.rollout_slots, self.store = rollout_queue, rollout_slots, store
        self.eval_done_at: int | None = None

    def load_state_dict(self, state: dict) -> None:
        self.store.loaded.append(state)

    def fit(self, episode: int, total_consumed_prompts: int) -> None:
        s, consumed = self.store, total_consumed_prompts
        while consumed < s.prompts_total:
            step = self.rollout_slots.get(block=True)
            if s.eval_steps and step and step % s.eval_steps == 0 and self.eval_done_at != step:
                self.eval_done_at = step  # upstream's _eval_just_done: one eval per step reached
                self.rollout_queue.put(("eval", step, {"eval/accuracy": step / 10}), block=True)
                continue
            self.rollout_slots.put(step)  # generate_loop takes the slot again
            consumed = generate_loop(self.rollout_queue, self.rollout_slots, 1, prompts_per_step=s.prompts_per_step,
                                     n=s.n, episode=episode, consumed=consumed, done=False)
        self.rollout_queue.put("done", block=True)


class TrainingActor:
    def __init__(self, rollout_queue: Any, rollout_slots: Any, store: Checkpoints) -> None:
        self.rollout_queue, self.rollout_slots, self.store = rollout_queue, rollout_slots, store

    def init_checkpoint_states(self) -> dict:
        saved = self.store.saved
        return dict(saved[max(saved)]) if saved else {"episode": 0, "global_step": 0, "total_consumed_prompts": 0}

    def restore_best_checkpoint_state(self, states: dict) -> None:
        pass

    def broadcast_to_vllm(self) -> None:
        self.store.broadcasts += 1

    def fit(self, global_step: int = 0) -> None:
        s = self.store

        def train(samples: list, step: int) -> None:
            if s.crash_at is not None and step + 1 == s.crash_at:
                raise Crash(f"the trainer died training step {step + 1}")
            s.trained.append([e.prompts[0] for e in samples[::s.n]])

        def save(step: int, states: dict) -> None:
            if step % s.save_steps == 0:
                s.saved[step] = dict(states)

        train_loop(self.rollout_queue, self.rollout_slots, global_step, train=train, save=save,
                   on_eval=lambda step, metrics: s.evals.append((step, metrics)))


class PPOTrainerAsync:
    def __init__(self, pretrain: str, strategy: Any, actor_model_group: Any, critic_model_group: Any,
                 reward_model_group: Any, reference_model_group: Any, vllm_engines: Any, **generate_kwargs: Any):
        queue_size = getattr(strategy.args.train, "async_queue_size", 1)
        self.rollout_queue = Queue(maxsize=queue_size)
        self.rollout_slots = Queue(maxsize=queue_size)
        for _ in range(queue_size):
            self.rollout_slots.put(0, block=True)
        store = strategy.store
        self.generator_actor = ray.handle(GenerateSamplesActor(*_as_sent(self.rollout_queue, self.rollout_slots),
                                                               store))
        self.trainer_actor = ray.handle(TrainingActor(*_as_sent(self.rollout_queue, self.rollout_slots), store))


def _as_sent(*objects: Any) -> list[Any]:
    """What Ray hands an actor: a pickled copy (a ``queue.Queue`` cannot be pickled; it stays shared)."""
    return [o if isinstance(o, queue.Queue) else pickle.loads(pickle.dumps(o)) for o in objects]
