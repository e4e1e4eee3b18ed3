"""`rollstream.vllm_server` fails in bounded time with output that says why (no vLLM needed: the failures are
provoked with this interpreter, which has no vLLM, and with paths that do not exist)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from rollstream.schemas import ConfigError

from rollstream.vllm_server import VLLM_PYTHON_ENV, VLLMServer, VLLMServerError, vllm_python


def _model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_a_server_that_exits_while_starting_raises_with_the_end_of_its_log(tmp_path: Path) -> None:
    server = VLLMServer(_model_dir(tmp_path), python=sys.executable, log_path=tmp_path / "server.log",
                        startup_timeout_s=60)
    started = time.monotonic()
    with pytest.raises(VLLMServerError, match=r"exited with code 1 while starting(.|\n)*No module named") as err:
        server.start()
    assert time.monotonic() - started < 30 and str(tmp_path / "server.log") in str(err.value)
    assert not server.running


def test_a_server_that_never_serves_is_stopped_after_the_startup_timeout(tmp_path: Path) -> None:
    sleeper = tmp_path / "python"  # an "interpreter" that ignores its arguments and never serves
    sleeper.write_text("#!/bin/sh\necho loading weights\nexec sleep 60\n")
    sleeper.chmod(0o755)
    server = VLLMServer(_model_dir(tmp_path), python=sleeper, log_path=tmp_path / "server.log", startup_timeout_s=1.5)
    with pytest.raises(VLLMServerError, match=r"did not serve within 2 s(.|\n)*loading weights"):
        server.start()
    assert not server.running


def test_missing_environment_and_model_are_config_errors_naming_the_fix(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    with pytest.raises(ConfigError, match=VLLM_PYTHON_ENV):
        vllm_python()
    with pytest.raises(ConfigError, match="no config.json"):
        VLLMServer(tmp_path / "empty", python=sys.executable).start()
