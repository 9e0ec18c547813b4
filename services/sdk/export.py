"""Write the gateway's kernel rows to JSON Lines or Parquet, resumably.

:func:`export_kernels` pages through ``GET /api/v1/kernels`` with an
:class:`~services.sdk.client.AIKGClient` and writes every row
(:class:`schemas.KernelRow`, one JSON object a line, or one Parquet row with the
columns of :func:`parquet_schema`). Beside the output it keeps ``<output>.cursor``:
the gateway's cursor after the last row written and the filters used, written once
the rows it covers are in the file. ``resume=True`` starts from there: a JSON Lines
file is appended to, a Parquet file rewritten with its old rows followed by the new
ones (Parquet files cannot be appended to; the rewrite goes to a temporary file
that replaces the old one). A run cut short between a page and its cursor repeats
that page on resume; rows carry ``job_id``, which tells the repeat apart.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import msgspec

from schemas import KernelRow

FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}


@dataclass
class ExportSummary:
    """What :func:`export_kernels` did: ``rows`` written now, the ``cursor`` to resume
    from, the output ``path`` and its ``format``."""

    rows: int
    cursor: str | None
    path: Path
    format: str


def output_format(path: Path) -> str:
    """``jsonl`` or ``parquet``, from the file name's suffix.

    Raises:
        ValueError: any other suffix.
    """
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"{path}: the output's name must end in .jsonl (JSON Lines) or "
                         ".parquet (Parquet), which picks the format")
    return fmt


def cursor_path(path: Path) -> Path:
    """Where the resume cursor of ``path`` is kept: ``<path>.cursor``."""
    return path.with_name(path.name + ".cursor")


def parquet_schema() -> Any:
    """The Parquet (Arrow) schema of a :class:`KernelRow`: strings, int64, float64,
    bool, and timestamps in microseconds UTC; every column nullable."""
    import pyarrow as pa

    def arrow(tp: Any) -> Any:
        args = [a for a in get_args(tp) if a is not type(None)]
        base = args[0] if args else tp
        if base is bool:
            return pa.bool_()
        if base is int:
            return pa.int64()
        if base is float:
            return pa.float64()
        if base is dt.datetime:
            return pa.timestamp("us", tz="UTC")
        return pa.string()  # str and Literal[...] of strings

    return pa.schema([pa.field(f.name, arrow(f.type))
                      for f in msgspec.structs.fields(KernelRow)])


def _read_cursor(path: Path, filters: dict[str, Any]) -> str | None:
    state_file = cursor_path(path)
    if not state_file.is_file():
        raise ValueError(f"nothing to resume: {state_file} does not exist (export without "
                         "--resume first, or pass --cursor)")
    try:
        state = json.loads(state_file.read_text())
        cursor = state["cursor"]
        saved = state["filters"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{state_file} is not a cursor file of aikg export ({exc}); "
                         "remove it and export again without --resume") from None
    if saved != filters:
        raise ValueError(f"{path} was exported with filters {saved}, not {filters}: resume "
                         "with the same filters, or write another file")
    return cursor


def _write_cursor(path: Path, cursor: str | None, filters: dict[str, Any]) -> None:
    state = cursor_path(path)
    tmp = state.with_name(state.name + ".tmp")
    tmp.write_text(json.dumps({"cursor": cursor, "filters": filters}) + "\n")
    os.replace(tmp, state)


def read_kernels(path: Path) -> list[dict[str, Any]]:
    """The rows of an exported file as dicts (datetimes as aware ``datetime``)."""
    path = Path(path)
    if output_format(path) == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with path.open("rb") as f:
        return [msgspec.structs.asdict(msgspec.json.decode(line, type=KernelRow))
                for line in f if line.strip()]


def _write_parquet(path: Path, rows: list[KernelRow], append: bool) -> None:
    """Write ``rows`` (after the file's own when ``append``) to a temporary file that
    then replaces ``path``.

    The file gets the mode a JSON Lines export gets: an existing file's own, else
    ``0o666`` less the umask (``tempfile`` would make it ``0o600``).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = parquet_schema()
    table = pa.Table.from_pylist([msgspec.structs.asdict(r) for r in rows], schema=schema)
    if append and path.exists():
        table = pa.concat_tables([pq.read_table(path, schema=schema), table])
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(6)}.tmp")
    # O_EXCL: a fresh file of ours; 0o666 as open() creates one, the umask applied.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            pq.write_table(table, f)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def export_kernels(client: Any, path: Path, *, passed: bool | None = True,
                   op_name: str | None = None, backend: str | None = None,
                   arch: str | None = None, cursor: str | None = None,
                   resume: bool = False, page_size: int = 200) -> ExportSummary:
    """Write the kernels the gateway lists to ``path`` (``.jsonl`` or ``.parquet``).

    Args:
        client: an :class:`~services.sdk.client.AIKGClient`.
        passed / op_name / backend / arch: the route's filters (``passed=True``: the
            verified kernels only; None: every job's kernel).
        cursor: start after this cursor (a ``next_cursor``, or what an earlier export
            printed); the file is started afresh.
        resume: start from ``<path>.cursor`` and add to the file (exclusive with
            ``cursor``).
        page_size: rows per request (1 to 500).

    Raises:
        ValueError: a bad suffix, ``cursor`` with ``resume``, nothing to resume, or
            other filters than the file was written with.
        services.sdk.client.AIKGError: the gateway refused or could not be reached;
            rows written before stay, with their cursor.
    """
    path = Path(path)
    fmt = output_format(path)
    filters = {"passed": passed, "op_name": op_name, "backend": backend, "arch": arch}
    if resume and cursor is not None:
        raise ValueError("give either a cursor or resume (which reads it from "
                         f"{cursor_path(path).name}), not both")
    if resume:
        cursor = _read_cursor(path, filters)
    written: list[KernelRow] = []
    if not resume:
        # A fresh file, even when no kernel matches.
        if fmt == "jsonl":
            path.write_bytes(b"")
        else:
            _write_parquet(path, [], append=False)
        cursor_path(path).unlink(missing_ok=True)
    encoder = msgspec.json.Encoder()
    count = 0
    for page in client.iter_kernel_pages(passed=passed, op_name=op_name, backend=backend,
                                         arch=arch, cursor=cursor, limit=page_size):
        rows = msgspec.convert(page["kernels"], list[KernelRow], strict=False)
        cursor = page.get("next_cursor") or cursor
        count += len(rows)
        if fmt == "jsonl":
            # Each page and then its cursor: an interrupted export resumes from there.
            if rows:
                with path.open("ab") as f:
                    f.write(b"".join(encoder.encode(r) + b"\n" for r in rows))
            _write_cursor(path, cursor, filters)
        else:
            written.extend(rows)
    if fmt == "parquet":
        # One rewrite for the whole run (a Parquet file cannot be appended to).
        if written:
            _write_parquet(path, written, append=True)
        _write_cursor(path, cursor, filters)
    return ExportSummary(rows=count, cursor=cursor, path=path, format=fmt)
