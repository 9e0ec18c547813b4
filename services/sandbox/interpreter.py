"""A faster ``tl.dot`` for Triton's CPU interpreter (``TRITON_INTERPRET=1``).

Triton 3.9's interpreter runs ``tl.dot(a, b, acc)`` as
``np.matmul(a, b, dtype=acc.dtype) + acc``; the ``dtype`` keeps int8 products from
wrapping around (triton-lang/triton pull request 3566). Given a ``dtype``, numpy takes
its generic matmul loop instead of BLAS, even when no cast is needed: a float32
128 x 64 by 64 x 128 tile took 3.7 ms against 0.03 ms through BLAS (one BLAS thread,
measured on a 2-core machine), and a built-in coder matmul of 2 x 2304 by 2304 x 1024
in 128 x 128 x 64 tiles ran 4x faster as a whole.

:func:`install` replaces the interpreter's ``create_dot`` with one that calls
``np.matmul(a, b)`` when both operands already have the accumulator's dtype (the
case of every float32 ``tl.dot``), and the original otherwise (int8, float16 and
bfloat16 operands, float8). The product is the same float32 sum of products; only the
order of its additions differs, as it does between GPU tile shapes.

The sandbox's fork server installs it on the cpu backend before any child forks
(:mod:`services.sandbox.forkserver`), so every reference, candidate and lowering child
runs with it; a candidate's own code cannot undo it for the reference, which runs in
another process.
"""

from __future__ import annotations

from typing import Any

_INSTALLED = "_aikg_blas_dot"


def install() -> bool:
    """Patch ``triton.runtime.interpreter.InterpreterBuilder.create_dot``; idempotent.

    Returns:
        True when the patch is in place, False when this Triton has no interpreter
        builder with a ``create_dot`` (another version: left as it is).
    """
    import numpy as np
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None:
        return False
    if getattr(original, _INSTALLED, False):
        return True
    handle = interpreter.TensorHandle

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any,
                   max_num_imprecise_acc: Any) -> Any:
        acc = d.data
        if a.data.dtype == b.data.dtype == acc.dtype and acc.dtype.kind == "f":
            return handle(np.matmul(a.data, b.data) + acc, d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    setattr(create_dot, _INSTALLED, True)
    builder.create_dot = create_dot
    return True
