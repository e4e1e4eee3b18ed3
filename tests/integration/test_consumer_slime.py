"""The slime adapter against a real broker, under slime's real call orders, with a crash at each point.

slime (THUDM/slime) is not on PyPI: its types come from the stand-in in tests/standins/slime (slime
624b824, slime/utils/types.py and slime/rollout/base_types.py, field for field), and its two loops are
replayed below call for call, each line citing train.py / train_async.py at that commit. A crash is the
trainer process dying: the adapter's consumer is dropped without committing (what a kill -9 leaves on
the broker, since every step is recorded before it is handed over), then slime restarts from its last
checkpoint exactly as it does: ``start_rollout_id = last saved + 1`` and ``data_source.load(start - 1)``
(backends/megatron_utils/actor.py:114, ray/placement_group.py:221-222).

Pinned here: every call returns exactly rollout_batch_size groups of slime Samples in slime's
RolloutFnTrainOutput with rollstream's metrics; a batch is committed only after the step that trained
it, in both loops; a crash before a step finished gives that step's batch back (same ids, same order)
and the audit passes; resuming from checkpoint k takes first exactly the groups after step k; the
weight version counts slime's weight updates (and starts over after a resume); a default slime config
reaches its eval; calls that contradict rollstream_slime_loop raise; a job restarted from a checkpoint, with
a real producer feeding it, moves the producer down to its weight-update count, trains only groups of its own
run (the dead job's backlog requeued, accounted), and the hung dead job can neither announce nor commit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from rollstream.consumers import audit
from rollstream.consumers.slime import RollstreamDataSource, close, generate_rollout
from rollstream.infra import LagReader
from rollstream.schemas import ConfigError

from tests.records import make_group, publish, publish_many


class Crash(Exception):
    """The trainer process dies here."""


def slime_args(bootstrap: str, names, group_id: str, tmp: Path, **extra) -> SimpleNamespace:
    """slime's args as its RolloutManager sees them (utils/arguments.py defaults where they matter)."""
    base = dict(rollout_batch_size=2, n_samples_per_prompt=2, num_rollout=6, rollout_global_dataset=True,
                update_weights_interval=1, save=str(tmp), load=None, eval_interval=None, start_rollout_id=None,
                rollstream_bootstrap_servers=bootstrap, rollstream_namespace=names.namespace,
                rollstream_group=group_id, rollstream_take_timeout=30)
    return SimpleNamespace(**{**base, **extra})


def ids(output) -> list[str]:
    """The group ids of one rollout's output, in order (one per group)."""
    return [g[0].metadata["group_id"] for g in output.samples]


