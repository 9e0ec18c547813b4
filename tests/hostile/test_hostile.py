"""Hostile candidates: each gets the right stage, and the same Verifier keeps serving.

Candidates that would be stopped by the static checks are tested twice where it
matters: once as written (stage ``static``), once with the static check turned off
(fixture ``no_static_check``) and the forbidden module reached through
``getattr(torch, "o" + "s")`` (torch's module namespace holds ``os`` and ``ctypes``),
to show that the sandbox holds on its own. (The static check itself refuses that
computed ``getattr``: rule S016.)
"""

from __future__ import annotations

import asyncio
import os
import socket
import textwrap
import time
import uuid

import pytest

from schemas.events import VerifyRequest
from services.common.verify_client import build_request
from services.worker.verifier import Verifier
from tests.helpers import RELU_TASK, SECRET, scaled
from tests.support_candidates import RELU_LAUNCHER, TRITON_IMPORTS, forged_frames, relu_jit

TASK = RELU_TASK

PRELUDE = "import time\n\n" + TRITON_IMPORTS + "\n\n" + relu_jit() + """

@triton.jit
def noop_kernel(out_ptr):
    pid = tl.program_id(0)


""" + RELU_LAUNCHER

CORRECT_FORWARD = "return relu(x.contiguous())"


def candidate(forward: str, module: str = "") -> str:
    """The relu kernel, ``module`` code, and a ModelNew whose forward body is ``forward``."""
    body = textwrap.indent(textwrap.dedent(forward).strip(), " " * 8)
    return (PRELUDE + textwrap.dedent(module) + "\n\nclass ModelNew(nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n\n"
            f"    def forward(self, x):\n{body}\n")


def request(code: str, **kwargs) -> VerifyRequest:
    fields = {"request_id": f"req-{uuid.uuid4().hex[:12]}", "job_id": "job-hostile",
              "candidate_id": "cand-hostile", "op_name": "relu", "task_desc": TASK,
              "code": code, "backend": "cpu", "arch": "x86_64", "timeout_s": 20.0}
    fields.update(kwargs)
    return build_request(**fields)


@pytest.fixture(scope="module")
def verifier(shared_verifier):
    """The session's verifier, started with secrets in the environment (SECRET_ENV)."""
    return shared_verifier


@pytest.fixture
def no_static_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn the verifier's static check off for one test, so that a candidate reaches
    the sandbox: what the test then shows is the sandbox's own hold."""
    monkeypatch.setattr("services.worker.verifier.check_candidate",
                        lambda code, dsl="triton": [])


async def still_serves(verifier: Verifier) -> None:
    result = await verifier.verify(request(candidate(CORRECT_FORWARD)), device="0")
    assert result.passed, result


async def test_correct_candidate_passes(verifier):
    await still_serves(verifier)


async def test_uninitialised_output_is_a_mismatch(verifier):
    code = candidate("""
        out = torch.empty_like(x)
        noop_kernel[(1,)](out)
        return out
    """)
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "mismatch", result
    assert "elements differ" in result.error
    await still_serves(verifier)


async def test_modifying_inputs_is_a_mismatch(verifier):
    code = candidate("""
        out = relu(x)
        x.zero_()
        return out
    """)
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "mismatch", result
    assert result.error.startswith("candidate modified input 0 in place")
    await still_serves(verifier)


@pytest.mark.parametrize("returned", ["x", "x.view(-1).view(x.shape)"])
async def test_returning_the_input_is_a_mismatch(verifier, returned):
    code = candidate(f"""
        out = relu(x)
        return {returned}
    """)
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "mismatch", result
    assert result.error.startswith("output 0 shares memory with input 0")
    await still_serves(verifier)


async def test_torch_result_without_kernel_is_static(verifier):
    code = ("import torch\nimport torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n"
            "    def forward(self, x):\n        return torch.relu(x)\n")
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "static"
    assert "no @triton.jit kernel is defined" in result.log
    assert "line 7: torch.relu called in ModelNew.forward" in result.log
    await still_serves(verifier)


@pytest.mark.parametrize("patch", [
    "time.perf_counter = lambda: 0.0",
    "torch.cuda.Event.elapsed_time = lambda self, end: 0.001",
    "setattr(torch, 'relu', lambda x: x)",
])
async def test_patching_timers_or_torch_is_static(verifier, patch):
    result = await verifier.verify(request(candidate(CORRECT_FORWARD, patch)), device="0")
    assert result.stage == "static", result
    assert "patches a library" in result.error
    await still_serves(verifier)


async def test_spinning_forever_times_out(verifier):
    code = candidate("""
        while True:
            pass
        return relu(x)
    """)
    started = time.monotonic()
    result = await verifier.verify(request(code, timeout_s=3.0), device="0")
    elapsed = time.monotonic() - started
    assert result.stage == "timeout", result
    assert "did not finish within 3 s (during trial 0: ModelNew.forward)" in result.error
    assert elapsed < 3.0 + 2.0
    await still_serves(verifier)


