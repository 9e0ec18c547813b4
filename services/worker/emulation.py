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
  ``get_device_name`` / ``get_device_properties`` / ``get_device_capability`` /
  ``current_device`` / ``device_count`` describe the arch's part (:data:`_PARTS`: its
  product name, memory, L2 size, clocks; a ``_CudaDeviceProperties`` with torch's
  ``repr``).
* To the candidate's own code (the nearest frame outside this module and the standard
  library is the candidate's file), a tensor on the CPU or on ``meta`` (the dry run)
  answers as a CUDA tensor: ``is_cpu`` and ``is_meta`` false, ``get_device()`` 0,
  ``device`` ``cuda:0``, ``data_ptr()`` a 512-byte-aligned device-like address (per
  storage, offsets kept); ``torch.get_default_device()`` is the CPU during the dry
  run. Torch's own code (its meta kernels, the harness) gets the truth.
* What the torch build says of itself, to the candidate's code: a CUDA build's
  (``torch.version.cuda`` ``"12.8"``, ``torch.__version__`` ``+cu128``,
  ``torch.backends.cuda.is_built()`` and ``torch.backends.cudnn.is_available()`` true,
  ``cudnn.version()`` 91002, ``torch.__config__.show()`` with CUDA on); torch's own
  code keeps the truth (its meta kernels read ``torch.version.cuda``).
* Triton's ``driver.active`` is such a GPU (``utils.get_device_properties`` gives its
  SM count and shared memory).