class Slime:
    """slime's rollout manager side, called in the order of train.py / train_async.py (slime 624b824).

    Before "training" each batch it checks, on the broker, that none of the batch's offsets is committed yet.
    """

    def __init__(self, args: SimpleNamespace, kafka_config, crash: tuple[str, int] | None = None, *,
                 check_commits: bool = True, hook: Callable[[str, int], None] | None = None) -> None:
        from slime.rollout.base_types import call_rollout_fn

        self.args, self.kafka_config, self.crash, self.call = args, kafka_config, crash, call_rollout_fn
        self.check_commits, self.hook = check_commits, hook
        self.data_source = RollstreamDataSource(args)  # RolloutManager.__init__, ray/rollout.py:383-384
        self.handed: dict[int, list[str]] = {}
        self.trained: dict[int, list[str]] = {}
        self.versions: dict[int, int] = {}
        self.steps: dict[int, int] = {}  # rollout id -> rollstream step
        self.evals: list = []
        self.resumed_at = 0

    def at(self, point: str, rollout_id: int) -> None:
        if self.hook is not None:
            self.hook(point, rollout_id)
        if self.crash == (point, rollout_id):
            raise Crash(f"{point} {rollout_id}")

    def start(self) -> int:
        """create_training_models: the checkpoint's rollout id + 1, and data_source.load(start - 1)."""
        saved = sorted(int(p.stem.rsplit("_", 1)[1]) for p in Path(self.args.save).glob("rollout/*.json"))
        self.args.load = self.args.save if saved else None
        self.resumed_at = saved[-1] + 1 if saved else 0  # actor.py:114
        self.data_source.load(self.resumed_at - 1)  # placement_group.py:221-222
        return self.resumed_at

    def generate(self, rollout_id: int):
        output = self.call(generate_rollout, self.args, rollout_id, self.data_source, evaluation=False)
        assert len(output.samples) == self.args.rollout_batch_size
        self.handed[rollout_id] = ids(output)
        self.versions[rollout_id] = output.metrics["rollstream/weight_version"]
        self.steps[rollout_id] = output.metrics["rollstream/step"]
        return output

    def train(self, rollout_id: int, output) -> None:
        done = committed(self.kafka_config, self.args.rollstream_namespace, self.args.rollstream_group)
        for group in output.samples:
            p, o = group[0].metadata["partition"], group[0].metadata["offset"]
            assert not self.check_commits or done[p] is None or done[p] <= o, (
                f"rollout {rollout_id}'s batch was committed before training")
        self.at("train", rollout_id)
        self.trained[rollout_id] = ids(output)

    def save(self, rollout_id: int) -> None:
        interval = self.args.save_interval
        if interval and ((rollout_id + 1) % interval == 0 or rollout_id + 1 == self.args.num_rollout):  # misc.py:107
            self.at("save", rollout_id)
            self.data_source.save(rollout_id)  # RolloutManager.save, ray/rollout.py:530-531

    def eval(self, rollout_id: int) -> None:
        if self.args.eval_interval and (rollout_id + 1) % self.args.eval_interval == 0:
            self.evals.append(self.call(generate_rollout, self.args, rollout_id, self.data_source, evaluation=True))

    def train_py(self) -> None:
        """train.py:49-91: generate k, train k, save k, update weights, eval k."""
        for rollout_id in range(self.start(), self.args.num_rollout):
            output = self.generate(rollout_id)  # :53
            self.train(rollout_id, output)  # :69
            self.save(rollout_id)  # :71-80
            self.at("update", rollout_id)  # update_weights, :85
            self.eval(rollout_id)  # :90-91

    def train_async_py(self) -> None:
        """train_async.py:32-73: rollout k+1 is asked for before k is trained; the rollout manager runs calls
        one at a time in order, so save(k) and eval(k) run after generate(k+1)."""
        start = self.start()
        following = self.generate(start)  # :32
        for rollout_id in range(start, self.args.num_rollout):
            current = following  # :35-36
            if rollout_id + 1 < self.args.num_rollout:
                following = self.generate(rollout_id + 1)  # :39-40
            self.train(rollout_id, current)  # :53
            self.save(rollout_id)  # :55-64
            self.at("update", rollout_id)  # :66-70
            self.eval(rollout_id)  # :72-73

    def run(self, loop: str, *, hang: bool = False) -> bool:
        """Run `loop` to the end or to the crash; return True when it crashed. The consumer is dropped either way,
        unless `hang`: then a crashed job keeps it (a node that hangs on after the scheduler restarted the job)."""
        crashed = False
        try:
            (self.train_py if loop == "sync" else self.train_async_py)()
        except Crash:
            crashed = True
        finally:
            if not (crashed and hang):
                close(self.args)
        return crashed


def committed(kafka_config, namespace: str, group_id: str) -> dict[int, int | None]:
    with LagReader(kafka_config) as reader:
        return {p.partition: p.committed for p in reader.group_lag(group_id, f"{namespace}.rollouts").partitions}


CRASHES = [("sync", None, ("train", 2)), ("sync", 2, ("train", 3)), ("sync", 2, ("save", 3)),
           ("sync", None, ("update", 2)), ("async", None, ("train", 2)), ("async", 2, ("train", 4)),
           ("async", 2, ("save", 3)), ("async", None, ("update", 1)), ("async", 1, ("train", 0))]


@pytest.mark.parametrize(("loop", "save_interval", "crash"), CRASHES,
                         ids=[f"{lp}-save{s}-{c[0]}{c[1]}" for lp, s, c in CRASHES])
