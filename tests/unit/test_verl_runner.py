"""The seams `rollstream.consumers._verl_runner` uses in verl 0.9.1, pinned: a verl upgrade that moves them
fails here, not in a training run. Also the hooks' order (commit after training, position file before verl
marks a checkpoint complete) and `VerlSettings`."""

from __future__ import annotations

import asyncio
import inspect
import json
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'rollstream[verl]')")

from rollstream.consumers import _verl_runner as runner  # noqa: E402
from rollstream.consumers.verl import POSITION_FILE, VerlSettings, VerlTrainerQueue, staleness_limit  # noqa: E402
from rollstream.schemas import ConfigError  # noqa: E402
from verl.experimental.fully_async_policy import fully_async_main  # noqa: E402
from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer  # noqa: E402

UPSTREAM = FullyAsyncTrainer.__ray_actor_class__


def source(obj) -> str:
    return inspect.getsource(obj)


def test_upstream_seams() -> None:
    fit_step = source(UPSTREAM.fit_step)
    order = [fit_step.index(call) for call in ("self._fit_generate(", "self._fit_update_actor(",
                                               "self._fit_update_weights(", "self._fit_save_checkpoint(")]
    assert order == sorted(order)  # trained, then weights, then checkpoint: the commit point is after training
    take = source(UPSTREAM._get_samples_from_queue)
    assert "self.message_queue_client.get_sample()" in take and "ray.cloudpickle.loads" in take
    init = source(fully_async_main.FullyAsyncTaskRunner.__ray_actor_class__._initialize_components)
    assert (init.index("set_message_queue_client") < init.index("load_checkpoint")
            < init.index("_fit_update_weights"))
    for method in ("_create_trainer", "_create_rollouter"):  # what _TaskRunner follows with the class swapped
        upstream = source(getattr(fully_async_main.FullyAsyncTaskRunner.__ray_actor_class__, method))
        assert ("FullyAsyncTrainer.remote(" if method == "_create_trainer" else "FullyAsyncRollouter.remote(") \
            in upstream
        assert "init_workers.remote()" in upstream
    sync = source(UPSTREAM._fit_update_weights)  # the run is handed over where verl resets the rollouter's staleness
    assert "self.rollouter.reset_staleness.remote()" in sync and "if self.local_trigger_step != 1" in sync
    assert "self.local_trigger_step = 1" in source(UPSTREAM.__init__)  # so the sync before fit is a real one
    assert "self.staleness_threshold" in source(UPSTREAM.__init__)
    save = source(UPSTREAM._save_checkpoint)
    assert 'f"global_step_{self.current_param_version}"' in save and "latest_checkpointed_iteration.txt" in save


class FakeQueue:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def commit_trained(self) -> int:
        self.calls.append("commit")
        return 0

    def metrics(self) -> dict:
        return {"rollstream/commit_s": 0.01}

    def save_position(self, folder) -> None:
        self.calls.append(("save", str(folder)))


def test_hooks_commit_after_training_and_save_before_verl(monkeypatch, tmp_path) -> None:
    calls: list = []
    monkeypatch.setattr(UPSTREAM, "_fit_update_actor", lambda self, batch: calls.append("train") or batch)
    monkeypatch.setattr(UPSTREAM, "_save_checkpoint", lambda self: calls.append("verl saves"))
    trainer = runner._Trainer.__new__(runner._Trainer)
    trainer.message_queue_client, trainer.metrics, trainer.current_param_version = FakeQueue(calls), {}, 4
    trainer.config = SimpleNamespace(trainer=SimpleNamespace(default_local_dir=str(tmp_path)))
    assert trainer._fit_update_actor("batch") == "batch"
    trainer._save_checkpoint()
    assert calls == ["train", "commit", ("save", str(tmp_path / "global_step_4")), "verl saves"]
    assert trainer.metrics == {"rollstream/commit_s": 0.01}


def test_each_weight_sync_announces_and_hands_the_run_to_the_rollouter(monkeypatch) -> None:
    calls: list = []

    async def synced(self) -> dict:
        calls.append("verl syncs")
        return {}

    def serve_run(run: int) -> object:
        calls.append(("rollouter serves run", run))
        done: Future = Future()
        done.set_result(None)
        return SimpleNamespace(future=lambda: done)

    class Announcing:
        def announce(self, version: int) -> int:
            calls.append(("announce", version))
            return 7

    monkeypatch.setattr(UPSTREAM, "_fit_update_weights", synced)
    trainer = runner._Trainer.__new__(runner._Trainer)
    trainer.message_queue_client, trainer.current_param_version = Announcing(), 3
    trainer.rollouter = SimpleNamespace(serve_run=SimpleNamespace(remote=serve_run))
    assert asyncio.run(trainer._fit_update_weights()) == {}
    assert calls == ["verl syncs", ("announce", 3), ("rollouter serves run", 7)]


def test_max_staleness_follows_verls_staleness_threshold() -> None:
    assert [staleness_limit(s) for s in (0, 0.1, 0.5, 1, 1.5, 3)] == [1, 2, 2, 2, 3, 4]
    derived = VerlTrainerQueue(VerlSettings(), groups_per_step=2, group_size=4, staleness_threshold=1.5)
    assert derived.max_staleness == derived.consumer.max_staleness == 3
    assert VerlTrainerQueue(VerlSettings(), groups_per_step=2, group_size=4).max_staleness == 2  # verl's 0.1
    given = VerlTrainerQueue(VerlSettings(max_staleness=0), groups_per_step=2, group_size=4, staleness_threshold=1)
    assert given.consumer.max_staleness == 0
    with pytest.raises(ConfigError, match="staleness_threshold=-1"):
        staleness_limit(-1)
    for queue in (derived, given):
        queue.close()


def test_settings(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ROLLSTREAM_NAMESPACE", "from-env")
    s = VerlSettings.of({"group": "g", "max_staleness": 2})
    assert (s.namespace, s.group, s.max_staleness, s.dynamic_sampling) == ("from-env", "g", 2, False)
    with pytest.raises(ConfigError, match="take_timeout"):
        VerlSettings.of({"take_timeout": 3})
    with pytest.raises(ConfigError, match="max_staleness"):
        VerlSettings.of({"max_staleness": -1})
    assert POSITION_FILE == "rollstream.json" and json.dumps({"step": None})
