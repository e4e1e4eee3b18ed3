"""rollstream.consumers.areal without a broker: the one import that is the user's whole change puts the executor into
AReaL's SPMD engines (and `uninstall` takes it out), settings come from ROLLSTREAM_* variables, and an actor with
more than one data-parallel head is refused at `initialize`, before anything is generated or taken."""

from __future__ import annotations

import importlib
import sys

import pytest

pytest.importorskip("areal", reason="AReaL is not installed (make install-areal: .venv-areal)")

import areal.infra.remote_inf_engine as remote  # noqa: E402
from areal.api.cli_args import InferenceEngineConfig  # noqa: E402
from areal.infra.workflow_executor import WorkflowExecutor  # noqa: E402
from rollstream.consumers import areal as adapter  # noqa: E402
from rollstream.schemas import RollstreamError  # noqa: E402


def test_one_import_installs_the_executor() -> None:
    sys.modules.pop("rollstream.consumers.areal_install", None)
    try:
        importlib.import_module("rollstream.consumers.areal_install")
        assert remote.WorkflowExecutor is adapter.RollstreamExecutor
    finally:
        adapter.uninstall()
    assert remote.WorkflowExecutor is WorkflowExecutor


def test_settings_come_from_the_environment() -> None:
    s = adapter.ArealSettings.of({"ROLLSTREAM_BOOTSTRAP_SERVERS": "k:9092", "ROLLSTREAM_NAMESPACE": "exp",
                                  "ROLLSTREAM_TRAINER_GROUP": "areal-trainer"})
    assert (s.bootstrap_servers, s.namespace, s.group, s.kafka_config) == ("k:9092", "exp", "areal-trainer", None)


def test_more_than_one_data_parallel_head_is_refused() -> None:
    settings = adapter.ArealSettings(bootstrap_servers="127.0.0.1:1", namespace="unit", kafka_timeout_s=1)
    ex = adapter.RollstreamExecutor(InferenceEngineConfig(consumer_batch_size=4), object(), settings=settings)
    try:
        with pytest.raises(RollstreamError, match="one data-parallel head"):
            ex.initialize(train_data_parallel_size=2)
        with pytest.raises(RollstreamError, match="initialize"):
            ex.get_capacity()  # nothing was built
    finally:
        ex.destroy()
