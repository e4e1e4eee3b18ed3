"""The README's quickstart, run as a reader runs it: its `toy.py` saved as written, each of its shell lines run
in that folder against the test session's broker (the `rollstream broker` lines are left out: the session has
one), in a fresh namespace (ROLLSTREAM_NAMESPACE, which every command reads). What the comments promise is
checked: `take` prints exactly 3 groups, the audit passes, `replay --step 0` gives the same 3 groups back."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.docs._markdown import ROOT, Block, code_blocks

pytestmark = pytest.mark.integration
_COMMENT = re.compile(r"\s+#\s.*$")
_TIMEOUT_S = 120


def _quickstart() -> tuple[Block, list[str]]:
    """The quickstart's python block (toy.py) and its shell lines, comments dropped."""
    text = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = text.index("## Quickstart") + 1
    end = next((i for i in range(start, len(text)) if text[i].startswith("## ")), len(text)) + 1
    blocks = [b for b in code_blocks(ROOT / "README.md") if start < b.line < end]
    python = [b for b in blocks if b.language == "python"]
    shell = [b for b in blocks if b.language == "bash"]
    assert len(python) == 1 and len(shell) == 1, "the quickstart has one python block (toy.py) and one bash block"
    lines = [_COMMENT.sub("", line).strip() for line in shell[0].source.splitlines()]
    return python[0], [line for line in lines if line]


def _run(line: str, cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=_TIMEOUT_S, check=False)
    assert done.returncode == 0, f"README quickstart line failed ({done.returncode}): {line}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_readme_quickstart_runs(bootstrap_servers: str, tmp_path: Path) -> None:
    toy, lines = _quickstart()
    (tmp_path / "toy.py").write_text(toy.source, encoding="utf-8")
    env = {**os.environ, "ROLLSTREAM_BOOTSTRAP_SERVERS": bootstrap_servers,
           "ROLLSTREAM_NAMESPACE": f"quickstart-{uuid.uuid4().hex[:8]}",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = [line for line in lines if not line.startswith("rollstream broker")]
    out = {line.split()[1] if line.startswith("rollstream ") else line: _run(line, tmp_path, env) for line in run}
    taken = [json.loads(row)["group_id"] for row in out["take"].splitlines() if row.startswith("{")]
    replayed = [json.loads(row)["group_id"] for row in out["replay"].splitlines() if row.startswith("{")]
    assert len(taken) == 3 and sorted(replayed) == sorted(taken), (out["take"], out["replay"])
    assert "OK: every committed offset is accounted for exactly once" in out["audit"], out["audit"]
