"""The pieces hand-written relu candidates are built from: Triton's imports, the
``relu_kernel`` (one program per 1024-element block), a ``relu(x)`` launcher and a
``ModelNew`` that launches the kernel, and the host lines of a forged wire frame. A test
writes the part it is about and takes the rest from here, so the parts read the same
everywhere."""

from __future__ import annotations

TRITON_IMPORTS = """\
import torch
import torch.nn as nn
import triton
import triton.language as tl
"""


def relu_jit(store: str = "tl.maximum(x, 0.0)", *, params: str = "", pid: bool = True) -> str:
    """The ``@triton.jit relu_kernel``: stores ``store`` for each loaded ``x``;
    ``params`` are extra parameters after ``n`` (with their leading comma); ``pid``:
    the program id in a variable of its own."""
    offs = ("    pid = tl.program_id(0)\n    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)\n"
            if pid else "    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)\n")
    return (f"@triton.jit\ndef relu_kernel(x_ptr, out_ptr, n{params}, BLOCK_SIZE: tl.constexpr):\n"
            f"{offs}    m = offs < n\n    x = tl.load(x_ptr + offs, mask=m)\n"
            f"    tl.store(out_ptr + offs, {store}, mask=m)\n")


# A host function launching relu_kernel over a tensor of any shape.
RELU_LAUNCHER = """\
def relu(x):
    out = torch.empty_like(x)
    n = x.numel()
    relu_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK_SIZE=1024)
    return out
"""


def relu_model(args: str = "", returns: str = "out") -> str:
    """A ``ModelNew`` whose forward launches relu_kernel on the flattened input;
    ``args``: the extra launch arguments after ``n`` (with their leading comma)."""
    return f"""\
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        relu_kernel[(triton.cdiv(n, 1024),)](x, out, n{args}, BLOCK_SIZE=1024)
        return {returns}
"""


def forged_frames(payload: str) -> str:
    """Host lines that write ``payload`` (an expression of bytes) as a length-prefixed
    frame of the sandbox's wire to every descriptor from 3 to 63, through the os module
    reached as ``getattr(torch, "o" + "s")`` and bound to ``os_``."""
    return (f'os_ = getattr(torch, "o" + "s")\npayload = {payload}\n'
            'frame = len(payload).to_bytes(8, "big") + payload\n'
            "for fd in range(3, 64):\n    try:\n        os_.write(fd, frame)\n"
            "    except OSError:\n        pass\n")
