"""The one failure of a built-in coder lowering, wherever it is met.

Raised inside the sandboxed lowering child by the lowering itself (this package: an
operator with no lowering, a task that does not run), and in the parent by :func:`services.generator.coders.lowering_role.lower_in_sandbox`
when that child failed, hit a limit, outlived its timeout or answered badly. A coder
turns it into :class:`services.generator.coders.base.CoderError` (a coder's failure,
LLM or built-in), whose message adds what the user can do next.

This module imports nothing (no torch), so the generator and the SDK, which never run
the lowering themselves, can catch the error without loading it.
"""

from __future__ import annotations


class LoweringError(Exception):
    """The task cannot be lowered by the built-in coder; the message says why.

    Attributes:
        op: The core-ATen operator that has no lowering (e.g. ``"aten.mm.default"``),
            or a short reason tag: ``"task"`` (the source does not run or lacks
            ``Model``/``get_inputs``/``get_init_inputs``), ``"export"`` (torch.export
            failed), ``"inputs"``, ``"outputs"``, ``"dtype"``, ``"shape"``; met in the
            parent: ``"child"`` (the child's own report, message as it said),
            ``"crash"`` (the child died), ``"timeout"``, ``"protocol"`` (a bad answer).
    """

    def __init__(self, op: str, message: str) -> None:
        super().__init__(message)
        self.op = op