Only the candidate's planner child installs it; the verdict lists the CUDA calls the
candidate made (:attr:`CudaEmulation.used`) in its notes.
"""

from __future__ import annotations

import secrets
import sys
import sysconfig
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.torch_version import TorchVersion

from services.worker.targets import GpuTarget

_CUDA = torch.device("cuda", 0)
# What a CUDA build of torch says of itself: the CUDA toolkit it was built with (the
# ``cu128`` wheels of PyTorch's index, whose version tag it carries) and its cuDNN
# (``torch.backends.cudnn.version()``, major * 10000 + minor * 100 + patch: 9.10.2).
CUDA_VERSION = "12.8"
CUDA_TAG = "cu128"
CUDNN_VERSION = 91002
# Where the candidate sees device allocations start (a CUDA virtual address range).
_DEVICE_BASE = 0x7F0000000000


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


@dataclass(frozen=True)
class _Part:
    """What ``cudaGetDeviceProperties`` reports for one part (the fields torch and
    Triton's driver expose): ``name`` (the product name), ``memory`` (bytes of device
    memory: nvidia-smi's ``memory.total`` in MiB), ``l2`` (L2 cache bytes), ``sm_clock``
    and ``mem_clock`` (kHz), ``bus`` (memory bus width, bits)."""

    name: str
    memory: int
    l2: int
    sm_clock: int
    mem_clock: int
    bus: int


_MIB = 1 << 20
# Sources: NVIDIA's datasheets and architecture whitepapers (A100: 40 MB L2, 5120-bit
# HBM2e; H100 SXM5 / PCIe and H200: 50 MB L2, 5120-bit HBM3 / 6144-bit HBM3e; Ada
# RTX 4090 72 MB, L4 48 MB, L40S 96 MB of L2); product names and memory as nvidia-smi
# reports them for these parts.
_PARTS: dict[str, _Part] = {
    "a100": _Part("NVIDIA A100-SXM4-80GB", 81920 * _MIB, 40 * _MIB, 1410000, 1593000, 5120),
    "a100_80gb": _Part("NVIDIA A100-SXM4-80GB", 81920 * _MIB, 40 * _MIB, 1410000, 1593000,
                       5120),
    "a100_40gb": _Part("NVIDIA A100-SXM4-40GB", 40960 * _MIB, 40 * _MIB, 1410000, 1215000,
                       5120),
    "h100": _Part("NVIDIA H100 80GB HBM3", 81559 * _MIB, 50 * _MIB, 1980000, 2619000, 5120),
    "h100_sxm": _Part("NVIDIA H100 80GB HBM3", 81559 * _MIB, 50 * _MIB, 1980000, 2619000,
                      5120),
    "h100_pcie": _Part("NVIDIA H100 PCIe", 81559 * _MIB, 50 * _MIB, 1755000, 1593000, 5120),
    "h200": _Part("NVIDIA H200", 143771 * _MIB, 50 * _MIB, 1980000, 3201000, 6144),
    "4090": _Part("NVIDIA GeForce RTX 4090", 24564 * _MIB, 72 * _MIB, 2520000, 10501000, 384),
    "rtx4090": _Part("NVIDIA GeForce RTX 4090", 24564 * _MIB, 72 * _MIB, 2520000, 10501000,
                     384),
    "l4": _Part("NVIDIA L4", 23034 * _MIB, 48 * _MIB, 2040000, 6251000, 192),
    "l40s": _Part("NVIDIA L40S", 46068 * _MIB, 96 * _MIB, 2520000, 9001000, 384),
}
_PARTS["sm_80"], _PARTS["sm_89"], _PARTS["sm_90"] = _PARTS["a100"], _PARTS["4090"], \
    _PARTS["h100"]
# AMD Instinct (ROCm's "AMD GPU specifications" and the datasheets: MI300X 192 GB HBM3,
# 8192-bit, 2100 MHz peak engine clock, 4 MB L2 per XCD as a device reports it; one
# MI250/MI250X GCD: 64 GB HBM2e, 4096-bit, 1700 MHz, 8 MB L2), named as
# ``torch.cuda.get_device_name`` gives them on ROCm.
_PARTS["mi300x"] = _PARTS["gfx942"] = _Part("AMD Instinct MI300X", 196592 * _MIB, 4 * _MIB,
                                            2100000, 1300000, 8192)
_PARTS["mi250x"] = _PARTS["gfx90a"] = _Part("AMD Instinct MI250X", 65520 * _MIB, 8 * _MIB,
                                            1700000, 1600000, 4096)
_PARTS["mi250"] = _Part("AMD Instinct MI250", 65520 * _MIB, 8 * _MIB, 1700000, 1600000, 4096)
# Per compute capability (CUDA C++ Programming Guide, technical specifications): threads
# and shared memory per multiprocessor.
_THREADS_PER_SM = {80: 2048, 86: 1536, 89: 1536, 90: 2048}
_SHARED_PER_SM = {80: 167936, 86: 102400, 89: 102400, 90: 233472}


def part_of(target: GpuTarget) -> _Part:
    """The part a target stands for (its datasheet part; see :data:`_PARTS`)."""
    return _PARTS.get(target.name, _PARTS["h100"])


class _CudaDeviceProperties:
    """What ``torch.cuda.get_device_properties`` returns on a GPU build (the same class
    name, fields and ``repr``), for the target's part."""

    def __init__(self, target: GpuTarget) -> None:
        part = part_of(target)
        self.name = part.name
        self.major, self.minor = divmod(target.capability, 10)
        self.total_memory = part.memory
        self.multi_processor_count = target.sms
        self.is_integrated = 0
        self.is_multi_gpu_board = 0
        self.max_threads_per_multi_processor = _THREADS_PER_SM.get(target.capability, 2048)
        self.max_threads_per_block = 1024
        self.warp_size = target.warp_size
        self.regs_per_multiprocessor = 65536
        self.shared_memory_per_block = 49152 if target.backend == "cuda" else target.shared_bytes
        self.shared_memory_per_block_optin = target.shared_bytes
        self.shared_memory_per_multiprocessor = (
            _SHARED_PER_SM.get(target.capability, target.shared_bytes)
            if target.backend == "cuda" else target.occupancy.shared)
        self.L2_cache_size = part.l2
        self.clock_rate = part.sm_clock
        self.memory_clock_rate = part.mem_clock
        self.memory_bus_width = part.bus
        self.uuid = str(uuid.UUID(int=secrets.randbits(128), version=4))
        self.pci_bus_id, self.pci_device_id, self.pci_domain_id = 0x18, 0, 0
        self.gcnArchName = ("NVIDIA CUDA" if target.backend == "cuda"
                            else f"{target.gfx}:sramecc+:xnack-")

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, "
                f"minor={self.minor}, total_memory={self.total_memory // _MIB}MB, "
                f"multi_processor_count={self.multi_processor_count}, uuid={self.uuid}, "
                f"pci_bus_id={self.pci_bus_id}, pci_device_id={self.pci_device_id}, "
                f"pci_domain_id={self.pci_domain_id}, "
                f"L2_cache_size={self.L2_cache_size // _MIB}MB)")


