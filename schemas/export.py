"""Export JSON Schema for every wire record, for clients not written in Python.

``aikg schema`` writes ``schemas/json/<Record>.json``; a test checks the committed
files match the records.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from schemas.events import ALL_RECORDS

JSON_DIR = Path(__file__).resolve().parent / "json"


def schema_documents() -> dict[str, str]:
    """``{"JobSubmit.json": "<pretty JSON Schema>", ...}`` for every record."""
    docs = {}
    for record in ALL_RECORDS:
        schema = msgspec.json.schema(record)
        docs[f"{record.__name__}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return docs


def export_json_schemas(out_dir: Path = JSON_DIR) -> list[Path]:
    """Write every record's schema into ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in schema_documents().items():
        path = out_dir / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
