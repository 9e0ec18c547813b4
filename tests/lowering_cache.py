"""Each task lowered once per test session, whichever test (or xdist worker) asks first.

Lowering is mostly ``torch.export`` (0.5-3.5 CPU-s a task on 2 cores), and the same
task is lowered by its schedule's test, by the ahead-of-time sm_90 compile of every
lowered kernel (``tests/sandbox/test_gpu_compile.py``, in a process of its own) and by
tests that check one candidate several ways. :func:`lowered` keeps each source in
:data:`ROOT` (set by ``tests/conftest.py`` to a directory of this session's shared by
its xdist workers), under the SHA-256 of the arguments; a :class:`LoweringError` is
raised again each time, never kept. A test that needs a fresh lowering (its progress
reports, say) calls ``lower_task`` directly.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from services.generator.lowering import lower_task

# This session's store; None (no conftest, e.g. a script): lower every time.
ROOT: Path | None = None


def lowered(task_src: str, shape_overrides: dict[str, Any] | None = None,
            root: Path | None = None, **params: Any) -> str:
    """``lower_task(task_src, shape_overrides, **params)``, read from ``root`` (default
    :data:`ROOT`) when a test of this session lowered the same arguments before.

    Raises:
        LoweringError: as ``lower_task`` does.
    """
    root = ROOT if root is None else root
    if root is None:
        return lower_task(task_src, shape_overrides, **params)
    key = json.dumps([task_src, shape_overrides, params], sort_keys=True, default=repr)
    path = Path(root) / f"{hashlib.sha256(key.encode()).hexdigest()}.py"
    try:
        return path.read_text()
    except FileNotFoundError:
        pass
    source = lower_task(task_src, shape_overrides, **params)
    partial = path.with_name(f"{path.name}.{os.getpid()}.part")
    partial.write_text(source)
    os.replace(partial, path)  # atomic: another worker reads all of it or none
    return source
