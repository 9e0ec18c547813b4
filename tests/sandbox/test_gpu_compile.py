"""The built-in coder's kernels compile for an NVIDIA H200 (sm_90) on a machine without a GPU.

Triton's interpreter, which runs kernels on the CPU in the other tests, accepts code
that its GPU compiler rejects (types, shapes, unsupported ops). Here each kernel goes
through the real compiler, ahead of time, to a cubin: ``triton.compile`` for target
``GPUTarget("cuda", 90, 32)`` (Hopper, warp size 32) runs Triton's MLIR passes and the
ptxas bundled with the triton wheel, and needs no driver. Run in a fresh interpreter
(no TRITON_INTERPRET), with its own Triton cache.

Every kernel of every bundled task, schedule task, convolution task
(``test_conv_lowering.CONVS``), row-family task (``test_row_families.FAMILIES``),
matmul-with-row-reduction task (``test_matmul_rows.OPS``) and recurrent task
(``test_recurrent_lowering.RNNS``) compiles in float32, both
``FLAT`` variants of a pointwise kernel included. Kernels compute in float32 whatever
their tensors' dtype, so float16 and bfloat16 change only the loads, the stores and
``tl.dot``'s inputs: those two are compiled for every kernel of :data:`DTYPE_TASKS`
(pointwise, row reduction, matmul) and of the first task of any other kernel family.
A kernel whose source (its name aside) another task already compiled with the same
signature is not compiled again; its result is the first one's. A task another test of
the session already lowered is read from :mod:`tests.lowering_cache`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, TASKS, scaled

pytestmark = pytest.mark.slow

DTYPES = ("fp32", "fp16", "bf16")
# Bundled tasks compiled in every dtype: a pointwise kernel, a softmax (row reductions
# and a pointwise epilogue) and a matmul (tl.dot).
DTYPE_TASKS = ("relu", "softmax", "matmul")

_COMPILE_ALL = r'''
import importlib.util, itertools, json, sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from services.generator.lowering import LoweringError
from tests.lowering_cache import lowered

CONSTEXPRS = {"BLOCK_SIZE": 1024, "BLOCK_R": 64, "BLOCK_I": 16, "BLOCK_M": 32, "BLOCK_N": 32,
              "BLOCK_K": 32, "KS0": 3, "KS1": 3, "KS2": 3, "BLOCK_G": 4}
out, scratch = {}, Path(sys.argv[1])
dtype_tasks = sys.argv[4].split(",")
paths = (sorted(Path("tasks").glob("*.py")) if sys.argv[5] == "1" else []) + \
    sorted(Path(sys.argv[3]).glob("*.py"))
# the representatives first, so that their families count as covered in every dtype
paths.sort(key=lambda p: (p.parent.name != "tasks", p.stem not in dtype_tasks))
every_dtype_families, compiled_once, compiles = set(), {}, 0
for path in paths:
    try:
        source = lowered(path.read_text(), root=Path(sys.argv[6]))
    except LoweringError as exc:
        out[path.stem] = {"lowered": False, "error": str(exc)[:200]}
        continue
    module_path = scratch / f"candidate_{path.stem}.py"
    module_path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"candidate_{path.stem}", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernels = {name: fn for name, fn in vars(module).items()
               if isinstance(fn, JITFunction) and "_kernel_" in name}
    results = {}
    for kname, kernel in kernels.items():
        family = kname.split("_kernel_")[0]
        dtypes = ["fp32"]
        if path.parent.name == "tasks" and (path.stem in dtype_tasks
                                             or family not in every_dtype_families):
            dtypes = sys.argv[2].split(",")
            every_dtype_families.add(family)
        # pointwise kernels branch on FLAT at compile time: build both variants
        variants = ["FLAT=1", "FLAT=0"] if "FLAT" in kernel.arg_names else [""]
        for dtype, variant in itertools.product(dtypes, variants):
            # numbers from get_inputs() arrive as f_<name> (float), b_<name> (bool),
            # i_<name> (int) arguments; sizes and strides as ints
            signature = {name: "*" + dtype if name.endswith("_ptr")
                         else "constexpr" if name in CONSTEXPRS or name == "FLAT"
                         else "fp32" if name.startswith("f_")
                         else "i1" if name.startswith("b_") else "i64"
                         for name in kernel.arg_names}
            constexprs = {n: v for n, v in CONSTEXPRS.items() if n in kernel.arg_names}
            if variant:
                constexprs["FLAT"] = variant == "FLAT=1"
            key = f"{kname} {dtype} {variant}".rstrip()
            same = (kernel.src.replace(kname, "KERNEL"), json.dumps(signature, sort_keys=True),
                    json.dumps(constexprs, sort_keys=True))
            if same in compiled_once:
                results[key] = compiled_once[same]
                continue
            compiles += 1
            try:
                compiled = triton.compile(
                    ASTSource(kernel, signature, constexprs=constexprs),
                    target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
                results[key] = {"cubin_bytes": len(compiled.asm["cubin"])}
            except Exception as exc:
                results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            compiled_once[same] = results[key]
    out[path.stem] = {"lowered": True, "dtypes": results}
print(json.dumps({"tasks": out, "compiles": compiles}))
'''


# Two halves, each its own compiling process, so that xdist runs them side by side and
# neither nears its time limit on a loaded machine (the whole took 261 s on 2 idle cores).
@pytest.mark.timeout(600)
@pytest.mark.parametrize("part", ["tasks_and_schedules", "convolutions_and_row_families"])
def test_every_lowered_kernel_compiles_to_a_cubin_for_sm90(tmp_path, part,
                                                           lowered_once) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the test module below sets it anyway
    from tests.sandbox.test_builtin_coder import SCHEDULES, schedule_task
    from tests.sandbox.test_conv_lowering import CONVS, conv_task
    from tests.sandbox.test_matmul_rows import OPS as MATMUL_ROWS
    from tests.sandbox.test_matmul_rows import task as matmul_rows_task
    from tests.sandbox.test_recurrent_lowering import RNNS, rnn_task
    from tests.sandbox.test_row_families import FAMILIES
    from tests.sandbox.test_row_families import task as family_task

    first = part == "tasks_and_schedules"
    schedules = tmp_path / "schedules"
    schedules.mkdir()
    for name in SCHEDULES if first else ():
        (schedules / f"schedule_{name}.py").write_text(schedule_task(name))
    for name in () if first else CONVS:  # the convolution kernels' variants (1-D to 3-D)
        (schedules / f"conv_{name}.py").write_text(conv_task(name))
    for name in () if first else FAMILIES:  # fused rows' layouts (rows a program, a view)
        (schedules / f"rows_{name}.py").write_text(family_task(name))
    for name in () if first else MATMUL_ROWS:  # a matmul with a row reduction epilogue
        (schedules / f"mmrows_{name}.py").write_text(matmul_rows_task(name))
    for name in () if first else RNNS:  # input projections and LSTM / GRU / RNN steps
        (schedules / f"rnn_{name}.py").write_text(rnn_task(name))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    run = subprocess.run([sys.executable, "-c", _COMPILE_ALL, str(tmp_path), ",".join(DTYPES),
                          str(schedules), ",".join(DTYPE_TASKS), "1" if first else "0",
                          str(lowered_once)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(540))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    results = report["tasks"]

    expected = ({p.stem for p in TASKS.glob("*.py")} | {f"schedule_{n}" for n in SCHEDULES}
                if first else {f"conv_{n}" for n in CONVS} | {f"rows_{n}" for n in FAMILIES}
                | {f"mmrows_{n}" for n in MATMUL_ROWS} | {f"rnn_{n}" for n in RNNS})
    assert set(results) == expected
    not_lowered = sorted(name for name, r in results.items() if not r["lowered"])
    assert not_lowered == [], not_lowered
    failures = {f"{name} {kernel}": r["error"]
                for name, task in results.items() if task["lowered"]
                for kernel, r in task["dtypes"].items() if "error" in r}
    assert not failures, json.dumps(failures, indent=1)
    # every kernel of every schedule task (matmul epilogues and scalar arguments included)
    for name in SCHEDULES if first else ():
        assert results[f"schedule_{name}"]["dtypes"], name
    for name in () if first else CONVS:
        assert any(k.startswith("conv_kernel_") for k in results[f"conv_{name}"]["dtypes"]), name
    for name in () if first else MATMUL_ROWS:
        assert any(k.startswith("matmul_rows_kernel_")
                   for k in results[f"mmrows_{name}"]["dtypes"]), name
    for name in () if first else RNNS:
        kernels = {k.split("_kernel_")[0] for k in results[f"rnn_{name}"]["dtypes"]}
        assert kernels == {"rnn_input", f"{RNNS[name][0].lower()}_step"}, (name, kernels)
    # every kernel of every task in float32 (both load paths of a pointwise kernel)
    for name, task in results.items():
        kernels = {k.split(" ")[0] for k in task["dtypes"]}
        assert kernels, name
        for kernel in kernels:
            fp32 = {k for k in task["dtypes"] if k.split(" ")[:2] == [kernel, "fp32"]}
            assert fp32 in ({f"{kernel} fp32"},
                            {f"{kernel} fp32 FLAT=0", f"{kernel} fp32 FLAT=1"}), (name, fp32)
    cubins = [r["cubin_bytes"] for task in results.values() for r in task["dtypes"].values()]
    assert min(cubins) > 1000
    if not first:
        # identical kernels were compiled once
        assert 0 < report["compiles"] <= len(cubins)
        return
    # the representatives' kernels in every dtype
    for name in DTYPE_TASKS:
        dtypes = {k.split(" ")[1] for k in results[name]["dtypes"]}
        assert dtypes == set(DTYPES), (name, dtypes)
    relu = results["relu"]["dtypes"]
    assert {k.split(" ", 1)[1] for k in relu} == {f"{d} FLAT={f}" for d in DTYPES for f in (0, 1)}
    matmul = {k.split(" ")[0] for k in results["matmul"]["dtypes"]}
    assert any(k.startswith("matmul_") for k in matmul), matmul
    assert len(cubins) >= 2 * len(list(TASKS.glob("*.py"))) + len(SCHEDULES)
    # identical kernels were compiled once
    assert 0 < report["compiles"] < len(cubins)
