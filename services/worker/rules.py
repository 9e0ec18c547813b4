"""The dynamic checks of a verification: one table, the ATen allowlist, the roofline bound.

Every check that runs candidate code and can fail it is listed in :data:`DYNAMIC_RULES`
with a stable id, what it catches, the public report it comes from, and the test that
shows it working. The static rules live in :mod:`services.worker.static_check`.

The parent (the worker) applies these rules to data it received from the sandboxed
children; a child only reports what happened (ops it saw, bytes it produced).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """One dynamic check: ``id`` (``D001``...), what it catches, its public source, its test."""

    id: str
    catches: str
    source: str
    test: str


_T = "tests/test_verdict_integrity.py::"

DYNAMIC_RULES: tuple[Rule, ...] = (
    Rule("D001", "input modified in place: the parent digests the input bytes the candidate's "
         "child hands back after each call and compares them with the reference process's",
         "KernelBench reward-hacking reports (in-place writes to inputs)",
         _T + "test_rewriting_the_harness_does_not_hide_input_mutation"),
    Rule("D002", "PyTorch compute operators executed in ModelNew.forward (ATen ops recorded by a "
         "TorchDispatchMode, outside the allocation/view/copy allowlist)",
         "KernelGuard (runtime op audit); KernelBench issue #165 discussion of torch fallbacks",
         _T + "test_torch_operators_behind_a_scratch_kernel_fail_the_audit"),
    Rule("D003", "ghost replay: outputs still match with every Triton launch a no-op and "
         "allocations NaN-filled, so the kernels did not compute them",
         "KernelGuard ghost replay; Sakana AI CUDA Engineer post-mortem (kernels that skip work)",
         _T + "test_numpy_doing_the_work_fails_the_ghost_replay"),
    Rule("D004", "candidate code reaching the harness (gc.get_objects/referrers, frames, ctypes, "
         "/proc, sockets, settrace, exec) is refused by an audit hook and fails the run",
         "PEP 578 (runtime audit hooks); this project's red-team: a timing frame forged via gc",
         _T + "test_finding_the_channel_through_gc_is_refused"),
    Rule("D005", "frames on the result channel that the harness did not write (keyed BLAKE2b "
         "chain over every frame) or that arrive outside the protocol (a Timing outside "
         "profiling, twice, or with the wrong sample count)",
         "this project's red-team: a timing frame sent by candidate code was accepted",
         _T + "test_forged_timing_frame_is_detected"),
    Rule("D006", "timings whose sum exceeds the wall time the parent observed for the phase",
         "timings cross-checked against the parent's clock (red-team)", "tests/test_verifier.py::test_timings_larger_than_wall_time_are_"
         "inconsistent"),
    Rule("D007", "speedups implying more bytes/s than the arch's peak memory bandwidth "
         "(roofline floor over the task's input + output bytes)",
         "roofline model (Williams, Waterman, Patterson, CACM 2009); NVIDIA datasheets",
         _T + "test_roofline_floor"),
    Rule("D008", "a second input size: the task's own sizes when they fit, else a reduced size "
         "with non-power-of-two extents (kernels right only for the first tile)",
         "KernelBench shape-generalisation reports (matmul/mean kernels right for one tile)",
         _T + "test_first_tile_matmul_fails_at_the_second_size"),
    Rule("D009", "scale-aware comparison: relative L2 error per dtype and constant outputs "
         "against a non-constant reference",
         "KernelBench issue #165 (outputs below atol pass with zeros)",
         _T + "test_constant_output_against_a_small_scale_reference_fails"),
    Rule("D010", "a verification that compared no elements never passes",
         "this project's red-team: --shape batch_size=0 passed with nothing compared", _T + "test_zero_size_inputs_never_pass"),
    Rule("D011", "tensor data handed to host code in ModelNew.forward beyond "
         "64 elements a call (Tensor.numpy/tolist/__array__/__dlpack__/storages, "
         ".item()/float()): numpy or Python computing where no ATen op is recorded",
         "this project's red-team: a relu computed by numpy through a tensor's numpy view, "
         "and by .item() reads, passed with NaN-fill detection dodging the ghost replay",
         _T + "test_host_reads_of_tensor_data_fail_the_audit"),
)
# D011: tensor elements one forward call may hand to host code (a few scalar parameters
# read with .item(), say); a computation on the host reads whole inputs.
HOST_READ_LIMIT = 64

# ATen operators a candidate's forward may execute (the op's packet name, e.g.
# ``aten.view`` for ``aten.view.default``); anything else is a compute operator.
# Allocation: new tensors whose contents are constants or undefined.
ALLOCATION_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
    "zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like",
    "new_full", "fill_", "zero_", "scalar_tensor", "lift_fresh", "lift_fresh_copy", "arange",
})
# Views: new tensor metadata over the same storage, no arithmetic.
VIEW_OPS = frozenset({
    "view", "reshape", "_unsafe_view", "_reshape_alias", "as_strided", "expand", "permute",
    "transpose", "t", "unsqueeze", "squeeze", "slice", "select", "detach", "alias", "split",
    "split_with_sizes", "unbind", "chunk", "narrow", "unflatten", "flatten", "movedim",
    "view_as_real", "view_as_complex", "resolve_conj", "resolve_neg", "_local_scalar_dense",
})
# Layout and dtype copies: the same values in another layout, dtype or device.
COPY_OPS = frozenset({"clone", "copy_", "_to_copy", "contiguous", "to", "_copy_from",
                      "_copy_from_and_resize"})
ALLOWED_OPS = ALLOCATION_OPS | VIEW_OPS | COPY_OPS
# Issued from Triton's own frames while it launches a kernel: the interpreter copies
# every tensor argument's storage to the host and back (``GridExecutor._init_args_hst``,
# ``_restore_args_dev`` in triton/runtime/interpreter.py: ``new_empty``, ``set_``,
# ``copy_``); the autotuner clears caches and restores arguments (``zero_``, ``clone``).
LAUNCHER_OPS = ALLOWED_OPS | frozenset({"set_"})


def op_packet(name: str) -> str:
    """``aten.relu.default`` -> ``relu``; ``aten.gt.Scalar`` -> ``gt``."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else name