def test_a_crash_anywhere_in_slimes_loop_loses_no_batch(bootstrap_servers, kafka_config, namespace_factory,
                                                        group_id, tmp_path, slime_path, loop, save_interval,
                                                        crash) -> None:
    names = namespace_factory(partitions=3)
    publish_many(kafka_config, names, 40)

    def slime(crash_at=None) -> Slime:
        return Slime(slime_args(bootstrap_servers, names, group_id, tmp_path, rollstream_slime_loop=loop,
                                save_interval=save_interval), kafka_config, crash_at)

    before = slime(crash)
    assert before.run(loop)
    after = slime()
    assert not after.run(loop)
    kept = {r: b for r, b in before.trained.items() if r < after.resumed_at}  # trained into the checkpoint
    again = [b for r, b in sorted(after.trained.items())]
    if crash[0] == "train":  # killed while training k: k comes back, same ids, same order
        assert before.handed[crash[1]] in again
    for r in range(after.resumed_at, max(before.handed) + 1):  # with a checkpoint: every later rollout as it was
        if after.resumed_at:
            assert after.trained[r] == before.handed[r]
    lost = {g for b in before.handed.values() for g in b} - {g for b in [*before.trained.values(), *again] for g in b}
    assert not lost
    taken = [g for b in [*kept.values(), *again] for g in b] if after.resumed_at else [g for b in again for g in b]
    assert len(taken) == len(set(taken))  # after the checkpoint (or from scratch) no group trained twice
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()


def test_generate_rollout_feeds_slime(bootstrap_servers, kafka_config, namespace_factory, group_id,
                                      tmp_path, slime_path) -> None:
    from slime.utils.types import Sample

    names = namespace_factory(partitions=1)
    groups = [make_group(f"s{i}", versions=(3,)) for i in range(3)]
    groups.insert(1, make_group("three", rewards=(0.0, 1.0, 0.5)))  # slime expects 2 samples per prompt
    groups += [make_group(f"t{i}") for i in range(3)]
    publish(kafka_config, names, groups)
    args = slime_args(bootstrap_servers, names, group_id, tmp_path, rollout_batch_size=3, rollstream_slime_loop="sync")
    try:
        rollout = generate_rollout(args, 0, None).samples
        assert [[s.metadata["group_id"] for s in g] for g in rollout] == [["s0#0"] * 2, ["s1#0"] * 2, ["s2#0"] * 2]
        sample = rollout[0][1]
        assert isinstance(sample, Sample) and sample.status is Sample.Status.COMPLETED
        assert sample.tokens == [1, 2, 3, *groups[0].samples[1].tokens.tolist()]
        assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs) == 5
        assert sample.reward == 1.0 and sample.weight_versions == ["3"] and sample.group_index == 0
        assert committed(kafka_config, names.namespace, group_id) == {0: None}  # not trained yet
        generate_rollout(args, 1, None)  # train.py asks for the next only after training: the first is committed
        assert committed(kafka_config, names.namespace, group_id) == {0: 4}
    finally:
        close(args)
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok and report.counts["filtered"] == 1 and report.steps == (0,) and report.pending == (1,)


def test_outputs_metrics_and_weight_versions_follow_slime(bootstrap_servers, kafka_config, namespace_factory,
                                                         group_id, tmp_path, slime_path) -> None:
    from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
    from slime.utils.types import Sample

    names = namespace_factory(partitions=3)
    publish(kafka_config, names, [make_group(f"v{i}", versions=(1,)) for i in range(40)])
    sync = Slime(slime_args(bootstrap_servers, names, group_id, tmp_path, rollstream_slime_loop="sync",
                            save_interval=3, eval_interval=2, num_rollout=3), kafka_config)
    assert not sync.run("sync")
    assert sync.versions == {0: 1, 1: 2, 2: 3}  # train.py pushes weights after every step (:85)
    # A default slime config (eval function = rollout function, arguments.py:1968-1969) reaches its eval.
    assert [type(e) for e in sync.evals] == [RolloutFnEvalOutput] and sync.evals[0].data == {}
    async_dir = tmp_path / "async"
    run = Slime(slime_args(bootstrap_servers, names, f"{group_id}-async", async_dir, rollstream_slime_loop="async",
                           save_interval=2, num_rollout=4), kafka_config)
    assert not run.run("async")
    assert run.versions == {0: 1, 1: 1, 2: 2, 3: 3}  # rollout k+1 is generated before step k's update (:40, :70)
    # After a resume from checkpoint 1, slime's counter starts over (first push = 1): groups at version 1 are
    # fresh (measured against rollout ids 2 and 3 they were 1 and 2 versions behind: all skipped, take waits).
    resumed = Slime(slime_args(bootstrap_servers, names, f"{group_id}-async", async_dir, rollstream_slime_loop="async",
                               save_interval=2, num_rollout=4, rollstream_max_staleness=0), kafka_config)
    (async_dir / "rollout" / "rollstream_state_3.json").unlink()  # the last checkpoint is lost: resume from 1
    assert not resumed.run("async") and resumed.resumed_at == 2
    assert resumed.versions == {2: 1, 3: 1}
    assert resumed.trained[2] == run.handed[2] and resumed.trained[3] == run.handed[3]
    args = slime_args(bootstrap_servers, names, f"{group_id}-types", tmp_path / "t", rollstream_slime_loop="sync")
    try:
        output = generate_rollout(args, 0, None)
        assert isinstance(output, RolloutFnTrainOutput) and isinstance(output.samples[0][0], Sample)
        assert output.samples[0][0].status is Sample.Status.COMPLETED
        assert {"rollstream/step", "rollstream/lag", "rollstream/filtered", "rollstream/staleness_max",
                "rollstream/weight_version"} <= set(output.metrics)
    finally:
        close(args)
    for group in (f"{group_id}-async", f"{group_id}-types"):
        assert audit(kafka_config, names.namespace, group).ok


