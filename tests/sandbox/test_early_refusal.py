"""A static refusal decided before the sandbox starts (services/cli/watch.py) is the
verdict the verifier gives the same request: same stage, error, log and envelope,
for a torch op in forward, a syntax error and more findings than the error names, with
and without the kernel's file name (the verifier names it where a message names the
candidate's file; a static finding never does)."""

from __future__ import annotations

import msgspec
import pytest

from services.cli.watch import static_refusal
from services.common.verify_client import build_request
from tests.helpers import BUNDLED_RELU_TASK
from tests.unit.test_verify_loop import MANY_FINDINGS, TORCH_IN_FORWARD

# What differs between two runs of the same check: how long it took, and when it ended.
TIMES = ("duration_s", "phases", "finished_at")


@pytest.mark.parametrize("code", [TORCH_IN_FORWARD, "class ModelNew(:\n", MANY_FINDINGS],
                         ids=["torch-in-forward", "syntax", "many-findings"])
@pytest.mark.parametrize("source_name", [None, "kernel.py"], ids=["unnamed", "named"])
async def test_the_early_refusal_is_the_verifiers_verdict(shared_verifier, code, source_name):
    named = {"source_name": source_name} if source_name else {}
    request = build_request(task_desc=BUNDLED_RELU_TASK, code=code, op_name="relu",
                            backend="cpu", arch="x86_64", **named)
    early = static_refusal(request, worker_id=shared_verifier.worker_id, device="0",
                           interpreted=True)
    worker = await shared_verifier.verify(request, device="0")
    assert early is not None and worker.stage in ("static", "compile")
    mine, theirs = msgspec.to_builtins(early), msgspec.to_builtins(worker)
    assert set(mine["phases"]) == set(theirs["phases"])
    assert {k: v for k, v in mine.items() if k not in TIMES} == \
        {k: v for k, v in theirs.items() if k not in TIMES}
