"""The corpus of candidates as files: ``hostile/`` and ``honest/`` (one candidate per
file) and the tasks they are verified against (``tasks/``; other tests' jobs read their
tasks from there too, through ``tests/helpers.py``).

Read by ``tests/hostile/test_corpus.py`` (the cpu backend) and by ``bench/gpu_check.py``
(part ``corpus``, on a GPU), so it imports nothing but the standard library.

A candidate's first line is ``# corpus: {json}``: ``task`` (a key of :data:`TASKS`),
``class``, ``stage`` (allowed stages), ``error`` (a substring of the error),
``shape_overrides``, ``trials``, ``arch``, ``shape_generic``, ``note`` (a substring of
a note).
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = Path(__file__).resolve().parent

TASKS = {p.stem: p.read_text() for p in sorted((CORPUS / "tasks").glob("*.py"))}
# The task's own sizes (64 MiB of inputs) are far beyond the cpu worker's check budget:
# checked at shape_overrides, dry-run at its own sizes.
TASKS["big_relu"] = TASKS["relu"].replace("batch_size = 16", "batch_size = 4096").replace(
    "dim = 1024", "dim = 4096")


def load(path: Path) -> tuple[str, dict]:
    """A corpus file's source and its ``# corpus:`` fields.

    Raises:
        ValueError: the first line is not ``# corpus: {json}``.
    """
    code = path.read_text()
    first = code.splitlines()[0] if code else ""
    if not first.startswith("# corpus: "):
        raise ValueError(f"{path.name}: no '# corpus:' first line")
    return code, json.loads(first.removeprefix("# corpus: "))


def files(kind: str) -> list[Path]:
    """The candidates of ``kind`` (``hostile`` or ``honest``), by name."""
    return sorted((CORPUS / kind).glob("*.py"))
