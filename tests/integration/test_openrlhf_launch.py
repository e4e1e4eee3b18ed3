"""``python -m rollstream.consumers.openrlhf``'s trainer (`rollstream_trainer`) against a real broker, on a stand-in
of OpenRLHF 0.11.2's ``ppo_trainer_async`` module (tests.standins.openrlhf_trainer_module: the real one imports
vLLM, DeepSpeed and peft). Pinned: the subclass builds rollstream's queues where OpenRLHF builds its Ray queues and
hands them to both actors; a trainer that dies after checkpoint k resumes after k with nothing lost (the steps
after k again, then the rest) and the generator after what was published (OpenRLHF #1322, through ``fit``); eval
results reach the trainer; OpenRLHF's own ``@ray.remote`` trainer class becomes a Ray actor class again; the
launcher refuses to run without ``--train.async_enable``.
"""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest

pytest.importorskip("openrlhf", reason="the openrlhf extra is not installed (make install-openrlhf)")
ray = pytest.importorskip("ray", reason="Ray is not installed (make install-openrlhf)")

from rollstream.consumers import _openrlhf_launch  # noqa: E402
from rollstream.consumers.openrlhf import RolloutQueue, RolloutSlots  # noqa: E402

from tests.standins import openrlhf_trainer_module as module  # noqa: E402

pytestmark = pytest.mark.integration
PROMPTS, N = 2, 2


def strategy(store: module.Checkpoints, queue_size: int) -> SimpleNamespace:
    args = SimpleNamespace(rollout=SimpleNamespace(batch_size=PROMPTS, n_samples_per_prompt=N),
                           train=SimpleNamespace(async_queue_size=queue_size))
    return SimpleNamespace(args=args, store=store)


@pytest.fixture
def trainer_class(bootstrap_servers, namespace_factory, group_id, monkeypatch):
    names = namespace_factory(partitions=1)
    for var, value in (("ROLLSTREAM_BOOTSTRAP_SERVERS", bootstrap_servers), ("ROLLSTREAM_NAMESPACE", names.namespace),
                       ("ROLLSTREAM_TRAINER_GROUP", group_id)):
        monkeypatch.setenv(var, value)
    return _openrlhf_launch.rollstream_trainer(module)


def build(trainer_class, store: module.Checkpoints, queue_size: int):
    return trainer_class("model", strategy(store, queue_size), None, None, None, None, None, do_sample=True)


def prompts(*numbers: int) -> list[str]:
    return [f"prompt {i}" for i in numbers]


@pytest.mark.timeout(180)
def test_a_trainer_that_died_after_checkpoint_k_resumes_after_k_through_fit(trainer_class) -> None:
    store = module.Checkpoints(prompts_total=10, prompts_per_step=PROMPTS, n=N, save_steps=2, crash_at=4)
    dying = build(trainer_class, store, queue_size=10)  # room for every step: the generator finishes first
    assert isinstance(dying.rollout_queue, RolloutQueue) and isinstance(dying.rollout_slots, RolloutSlots)
    assert module.Queue is queue.Queue  # OpenRLHF's own Queue is back once the trainer is built
    with pytest.raises(module.Crash):
        dying.fit()
    assert store.trained == [prompts(0, 1), prompts(2, 3), prompts(4, 5)]  # the fourth step died in training
    assert store.saved[2]["rollstream_step"] == 1 and store.loaded == [] and store.broadcasts == 0

    store.crash_at = None
    build(trainer_class, store, queue_size=10).fit()  # OpenRLHF restores checkpoint global_step 2
    assert store.trained[3:] == [prompts(4, 5), prompts(6, 7), prompts(8, 9)]  # after k: again, then the rest
    assert store.loaded == [{"samples_yielded": 10}] and store.broadcasts == 1  # the generator: after all 10


@pytest.mark.timeout(180)
def test_eval_results_reach_the_trainer(trainer_class) -> None:
    store = module.Checkpoints(prompts_total=12, prompts_per_step=PROMPTS, n=N, save_steps=100, eval_steps=1)
    build(trainer_class, store, queue_size=1).fit()  # one step queued: the generator sees the trainer's steps
    assert store.trained == [prompts(i, i + 1) for i in range(0, 12, 2)]  # evals are in no step
    assert store.evals and all(metrics == {"eval/accuracy": step / 10} for step, metrics in store.evals)
    assert len({step for step, _ in store.evals}) == len(store.evals) >= 1  # each once


def test_openrlhfs_ray_actor_class_becomes_a_ray_actor_class_of_the_subclass() -> None:
    @ray.remote(num_cpus=0)
    class PPOTrainerAsync(module.PPOTrainerAsync):
        pass

    made = _openrlhf_launch.rollstream_trainer(SimpleNamespace(PPOTrainerAsync=PPOTrainerAsync, ray=ray,
                                                               Queue=module.Queue))
    subclass = made.__ray_metadata__.modified_class.__ray_actor_class__
    assert issubclass(subclass, PPOTrainerAsync.__ray_metadata__.modified_class.__ray_actor_class__)
    assert subclass.__name__ == "RollstreamPPOTrainerAsync" and made._default_options == {"num_cpus": 0}


def test_the_launcher_refuses_the_synchronous_trainer() -> None:
    with pytest.raises(SystemExit, match="add --train.async_enable"):
        _openrlhf_launch.main(["--actor.model_name_or_path", "m", "--rollout.batch_size", "2"])
