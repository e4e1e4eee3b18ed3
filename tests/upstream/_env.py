"""Which SGLang and vLLM the conformance tests check against, and where they are installed.

Pinned to the newest releases on the index when the engines were last read side by side with them
(`PINS`); ``ROLLSTREAM_UPSTREAM`` (e.g. ``"sglang==0.5.15 vllm==0.30.0"``, either or both) runs the same tests
against other versions: ``make test ROLLSTREAM_UPSTREAM=...`` installs them into a folder of their own.
The packages go WITHOUT their dependencies (CUDA kernels, a pinned torch) into ``build/upstream/<versions>``,
with the few pure-Python packages their type modules import (requirements.txt beside this file), and only
the conformance checks, run in subprocesses, put that folder on ``sys.path``: after the environment's own
packages, so rollstream's torch, transformers and pydantic are the ones used and nothing is installed twice
where it counts.
"""

from __future__ import annotations

import os
from pathlib import Path

PINS = {"sglang": "0.5.23", "vllm": "0.33.0"}
ENV = "ROLLSTREAM_UPSTREAM"
ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STAMP = ".installed"
FAILED = ".failed"


def versions() -> dict[str, str]:
    """The version of each package to check against: `PINS`, overridden by ``ROLLSTREAM_UPSTREAM``.

    Raises:
        ValueError: ``ROLLSTREAM_UPSTREAM`` names another package or has no ``==VERSION``.
    """
    out = dict(PINS)
    for item in os.environ.get(ENV, "").replace(",", " ").split():
        name, sep, version = item.partition("==")
        if name not in PINS or not sep or not version:
            raise ValueError(f"{ENV}={os.environ[ENV]!r}: give sglang==X and/or vllm==Y")
        out[name] = version
    return out


def target(pins: dict[str, str] | None = None) -> Path:
    """The folder the packages of `pins` (default: `versions`) are installed into."""
    pins = pins or versions()
    return ROOT / "build" / "upstream" / "_".join(f"{k}-{v}" for k, v in sorted(pins.items()))


def installed(folder: Path) -> bool:
    return (folder / STAMP).is_file()


def why_not_installed(folder: Path) -> str:
    """Why the packages are not there (for a skip's reason)."""
    failed = folder.parent / (folder.name + FAILED)
    detail = failed.read_text().strip()[-600:] if failed.is_file() else "not installed yet"
    return (f"SGLang/vLLM not installed in {folder.relative_to(ROOT)} ({detail}); `make upstream` (or "
            f"python -m tests.upstream.install) installs them from the package index")
