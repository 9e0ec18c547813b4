"""The wire format between the worker and its sandboxed children.

Parent -> child: a :class:`ChildSpec` (msgpack), through the fork server
(:mod:`services.worker._forkserver`). Child -> parent, over a private socket the fork
server hands the child, never stdout: frames of an 8-byte big-endian length followed
by the payload. A payload is a msgpack-encoded :data:`Frame`; a :class:`Trial` is
followed by one raw frame per output tensor holding its bytes (row-major, native
byte order), then one per tensor input. With a ``frame_key`` in the spec every frame
is followed by a 32-byte keyed BLAKE2b tag over the previous tag, the header and the
payload, so bytes the candidate writes on the socket's file descriptor (it can guess
the number) break the chain and the parent sees them
(:class:`services.worker.sandbox.ChildRun`).

This module is imported by both sides: the parent decodes with it, the child's
:class:`Channel` encodes with it (reading tensors through ``torch.Tensor`` methods
captured at import, before any candidate code can reassign them).
"""

from __future__ import annotations

import hashlib
import socket
import struct
from typing import Any, Literal

import msgspec
import torch

HEADER = struct.Struct("!Q")
TAG_BYTES = 32
# Tensor methods captured before any candidate code runs: candidates can reassign
# ``torch.Tensor.contiguous`` and friends, not these references.
_detach = torch.Tensor.detach
_to = torch.Tensor.to
_contiguous = torch.Tensor.contiguous
_reshape = torch.Tensor.reshape
_view = torch.Tensor.view
_numpy = torch.Tensor.numpy
_numel = torch.Tensor.numel
# Files in the child's scratch directory that receive its stdout and stderr.
STDOUT_FILE = "stdout.txt"
STDERR_FILE = "stderr.txt"
# The candidate child's first Progress after loading the task (the parent laps
# ``candidate_start`` on it).
IMPORT_PHASE = "importing the candidate"


class ChildSpec(msgspec.Struct, kw_only=True):
    """One job for a sandboxed child (parent -> fork server -> child).

    Sizes are bytes, times seconds. ``env`` is set after the secret scrub;
    ``address_space_bytes`` is added to the child's address-space size at entry
    (None: no RLIMIT_AS). ``run_as`` is ``(uid, gid)`` to switch to when the fork
    server runs as root (None: keep the current user).
    """

    role: Literal["probe", "reference", "candidate", "lower"]
    scratch_dir: str
    backend: str = "cpu"
    env: dict[str, str] = {}
    task_path: str = ""
    candidate_path: str = ""
    seeds: list[int] = []
    shape_overrides: dict[str, Any] = {}
    want_outputs: bool = True
    profile: bool = False
    input_limit_bytes: int | None = None
    address_space_bytes: int | None = None
    cpu_seconds: int = 600
    file_size_bytes: int = 512 << 20
    open_files: int = 1024
    processes: int = 4096
    run_as: tuple[int, int] | None = None
    isolate_network: bool = True
    env_allow: list[str] = []
    landlock: bool = True
    seccomp: bool = True
    lower_params: dict[str, int] = {}
    warmup: int = 3
    repeats: int = 20
    flush_bytes: int = 256 << 20
    frame_key: bytes = b""
    ghost: bool = False


class Hello(msgspec.Struct, tag="hello"):
    """The child entered its sandbox; ``notes`` lists isolation steps that failed.

    ``capabilities``: the bitwise OR of every capability set left (0: none);
    ``landlock_abi``: the Landlock ABI confining its files (0: none); ``seccomp``:
    whether the syscall filter is loaded.
    """

    pid: int
    uid: int
    network_isolated: bool
    address_space_bytes: int | None
    notes: list[str]
    capabilities: int = 0
    landlock_abi: int = 0
    seccomp: bool = False


class Progress(msgspec.Struct, tag="progress"):
    """The child started a phase (named in timeout messages)."""

    phase: str


class Sizes(msgspec.Struct, tag="sizes"):
    """Total bytes of the task's ``get_inputs()`` tensors for the first seed.

    ``estimated``: measured on fake tensors (nothing allocated). ``size_names``:
    the task's module-level ints, for a shape_overrides suggestion.
    """

    input_bytes: int
    estimated: bool
    size_names: dict[str, int]