async def test_allocating_until_killed(verifier):
    # bytes(n) maps zero pages without touching them, so the loop reaches the
    # address-space limit at once. bytearray(n) writes every page: each of the
    # verification's three children then fills its 2 GiB+ of slack, which on a loaded
    # 2-core machine ran past the request's 20 s (a timeout verdict, contained too).
    code = candidate("""
        chunks = []
        while True:
            chunks.append(bytes(64 << 20))
        return relu(x)
    """)
    result = await verifier.verify(request(code), device="0")
    assert result.stage in ("runtime", "crash"), result
    if result.stage == "runtime":
        assert "MemoryError" in result.error and "address-space limit" in result.error
    else:
        assert "signal" in result.error
    print(f"memory hog: {result.stage}: {result.error}")
    await still_serves(verifier)


@pytest.mark.parametrize(("forward", "module", "error"), [
    ("ctypes.string_at(0)\nreturn relu(x)", "import ctypes\n", "import of ctypes is not allowed"),
    ("os._exit(0)", "import os\n", "os._exit used"),
], ids=["ctypes", "os_exit"])
async def test_ctypes_and_os_exit_are_static(verifier, forward, module, error):
    result = await verifier.verify(request(candidate(forward, module=module)), device="0")
    assert result.stage == "static"
    assert error in result.error
    await still_serves(verifier)


async def test_ctypes_past_the_static_check_is_refused(verifier, no_static_check):
    code = candidate("""
        getattr(torch, "ctyp" + "es").string_at(0)
        return relu(x)
    """)
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "audit", result
    assert "the sandbox refused ctypes" in result.error
    await still_serves(verifier)


async def test_segfault_past_the_static_check_is_a_crash(verifier, no_static_check):
    # A real bad memory access (a signal the candidate sends itself would not do:
    # the child is process 1 of its own PID namespace, which ignores those).
    code = candidate("""
        __import__("faulthandler")._read_null()
        return relu(x)
    """)
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "crash", result
    assert "process was killed by signal SIGSEGV" in result.error
    assert "during trial 0: ModelNew.forward" in result.error
    # faulthandler's dump of the Python stack lands in the captured stderr.
    assert "Fatal Python error: Segmentation fault" in result.log
    await still_serves(verifier)


async def test_os_exit_past_the_static_check_is_a_crash(verifier, no_static_check):
    code = candidate("""getattr(torch, "o" + "s")._exit(0)
return relu(x)""")
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "crash", result
    assert "exited with code 0 before returning results" in result.error
    await still_serves(verifier)


@pytest.mark.parametrize("escape", [False, True], ids=["same-group", "own-session"])
async def test_a_candidate_may_not_fork(verifier, escape, no_static_check):
    code = candidate(f"""
        sys_os = getattr(torch, "o" + "s")
        if sys_os.fork() == 0:
            if {escape}:
                sys_os.setsid()
            while True:
                time.sleep(1)
        return relu(x.contiguous())
    """)
    result = await verifier.verify(request(code, trials=1), device="0")
    assert result.stage == "audit", result
    assert "the sandbox refused os.fork" in result.error, result.error
    await still_serves(verifier)


async def test_what_a_child_starts_dies_with_it(lowering_sandbox):
    """A child is process 1 of a PID namespace of its own: it sees only its own
    processes in /proc, and what it starts (here the task's own code, in the built-in
    coder's child, where forking is allowed) is killed with it."""
    from services.generator.coders.lowering_role import lower_in_sandbox
    from services.generator.lowering.errors import LoweringError

    marker = "orph" + uuid.uuid4().hex[:8]
    task = RELU_TASK + f"""
import ctypes, os, time
if os.fork() == 0:
    os.setsid()
    ctypes.CDLL(None).prctl(15, b"{marker}", 0, 0, 0)
    time.sleep(600)
    os._exit(0)
time.sleep(0.3)
raise RuntimeError("pids " + " ".join(sorted(p for p in os.listdir("/proc") if p.isdigit())))
"""
    with pytest.raises(LoweringError) as info:
        await lower_in_sandbox(lowering_sandbox, task, timeout_s=60)
    if "PID namespace" in " ".join(lowering_sandbox.isolation.notes):
        pytest.skip("this machine gives children no PID namespace")
    assert "pids 1 2" in str(info.value), info.value

    def alive() -> bool:
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == marker:
                        return True
            except OSError:
                continue
        return False

    deadline = time.monotonic() + scaled(10)
    while alive():
        assert time.monotonic() < deadline, f"the process {marker} outlived its child"
        await asyncio.sleep(0.05)


