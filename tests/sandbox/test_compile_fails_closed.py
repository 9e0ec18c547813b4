"""The GPU compile check fails closed (rule D024, :mod:`services.worker.aot`).

Every launch of every call the verifier records is compiled for the GPU target, or
the verdict fails at ``compile`` naming the kernel, what could not be compiled and why;
a compile child that fails, dies or hits its limits is a ``compile`` failure too.
The hostile corpus (class 8) holds the candidates: a list argument, a tuple argument
hiding a ``break``, an unused ``@triton.jit`` a GPU cannot load, a kernel first
launched on the second call, one launched only at the task's own sizes. Here: the
launch signatures against Triton's own specialisation, the compile child's CPU-time
and address-space limits (both settings), and specialisations compiled once.
"""

from __future__ import annotations

import contextlib
import uuid

from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from schemas.events import VerifyRequest
from services.common.settings import load_settings
from services.common.verify_client import build_request
from services.sandbox import values
from services.sandbox.limits import child_limits_from
from services.worker import aot
from services.worker.targets import target_for
from tests.helpers import RELU_TASK


def _event(kernel: str, args: dict, grid: list[int] | None = None) -> dict:
    return {"launch": kernel, "args": args, "grid": grid or [4]}


def _tensor(dtype: str = "float32") -> dict:
    return {values.TAG: "T", "s": 0, "o": 0, "z": [4], "r": [1], "d": dtype}


def test_launch_signatures_are_tritons_own_specialisation() -> None:
    # Numbers and tuples of them: the types Triton 3.9's launcher gives (its native
    # specialisation, BaseBackend as the CUDA backend's), 1 a constexpr included.
    samples = [7, 1, 2**31 - 1, 2**31, 2**32, -2**31 - 1, 2**63, 2**40, -5, 0.5, True,
               (3, 1, (2, 1.5))]
    for sample in samples:
        encoded = values.encode(sample, lambda t: None)
        constants: list = []
        got = aot._arg_type(encoded, ("a",), constants)
        want = native_specialize_impl(BaseBackend, sample, False, True, True)[0]
        assert got == want, (sample, got, want)
    constants = []
    aot._arg_type(values.encode((3, 1, (2, 1)), lambda t: None), ("shape",), constants)
    assert constants == [(("shape", 1), 1), (("shape", 2, 1), 1)]


def test_launches_no_gpu_could_make_are_named() -> None:
    target = target_for("h100")
    launches = [
        ("trial 0", _event("k", {"x": _tensor(), "sizes": [4, 4]})),
        ("trial 1", _event("k", {"x": _tensor(), "mode": "fast"})),
        ("trial 2", _event("k", {"x": _tensor(), "n": 4}, grid=[1, 70000])),
        ("trial 3", _event("k", {"x": _tensor(), "MODE": "fast"})),
    ]
    specs, problems = aot.specs(launches, {"k": {"MODE"}}, target, "sha")
    assert problems == [
        "the Triton kernel k cannot be launched on a GPU at trial 0: argument 'sizes' is a "
        "list, which has no GPU type (Triton specialises tuples, not lists); a GPU launch "
        "raises TypeError there (pass numbers, tensors, or tuples of them)",
        "the Triton kernel k cannot be launched on a GPU at trial 1: argument 'mode' is a "
        "str, which a GPU launch passes only to a tl.constexpr parameter; a GPU launch "
        "raises TypeError there (pass numbers, tensors, or tuples of them)",
        "grid of k at trial 2 exceeds the target's limits: y=70000 (x < 2**31, y and z < "
        "65536)"]
    # The last two launches are compiled; a str for a tl.constexpr parameter is one.
    assert [s.where for s in specs] == ["trial 2", "trial 3"]
    assert dict(specs[1].signature) == {"x": "*fp32", "MODE": "constexpr"}


def test_a_specialisation_that_repeats_is_one_spec() -> None:
    # Every call's launches go to the check; the same types at other sizes are one key.
    target = target_for("h100")
    launches = [(f"trial {i}", _event("k", {"x": _tensor(), "n": n}))
                for i, n in enumerate((4096, 1000, 2**20))]
    specs, problems = aot.specs(launches, {}, target, "sha")
    assert not problems and len(specs) == 1 and specs[0].where == "trial 0"
    specs, _ = aot.specs(launches + [("trial 3", _event("k", {"x": _tensor("float16"),
                                                               "n": 1}))], {}, target, "sha")
    assert [dict(s.signature) for s in specs] == [{"x": "*fp32", "n": "i32"},
                                                   {"x": "*fp16", "n": "constexpr"}]


# A kernel whose GPU compile takes seconds of CPU (1000 unrolled steps: 3.6 s here).
_HEAVY = '''import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def heavy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    # {salt}
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    acc = tl.load(x_ptr + offs, mask=m)
    for i in tl.static_range(STEPS):
        acc = tl.maximum(acc, 0.0) + acc * 0.0
    tl.store(out_ptr + offs, acc, mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        heavy_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024,
                                                     STEPS={steps})
        return out
'''


def _request(code: str) -> VerifyRequest:
    return build_request(request_id=f"aot-{uuid.uuid4().hex[:10]}", job_id="job-aot",
                         candidate_id="cand-aot", op_name="relu", task_desc=RELU_TASK,
                         code=code, backend="cpu", arch="h100", timeout_s=120.0, trials=1)


def _candidate(steps: int) -> str:
    # A salt in the kernel's body: no compile result cached in the verifier or on disk.
    return _HEAVY.replace("{salt}", uuid.uuid4().hex).replace("{steps}", str(steps))


@contextlib.contextmanager
def _limits(verifier, **env: str):
    """The verifier's child limits from settings ``env`` while the block runs."""
    before = verifier.child_limits
    verifier.child_limits = child_limits_from(load_settings(env=env))
    try:
        yield
    finally:
        verifier.child_limits = before


async def test_a_compile_child_that_dies_fails_at_compile(shared_verifier) -> None:
    # Killed by SIGXCPU at its CPU-time limit while compiling: the candidate's
    # kernel, not the worker, is blamed, and the limit is named.
    with _limits(shared_verifier, AIKG_SANDBOX_COMPILE_CPU_S="1"):
        result = await shared_verifier.verify(_request(_candidate(1000)), device="0")
    assert not result.passed and result.stage == "compile", result
    assert "was killed by signal" in result.error and "heavy_kernel" in result.error, \
        result.error
    assert "AIKG_SANDBOX_COMPILE_CPU_S=1" in result.error, result.error


async def test_the_compile_childs_address_space_limit_applies(shared_verifier) -> None:
    # 1 MiB beyond the forked child's own: its limit is reached, and the verdict (stage
    # compile) names the setting and its value.
    limit = 1 << 20
    with _limits(shared_verifier, AIKG_SANDBOX_COMPILE_ADDRESS_SPACE_BYTES=str(limit)):
        result = await shared_verifier.verify(_request(_candidate(4)), device="0")
    assert not result.passed and result.stage == "compile", result
    assert f"AIKG_SANDBOX_COMPILE_ADDRESS_SPACE_BYTES={limit}" in result.error, result.error


async def test_the_default_limits_pass_an_honest_kernel_compiled_once(shared_verifier) -> None:
    # Three trials, the shape-generality size, the variants: one specialisation.
    request = _request(_candidate(4))
    request.trials = 3
    result = await shared_verifier.verify(request, device="0")
    assert result.passed, (result.stage, result.error)
    assert "compile: 1 kernel specialisation(s) compiled for sm_90 (h100)" in " ".join(
        result.notes), result.notes
