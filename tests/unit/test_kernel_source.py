"""The kernel module the replayer and the GPU compile check load
(services/worker/kernel_source.py): what it keeps, and the kernels it refuses because
the interpreter and the GPU compiler would see them differently (rule D013)."""

from __future__ import annotations

import textwrap

import pytest

from services.worker.kernel_source import kernel_module

HONEST = textwrap.dedent('''\
    import math
    import torch
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton import cdiv

    BLOCK = 256
    SCALE = tl.constexpr(math.sqrt(2.0) / 2)
    ROWS = cdiv(1000, BLOCK)
    DTYPE = tl.float32
    TABLE = torch.arange(4)


    @triton.jit
    def helper(x):
        return x * SCALE


    @triton.autotune(configs=[triton.Config({"B": 64})], key=["n"])
    @triton.jit
    def gelu_kernel(x_ptr, out_ptr, n, B: tl.constexpr, EPS: tl.constexpr = 1e-6):
        offs = tl.program_id(0) * B + tl.arange(0, B)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m).to(DTYPE)
        for i in tl.static_range(2):
            x = x + 0.0 * i
        y = 0.5 * x * (1 + libdevice.erf(helper(x))) + tl.math.exp(x) * 0.0
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=m)


    def launch(x):
        return x
''')


def test_an_honest_module_keeps_its_kernels_constants_and_line_numbers():
    module = kernel_module(HONEST)
    assert module.refused == []
    assert module.kernels == ["helper", "gelu_kernel"]
    assert module.constexpr_params["gelu_kernel"] == {"B", "EPS"}
    lines = module.source.splitlines()
    assert len(lines) == len(HONEST.splitlines())
    kept = {line.split(" =")[0] for line in lines if " = " in line and line[:1].isupper()}
    assert kept == {"BLOCK", "SCALE", "ROWS", "DTYPE"}  # TABLE needs torch: not kept
    assert "import torch" not in module.source and "def launch" not in module.source
    assert "@triton.autotune" not in module.source
    compile(module.source, "candidate.py", "exec")


@pytest.mark.parametrize(("body", "found"), [
    ("if triton.knobs.runtime.interpret:\n        x = x + 1",
     "reaches triton.knobs.runtime.interpret"),
    ("x.handle.data = x.handle.data.clip(0)", "reads the attribute 'handle'"),
    ("x = x.__class__", "reads the attribute '__class__'"),
    ("x = tl.core.builtins.getattr(x, 'handle')", "reads the attribute 'core'"),
    ("x = getattr(x, 'handle')", "uses the name 'getattr'"),
    ("x = np.maximum(x, 0)", "uses the name 'np'"),
    ("x = FLAG + x", "uses the module-level name 'FLAG', whose value "
                     "(tl.constexpr(triton.knobs.runtime.interpret)) is not a plain constant"),
    ("x = importlib.import_module('os')", "uses the name 'importlib'"),
    ("f = lambda v: v\n    x = f(x)", "contains a Lambda statement"),
])
def test_a_kernel_that_names_what_the_compiler_sees_otherwise_is_refused(body, found):
    source = textwrap.dedent('''\
        import numpy as np
        import triton
        import triton.language as tl
        from triton.knobs import importlib

        FLAG = tl.constexpr(triton.knobs.runtime.interpret)


        @triton.jit
        def k(x_ptr, n, B: tl.constexpr):
            x = tl.load(x_ptr + tl.arange(0, B))
            BODY
            tl.store(x_ptr + tl.arange(0, B), x)
        ''').replace("BODY", body)
    module = kernel_module(source)
    assert any(found in message for message in module.refused), module.refused
    assert all(message.startswith("the Triton kernel k ") for message in module.refused)
    assert "FLAG =" not in module.source
    assert "from triton.knobs import importlib" not in module.source