_CudaDeviceProperties.__module__ = "torch._C"


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


def _cuda_build_settings(text: str) -> str:
    """``torch.__config__.show()`` of a cpu build as a CUDA build's says it."""
    for old, new in (("USE_CUDA=0", "USE_CUDA=ON"), ("USE_CUDA=OFF", "USE_CUDA=ON"),
                     ("USE_CUDNN=OFF", "USE_CUDNN=ON"), ("USE_NCCL=OFF", "USE_NCCL=1")):
        text = text.replace(old, new)
    return text.replace("  - CPU capability usage:",
                        f"  - CUDA Runtime {CUDA_VERSION}\n"
                        f"  - CuDNN {CUDNN_VERSION // 10000}.{CUDNN_VERSION // 100 % 100}."
                        f"{CUDNN_VERSION % 100}\n  - CPU capability usage:")


def _candidate_frame(filename: str | None) -> bool:
    """Whether the code asking (the nearest frame outside this module and the standard
    library, two frames up: past the patched getter) is the candidate's module."""
    if filename is None:
        return False
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != __file__ and not name.startswith(_STDLIB):
            return name == filename
        frame = frame.f_back
    return False


_STDLIB = sysconfig.get_paths()["stdlib"] + "/"


class CudaEmulation:
    """See the module doc. ``target``: where tensors really live (``cpu``; ``meta``
    during the dry run). ``used``: the CUDA calls the candidate made. ``candidate``:
    the candidate module's file, whose code gets a GPU's answers where torch's own code
    (its meta kernels, the harness) must get the truth."""

    def __init__(self, target: GpuTarget, candidate: str | None = None) -> None:
        self.gpu = target
        self.target = torch.device("cpu")
        self.used: set[str] = set()
        self.candidate = candidate
        self._mode = _DeviceMode(self)

    def install(self) -> None:
        """Patch torch and triton in this process and enter the device mode for good."""
        emulation = self
        candidate = self.candidate
        base = torch._C.TensorBase
        base_device = base.device.__get__
        base_is_cpu = base.is_cpu.__get__
        base_is_meta = base.is_meta.__get__
        base_get_device = base.get_device
        base_data_ptr = base.data_ptr
        real_types = ("cpu", "meta")
        # The C getter hands the access to torch-function modes, ours among them, which
        # would read this patched property again.
        no_modes = torch._C.DisableTorchFunction

        def real_device(tensor: torch.Tensor) -> torch.device:
            with no_modes():
                return base_device(tensor)

        def device(tensor: torch.Tensor) -> torch.device:
            # A meta tensor's truth for torch's meta kernels (written in Python), which
            # read it; cuda:0 for the candidate's code.
            real = real_device(tensor)
            if real.type == "cpu" or real.type == "meta" and _candidate_frame(candidate):
                return _CUDA
            return real

        def is_cuda(tensor: torch.Tensor) -> bool:
            emulation.used.add("Tensor.is_cuda")
            return real_device(tensor).type in real_types

        def is_cpu(tensor: torch.Tensor) -> bool:
            with no_modes():
                real = base_is_cpu(tensor)
            return real and not _candidate_frame(candidate)

        def is_meta(tensor: torch.Tensor) -> bool:
            with no_modes():
                real = base_is_meta(tensor)
            return real and not _candidate_frame(candidate)

        def get_device(tensor: torch.Tensor) -> int:
            with no_modes():
                real = base_get_device(tensor)
            if real < 0 and _candidate_frame(candidate) and \
                    real_device(tensor).type in real_types:
                return 0
            return real

        def data_ptr(tensor: torch.Tensor) -> int:
            # The candidate sees device-like addresses: 512-byte aligned allocations as
            # the CUDA caching allocator makes (a CPU allocation is 64-byte aligned, a
            # meta one is 0), distinct per storage, offsets kept.
            with no_modes():
                real = base_data_ptr(tensor)
                if not _candidate_frame(candidate):
                    return real
                kind = real_device(tensor).type
                if kind not in real_types:
                    return real
                storage = tensor.untyped_storage()
                start = storage._cdata if kind == "meta" else storage.data_ptr()
                offset = tensor.storage_offset() * tensor.element_size()
            return _DEVICE_BASE + (start % (1 << 36)) * 512 + offset

        torch.Tensor.device = property(device)
        torch.Tensor.is_cuda = property(is_cuda)
        torch.Tensor.is_cpu = property(is_cpu)
        torch.Tensor.is_meta = property(is_meta)
        torch.Tensor.get_device = get_device
        torch.Tensor.data_ptr = data_ptr
        default_device = torch.get_default_device

        def get_default_device() -> torch.device:
            # The dry run builds and calls under torch.device("meta").
            real = default_device()
            return torch.device("cpu") if real.type == "meta" and \
                _candidate_frame(candidate) else real

        torch.get_default_device = get_default_device
        cuda = torch.cuda
        props = _CudaDeviceProperties(self.gpu)

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
            "is_bf16_supported": props.major >= 8,
            "get_arch_list": [f"sm_{c}" for c in (50, 60, 70, 75, 80, 86, 90)],
        }.items():
            setattr(cuda, name, note(name, value))
        cuda.Event = _Event
        cuda.Stream = _Stream
        self._install_build_answers()
        self._mode.__enter__()
        self._install_triton_driver()

    def _install_build_answers(self) -> None:
        """What the torch build says of itself answers, to the candidate's code only, as
        a CUDA build (:data:`CUDA_VERSION`, :data:`CUDNN_VERSION`): ``torch.__version__``
        and ``torch.version.__version__`` (``+cu128``, not ``+cpu``), ``torch.version.cuda``,
        ``torch.backends.cuda.is_built()``, ``torch.backends.cudnn.is_available()`` and
        ``version()``, ``torch.cuda._is_compiled()``, ``torch._C._has_cuda`` /
        ``_has_cudnn`` and the build settings of ``torch.__config__.show()``. Torch's own
        code (its meta kernels read ``torch.version.cuda``) keeps the truth; a module's
        ``__dict__`` holds the GPU's answer, which its attribute gives torch's code."""
        emulation = self
        candidate = self.candidate
        real_version = str(torch.__version__)
        gpu_version = TorchVersion(real_version.split("+")[0] + "+" + CUDA_TAG)

        def attributes(module: Any, label: str, answers: dict[str, Any]) -> None:
            real = {name: getattr(module, name) for name in answers}

            def answer(name: str) -> property:
                def get(_module: Any) -> Any:
                    if _candidate_frame(candidate):
                        emulation.used.add(f"{label}.{name}")
                        return answers[name]
                    return real[name]

                return property(get)

            cls = type(module)
            sub = type(cls.__name__, (cls,), {n: answer(n) for n in answers})
            sub.__module__, sub.__qualname__ = cls.__module__, cls.__qualname__
            module.__class__ = sub
            vars(module).update(answers)

        def function(owner: Any, label: str, name: str, value: Any) -> None:
            real = getattr(owner, name)

            def call(*args: Any, **kwargs: Any) -> Any:
                if _candidate_frame(candidate):
                    emulation.used.add(f"{label}.{name}")
                    return value(real(*args, **kwargs)) if callable(value) else value
                return real(*args, **kwargs)

            call.__name__ = call.__qualname__ = name
            call.__module__ = getattr(real, "__module__", None)
            call.__doc__ = getattr(real, "__doc__", None)
            setattr(owner, name, call)

        attributes(torch.version, "torch.version",
                   {"cuda": CUDA_VERSION, "__version__": gpu_version})
        attributes(torch, "torch", {"__version__": gpu_version})
        attributes(torch._C, "torch._C", {"_has_cuda": True, "_has_cudnn": True})
        function(torch.backends.cuda, "torch.backends.cuda", "is_built", True)
        function(torch.backends.cudnn, "torch.backends.cudnn", "is_available", True)
        function(torch.backends.cudnn, "torch.backends.cudnn", "version", CUDNN_VERSION)
        function(torch.cuda, "torch.cuda", "_is_compiled", True)
        function(torch.__config__, "torch.__config__", "show", _cuda_build_settings)

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
                return GPUTarget(*gpu.triton_target())

            def get_active_torch_device(self) -> torch.device:
                return _CUDA

            def get_device_interface(self) -> Any:
                return torch.cuda

            def is_active(self) -> bool:
                return True

        driver.set_active(_Driver())
