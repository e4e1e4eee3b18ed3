"""One real vLLM server per test session (vLLM's CPU build from ``make install-vllm``), on a tiny local model.

The model is `build_tiny_model`'s character-level Llama at the smallest head size vLLM's CPU attention
supports (`MIN_HEAD_SIZE` = 32: hidden 64, 2 heads), so the server starts and generates fast on 2 cores.
Without vLLM's environment the tests that need the server skip, saying how to install it, except under
``ROLLSTREAM_REQUIRE_VLLM=1`` (`make test` sets it): there a missing environment fails them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from rollstream.producers.engines.tiny_model import build_tiny_model
from rollstream.schemas import ConfigError

from rollstream.vllm_server import MIN_HEAD_SIZE, VLLMServer, vllm_python

REQUIRE_ENV = "ROLLSTREAM_REQUIRE_VLLM"
HEADS = 2


@dataclass
class RealVLLM:
    """The session's server and the model directory it serves (which is also the producers' tokenizer)."""

    server: VLLMServer
    model_dir: Path

    @property
    def url(self) -> str:
        return self.server.url

    def post(self, path: str, body: dict | None = None, timeout_s: float = 60.0) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=timeout_s)

    def get(self, path: str, timeout_s: float = 30.0) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=timeout_s)

    def generated_tokens(self) -> float:
        """The server's count of tokens generated so far (``vllm:generation_tokens_total``, counted as they are)."""
        metrics = self.get("/metrics")
        metrics.raise_for_status()
        return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.text.splitlines()
                   if line.startswith("vllm:generation_tokens_total"))

    def signal_engine_core(self, sig: signal.Signals) -> None:
        """Send `sig` to the server's engine core process(es) (its process group but the API server).

        SIGSTOP freezes generation at once, whatever the server's load, while its API server answers on; a
        utility call sent meanwhile (``/pause``) is acted on right after SIGCONT, before many more steps."""
        for pid in self._engine_cores():
            os.kill(pid, sig)

    def _engine_cores(self) -> list[int]:
        leader = self.server.pid
        assert leader is not None, "the vLLM server is not running"
        members = [int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != leader and _pgid(int(d)) == leader]
        cores = [pid for pid in members if "EngineCore" in _cmdline(pid)]
        assert cores, f"no engine core process in the vLLM server's process group {leader}: {members}"
        return cores

    @contextmanager
    def engine_throttled(self, running_s: float = 0.02, stopped_s: float = 0.18) -> Iterator[None]:
        """Let the engine core run `running_s` of every `running_s + stopped_s` seconds while the block runs; it
        is left STOPPED when the block ends, however it ends: the caller sends SIGCONT (in a ``finally``).

        On 2 cores the tiny model generates faster than the API server turns its outputs into a stream: four
        1,800-token samples are generated in about a second and reach the client in one burst 3-7 s later (vLLM
        merges the outputs a stream has not taken yet), so a client sees no sample part way. Run a tenth of the
        time, the core lets the API server stream every few tokens as they come (15-50 chunks a second, measured),
        as a GPU server streams a real model's."""
        cores = self._engine_cores()
        # its own process: a thread of the test's process missed its SIGSTOP by 4.2 s here, and the core then
        # generated everything unthrottled (processes of their own have stalled as long on 2 cores: callers retry)
        cycling = subprocess.Popen([sys.executable, "-c", _THROTTLE, str(running_s), str(stopped_s), *map(str, cores)])
        try:
            yield
        finally:
            cycling.kill()
            cycling.wait()
            for pid in cores:
                os.kill(pid, signal.SIGSTOP)

    def ensure_running(self) -> None:
        """Start the server again if a test killed it, and make sure it is not left paused."""
        if not self.server.running:
            self.server.start()
        self.post("/resume").raise_for_status()


_THROTTLE = """
import os, signal, sys, time
running_s, stopped_s, cores = float(sys.argv[1]), float(sys.argv[2]), [int(p) for p in sys.argv[3:]]
while True:
    for sig, pause_s in ((signal.SIGCONT, running_s), (signal.SIGSTOP, stopped_s)):
        for pid in cores:
            os.kill(pid, sig)
        time.sleep(pause_s)
"""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def build_model(out_dir: Path, seed: int = 0) -> Path:
    return build_tiny_model(out_dir, hidden_size=MIN_HEAD_SIZE * HEADS, layers=2, heads=HEADS, seed=seed)


def require_vllm() -> None:
    """Skip the calling test without vLLM's environment, or fail it under ``ROLLSTREAM_REQUIRE_VLLM=1``."""
    try:
        vllm_python()
    except ConfigError as exc:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {exc}")
        pytest.skip(str(exc))


def real_vllm_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealVLLM]:
    require_vllm()
    root = tmp_path_factory.mktemp("vllm")
    model_dir = build_model(root / "model")
    server = VLLMServer(model_dir, log_path=root / "server.log", max_model_len=2048, startup_timeout_s=300.0,
                        extra_args=("--logprobs-mode", "processed_logprobs"))
    with server:
        yield RealVLLM(server, model_dir)