@pytest.mark.parametrize(("setting", "driver", "message"), [
    ("sync", "async", "set rollstream_slime_loop=async"), ("async", "sync", "set rollstream_slime_loop=sync")])
def test_calls_that_contradict_the_loop_setting_raise(bootstrap_servers, kafka_config, namespace_factory, group_id,
                                                      tmp_path, slime_path, setting, driver, message) -> None:
    names = namespace_factory(partitions=1)
    publish_many(kafka_config, names, 20)
    # A wrong setting can commit a batch too early (sync under train_async.py commits k when k+1 is asked for):
    # the first save shows the order and stops the run.
    slime = Slime(slime_args(bootstrap_servers, names, group_id, tmp_path, rollstream_slime_loop=setting,
                             save_interval=1), kafka_config, check_commits=False)
    with pytest.raises(ConfigError, match=message):
        slime.run(driver)
    assert slime.trained.keys() == {0}  # stopped at the first checkpoint
    with pytest.raises(ConfigError, match="rollstream_slime_loop"):
        generate_rollout(slime_args(bootstrap_servers, names, group_id, tmp_path, rollstream_slime_loop="fast"), 0)
    with pytest.raises(ConfigError, match="rollstream_commit is gone"):
        generate_rollout(slime_args(bootstrap_servers, names, group_id, tmp_path, rollstream_commit="next"), 0)


def test_a_replaced_slime_job_can_no_longer_commit(bootstrap_servers, kafka_config, namespace_factory, group_id,
                                                   tmp_path, slime_path) -> None:
    from rollstream.consumers.slime import SlimeRollout, SlimeSettings
    from rollstream.infra import RunSupersededError

    names = namespace_factory(partitions=1)
    publish_many(kafka_config, names, 8)
    args = slime_args(bootstrap_servers, names, group_id, tmp_path, rollstream_slime_loop="sync")
    old = SlimeRollout(args, SlimeSettings.from_args(args))
    first, _ = old.rollout(0, 2)  # the old job's run begins; its step 0 is recorded, not committed
    new = SlimeRollout(args, SlimeSettings.from_args(args))  # the scheduler restarted the job elsewhere
    again, _ = new.rollout(0, 2)  # its run begins: the same batch comes back
    assert again.group_ids == first.group_ids and again.step == first.step == 0
    with pytest.raises(RunSupersededError, match="committing step 0"):
        old.commit_through(0)  # the old job comes back and commits what it trained: refused by the broker
    with pytest.raises(RunSupersededError, match="announcing policy version 2"):
        old.rollout(1, 2)  # its next rollout announces its weight version first: refused too
    old.close()
    new.rollout(1, 2)  # the new job commits rollout 0 and goes on
    new.close()
    assert committed(kafka_config, names.namespace, group_id) == {0: 2}
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()



