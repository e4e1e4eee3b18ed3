"""docs/wire-format.md cannot drift from the code: its fingerprint table is `default_codec().fingerprints()`,
and it names every field of every current schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rollstream.schemas import default_codec
from rollstream.schemas.codec import SCHEMA_DIR

DOC = Path(__file__).resolve().parents[2] / "docs" / "wire-format.md"
_ROW = re.compile(r"^\| `([\w/.]+\.avsc)` \| `([0-9a-f]{16})` \|$", re.MULTILINE)


def test_the_documented_fingerprints_are_the_codecs() -> None:
    documented = {fp: file for file, fp in _ROW.findall(DOC.read_text())}
    assert documented == default_codec().fingerprints(), (
        "docs/wire-format.md's fingerprint table is stale: regenerate its rows with "
        "`python -c 'from schemas import default_codec; "
        "[print(f\"| `{f}` | `{fp}` |\") for fp, f in default_codec().fingerprints().items()]'`")


def test_the_doc_names_every_field_of_every_current_schema() -> None:
    text = DOC.read_text()
    missing = {path.name: [f["name"] for f in json.loads(path.read_text())["fields"] if f"`{f['name']}`" not in text]
               for path in sorted(SCHEMA_DIR.glob("*.avsc"))}
    assert not {name: fields for name, fields in missing.items() if fields}, "fields docs/wire-format.md omits"
