"""Child process of :func:`services.sdk.task.lower_in_child`: run the built-in coder.

Reads ``{"task_desc": ..., "shape_overrides": {...}}`` (JSON) on stdin and writes
``{"code": ..., "error": ...}`` on its original stdout; anything the task's own code
prints goes to stderr, so it cannot corrupt the answer. A fresh interpreter rather than
a multiprocessing child: a user's script need not guard its ``__main__``.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    request = json.load(sys.stdin)
    from services.generator.coders.builtin import LoweringError, lower_task

    try:
        reply = {"code": lower_task(request["task_desc"], request.get("shape_overrides") or {}),
                 "error": None}
    except LoweringError as exc:
        reply = {"code": None, "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the task's own code may raise anything
        reply = {"code": None, "error": f"built-in coder failed: {type(exc).__name__}: {exc}"}
    answer.write(json.dumps(reply))
    answer.flush()


if __name__ == "__main__":
    main()
