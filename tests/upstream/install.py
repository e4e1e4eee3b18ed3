"""Install the SGLang and vLLM the conformance tests check against (``python -m tests.upstream.install``).

Into ``build/upstream/<versions>`` (see `_env`), once: the two wheels without their dependencies, then the
pure-Python packages of requirements.txt, also without theirs. A machine that cannot install them (no index,
no wheel for this Python) records why and exits 0: the conformance tests then skip, naming the reason.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

from tests.upstream._env import FAILED, HERE, STAMP, installed, target, versions

_TIMEOUT_S = 1200  # a slow index must not hang `make test`: the tests then skip, saying so


def main() -> int:
    pins = versions()
    folder = target(pins)
    if installed(folder):
        return 0
    failed = folder.parent / (folder.name + FAILED)
    staging = folder.parent / (folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--target", str(staging)]
    steps = [[*pip, *(f"{k}=={v}" for k, v in sorted(pins.items()))], [*pip, "-r", str(HERE / "requirements.txt")]]
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=_TIMEOUT_S)
            problem = "" if done.returncode == 0 else f"pip failed: {(done.stderr or done.stdout).strip()[-2000:]}"
        except subprocess.TimeoutExpired:
            problem = f"pip took longer than {_TIMEOUT_S} s"
        if problem:
            failed.write_text(problem)
            shutil.rmtree(staging, ignore_errors=True)
            print(f"upstream packages not installed ({failed}); the conformance tests will skip", file=sys.stderr)
            return 0
    (staging / STAMP).write_text(" ".join(f"{k}=={v}" for k, v in sorted(pins.items())) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    failed.unlink(missing_ok=True)
    print(f"installed {', '.join(f'{k} {v}' for k, v in sorted(pins.items()))} into {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