def test_constants_may_call_only_what_computes_a_constant():
    source = textwrap.dedent('''\
        import triton
        import triton.language as tl
        from triton.language.core import builtins

        A = tl.constexpr(4)
        B = builtins.setattr(tl, "x", 1)
        C = triton.next_power_of_2(A * 3)
        D = triton.compile
        E = max(A, 2)
        ''')
    module = kernel_module(source)
    kept = [line.split(" =")[0] for line in module.source.splitlines() if " = " in line]
    assert kept == ["A", "C", "E"]
    assert "builtins" not in module.source


TWINS = textwrap.dedent('''\
    import triton
    import triton.language as tl


    @triton.jit
    def scale_kernel_1(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)


    @triton.jit
    def scale_kernel_2(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)


    @triton.jit
    def scale_kernel_3(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 3.0, mask=offs < n)
''')


def _launch(kernel: str, n: int, block: int) -> tuple[str, dict]:
    tensor = {"~": "T", "s": 0, "o": 0, "z": [n], "d": "float32"}
    return ("the checked sizes", {"launch": kernel, "args": {"x_ptr": tensor, "n": n,
                                                             "BLOCK": block}, "grid": [4]})


def test_kernels_alike_but_for_their_names_are_compiled_once():
    from services.worker import aot
    from services.worker.targets import target_for

    module = kernel_module(TWINS)
    assert module.bodies["scale_kernel_1"] == module.bodies["scale_kernel_2"]
    assert module.bodies["scale_kernel_3"] != module.bodies["scale_kernel_1"]
    launches = [_launch("scale_kernel_1", 1000, 256), _launch("scale_kernel_2", 1000, 256),
                _launch("scale_kernel_3", 1000, 256), _launch("scale_kernel_2", 1000, 512)]
    target = target_for("x86_64")
    specs, notes = aot.specs(launches, module.constexpr_params, target, "sha", module.bodies)
    assert notes == []
    # 1 and 2 at BLOCK 256 are one compile (the first's name); 3 and BLOCK 512 their own
    assert [(s.kernel, dict(s.constexprs)[("BLOCK",)]) for s in specs] == [
        ("scale_kernel_1", 256), ("scale_kernel_3", 256), ("scale_kernel_2", 512)]
    # without the digests (another caller), each kernel is its own compile
    specs, _ = aot.specs(launches, module.constexpr_params, target, "sha")
    assert len(specs) == 4


def test_twins_that_compile_differently_are_not_one_compile():
    # a hostile twin: the same body under other jit options, or naming itself (a call
    # the compiler must resolve), must get its own compile, not its twin's verdict
    base = TWINS.split("@triton.jit\ndef scale_kernel_2")[0]
    body = TWINS.split("def scale_kernel_1")[1].split("\n\n\n")[0]
    options = base + "@triton.jit(do_not_specialize=['n'])\ndef scale_kernel_2" + body + "\n"
    module = kernel_module(options)
    assert module.bodies["scale_kernel_1"] != module.bodies["scale_kernel_2"]
    naming = base + "@triton.jit\ndef scale_kernel_2" + body.replace(
        "* 2.0", "* 2.0 + 0 * scale_kernel_2") + "\n"
    module = kernel_module(naming)
    assert module.bodies["scale_kernel_1"] != module.bodies["scale_kernel_2"]


def test_a_mixed_import_line_keeps_its_triton_and_math_names():
    # `import torch, triton.language as tl` is one line an LLM writes: the kernel module
    # keeps tl (and math) from it, on the same line, and leaves torch out.
    module = kernel_module(textwrap.dedent('''\
        import torch, triton, triton.language as tl, math
        from torch import nn
        from triton.language import arange, _private


        @triton.jit
        def relu_kernel(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + arange(0, BLOCK)
            tl.store(x_ptr + offs, tl.maximum(tl.load(x_ptr + offs), 0.0), mask=offs < n)
        '''))
    lines = module.source.splitlines()
    assert lines[0] == "import triton, triton.language as tl, math"
    assert lines[1] == ""
    assert lines[2] == "from triton.language import arange"
    assert module.kernels == ["relu_kernel"] and module.refused == []
    compile(module.source, "kernels.py", "exec")
