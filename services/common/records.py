"""Job records and task checks: pure logic, no NATS.

What both doors of a job (the gateway's HTTP submit and a raw ``nats pub`` on
``jobs.submit`` read by the generator) and the local path (``aikg run``, the SDK's
``Task``) need without a bus: checking a KernelBench-format task's source, building
a ``pending`` record, decoding a stored record, choosing an arch among live
workers, and the normalised hash by which identical candidates are recognised (an
evolve job's duplicates, a batch verification's). The NATS side (the checked job store, events, cancel) is
:mod:`services.common.jobs`.
"""

from __future__ import annotations

import ast
import hashlib

import msgspec

from schemas import JobRecord, JobSubmit, WorkerInfo, decode, new_id, subjects, utcnow
from services.common.pyast import parse

# Longest piece of a decoder's complaint kept in a corrupt record's error text, characters.
_FAULT_CHARS = 300


class JobRecordCorrupt(Exception):
    """A job's value in the ``jobs`` bucket does not decode as a :class:`JobRecord`.

    Written by something other than AIKG (``nats kv put``, a task's code with bus
    access, a newer or broken client) or truncated. Not a :class:`JobNotFound`: the
    job exists, its record cannot be read.

    Attributes:
        job_id: the key.
        fault: what the decoder said (``JSON is malformed: ...`` or ``Expected `str`,
            got `int` - at `$.status```), at most 300 characters.
        revision: the key's revision holding the bad value, for a compare-and-swap
            that replaces exactly that value.
    """

    def __init__(self, job_id: str, fault: str, revision: int | None = None) -> None:
        self.job_id = job_id
        self.fault = fault[:_FAULT_CHARS]
        self.revision = revision
        super().__init__(f"job record {job_id} is corrupt: {self.fault}")


def decode_record(job_id: str, value: bytes) -> JobRecord:
    """Decode a ``jobs`` bucket value, naming the job when it does not decode.

    Raises:
        JobRecordCorrupt: not JSON, or JSON that breaks the :class:`JobRecord` schema.
    """
    try:
        return decode(value, JobRecord)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise JobRecordCorrupt(job_id, str(exc) or exc.__class__.__name__) from exc


REQUIRED_TASK_NAMES = ("Model", "get_inputs", "get_init_inputs")


class TaskError(ValueError):
    """The task source is not a usable KernelBench-format task; the message says why."""


