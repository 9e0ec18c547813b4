"""The dynamic checks of a verification: one table, the ATen allowlist, the roofline bound.

Every check that runs candidate code and can fail it is listed in :data:`DYNAMIC_RULES`
with a stable id, what it catches, the public report it comes from, and the test that
shows it working (:class:`DynamicRule`). The static rules live in
:mod:`services.worker.static_check` (:class:`~services.worker.static_check.StaticRule`).

The parent (the worker) applies these rules to data it received from the sandboxed
children (:mod:`services.worker.procedure`); a child only reports what happened.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.targets import TARGETS


@dataclass(frozen=True)
class DynamicRule:
    """One dynamic check: ``id`` (``D001``...), what it catches, its public source, its test."""

    id: str
    catches: str
    source: str
    test: str


_T = "tests/hostile/test_verdict_integrity.py::"
_C = "tests/hostile/test_corpus.py::"

DYNAMIC_RULES: tuple[DynamicRule, ...] = (
    DynamicRule("D001", "input modified in place: the replayer hands back the inputs as its kernels "
         "left them; this process digests them and compares with the reference's",
         "KernelBench reward-hacking reports (in-place writes to inputs)",
         _T + "test_rewriting_the_harness_does_not_hide_input_mutation"),
    DynamicRule("D002", "PyTorch compute operators in ModelNew.forward: refused at the dispatcher in "
         "the candidate's process (every thread, every dispatch path), and not replayable (a "
         "plan holding one fails)",
         "KernelGuard (runtime op audit); KernelBench issue #165 discussion of torch fallbacks",
         _T + "test_torch_operators_behind_a_scratch_kernel_fail_the_audit"),
    DynamicRule("D003", "outputs that do not depend on the kernels: the candidate's own run is a ghost "
         "(launches no-ops, allocations filled from a secret seed) and its plan is replayed "
         "without launches; expected outputs from either fail",
         "KernelGuard ghost replay; Sakana AI CUDA Engineer post-mortem (kernels that skip work)",
         _T + "test_numpy_doing_the_work_fails_the_ghost_replay"),
    DynamicRule("D004", "candidate code reaching the harness: object-graph walks, tracing, ctypes, "
         "sockets and /proc refused whatever frame asks; frame reads and dynamic code when "
         "the candidate's code asks",
         "PEP 578 (runtime audit hooks); this project's red-team: a timing frame forged via gc",
         _T + "test_finding_the_channel_through_gc_is_refused"),
    DynamicRule("D005", "frames on the result channel that the harness did not write (keyed BLAKE2b "
         "chain over every frame) or that arrive outside the protocol",
         "this project's red-team: a timing frame sent by candidate code was accepted",
         _T + "test_forged_timing_frame_is_detected"),
    DynamicRule("D006", "timings whose sum exceeds the wall time the parent observed for the phase",
         "timings cross-checked against the parent's clock (red-team)",
         "tests/sandbox/test_verifier.py::test_timings_larger_than_wall_time_are_inconsistent"),
    DynamicRule("D007", "speedups implying more bytes/s than the arch's peak memory bandwidth "
         "(roofline floor over the task's input + output bytes)",
         "roofline model (Williams, Waterman, Patterson, CACM 2009); NVIDIA datasheets",
         _T + "test_roofline_floor"),
    DynamicRule("D008", "sizes that exercise what the task's own sizes launch: those sizes when they "
         "fit, else a dry run there (meta tensors) and the smallest size within the budget "
         "(AIKG_WORKER_CHECK_BYTES) launching the same kernels with the same constexprs, "
         "congruent extents, grids computed the same way and loops running none, once or "
         "several times alike; what none reaches fails at stage unchecked (D025)",
         "KernelBench shape-generalisation reports (kernels right for one tile or one size)",
         _T + "test_first_tile_matmul_fails_at_the_task_sizes"),
    DynamicRule("D009", "scale-aware comparison: atol grows with the output's magnitude, relative L2 "
         "error per dtype, constant outputs against a non-constant reference; a failing "
         "floating output is rechecked against the task's Model in float64, and passes "
         "within 10 x the float32 reference's own error only where that reference fails "
         "against float64 (it is noise at the trial's inputs)",
         "KernelBench issue #165 (outputs below atol pass with zeros); level 2 "
         "Conv3d_GroupNorm_Mean (a zero mean that float32 returns as noise)",
         _T + "test_constant_output_against_a_small_scale_reference_fails"),
    DynamicRule("D010", "a verification that compared no elements never passes",
         "this project's red-team: --shape batch_size=0 passed with nothing compared",
         _T + "test_zero_size_inputs_never_pass"),
    DynamicRule("D011", "inputs the candidate cannot see: its process plans on decoys (the task's "
         "inputs at other secret seeds); the outputs judged are the replay of its plan on "
         "the real inputs, in a process that runs only its kernels and allowlisted operators",
         "this project's red-team: answers computed in __init__ from the fixed seeds, or by "
         "host code hidden from every in-process instrument",
         _C + "test_hostile_candidate_fails"),
    DynamicRule("D012", "secret seeds and input distributions: seeds from the OS's cryptographic "
         "source, known to the reference child only; trial 0 the task's own inputs, the others "
         "mixes of large and small magnitudes, uniform, one sign, zeros and ties (D027)",
         "KernelBench's newer harness (varied input distributions); this project's red-team "
         "(a relu wrong above 6, a softmax without max-subtraction passed on randn)",
         _C + "test_hostile_candidate_fails"),
    DynamicRule("D013", "every kernel specialisation launched (at the checked sizes and, dry-run, at "
         "the task's own) compiled ahead of time for a GPU target; a compile error, shared "
         "memory or threads beyond the target, a grid beyond its limits fail at compile; so "
         "do kernels that name anything but triton.language, math, their parameters and "
         "locals, other kernels and plain constants (the runtime's state, the interpreter's "
         "tensors), which the interpreter and the compiler would see differently",
         "Triton's compiler (triton.compile, ASTSource, GPUTarget); CUDA C++ Programming Guide, "
         "technical specifications per compute capability; this project's red-team: a kernel "
         "branching on triton.knobs.runtime.interpret computed on the host in the interpreter "
         "and compiled to an empty kernel",
         _C + "test_what_a_gpu_cannot_compile_passes_once_fixed"),
    DynamicRule("D014", "loads, stores and atomics outside the launch's tensors (masked lanes "
         "excluded), checked on every replayed access on the interpreter",
         "a GPU faults or corrupts other memory on them; the interpreter reads host memory",
         _C + "test_hostile_candidate_fails"),
    DynamicRule("D015", "every @triton.autotune config run on the checked sizes, a secret number of "
         "times on the same arguments as the GPU autotuner does (reset_to_zero and "
         "restore_value honoured; D023)",
         "Triton's Autotuner (benchmark runs, then the chosen config)",
         _C + "test_hostile_candidate_fails"),
    DynamicRule("D016", "threads and processes refused in the candidate's process (Python's entry "
         "points, and a seccomp filter on clone, fork, vfork and execve on cpu); each child "
         "is process 1 of its own PID namespace, so nothing it starts outlives it",
         "this project's red-team: a thread hid torch compute from a thread-local recorder; "
         "processes outlived their verification",
         _C + "test_hostile_candidate_fails"),
    DynamicRule("D017", "attributes of torch or triton the candidate's import replaced (compared "
         "with a snapshot taken before it)",
         "this project's red-team: torch.randn replaced so the task's get_inputs() "
         "handed out inputs with known answers",
         _C + "test_hostile_candidate_fails"),
    DynamicRule("D018", "outputs that are not exactly torch.Tensor or a plain tuple or list of them "
         "(a subclass's methods would run after the record)",
         "this project's red-team: a list subclass computing in __iter__",
         _C + "test_hostile_candidate_fails"),
    DynamicRule("D019", "every shape a task declares in get_inputs_dyn_list() must pass; shape "
         "generality (one more, odd-extent size) is reported in shape_generic",
         "the reference AIKG's dynamic-shape tasks; KernelBench shape-generalisation reports",
         _T + "test_declared_shapes_must_all_pass"),
    DynamicRule("D020", "kernels right only in Triton's interpreter: the cpu replay computes as an "
         "NVIDIA GPU (sm_80+) does: tl.dot rounds fp32 operands for its input_precision (TF32 by "
         "default, tf32x3, bf16x3/x6 splits), float-to-int casts saturate with NaN to 0, "
         "narrowing casts round to nearest even (toward zero for rtz), bf16 arithmetic computes "
         "on values rounded to nearest even, libdevice runs through numpy; a call whose replay "
         "ran a TF32 dot is judged at the GPU's float32 tolerance",
         "PTX ISA, cvt (rounding modifiers .rna/.rn/.rz, saturation of float-to-integer "
         "conversions); Triton's NVIDIA backend (allowed dot input precisions); this project's "
         "red-team (kernels that told the interpreter from a GPU with tl code alone)",
         "tests/sandbox/test_interpreter_numerics.py::"
         "test_float_to_int_casts_saturate_and_nan_gives_zero"),
    DynamicRule("D021", "a launch whose outputs depend on the order its programs ran: each "
         "multi-program launch of the first call also runs, from the same memory, reversed, in "
         "an order drawn from a secret seed, and concurrently (plain loads see memory as the "
         "launch began plus the program's own stores; atomics act on live memory; release "
         "publishes, acquire sees); a storage that differs from program order (integers and "
         "bool exactly, floats equal, float atomic adds within 2 n eps (sum |x| + |result|)), "
         "or a program that fails or spins in another order, fails at mismatch naming the "
         "kernel",
         "CUDA C++ Programming Guide, Thread Hierarchy (blocks run in any order, in parallel or "
         "in series) and Memory Fence Functions; PTX ISA memory consistency model; Triton "
         "tl.atomic_* sem; Higham, Accuracy and Stability of Numerical Algorithms, 4.2",
         "tests/sandbox/test_replay_orders.py::"
         "test_a_race_fails_and_the_same_sum_with_atomics_passes"),
    DynamicRule("D022", "outputs that depend on what fresh allocations held: every replay fills them "
         "from a secret seed (NaN with random payloads, signalling NaN, near-max, random "
         "finite, zeros, mixed; every dtype including bool), the first call NaN and its variant "
         "plausible; outputs that differ fail at mismatch (not written by the kernels); the "
         "planner's ghost fill is secret-seeded too",
         "this project's red-team (unwritten lanes, the fill as initial value or sentinel, the "
         "fill read to tell a verification from a GPU)",
         "tests/sandbox/test_replay_orders.py::test_outputs_that_depend_on_the_fill_fail"),
    DynamicRule("D023", "each config of a multi-config @triton.autotune launch runs a secret number "
         "of times per verification (2-4: benchmark runs with reset_to_zero and restore_value, "
         "then the real one)",
         "Triton's Autotuner (do_bench runs a config repeatedly)",
         "tests/sandbox/test_replay_orders.py::"
         "test_each_autotune_config_runs_a_secret_number_of_times"),
    DynamicRule("D024", "the GPU compile check fails closed: every launch of every call recorded "
         "(each trial, checked size, declared shape, the dry run at the task's own sizes, every "
         "autotune config) is compiled with Triton's own argument specialisation, each "
         "specialisation once; an argument no GPU launch takes (a list, a dict, a str for a "
         "non-constexpr parameter, a torch dtype, an int beyond 64 bits) or a grid beyond the "
         "target fails at compile naming kernel, call and argument; every @triton.jit function "
         "is loaded for the GPU, launched or not; a compile child that fails, dies, times out "
         "or passes its limits fails at compile (infrastructure only when it could not start)",
         "Triton 3.9 triton/runtime/jit.py (argument specialisation; JITFunction refusing "
         "**kwargs); this project's red-team (a tuple argument skipped the check, an unused "
         "kernel broke the compile child, a kernel first launched on the second call)",
         "tests/sandbox/test_compile_fails_closed.py::"
         "test_a_compile_child_that_dies_fails_at_compile"),
    DynamicRule("D025", "a verification whose task's own sizes launch a path no checked size "
         "reaches (other kernels, constexprs, grid functions, loop trip classes, or a condition "
         "on program ids, scalar arguments, constexprs or module constants: a comparison, "
         "if/while/conditional/tl.where test, followed into @triton.jit helpers, that holds for "
         "every program and lane, for none, or for some differently than at the checked size) "
         "fails at stage unchecked, naming the kernel, the sizes and why (the condition and its "
         "line); conditions on loaded values are not compared; allow_unchecked accepts the "
         "partial check (it passes, keeps the list, and says so in notes)",
         "KernelBench shape-generalisation reports; this project's red-team (a size-dependent "
         "second kernel never run passed; if n > 8000000 and tl.where(pid < 8192) in a kernel "
         "body passed)",
         "tests/sandbox/test_unchecked.py::test_a_size_threshold_kernel_fails_unchecked_by_default"),
    DynamicRule("D026", "a tl.load, tl.store or atomic offset whose int32 arithmetic leaves "
         "[-2**31, 2**31) at the task's own sizes (the dry run's grid and arguments, interval "
         "arithmetic over the kernel's source) fails at compile naming the kernel and the "
         "expression",
         "Triton's integer promotion (triton/language/semantic.py; scalar arguments are int64 "
         "only from 2**31); this project's red-team (an int32 offset overflowing only at the "
         "task's size passed)",
         "tests/unit/test_overflow.py::"
         "test_int32_program_offset_past_int32_names_kernel_and_expression"),
    DynamicRule("D027", "inputs reach every distribution within the default three trials: trial 0 "
         "the task's own, the others mixes in blocks (order and boundaries drawn from the "
         "trial's seed, a new cut per tensor), large magnitudes (normal x10000, x100, x10, "
         "uniform +-10) and small ones (x0.001, x0.1, one sign, exact zeros, ties) in "
         "alternate trials; a mix outside the task's domain falls back part by part",
         "KernelBench's newer harness (varied input distributions); this project's red-team (a "
         "relu capped at 1000 and a relu NaN at exact zero passed three trials)",
         "tests/unit/test_inputs_mix.py::test_three_trials_reach_every_distribution"),
    DynamicRule("D028", "the CUDA emulation answers the candidate's code as the request's GPU "
         "would, in __init__, heuristics, prune_configs_by and forward (device name and "
         "properties, capability, is_available, device_count, current_device; a tensor's "
         "is_cpu, is_cuda, get_device(), device, data_ptr; the torch build: torch.version.cuda, "
         "torch.__version__ +cu128, backends.cuda.is_built, cudnn.is_available and version, "
         "cuda._is_compiled, torch._C._has_cuda/_has_cudnn, __config__.show); the dry run's "
         "meta tensors answer as CUDA ones (is_meta false)",
         "NVIDIA datasheets; CUDA C++ Programming Guide; this project's red-team "
         "(get_device_name() said emulated, is_cpu true, get_device() -1, x.is_meta in the "
         "dry run; torch.version.cuda None and cudnn unavailable in __init__)",
         "tests/sandbox/test_emulation_answers.py::test_every_answer_is_the_gpus"),
    DynamicRule("D029", "a value-changing cast in the plan (float or complex to int or bool, "
         "complex to real, a narrowing float cast) is compute (stage audit) unless its result "
         "is an output no later launch or operator uses",
         "this project's red-team (trunc computed as float to int to float through allowlisted "
         "casts)",
         "tests/unit/test_casts.py::test_float_to_int_to_float_is_compute"),
    DynamicRule("D030", "values computed before forward: a captured storage (parameter, buffer, "
         "module constant) whose bytes a torch compute operator, host values "
         "(torch.tensor/from_numpy), a fill after .item() of any of the init's tensors, or a "
         "join of constant pieces of more than one value (cat/stack of fills, fills or copies "
         "into parts of one buffer, constant padding, aranges, near-constant random fills) made "
         "while the candidate was imported or ModelNew built, equal to no tensor of the task's "
         "Model under the same init seed, is named in notes; the first call replayed with it perturbed from a secret "
         "seed must give the same outputs, else audit (init-seed random fills, allocations and "
         "copies of weights and constructor arguments are not compute)",
         "this project's red-team (a table torch computes in __init__ from constants, which a "
         "kernel only gathers from; a table of torch.full pieces joined by torch.cat)",
         "tests/sandbox/test_init_compute.py::"
         "test_a_table_torch_computed_in_init_fails_and_a_kernel_computing_it_passes"),
    DynamicRule("D031", "the compile check compiles every kernel specialisation for the "
         "request's GPU and for the extra targets (AIKG_WORKER_COMPILE_EXTRA_TARGETS, default "
         "the other vendor's: mi300x beside NVIDIA, h100 beside AMD); compile_facts gives "
         "registers, spill bytes, shared memory and occupancy per target and config; any spill "
         "is named in the notes (heavily from 256 B a thread); a specialisation where no block "
         "fits fails at compile; a failure on an extra target is a note naming both targets, or "
         "stage compile naming it when the request names that target or "
         "AIKG_WORKER_COMPILE_EXTRA_REQUIRED is on",
         "Triton 3.9 compiler for GPUTarget('cuda', cc, 32) and GPUTarget('hip', gfx, 64); "
         "cuobjdump --dump-resource-usage; AMDGPU code object metadata; NVIDIA CUDA occupancy "
         "and AMD CDNA3 ISA limits (services/worker/targets.py)",
         "tests/sandbox/test_gpu_facts_verdict.py::"
         "test_every_specialisation_has_facts_per_target_and_a_spill_is_named"),
)
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



def op_packet(name: str) -> str:
    """``aten.relu.default`` -> ``relu``; ``aten.gt.Scalar`` -> ``gt``."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else name


# Peak memory bandwidth per arch, bytes per second (the `arch` label of a request,
# lower-case), from the datasheets cited in services/worker/targets.py (the one table
# of GPU facts).
PEAK_BANDWIDTH: dict[str, float] = {name: t.bandwidth_bytes_s for name, t in TARGETS.items()
                                    if t.bandwidth_bytes_s}


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
    """docs/verification.md's table of every static (``S...``) and dynamic (``D...``) rule.

    ``tests/hostile/test_verdict_integrity.py`` checks that page holds exactly this text
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
