"""``rollstream produce`` run with its `RolloutProducer` replaced by a recorder: what the flags built."""

from __future__ import annotations

from typing import Any

import pytest
from rollstream.producers import ProducerSettings
from typer.testing import CliRunner

from rollstream.cli import app


def produce_builds(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[Any, ProducerSettings]:
    """(the engine, the settings) ``rollstream produce ARGS --bootstrap-servers 127.0.0.1:1`` gives the
    producer; nothing is started. Fails the test when the command fails."""
    seen: dict[str, Any] = {}

    class Recorder:
        def __init__(self, engine: Any, settings: ProducerSettings, **kwargs: Any) -> None:
            seen.update(engine=engine, settings=settings)

        def run_sync(self, **kwargs: Any) -> None:
            pass

    monkeypatch.setattr("rollstream.cli._produce.RolloutProducer", Recorder)
    result = CliRunner().invoke(app, ["produce", *args, "--bootstrap-servers", "127.0.0.1:1"])
    assert result.exit_code == 0, result.output
    return seen["engine"], seen["settings"]
