"""Hostile relu candidates against the dispatcher's refusal (D002), the decoys and the
replay (D011) and their static rules (S016, S022, S023), on the cpu backend.

Each test is one candidate that computes the relu outside Triton kernels (numpy,
Python, PyTorch hidden from the op recorder, or code run after the record stops) and
asserts it does not pass verification, with the static check on and, separately, off
(the dynamic checks alone).

Each also tries to tell a ghost run from a real one: a ``scratch_kernel`` launch
writes 0.0 into a ``torch.ones(1)`` flag (never NaN-filled); where launches are no-ops
the flag stays 1.0 and forward returns an output nothing wrote. The candidate's process
only ever runs as a ghost, on decoys, so every one of them returns that output; the
control test drops the dodge and the host computation is seen for what it is.

These attacks once reached what no in-process instrument can see or keep (torch's C
tensor methods, the dispatch mode stack, the recorder's own counters) and passed with
the static check off; no fact the verdict rests on lives in that process any more.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.hostile.test_verdict_integrity import HEADER, RELU_KERNEL, request

SMALL = {"batch_size": 2, "dim": 96}



# Forward prologue: returns garbage in the ghost replay (launches are no-ops).
GHOST_CHECK = """
flag = torch.ones(1, device=x.device)
scratch_kernel[(1,)](flag, 1, BLOCK_SIZE=16)
x = x.contiguous()
out = torch.empty_like(x)
if flag[0].item() != 0:
    return out
"""


def candidate(forward: str, module: str = "", init: str = "") -> str:
    body = textwrap.indent(GHOST_CHECK.strip() + "\n" + textwrap.dedent(forward).strip(),
                           " " * 8)
    init_body = textwrap.indent("super().__init__()\n" + textwrap.dedent(init).strip(),
                                " " * 8)
    return (HEADER + "import numpy\nimport operator\nimport inspect\n"
            + textwrap.dedent(module) + RELU_KERNEL
            + "\n\nclass ModelNew(nn.Module):\n"
            f"    def __init__(self):\n{init_body}\n\n"
            f"    def forward(self, x):\n{body}\n")


# name -> (module, forward, init)
ATTACKS: dict[str, tuple[str, str, str]] = {
    # The C method directly (S022 refuses the name; the guard cannot wrap it).
    "tensorbase-numpy-direct": ("", """
torch._C.TensorBase.numpy(out)[...] = numpy.maximum(torch._C.TensorBase.numpy(x), 0)
return out
""", ""),
    # numpy view of raw memory: a class whose __array_interface__ (a property: a
    # FunctionDef name, never an ast.Attribute) points at data_ptr().
    "array-interface-property": ("""
class Raw:
    def __init__(self, t):
        self.t = t

    @property
    def __array_interface__(self):
        return {"data": (self.t.data_ptr(), False), "shape": tuple(self.t.shape),
                "typestr": "<f4", "version": 3}
""", """
dst = numpy.asarray(Raw(out))
dst[...] = numpy.maximum(numpy.asarray(Raw(x)), 0)
return out
""", ""),
    # torch._C.TensorBase.numpy through super(): the C method, never wrapped.
    "super-methodcaller-numpy": ("", """
src = operator.methodcaller("numpy")(super(torch.Tensor, x))
dst = operator.methodcaller("numpy")(super(torch.Tensor, out))
dst[...] = numpy.maximum(src, 0)
return out
""", ""),
    # TensorBase found by inspect.getmro, its numpy by a literal attrgetter.
    "getmro-attrgetter-numpy": ("", """
base = inspect.getmro(torch.Tensor)[1]
np_of = operator.attrgetter("numpy")(base)
np_of(out)[...] = numpy.maximum(np_of(x), 0)
return out
""", ""),
    # getattr with a computed name is allowed on a name called `self`: any parameter.
    "getattr-on-a-param-named-self": ("""
def pick(self, name):
    return getattr(self, name)
""", """
base = pick(torch.Tensor, "__b" + "ase__")
np_of = pick(base, "nu" + "mpy")
np_of(out)[...] = numpy.maximum(np_of(x), 0)
return out
""", ""),
    # Restore the unwrapped numpy onto torch.Tensor through setattr(self, ...).
    "restore-wrapped-method": ("""
def pick(self, name):
    return getattr(self, name)


def put(self, name, value):
    setattr(self, name, value)
""", """
name = "nu" + "mpy"
put(torch.Tensor, name, pick(pick(torch.Tensor, "__b" + "ase__"), name))
pick(out, name)()[...] = numpy.maximum(pick(x, name)(), 0)
return out
""", ""),
    # The dispatch mode turned off around torch.relu, in a helper forward reaches
    # through an attribute set in __init__ (the static walk does not follow it).
    "disable-torch-dispatch": ("""
def helper(x, out):
    with torch._C._DisableTorchDispatch():
        out.copy_(torch.relu(x))
    return out
""", """
return self.h(x, out)
""", "self.h = helper"),
    "disable-current-modes": ("""
def helper(x, out):
    with torch.utils._python_dispatch._disable_current_modes():
        out.copy_(torch.relu(x))
    return out
""", """
return self.h(x, out)
""", "self.h = helper"),
    # The recorder is the mode on torch's stack: clear what it recorded.
    "clear-the-recorder": ("""