def test_a_resumed_slime_job_leads_the_producers_down_to_its_count(bootstrap_servers, kafka_config, namespace_factory,
                                                                   group_id, tmp_path, slime_path) -> None:
    from rollstream.consumers import replay_step
    from rollstream.infra import RunSupersededError
    from rollstream.infra.runs import followed_policy
    from rollstream.producers import RolloutProducer
    from rollstream.schemas import PolicyVersion

    from tests import plugins
    from tests.integration._kafka import count, read_records, write_prompts
    from tests.integration.test_policy_versions import running, settings, wait_for

    names = namespace_factory(partitions=2)
    producer = RolloutProducer(plugins.instant, settings(names, n_samples=2, max_lag=8, trainer_group=group_id),
                               kafka=kafka_config, reward="tests.plugins:alternating")

    def slime(crash=None, hook=None) -> Slime:
        return Slime(slime_args(bootstrap_servers, names, group_id, tmp_path, rollstream_slime_loop="sync",
                                save_interval=2), kafka_config, crash, hook=hook)

    def dead_job_comes_back(point: str, rollout_id: int) -> None:
        """The hung job wakes up while the resumed one trains: its next call, rollout 4, announces its version 5
        first, which the broker refuses, so it takes nothing. (Its commits are refused too: see
        test_a_replaced_slime_job_can_no_longer_commit.)"""
        if (point, rollout_id) in (("train", 4), ("train", 5)):
            with pytest.raises(RunSupersededError, match=f"announcing .* trainer run {dead_run} "):
                generate_rollout(dead.args, 4, dead.data_source)
            assert dead.args._rollstream_slime_rollout.last == 3  # handed nothing more

    def more_prompts(point: str, rollout_id: int) -> None:
        """Once the dead job's run began (rollout 0, generated before any run), the prompts of the later steps."""
        if (point, rollout_id) == ("train", 0):
            write_prompts(kafka_config, names, [f"q{i}" for i in range(2, 12)])

    with running(producer):
        write_prompts(kafka_config, names, ["q0", "q1"])
        dead = slime(("update", 3), hook=more_prompts)
        assert dead.run("sync", hang=True)  # trained 0..3, saved checkpoint 3, died updating weights: it hangs on
        assert dead.versions == {0: 1, 1: 2, 2: 3, 3: 4}
        wait_for(lambda: count(kafka_config, names.rollouts) == 12, "the dead run's 4 groups beyond its step 3")
        dead_run = dead.args._rollstream_slime_rollout.run.run

        resumed = slime(hook=dead_job_comes_back)  # restarted from checkpoint 3: slime counts from 1 again
        assert not resumed.run("sync") and resumed.resumed_at == 4
        assert resumed.versions == {4: 1, 5: 2}
        wait_for(lambda: producer.policy_version == 2, "the producer to follow the resumed run down to 2")
    close(dead.args)
    followed = followed_policy(kafka_config, names.control, timeout=10).policy
    assert followed is not None and (followed.run, followed.version) == (dead_run + 1, 2)
    announced = [(v.run, v.version) for _, _, v in read_records(kafka_config, names.control, PolicyVersion,
                                                                key=b"policy")]
    assert announced == [*((dead_run, v) for v in range(1, 5)), (dead_run + 1, 1), (dead_run + 1, 2)]

    # The resumed job trains only groups of its own run, at its versions; the dead run's 4 groups beyond its
    # step 3 are requeued (accounted) and generated again under the resumed run.
    trained = [g for r in (4, 5) for g in replay_step(kafka_config, names.namespace, group_id,
                                                      resumed.steps[r]).groups]
    assert [g.group_id for g in trained] == resumed.trained[4] + resumed.trained[5]
    assert all(g.policy_run == dead_run + 1 and g.attempt == 1 for g in trained), [
        (g.group_id, g.policy_run, g.attempt) for g in trained]
    assert all(s.weight_versions[0] in (1, 2) for g in trained for s in g.samples)
    requeued = [d for r in (4, 5) for d in replay_step(kafka_config, names.namespace, group_id,
                                                       resumed.steps[r]).manifest.dispositions if d.kind == "requeued"]
    assert len(requeued) == 4 and all(d.reason == f"stale: generated under trainer run {dead_run}, superseded by "
                                      f"run {dead_run + 1}" for d in requeued), requeued
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
    assert report.counts["requeued"] == 4 and report.steps == (0, 1, 2, 3, 4, 5)
