"""The version file of a saved weights directory: which policy version the weights in it are.

The trainer writes it beside the weights it announces on NS.control; an engine that loads a directory
reads it to know which policy version it serves. A small JSON file, ``{"version": N}``.
"""

from __future__ import annotations

import json
from pathlib import Path

VERSION_FILE = "rollstream_version.json"


def read_policy_version(model_dir: str | Path) -> int | None:
    """The version recorded in ``model_dir/VERSION_FILE``, or None when there is none, it is unreadable or
    it is not an integer. Blocks on a small file read; never raises."""
    try:
        value = json.loads((Path(model_dir) / VERSION_FILE).read_text())["version"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def write_policy_version(model_dir: str | Path, version: int) -> Path:
    """Record `version` in ``model_dir/VERSION_FILE`` and return the file's path. Blocks on a small file
    write.

    Raises:
        OSError: the file cannot be written.
    """
    path = Path(model_dir) / VERSION_FILE
    path.write_text(json.dumps({"version": int(version)}))
    return path
