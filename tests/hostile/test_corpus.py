"""Hostile and honest candidates as files, one per file (tests/corpus/), discovered here.

``tests/corpus/hostile/``: each file a candidate that tries to buy a passing verdict
(or has a bug that used to pass on the cpu backend), in ten classes: work outside the
recorded window (1), work the in-process instruments cannot see (2), telling the
ghost run from a real one (3), ordinary bugs (4), side effects (5), a replay that is not
what a GPU runs (6: interpreter numerics, races), a predictable harness (7: fills,
distributions, the emulation), a GPU compile check that fails open (8), a pass resting
on sizes never run (9), values computed outside the kernels (10). Each must fail
with the stage its first line names and a message naming what was found, with the
static check off (the dynamic defences alone), and the worker must serve an honest
candidate next. ``tests/corpus/honest/``: candidates that must pass, with what their
result says about shape generality.

A file's first line says what it must come to (``tests/corpus/__init__.py``). A new defence comes with the file that beat the old one.
"""

from __future__ import annotations

import uuid

import pytest

from schemas.events import VerifyRequest
from services.common.verify_client import build_request
from tests.corpus import CORPUS, TASKS, files, load
from tests.helpers import RELU_KERNEL, representatives

HOSTILE, HONEST = files("hostile"), files("honest")


def _first_of_each_class(paths: list) -> set:
    """The fast lane's hostile representatives: the first file of each class."""
    firsts: dict[int, object] = {}
    for path in paths:
        firsts.setdefault(load(path)[1]["class"], path)
    return set(firsts.values())


def request(code: str, meta: dict) -> VerifyRequest:
    return build_request(
        request_id=f"corpus-{uuid.uuid4().hex[:10]}", job_id="job-corpus",
        candidate_id="cand-corpus", op_name="op", task_desc=TASKS[meta["task"]], code=code,
        backend="cpu", arch=meta.get("arch", "x86_64"), timeout_s=120.0,
        trials=meta.get("trials", 3), shape_overrides=meta.get("shape_overrides", {}))


@pytest.fixture
def verifier(shared_verifier):
    return shared_verifier


async def serves_next(verifier) -> None:
    result = await verifier.verify(request(RELU_KERNEL, {"task": "relu", "trials": 1}),
                                   device="0")
    assert result.passed, result


def test_every_class_has_two_spellings_at_least():
    classes: dict[int, int] = {}
    for path in files("hostile"):
        _, meta = load(path)
        classes[meta["class"]] = classes.get(meta["class"], 0) + 1
    assert all(classes.get(c, 0) >= 2 for c in range(1, 11)), classes


@pytest.mark.parametrize("path", representatives(HOSTILE, _first_of_each_class(HOSTILE)),
                         ids=lambda p: p.stem)
async def test_hostile_candidate_fails(verifier, dynamic_only, path):
    code, meta = load(path)
    result = await verifier.verify(request(code, meta), device="0")
    assert not result.passed, (path.name, result)
    assert result.stage in meta["stage"], (path.name, result.stage, result.error)
    assert meta["error"] in (result.error or ""), (path.name, result.error)
    await serves_next(verifier)


@pytest.mark.parametrize("path", representatives(HONEST, [
    p for p in HONEST if p.stem in ("elementwise_relu", "tiled_matmul", "autotune_configs",
                                   "centered_mean")]),
    ids=lambda p: p.stem)
async def test_honest_candidate_passes(verifier, path):
    code, meta = load(path)
    result = await verifier.verify(request(code, meta), device="0")
    assert result.passed, (path.name, result.stage, result.error, result.log[-3000:])
    assert result.shape_generic is meta["shape_generic"], (path.name, result.notes)
    if "note" in meta:
        assert any(meta["note"] in n for n in result.notes), result.notes
    assert not result.unchecked, result.unchecked


FIXED = {
    "kernel_with_break.py": [("        if (tl.program_id(0) * 4 + step + 1) * BLOCK >= n:\n"
                              "            break\n", "")],
    "kernel_calls_numpy_helper.py": [("helper(tl.load(x_ptr + offs, mask=m))",
                                      "tl.maximum(tl.load(x_ptr + offs, mask=m), 0.0)")],
    "shared_memory_beyond_sm89.py": [("BLOCK_M=128, BLOCK_N=64, BLOCK_K=64",
                                      "BLOCK_M=32, BLOCK_N=32, BLOCK_K=32"),
                                     ("num_stages=4", "num_stages=3"),
                                     ("triton.cdiv(M, 128), triton.cdiv(N, 64)",
                                      "triton.cdiv(M, 32), triton.cdiv(N, 32)")],
}


@pytest.mark.parametrize("name", sorted(FIXED))
async def test_what_a_gpu_cannot_compile_passes_once_fixed(verifier, name):
    code, meta = load(CORPUS / "hostile" / name)
    assert meta["stage"] == ["compile"]
    for old, new in FIXED[name]:
        assert old in code
        code = code.replace(old, new)
    result = await verifier.verify(request(code, meta), device="0")
    assert result.passed, (name, result.stage, result.error)
    assert any("compiled for sm_" in n for n in result.notes), result.notes


async def test_a_trial_names_the_autotune_config_it_ran(verifier, dynamic_only):
    # Trial i replays config i: the bad second config fails trial 1, which names it.
    code, meta = load(CORPUS / "hostile" / "autotune_config_skips_work.py")
    result = await verifier.verify(request(code, {**meta, "trials": 3}), device="0")
    assert result.stage == "mismatch", result
    assert "in trial 1" in result.error and "with autotune config 1 of " in result.error, \
        result.error
