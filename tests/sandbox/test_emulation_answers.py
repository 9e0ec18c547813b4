"""The CUDA emulation of the cpu backend answers as the request's GPU would
(services/worker/emulation.py), to the candidate's code wherever it asks: in
``__init__``, in a ``@triton.heuristics`` lambda, in an autotuner's
``prune_configs_by``, in ``forward`` at the checked sizes and in the dry run at the
task's own sizes (meta tensors there, which must answer as CUDA tensors too).

The candidate below records every answer and, at its first real call, raises naming
each one that differs from the GPU's: so the verdict passes only if all were right. The
expected facts are the parts' datasheet figures, written here independently of the
emulation's table. The hostile corpus (class 7, ``emulation_told_*``,
``dry_run_told_by_is_meta``) holds candidates that compute right only where an answer
tells on the emulation.
"""

from __future__ import annotations

import uuid

import pytest

from schemas.events import VerifyRequest
from services.common.verify_client import build_request
from tests.corpus import TASKS

MIB = 1 << 20
# arch -> (device name, capability, SMs, L2 bytes, device memory above, below (bytes)).
GPUS = {
    "h100": ("NVIDIA H100 80GB HBM3", (9, 0), 132, 50 * MIB, 79 * 10**9, 86 * 10**9),
    "4090": ("NVIDIA GeForce RTX 4090", (8, 9), 128, 72 * MIB, 23 * 10**9, 26 * 10**9),
    "a100_40gb": ("NVIDIA A100-SXM4-40GB", (8, 0), 108, 40 * MIB, 39 * 10**9, 43 * 10**9),
    # ROCm's torch: gfx942 is capability (9, 4), a CU is a multiprocessor, 4 MB of L2
    # per XCD, 192 GB of HBM3.
    "mi300x": ("AMD Instinct MI300X", (9, 4), 304, 4 * MIB, 190 * 10**9, 210 * 10**9),
}

CANDIDATE = '''
import torch
import torch.nn as nn
import triton
import triton.language as tl

GPU = {gpu!r}
SEEN = []
DRY = []


def ask(where, t=None):
    name, capability, sms, l2, low, high = GPU
    props = torch.cuda.get_device_properties(0)
    got = {{
        "get_device_name": torch.cuda.get_device_name() == name,
        "props.name": props.name == name,
        "capability": torch.cuda.get_device_capability() == capability,
        "major/minor": (props.major, props.minor) == capability,
        "multi_processor_count": props.multi_processor_count == sms,
        "L2_cache_size": props.L2_cache_size == l2,
        "total_memory": low < props.total_memory < high,
        "props type": type(props).__name__ == "_CudaDeviceProperties",
        "repr": repr(props).startswith("_CudaDeviceProperties(name='" + name),
        "is_available": torch.cuda.is_available() is True,
        "device_count": torch.cuda.device_count() == 1,
        "current_device": torch.cuda.current_device() == 0,
        "version.cuda": isinstance(torch.version.cuda, str) and "." in torch.version.cuda,
        "__version__": "+cu" in torch.__version__ and "+cu" in torch.version.__version__,
        "backends.cuda.is_built": torch.backends.cuda.is_built() is True,
        "cudnn.is_available": torch.backends.cudnn.is_available() is True,
        "cudnn.version": isinstance(torch.backends.cudnn.version(), int),
        "cuda._is_compiled": torch.cuda._is_compiled() is True,
        "config.show": "USE_CUDA=ON" in torch.__config__.show(),
    }}
    if t is not None:
        got.update({{
            "is_cpu": t.is_cpu is False, "is_cuda": t.is_cuda is True,
            "is_meta": t.is_meta is False, "get_device": t.get_device() == 0,
            "device.type": t.device.type == "cuda", "device.index": t.device.index == 0,
            "device": t.device == torch.device("cuda", 0),
            "data_ptr": t.data_ptr() != 0 and t.data_ptr() % 256 == 0,
        }})
    SEEN.extend(f"{{where}}: {{k}}" for k, ok in got.items() if not ok)
    return True


def prune(configs, named_args, **kwargs):
    ask("prune_configs_by", named_args["x_ptr"])
    return configs


@triton.autotune(configs=[triton.Config({{"BLOCK": 512}}), triton.Config({{"BLOCK": 1024}})],
                 key=["n"], prune_configs_by={{"early_config_prune": prune}})
@triton.heuristics({{"ASKED": lambda args: ask("heuristics", args["x_ptr"])}})
@triton.jit
def relu_kernel(x_ptr, out_ptr, n, ASKED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.maximum(tl.load(x_ptr + offs, mask=m), 0.0), mask=m)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        ask("__init__", torch.empty(4, device="cuda"))
        self.calls = 0

    def forward(self, x):
        dry = x.numel() >= (1 << 20)
        ask("forward (dry run)" if dry else "forward", x)
        out = torch.empty_like(x)
        ask("forward output", out)
        n = x.numel()
        relu_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, out, n)
        if not dry:
            self.calls += 1
            if SEEN:
                raise RuntimeError("emulation told on itself: " + "; ".join(sorted(set(SEEN))))
            if not DRY:
                raise RuntimeError("the dry run at the task's own sizes never asked")
        else:
            DRY.append(n)
        return out
'''


def request(arch: str, expect: str | None = None) -> VerifyRequest:
    code = CANDIDATE.format(gpu=GPUS[expect or arch])
    return build_request(
        request_id=f"emulation-{uuid.uuid4().hex[:10]}", job_id="job-emulation",
        candidate_id="cand-emulation", op_name="relu", task_desc=TASKS["big_relu"],
        code=code, backend="cpu", arch=arch, timeout_s=120.0, trials=1,
        shape_overrides={"batch_size": 16})


@pytest.mark.parametrize("arch", sorted(GPUS))
async def test_every_answer_is_the_gpus(shared_verifier, dynamic_only, arch):
    """Every query of the candidate, wherever it asks, gets the arch's GPU's answer; the
    dry run at the task's own sizes ran and asked too. (The static check, off here,
    refuses the queries in forward; the emulation must answer them anyway.)"""
    result = await shared_verifier.verify(request(arch), device="0")
    assert result.passed, (result.stage, result.error)
    assert any("CUDA was emulated" in n for n in result.notes), result.notes


async def test_a_wrong_answer_is_named(shared_verifier, dynamic_only):
    """The candidate's check is live: told to expect another GPU, it fails naming the
    answers that differ (so the test above cannot pass vacuously)."""
    result = await shared_verifier.verify(request("h100", expect="4090"), device="0")
    assert not result.passed
    assert result.stage == "runtime", (result.stage, result.error)
    for where in ("__init__", "heuristics", "prune_configs_by", "forward"):
        assert f"{where}: get_device_name" in result.error, result.error
    assert "L2_cache_size" in result.error and "is_cpu" not in result.error, result.error