class TensorMeta(msgspec.Struct):
    """dtype (``torch.float32`` spelled ``float32``), shape, and byte count of one output."""

    dtype: str
    shape: list[int]
    nbytes: int


class Trial(msgspec.Struct, tag="trial"):
    """One seed's run; the raw bytes of each output follow as separate frames.

    ``inputs_before`` / ``inputs_after``: sha256 digests of each ``get_inputs()``
    element before and after the forward call. ``aliasing``: human-readable facts
    such as ``output 0 shares memory with input 0``. ``inputs``: per ``get_inputs()``
    element, the metadata of the tensor whose bytes follow the outputs' (None for a
    non-tensor; empty from the reference child, which sends no input bytes).
    """

    index: int
    seed: int
    inputs_before: list[str]
    inputs_after: list[str]
    outputs: list[TensorMeta]
    aliasing: list[str]
    inputs: list[TensorMeta | None] = []


class Timing(msgspec.Struct, tag="timing"):
    """Device-event timings of the forward call, microseconds; ``wall_s`` the child's wall time."""

    median_us: float
    samples_us: list[float]
    wall_s: float


class Failure(msgspec.Struct, tag="failure"):
    """The job failed at ``stage`` (a VerifyResult stage name)."""

    stage: str
    message: str
    traceback: str = ""


class Lowered(msgspec.Struct, tag="lowered"):
    """The built-in coder's candidate source for the task (role ``lower``)."""

    code: str


class Done(msgspec.Struct, tag="done"):
    """All frames were sent."""


class Audit(msgspec.Struct, tag="audit"):
    """What the in-child instruments saw while ``ModelNew.forward`` ran (all calls).

    ``ops`` / ``launcher_ops``: ATen overload name -> calls, issued by candidate code /
    from Triton's frames. ``refused``: events the audit hook refused. ``notes``: how
    the candidate was run (autotune choices). ``host_reads``: ``Tensor.numpy`` ... ->
    calls by candidate code; ``host_elements``: the most tensor elements one forward
    call handed to host code (those calls and ``.item()`` reads).
    """

    ops: dict[str, int]
    launcher_ops: dict[str, int]
    refused: list[str]
    notes: list[str]
    host_reads: dict[str, int] = {}
    host_elements: int = 0


Frame = Hello | Progress | Sizes | Trial | Timing | Failure | Lowered | Done | Audit

_encoder = msgspec.msgpack.Encoder()
FRAME_DECODER = msgspec.msgpack.Decoder(Frame)
SPEC_DECODER = msgspec.msgpack.Decoder(ChildSpec)


def encode_spec(spec: ChildSpec) -> bytes:
    """msgpack bytes of ``spec`` (sent to the fork server)."""
    return _encoder.encode(spec)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`.

    Raises:
        ValueError: ``name`` is not a torch dtype (the name comes from an untrusted child).
    """
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def frame_tag(key: bytes, previous: bytes, header: bytes, payload: Any) -> bytes:
    """Keyed BLAKE2b (RFC 7693) of ``previous`` tag + ``header`` + ``payload``, 32 bytes."""
    h = hashlib.blake2b(key=key, digest_size=TAG_BYTES)
    h.update(previous)
    h.update(header)
    h.update(payload)
    return h.digest()


def tensor_bytes(t: torch.Tensor) -> Any:
    """A buffer over ``t``'s bytes (CPU, contiguous), via methods captured at import."""
    if not _numel(t):
        return b""
    return _numpy(_view(_reshape(_contiguous(_to(_detach(t), "cpu")), -1), torch.uint8))


class Channel:
    """The child's end of the result socket (blocking writes), tagging frames with ``key``."""

    def __init__(self, fd: int, key: bytes = b"") -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(True)
        self._key = key
        self._tag = b""

    def _write(self, payload: Any) -> None:
        header = HEADER.pack(len(payload))
        tag = b""
        if self._key:
            tag = self._tag = frame_tag(self._key, self._tag, header, payload)
        if isinstance(payload, bytes) and len(payload) < (1 << 16):
            self.sock.sendall(header + payload + tag)
            return
        self.sock.sendall(header)
        if len(payload):
            self.sock.sendall(memoryview(payload))
        if tag:
            self.sock.sendall(tag)

    def send(self, frame: Any, raws: list[torch.Tensor] = ()) -> None:
        self._write(_encoder.encode(frame))
        for t in raws:
            self._write(tensor_bytes(t))
