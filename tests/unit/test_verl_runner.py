"""The seams `rollstream.consumers._verl_runner` uses in verl 0.9.1, pinned: a verl upgrade that moves them
fails here, not in a training run. Also the hooks' order (commit after training, position file before verl
marks a checkpoint complete) and `VerlSettings`."""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'rollstream[verl]')")

from rollstream.consumers import _verl_runner as runner  # noqa: E402
from rollstream.consumers.verl import POSITION_FILE, VerlSettings  # noqa: E402
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


def test_settings(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ROLLSTREAM_NAMESPACE", "from-env")
    s = VerlSettings.of({"group": "g", "max_staleness": 2})
    assert (s.namespace, s.group, s.max_staleness, s.dynamic_sampling) == ("from-env", "g", 2, False)
    with pytest.raises(ConfigError, match="take_timeout"):
        VerlSettings.of({"take_timeout": 3})
    with pytest.raises(ConfigError, match="max_staleness"):
        VerlSettings.of({"max_staleness": -1})
    assert POSITION_FILE == "rollstream.json" and json.dumps({"step": None})
