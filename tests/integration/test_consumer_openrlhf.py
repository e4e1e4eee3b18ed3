"""OpenRLHF 0.11.2's async trainer queues on rollstream, against a real broker and OpenRLHF's own ``Experience``.

The two actors' loops are replayed by tests.standins.openrlhf_async (``GenerateSamplesActor.fit`` and
``TrainingActor.fit``'s queue calls; their GPU parts, vLLM generation and the DeepSpeed ``train_step``, stood in).
Pinned: exactly one step's worth per ``get``, equal to what was put; a step is committed only after it trained
(at the next ``get``); a trainer that dies before that gets the same batch back; the slot rule holds the generator
at ``(queue_size + 1) x batch_size`` groups of lag; a resume from checkpoint k continues after k with nothing lost
or trained twice, the generator continuing after what was published (OpenRLHF #1322); producers follow the
resumed run, and the dead run cannot commit.
"""

from __future__ import annotations

import pickle
import threading

import pytest

pytest.importorskip("openrlhf", reason="the openrlhf extra is not installed (make install-openrlhf)")

from rollstream.consumers import GroupConflictError  # noqa: E402
from rollstream.consumers.openrlhf import OpenRLHFSettings, RolloutQueue, RolloutSlots  # noqa: E402
from rollstream.infra.runs import RunSupersededError  # noqa: E402

from tests.standins.openrlhf_async import generate_loop, train_loop  # noqa: E402

pytestmark = pytest.mark.integration
PROMPTS = 2  # --rollout.batch_size
N = 3  # --rollout.n_samples_per_prompt


def settings(bootstrap: str, names, group: str, queue_size: int) -> OpenRLHFSettings:
    return OpenRLHFSettings(groups_per_step=PROMPTS, group_size=N, queue_size=queue_size,
                            bootstrap_servers=bootstrap, namespace=names.namespace, group=group,
                            take_timeout_s=30.0, poll_interval_s=0.1, kafka_timeout_s=20.0)


def prompts(samples) -> list[str]:
    return [e.prompts[0] for e in samples[::N]]


def lag(s: OpenRLHFSettings) -> int:
    from rollstream.infra.lag import LagReader

    with LagReader(s.kafka("test-lag")) as reader:
        return reader.group_lag(s.group, f"{s.namespace}.rollouts", timeout=10.0).total


def test_one_step_per_get_committed_only_after_it_trained_and_the_same_batch_after_a_crash(
        bootstrap_servers, namespace_factory, group_id) -> None:
    s = settings(bootstrap_servers, namespace_factory(partitions=1), group_id, queue_size=2)
    put = RolloutQueue(s)
    generate_loop(put, RolloutSlots(s), 2, prompts_per_step=PROMPTS, n=N, done=False)
    put.close()

    dying = pickle.loads(pickle.dumps(put))  # Ray hands the queue to each actor: it opens its own clients there
    assert dying.settings == s and dying._producer is None
    samples, states, _rate, _seconds = dying.get()
    assert len(samples) == PROMPTS * N and prompts(samples) == ["prompt 0", "prompt 1"]
    assert states["total_consumed_prompts"] == 2 and states["rollstream_step"] == 0
    assert lag(s) == 2 * PROMPTS  # handed over, trained maybe, not committed: the trainer dies here
    dying.close()

    trainer = RolloutQueue(s)
    trained: list[list[str]] = []
    train_loop(trainer, RolloutSlots(s), 0, train=lambda b, _g: trained.append(prompts(b)), save=lambda *_: None,
               steps=2)
    assert trained == [["prompt 0", "prompt 1"], ["prompt 2", "prompt 3"]]  # the same batch first, then the next
    assert lag(s) == PROMPTS  # step 0 committed at the second get; step 1 not yet (not asked for step 2)
    trainer.close()


def test_the_slot_rule_holds_the_generator_at_the_lag_bound(bootstrap_servers, namespace_factory, group_id) -> None:
    s = settings(bootstrap_servers, namespace_factory(), group_id, queue_size=1)
    put, slots = RolloutQueue(s), RolloutSlots(s)
    generate_loop(put, slots, 2, prompts_per_step=PROMPTS, n=N, done=False)  # lag 4 = (1 + 1) x 2: full
    released = threading.Event()
    waiting = threading.Thread(target=lambda: (slots.get(), released.set()), daemon=True)
    waiting.start()
    assert not released.wait(1.5), "the generator took a slot past (queue_size + 1) x batch_size groups of lag"
    trainer = RolloutQueue(s)
    trainer.get()
    assert not released.wait(1.0)  # taken, in training: still in the lag
    trainer.get()  # step 0 trained: committed
    assert released.wait(10.0)
    for q in (put, trainer):
        q.close()
    slots.close()


def test_a_resume_from_checkpoint_k_continues_after_k_with_nothing_lost_and_producers_follow(
        bootstrap_servers, namespace_factory, group_id) -> None:
    s = settings(bootstrap_servers, namespace_factory(partitions=2), group_id, queue_size=5)
    generator, slots = RolloutQueue(s), RolloutSlots(s)
    consumed = generate_loop(generator, slots, 5, prompts_per_step=PROMPTS, n=N, done=False)
    generator.close()  # the generator dies with the trainer: 10 prompts published, OpenRLHF's queue would lose them

    dead = RolloutQueue(s)
    checkpoints: dict[int, dict] = {}
    trained: list[list[str]] = []
    train_loop(dead, slots, 0, train=lambda b, _g: trained.append(prompts(b)),
               save=lambda g, states: checkpoints.setdefault(g, dict(states)), steps=3)
    assert dead.get()[0]  # step 3 taken; the trainer dies while training it
    assert slots.get() == 3  # the dead run announced its global step 3
    published = {f"prompt {i}" for i in range(10)}  # two partitions: FIFO per partition, not across

    resumed = RolloutQueue(s)  # OpenRLHF restores checkpoint global_step 1 (saved after step 0)
    states = resumed.resume(checkpoints[1])
    assert states["global_step"] == 1 and states["total_consumed_prompts"] == consumed  # after what was published
    assert slots.get() == 1  # producers follow the resumed run down to its step
    with pytest.raises((RunSupersededError, GroupConflictError)):
        dead.get()  # its commit of step 3 is refused, nothing committed
    again: list[list[str]] = []
    step = train_loop(resumed, slots, 1, train=lambda b, _g: again.append(prompts(b)), save=lambda *_: None, steps=4)
    assert again[:2] == trained[1:3]  # the steps after k again, the same batches
    after_k = [p for batch in again for p in batch]
    assert sorted(after_k) == sorted(published - set(trained[0]))  # every published prompt after k, once

    generator = RolloutQueue(s)  # the generator restarts at the published position, not the checkpoint's
    generate_loop(generator, slots, 1, prompts_per_step=PROMPTS, n=N, consumed=states["total_consumed_prompts"])
    generator.close()
    last: list[str] = []
    assert train_loop(resumed, slots, step, train=lambda b, _g: last.extend(prompts(b)), save=lambda *_: None) == 6
    assert sorted(last) == ["prompt 10", "prompt 11"]  # then "done"
    assert lag(s) == 1  # every step committed; only the end marker (filtered, in no step) is left
    for q in (dead, resumed):
        q.close()
    slots.close()