def helper(x, out):
    rec = torch.utils._python_dispatch._get_current_dispatch_mode()
    out.copy_(torch.relu(x))
    rec.ops.clear()
    return out
""", """
return self.h(x, out)
""", "self.h = helper"),
    # .item() reads, the per-call counter reset afterwards.
    "reset-host-counter": ("""
def helper(x, out):
    rec = torch.utils._python_dispatch._get_current_dispatch_mode()
    src, dst = x.reshape(-1), out.reshape(-1)
    for i in range(src.shape[0]):
        v = src[i].item()
        dst[i] = v if v > 0 else 0.0
    rec._call_elements = 0
    return out
""", """
return self.h(x, out)
""", "self.h = helper"),
    # Output is a tensor subclass that computes on the harness's first call after
    # forward (untyped_storage in _aliasing), when no recorder is active.
    "lazy-subclass-output": ("""
class Lazy(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            for t in args:
                src = getattr(t, "_src", None)
                if src is not None:
                    t.copy_(torch.relu(src))
                    t._src = None
        return super().__torch_function__(func, types, args, kwargs or {})


def lazy(x, out):
    res = out.as_subclass(Lazy)
    res._src = x
    return res
""", """
return self.h(x, out)
""", "self.h = lazy"),
    # Element-by-element through Python iteration and float().
    "iterate-float": ("", """
vals = [float(v) for v in x.reshape(-1)]
dst = out.reshape(-1)
for i, v in enumerate(vals):
    dst[i] = v if v > 0 else 0.0
return out
""", ""),
    # Parse the tensor's repr.
    "repr-parse": ("""
import re


def helper(x, out):
    torch.set_printoptions(threshold=100000, precision=10, sci_mode=True)
    vals = [float(s) for s in re.findall(r"-?\\d\\.\\d+e[+-]\\d+", repr(x))]
    dst = out.reshape(-1)
    for i, v in enumerate(vals):
        dst[i] = v if v > 0 else 0.0
    return out
""", """
return self.h(x, out)
""", "self.h = helper"),
    # numpy.from_dlpack calls __dlpack__ from C.
    "numpy-from-dlpack": ("", """
dst = numpy.from_dlpack(out)
dst[...] = numpy.maximum(numpy.from_dlpack(x), 0)
return out
""", ""),
    # __reduce_ex__ hands the storage to the pickler's rebuild function.
    "reduce-ex-storage": ("", """
red = x.__reduce_ex__(2)
storage = red[1][0]
src = numpy.frombuffer(bytes(storage), dtype=numpy.float32).reshape(x.shape)
dst = numpy.asarray(out)
dst[...] = numpy.maximum(src, 0)
return out
""", ""),
    # A kernel whose body (Python on the interpreter) calls a helper on globals.
    "kernel-body-python": ("""
STATE = {}


def cheat():
    STATE["out"].copy_(torch.relu(STATE["x"]))


@triton.jit
def host_kernel(x_ptr):
    cheat()
""", """
STATE["x"], STATE["out"] = x, out
host_kernel[(1,)](x)
return out
""", ""),
}

async def _run(verifier, name):
    module, forward, init = ATTACKS[name]
    result = await verifier.verify(request(candidate(forward, module, init),
                                           shape_overrides=SMALL), device="0")
    print(f"\n[{name}] passed={result.passed} stage={result.stage} "
          f"error={(result.error or '')[:160]!r} ghost={result.ghost_replay!r} "
          f"sizes={result.sizes_checked}")
    return result


@pytest.mark.parametrize("name", list(ATTACKS))
async def test_attack_static_on(shared_verifier, name):
    result = await _run(shared_verifier, name)
    assert not result.passed, result


@pytest.mark.parametrize("name", list(ATTACKS))
async def test_attack_dynamic_only(shared_verifier, dynamic_only, name):
    """Every attack fails on the dynamic checks alone: the candidate's host code only
    ever sees decoys in a ghost run, so the dodge returns an output no kernel wrote, and
    torch hidden from any recorder is refused at the dispatcher."""
    result = await _run(shared_verifier, name)
    assert not result.passed, result
    if name == "kernel-body-python":
        # The kernel module keeps no host helper: the kernel naming one is refused.
        assert result.stage == "compile" and "uses the name 'cheat'" in result.error, result
        return
    assert result.stage in ("mismatch", "audit"), result
    if result.stage == "mismatch":
        assert "was never written" in result.error, result.error


async def test_without_the_ghost_dodge_the_replay_catches_it(shared_verifier, dynamic_only):
    """Control: the super() numpy attack minus the flag check fails the ghost replay
    with the static check off, so the flag read (one .item()) is what dodges it."""
    code = candidate("""
src = operator.methodcaller("numpy")(super(torch.Tensor, x))
dst = operator.methodcaller("numpy")(super(torch.Tensor, out))
dst[...] = numpy.maximum(src, 0)
return out
""").replace("        if flag[0].item() != 0:\n            return out\n", "")
    assert "flag[0].item()" not in code
    result = await shared_verifier.verify(request(code, shape_overrides=SMALL), device="0")
    print(f"\n[control-no-ghost-dodge] stage={result.stage} error={(result.error or '')[:160]!r}")
    assert not result.passed, result
    assert "computed outside the Triton kernels" in result.error, result.error
