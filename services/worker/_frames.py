"""The file of the frame that called into an in-child instrument.

Apart from :mod:`services.worker._guard` on purpose: its audit hook refuses
``sys._getframe`` when the nearest frame outside ``_guard.py`` and the standard library
is the candidate's. A host-read wrapper (``_guard.guard_host_reads``) is called
straight from candidate code, so its own frame lookup would be refused; made from this
module, the lookup is the harness's (a library frame), as it is for the op recorder,
which torch calls through frames of its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def caller_file(depth: int, skip: Callable[[str], bool]) -> str:
    """File name of the nearest frame, ``depth`` frames above the caller of this
    function and up, whose file ``skip`` does not pass over; '' when there is none."""
    frame = sys._getframe(depth + 1)
    while frame is not None and skip(frame.f_code.co_filename):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else ""