def normalised_hash(code: str) -> str:
    """sha256 (hex) of the code's AST dump: comments, blank lines and formatting do
    not count, names and constants do.

    Falls back to the raw text for code that does not parse, or nests too deep for
    the parser (:class:`SyntaxError`, :class:`ValueError` for a NUL byte,
    :class:`RecursionError`, :class:`MemoryError`): such code fails verification at
    the compile stage anyway, and equal text still hashes equal. Never raises.
    """
    try:
        text = ast.dump(parse(code), annotate_fields=False)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        text = code
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def check_task_source(task_desc: str) -> None:
    """Statically check a KernelBench-format task without running it.

    The task must parse as Python and define ``class Model``, ``get_inputs`` and
    ``get_init_inputs`` at module level (KernelBench's problem format).

    Raises:
        TaskError: syntax error (with line number) or a missing definition.
    """
    try:
        tree = parse(task_desc)
    except SyntaxError as exc:
        raise TaskError(f"task_desc is not valid Python: line {exc.lineno}: {exc.msg}") from exc
    defined = {
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    }
    defined |= {
        t.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    missing = [n for n in REQUIRED_TASK_NAMES if n not in defined]
    if missing:
        raise TaskError(
            "task_desc must define class Model, get_inputs() and get_init_inputs() "
            f"(KernelBench format); missing: {', '.join(missing)}"
        )


def new_record(submit: JobSubmit, *, job_id: str | None = None, arch: str | None = None,
               tenant: str = subjects.DEFAULT_TENANT, priority: str | None = None) -> JobRecord:
    """A ``pending`` job record for ``submit`` (id from the submit, the argument, or new),
    of ``tenant``, at ``priority`` (the submission's when None)."""
    job_id = submit.job_id or job_id or new_id("job-")
    submit.job_id = job_id
    if arch:
        submit.arch = arch
    return JobRecord(
        job_id=job_id,
        status="pending",
        job_type=submit.job_type,
        op_name=submit.op_name,
        submit_time=utcnow(),
        backend=submit.backend,
        arch=submit.arch,
        request=submit,
        tenant=tenant,
        priority=priority or submit.priority,
    )


def pick_arch(workers: list[WorkerInfo], backend: str, arch: str | None) -> str | None:
    """The arch to run on: ``arch`` when a live worker offers backend/arch, else the
    arch of the least loaded live worker of ``backend`` when ``arch`` is None; None when
    no live worker matches."""
    matching = [w for w in workers if w.backend == backend and (arch is None or w.arch == arch)]
    if not matching:
        return None
    if arch is not None:
        return arch
    best = min(matching, key=lambda w: w.in_flight / max(w.capacity, 1))
    return best.arch


def describe_pairs(workers: list[WorkerInfo]) -> list[str]:
    """Sorted ``backend/arch`` pairs with a live worker, for error messages."""
    return sorted({f"{w.backend}/{w.arch}" for w in workers})


def attempt_ids(job_id: str, attempt: int) -> tuple[str, str]:
    """Deterministic ``(candidate_id, request_id)`` of a job's attempt.

    ``<job_id>-c<n>`` / ``<job_id>-a<n>``; a job id too long for a 64-character
    subject token is shortened with a hash of it, still deterministic.
    """
    base = job_id
    if len(job_id) + 6 > 64:
        base = f"{job_id[:40]}-{hashlib.sha256(job_id.encode()).hexdigest()[:12]}"
    return f"{base}-c{attempt}", f"{base}-a{attempt}"


def request_id_of(candidate_id: str) -> str:
    """The request id :func:`attempt_ids` pairs with ``candidate_id``
    (``<base>-c<n>`` -> ``<base>-a<n>``).

    Raises:
        ValueError: ``candidate_id`` is not one :func:`attempt_ids` makes.
    """
    base, sep, number = candidate_id.rpartition("-c")
    if not sep or not number.isdigit():
        raise ValueError(f"{candidate_id!r} is not an attempt's candidate id (<job>-c<n>)")
    return f"{base}-a{number}"


def task_module_names(task_desc: str) -> list[str]:
    """Names a task's module binds by assignment at top level, in source order.

    Found with :mod:`ast`, without running the task (whose code is not trusted here):
    targets of ``=``, ``+=`` and annotated assignments, also inside top-level ``if``,
    ``try``, ``for`` and ``with`` blocks, never inside functions or classes.

    Raises:
        SyntaxError: the task is not valid Python.
    """
    names: dict[str, None] = {}

    def targets(node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            names[node.id] = None
        elif isinstance(node, ast.Tuple | ast.List):
            for element in node.elts:
                targets(element)
        elif isinstance(node, ast.Starred):
            targets(node.value)

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    targets(target)
            elif isinstance(stmt, ast.AugAssign | ast.AnnAssign):
                targets(stmt.target)
            elif isinstance(stmt, ast.For | ast.AsyncFor):
                targets(stmt.target)
            elif isinstance(stmt, ast.With | ast.AsyncWith):
                for withitem in stmt.items:
                    if withitem.optional_vars is not None:
                        targets(withitem.optional_vars)
            for field_name in ("body", "orelse", "finalbody"):
                if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    visit(getattr(stmt, field_name, []) or [])
            for handler in getattr(stmt, "handlers", []):
                visit(handler.body)

    visit(parse(task_desc).body)
    return list(names)


def unknown_shape_names(task_desc: str, overrides: dict[str, object]) -> tuple[list[str], list[str]]:
    """``(names in overrides the task does not assign at top level, names it assigns)``
    (:func:`task_module_names`): a ``shape_overrides`` name must be one of the latter.

    Raises:
        SyntaxError: the task is not valid Python.
    """
    if not overrides:
        return [], []
    defined = task_module_names(task_desc)
    return [name for name in overrides if name not in defined], defined