async def test_stdout_flood_is_capped_and_judged(verifier):
    code = candidate("""
        global FLOODED
        if not FLOODED:
            FLOODED = True
            for _ in range(100):
                print("x" * (1 << 20))
        return relu(x.contiguous())
    """, module="FLOODED = False\n")
    result = await verifier.verify(request(code), device="0")
    assert result.passed, result
    assert len(result.log.encode()) <= verifier.output_limit_bytes
    assert "bytes cut" in result.log
    await still_serves(verifier)


async def test_writing_files_is_static(verifier):
    path = f"/tmp/aikg-escape-{uuid.uuid4().hex}"
    code = candidate(f"open('{path}', 'w').write('x')\nreturn relu(x)")
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "static"
    assert "open() called" in result.error
    assert not os.path.exists(path)
    await still_serves(verifier)


async def test_writing_outside_scratch_past_the_static_check_is_denied(verifier, tmp_path, no_static_check):
    if verifier.run_as is None:
        pytest.skip("children keep the worker's user on this machine")
    protected = tmp_path / "protected"
    protected.mkdir(mode=0o755)
    target = protected / "escape.txt"
    code = candidate(f"""
        sys_os = getattr(torch, "o" + "s")
        fd = sys_os.open("{target}", sys_os.O_WRONLY | sys_os.O_CREAT, 0o644)
        return relu(x)
    """)
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "runtime", result
    # Refused by Landlock, or not even visible (the private mount namespace).
    assert "PermissionError" in result.error or "FileNotFoundError" in result.error
    assert not target.exists()
    await still_serves(verifier)


async def test_environment_secrets_are_absent(verifier, no_static_check):
    code = candidate("""
        env = getattr(getattr(torch, "o" + "s"), "envi" + "ron")
        print(dict(env))
        raise RuntimeError(repr(dict(env)))
        return relu(x)
    """)
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "runtime", result
    assert "TRITON_CACHE_DIR" in result.error  # the environment was printed ...
    assert SECRET not in result.log and SECRET not in result.error  # ... without secrets
    assert "AIKG_LLM_API_KEY" not in result.error and "NATS_TOKEN" not in result.error
    await still_serves(verifier)


async def test_reading_the_workers_environment_is_denied(verifier, no_static_check):
    if verifier.run_as is None:
        pytest.skip("children keep the worker's user on this machine")
    code = candidate(f"""
        sys_os = getattr(torch, "o" + "s")
        fd = sys_os.open("/proc/{os.getpid()}/environ", sys_os.O_RDONLY)
        print(sys_os.read(fd, 1 << 20))
        return relu(x)
    """)
    result = await verifier.verify(request(code), device="0")
    # The audit hook refuses /proc before the kernel's permission check would.
    assert result.stage == "audit", result
    assert f"the sandbox refused open('/proc/{os.getpid()}/environ')" in result.error
    await still_serves(verifier)


async def test_network_is_unreachable(verifier, no_static_check):
    if not verifier.network_isolated:
        pytest.skip("network namespaces are not permitted on this machine")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = candidate(f"""
        sock = getattr(torch, "s" + "ys").modules["sock" + "et"]
        sock.create_connection(("127.0.0.1", {port}), timeout=2)
        return relu(x)
    """)
    try:
        result = await verifier.verify(request(code), device="0")
        # The audit hook refuses a new socket from candidate code; were it allowed,
        # the private network namespace would leave nothing to connect to.
        assert result.stage == "audit", result
        assert "the sandbox refused socket.__new__" in result.error
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    await still_serves(verifier)


async def test_forged_done_frame_does_not_pass(verifier, no_static_check):
    code = candidate(forged_frames('bytes([0x81, 0xA4]) + b"type" + bytes([0xA4]) + b"done"')
                     + "os_._exit(0)\nreturn relu(x)")
    result = await verifier.verify(request(code), device="0")
    assert not result.passed
    # The forged frame carries no tag of the harness's chain: the parent never takes it
    # for Done (here the stream ends inside it, so the verdict is a crash).
    assert result.stage in ("crash", "audit"), result
    assert ("before returning results" in result.error
            or "not written by the harness" in result.error), result.error
    await still_serves(verifier)


async def test_wrong_shape_is_a_mismatch(verifier):
    result = await verifier.verify(request(candidate("return relu(x.contiguous()).view(-1)")),
                                   device="0")
    assert result.stage == "mismatch"
    assert result.error.startswith("output 0 has shape (16384,) and dtype float32; expected "
                                   "(16, 1024) and float32")
    await still_serves(verifier)


async def test_wrong_dtype_is_a_mismatch(verifier):
    code = candidate("return relu(x.contiguous()).to(torch.float64)")
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "mismatch"
    assert result.error.startswith("output 0 has shape (16, 1024) and dtype float64; expected "
                                   "(16, 1024) and float32")
    await still_serves(verifier)


async def test_non_tensor_output_is_a_mismatch(verifier):
    result = await verifier.verify(request(candidate("relu(x)\nreturn 'done'")), device="0")
    assert result.stage == "mismatch"
    assert "returned a str as output 0" in result.error
    await still_serves(verifier)