def audit_findings(ops: dict[str, int], launcher_ops: dict[str, int]) -> list[str]:
    """Messages for recorded ops outside the allowlists, most-called first.

    Args:
        ops: ATen overload name -> calls, issued by candidate code (all forward calls).
        launcher_ops: the same, issued from Triton's frames during launches.

    Returns:
        e.g. ``["aten.mul.Tensor called 3 times in ModelNew.forward"]``; empty when clean.
    """
    bad = {n: c for n, c in ops.items() if op_packet(n) not in ALLOWED_OPS}
    bad.update({n: bad.get(n, 0) + c for n, c in launcher_ops.items()
                if op_packet(n) not in LAUNCHER_OPS})
    return [f"{name} called {count} time{'s' if count != 1 else ''} in ModelNew.forward"
            for name, count in sorted(bad.items(), key=lambda kv: (-kv[1], kv[0]))]


def host_read_finding(host_reads: dict[str, int], host_elements: int) -> str | None:
    """Rule D011's message when one forward call read more than :data:`HOST_READ_LIMIT`
    tensor elements into host code, else None.

    Args:
        host_reads: ``Tensor.numpy`` ... -> calls by candidate code (all forward calls).
        host_elements: the most elements one call read (those calls and ``.item()``).

    Example: ``ModelNew.forward handed 16384 tensor elements to host code in one call
    (Tensor.numpy 2 calls); at most 64 ...``.
    """
    if host_elements <= HOST_READ_LIMIT:
        return None
    how = ", ".join(f"{name} {count} call{'s' if count != 1 else ''}"
                    for name, count in sorted(host_reads.items())) or ".item()/float() reads"
    return (f"ModelNew.forward handed {host_elements} tensor elements to host code in one "
            f"call ({how}); at most {HOST_READ_LIMIT} are allowed (a few scalar parameters): "
            "compute in Triton kernels, not in numpy or Python (pass tensors to the kernels "
            "and tl.load them)")


# Peak memory bandwidth per arch, bytes per second (the `arch` label of a request,
# lower-case). Sources: NVIDIA H100 Tensor Core GPU datasheet (H100 SXM 3.35 TB/s,
# H100 NVL 3.9 TB/s, H100 PCIe 2 TB/s), NVIDIA H200 datasheet (4.8 TB/s), NVIDIA A100
# datasheet (A100 80GB SXM 2.039 TB/s, A100 40GB 1.555 TB/s). To add an arch, add its
# label with the datasheet's peak HBM/GDDR bandwidth and cite the datasheet here.
PEAK_BANDWIDTH: dict[str, float] = {
    "h100": 3.35e12,
    "h100_sxm": 3.35e12,
    "h100_pcie": 2.0e12,
    "h200": 4.8e12,
    "a100": 2.039e12,
    "a100_80gb": 2.039e12,
    "a100_40gb": 1.555e12,
}


def roofline_floor_us(nbytes: int, arch: str) -> float | None:
    """The least time, microseconds, that moving ``nbytes`` through memory takes on ``arch``.

    ``nbytes`` are the task's input plus output bytes: a kernel must read its inputs
    and write its outputs at least once, and after the L2 flush before each timed call
    they come from device memory. None for an arch not in :data:`PEAK_BANDWIDTH`.
    """
    peak = PEAK_BANDWIDTH.get(arch.lower())
    if peak is None or nbytes <= 0:
        return None
    return nbytes / peak * 1e6


def impossible_timing(gen_time_us: float, nbytes: int, arch: str) -> str | None:
    """A message when ``gen_time_us`` is below the roofline floor, else None.

    Example: ``gen_time_us 0.5 us moves 8.0 MB at 16.8 TB/s, above the h200's peak of 4.8 TB/s``.
    """
    floor = roofline_floor_us(nbytes, arch)
    if floor is None or gen_time_us >= floor:
        return None
    rate = nbytes / (gen_time_us * 1e-6) if gen_time_us > 0 else float("inf")
    return (f"impossible timing: {gen_time_us:.3g} us for {nbytes / 1e6:.1f} MB of inputs and "
            f"outputs is {rate / 1e12:.1f} TB/s, above the {arch}'s peak memory bandwidth of "
            f"{PEAK_BANDWIDTH[arch.lower()] / 1e12:.2f} TB/s (at least {floor:.3g} us)")


def rules_markdown() -> str:
    """The README's table of every static (``S...``) and dynamic (``D...``) rule.

    ``tests/test_verdict_integrity.py`` checks the README holds exactly this text
    between its ``rules`` markers, so code and documentation cannot drift apart.
    """
    from services.worker.static_check import RULES

    lines = ["| id | kind | what it catches | source | test |", "|---|---|---|---|---|"]
    for rule in RULES:
        lines.append(f"| {rule.id} | static (`{rule.tag}`) | {rule.catches} | {rule.source} "
                     f"| `{rule.test.split('::')[-1]}` |")
    for rule in DYNAMIC_RULES:
        lines.append(f"| {rule.id} | dynamic | {rule.catches} | {rule.source} "
                     f"| `{rule.test.split('::')[-1]}` |")
    return "\n".join(line.replace("\n", " ") for line in lines) + "\n"
