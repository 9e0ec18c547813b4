"""A CUDA device as a CUDA-written candidate expects one, on the cpu backend.

Candidates are written for GPUs: they assert ``x.is_cuda``, call ``.cuda()`` or
``.to("cuda")``, allocate with ``device="cuda"``, time themselves with
``torch.cuda.Event`` and ask Triton's driver for the SM count. On the cpu backend
:class:`CudaEmulation` answers as one GPU of the request's arch would (see
:mod:`services.worker.targets`), so the candidate takes the path it takes on a GPU
and is judged on that path:

* ``Tensor.is_cuda`` is true for tensors on the CPU (or on ``meta`` in the dry run)
  and ``Tensor.device`` is ``cuda:0`` for those on the CPU (torch's meta kernels,
  written in Python, read the device of meta tensors); ``Tensor.cuda()`` and ``.to("cuda")`` keep the
  tensor where it is; ``device="cuda"`` arguments of any torch function (a
  ``TorchFunctionMode``) allocate there.
* ``torch.cuda.is_available()`` is true; ``synchronize`` does nothing (every kernel
  has finished when its launch returns); ``Event`` measures the host clock;
  ``get_device_properties`` / ``get_device_capability`` / ``current_device`` /
  ``device_count`` describe the arch's GPU.
* Triton's ``driver.active`` is such a GPU (``utils.get_device_properties`` gives its
  SM count and shared memory).

Only the candidate's planner child installs it; the verdict lists the CUDA calls the
candidate made (:attr:`CudaEmulation.used`) in its notes.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from services.worker.targets import GpuTarget

_CUDA = torch.device("cuda", 0)


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.split(":")[0] == "cuda"
    return isinstance(value, int) and not isinstance(value, bool)


class _Event:
    """``torch.cuda.Event`` on the host clock (milliseconds between records)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self._at: float | None = None

    def record(self, stream: Any = None) -> None:
        self._at = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _Event) -> float:
        if self._at is None or end._at is None:
            raise RuntimeError("Events must be recorded before elapsed_time")
        return (end._at - self._at) * 1000.0


class _Stream:
    """The default stream: work is done when its launch returns."""

    cuda_stream = 0
    device = _CUDA

    def synchronize(self) -> None:
        return None

    def wait_stream(self, other: Any) -> None:
        return None

    def query(self) -> bool:
        return True

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _Properties:
    def __init__(self, target: GpuTarget) -> None:
        self.name = f"AIKG emulated {target.name.upper()} (cpu backend)"
        self.major, self.minor = divmod(target.capability, 10)
        self.multi_processor_count = target.sms
        self.total_memory = 80 << 30
        self.warp_size = 32
        self.max_threads_per_multi_processor = 2048
        self.shared_memory_per_block_optin = target.shared_bytes
        self.regs_per_multiprocessor = 65536


class _DeviceMode(TorchFunctionMode):
    """Rewrites CUDA devices in torch calls to the emulation's real device."""

    def __init__(self, emulation: CudaEmulation) -> None:
        super().__init__()
        self.emulation = emulation

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        target = self.emulation.target
        name = getattr(func, "__name__", "")
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            self.emulation.used.add("Tensor.cuda()")
            return args[0]
        changed = False
        if "device" in kwargs and kwargs["device"] is not None and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = target
            changed = True
        if name == "to" and args:
            rest = list(args[1:])
            for i, value in enumerate(rest):
                if (isinstance(value, (str, torch.device)) and _is_cuda_device(value)):
                    rest[i] = target
                    changed = True
            args = (args[0], *rest)
        if changed:
            self.emulation.used.add("device='cuda'")
        return func(*args, **kwargs)


class CudaEmulation:
    """See the module doc. ``target``: where tensors really live (``cpu``; ``meta``
    during the dry run). ``used``: the CUDA calls the candidate made."""

    def __init__(self, target: GpuTarget) -> None:
        self.gpu = target
        self.target = torch.device("cpu")
        self.used: set[str] = set()
        self._mode = _DeviceMode(self)

    def install(self) -> None:
        """Patch torch and triton in this process and enter the device mode for good."""
        emulation = self
        base_device = torch._C.TensorBase.device.__get__
        real_types = ("cpu", "meta")
        # The C getter hands the access to torch-function modes, ours among them, which
        # would read this patched property again.
        no_modes = torch._C.DisableTorchFunction

        def real_device(tensor: torch.Tensor) -> torch.device:
            with no_modes():
                return base_device(tensor)

        def device(tensor: torch.Tensor) -> torch.device:
            # Not for meta tensors: torch's meta kernels, written in Python, read it.
            real = real_device(tensor)
            return _CUDA if real.type == "cpu" else real

        def is_cuda(tensor: torch.Tensor) -> bool:
            emulation.used.add("Tensor.is_cuda")
            return real_device(tensor).type in real_types

        torch.Tensor.device = property(device)
        torch.Tensor.is_cuda = property(is_cuda)
        cuda = torch.cuda
        props = _Properties(self.gpu)

        def note(name: str, value: Any) -> Any:
            # torch.manual_seed and friends call some of these themselves.
            quiet = name in ("manual_seed", "manual_seed_all", "is_initialized", "init")

            def call(*args: Any, **kwargs: Any) -> Any:
                if not quiet:
                    emulation.used.add(f"torch.cuda.{name}")
                return value(*args, **kwargs) if callable(value) else value

            call.__name__ = name
            return call

        for name, value in {
            "is_available": True, "is_initialized": True, "device_count": 1,
            "current_device": 0, "set_device": None, "synchronize": None, "init": None,
            "empty_cache": None, "get_device_name": props.name,
            "get_device_capability": (props.major, props.minor),
            "get_device_properties": props, "current_stream": _Stream(),
            "default_stream": _Stream(), "manual_seed": None, "manual_seed_all": None,
            "max_memory_allocated": 0, "memory_allocated": 0, "reset_peak_memory_stats": None,
            "mem_get_info": (props.total_memory, props.total_memory),
        }.items():
            setattr(cuda, name, note(name, value))
        cuda.Event = _Event
        cuda.Stream = _Stream
        self._mode.__enter__()
        self._install_triton_driver()

    def _install_triton_driver(self) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.runtime import driver

        gpu = self.gpu
        emulation = self

        class _Utils:
            @staticmethod
            def get_device_properties(device: int = 0) -> dict[str, int]:
                emulation.used.add("triton driver.utils.get_device_properties")
                return {"multiprocessor_count": gpu.sms, "max_shared_mem": gpu.shared_bytes,
                        "max_num_regs": 65536, "warpSize": 32, "sm_clock_rate": 1980000,
                        "mem_clock_rate": 2619000, "mem_bus_width": 5120}

        class _Driver:
            utils = _Utils()

            def get_current_device(self) -> int:
                return 0

            def set_current_device(self, device: int) -> None:
                return None

            def get_current_stream(self, device: int | None = None) -> int:
                return 0

            def get_current_target(self) -> Any:
                return GPUTarget("cuda", gpu.capability, 32)

            def get_active_torch_device(self) -> torch.device:
                return _CUDA

            def get_device_interface(self) -> Any:
                return torch.cuda

            def is_active(self) -> bool:
                return True

        driver.set_active(_Driver())
