"""The wire format between a parent and its sandboxed children: the generic part.

Parent -> child: a :class:`ChildSpec` (msgpack), through the fork server
(:mod:`services.sandbox.forkserver`), then, on the same private socket, commands
with the raw frames they announce. Child -> parent, over that socket, never stdout:
frames of an 8-byte big-endian length followed by the payload. A payload is a
msgpack-encoded frame; frames that carry tensors are followed by one raw frame per
tensor holding its bytes (row-major, native byte order). With a ``frame_key`` in the
spec every frame is followed by a 32-byte keyed BLAKE2b tag over the previous tag,
the header and the payload, so bytes the candidate writes on the socket's file
descriptor (it can guess the number) break the chain and the parent sees them
(:class:`services.sandbox.channel.ChildRun`).

Every child sends :class:`Hello`, :class:`Progress`, :class:`Failure` and
:class:`Done`; every parent may send :class:`Bye`. What a role's child says beyond
that is its owner's: the owner registers those message types with the role
(:func:`services.sandbox.roles.register_role`, which calls :func:`register_messages`),
and each end decodes with the role's decoders (:func:`frame_decoder`,
:func:`command_decoder`).

This module is imported by both sides: the parent decodes with it, the child's
:class:`Channel` encodes with it (reading tensors through ``torch.Tensor`` methods
captured by :func:`capture_tensor_methods` when a child starts, before any candidate
code can reassign them). It does not import torch itself: a parent that only lowers
(the generator) never loads it (~3 s of CPU per process start).
"""

from __future__ import annotations

import hashlib
import socket
import struct
import threading
from typing import Any, Union

import msgspec

HEADER = struct.Struct("!Q")
TAG_BYTES = 32
# Tensor methods captured before any candidate code runs (capture_tensor_methods):
# candidates can reassign ``torch.Tensor.contiguous`` and friends, not these references.
_TENSOR_METHODS: tuple[Any, ...] | None = None
# Files in the child's scratch directory that receive its stdout and stderr.
STDOUT_FILE = "stdout.txt"
STDERR_FILE = "stderr.txt"
# The child's working directory inside its scratch directory (a size-limited tmpfs
# where the machine permits): HOME, TMPDIR, the cwd.
WORK_DIR = "work"


# A Progress phase that starts so names a call into the task's own code (its module
# code, get_init_inputs(), Model(...), get_inputs(), Model.forward); the parent bounds
# each such call (the worker's reference child: the request's timeout_s; the
# generator's lowering child: lowering_timeout_s) and names it when it does not finish.
TASK_PHASE = "the task's "


class ChildSpec(msgspec.Struct, kw_only=True):
    """One job for a sandboxed child (parent -> fork server -> child).

    Sizes are bytes, times seconds. ``role`` names what the child runs
    (:mod:`services.sandbox.roles`); ``runner``: the ``module:function`` the child calls
    for it (:func:`services.sandbox.roles.runner_of`; filled in from the registry when
    empty). ``env`` is set after the secret scrub; ``address_space_bytes`` is added to
    the child's address-space size at entry (None: no RLIMIT_AS). ``run_as`` is
    ``(uid, gid)`` to switch to when the fork server runs as root (None: keep the
    current user). ``scratch_bytes``: the size of the tmpfs the child works in (None:
    the scratch directory as it is). ``arch``: the request's arch (the GPU the cpu
    backend emulates and compiles for). ``task_path`` / ``candidate_path``: the task's
    and the candidate's source in the scratch directory ("": none; a failure in the
    candidate's file is located by its line). ``limit_notes``: ``address_space`` /
    ``cpu`` -> the words naming that limit's setting and value
    (:mod:`services.sandbox.limits`), quoted in a failure that hit it. ``params``: the
    role's own parameters (msgpack-able values), set and read by the role's owner; the
    sandbox passes them through unread.
    """

    role: str
    scratch_dir: str
    runner: str = ""
    backend: str = "cpu"
    arch: str = ""
    env: dict[str, str] = {}
    task_path: str = ""
    candidate_path: str = ""
    address_space_bytes: int | None = None
    cpu_seconds: int = 600
    file_size_bytes: int = 128 << 20
    open_files: int = 1024
    processes: int = 4096
    run_as: tuple[int, int] | None = None
    isolate_network: bool = True
    pid_namespace: bool = True
    scratch_bytes: int | None = None
    env_allow: list[str] = []
    landlock: bool = True
    seccomp: bool = True
    frame_key: bytes = b""
    limit_notes: dict[str, str] = {}
    params: dict[str, Any] = {}


class Hello(msgspec.Struct, tag="hello"):
    """The child entered its sandbox; ``notes`` lists isolation steps that failed.

    ``capabilities``: the bitwise OR of every capability set left (0: none);
    ``landlock_abi``: the Landlock ABI confining its files (0: none); ``seccomp``:
    whether the syscall filter is loaded; ``pid_namespace``: whether it is process 1 of
    its own PID namespace (with its own /proc); ``scratch_bytes``: the size of the
    tmpfs it works in (None: none).
    """

    pid: int
    uid: int
    network_isolated: bool
    address_space_bytes: int | None
    notes: list[str]
    capabilities: int = 0
    landlock_abi: int = 0
    seccomp: bool = False
    pid_namespace: bool = False
    scratch_bytes: int | None = None


class Progress(msgspec.Struct, tag="progress"):
    """The child started a phase (named in timeout messages)."""

    phase: str


class TensorMeta(msgspec.Struct):
    """dtype (``torch.float32`` spelled ``float32``), shape, and byte count of one tensor."""

    dtype: str
    shape: list[int]
    nbytes: int


class Failure(msgspec.Struct, tag="failure"):
    """The job failed at ``stage`` (a VerifyResult stage name)."""

    stage: str
    message: str
    traceback: str = ""


class Done(msgspec.Struct, tag="done"):
    """All frames were sent."""


class Bye(msgspec.Struct, tag="bye"):
    """Parent -> child: no more requests; finish and send Done."""


GENERIC_FRAMES: tuple[type, ...] = (Hello, Progress, Failure, Done)
GENERIC_COMMANDS: tuple[type, ...] = (Bye,)
_encoder = msgspec.msgpack.Encoder()
SPEC_DECODER = msgspec.msgpack.Decoder(ChildSpec)


def _decoders(frames: tuple[type, ...], commands: tuple[type, ...]) -> tuple[Any, Any]:
    # Union of a tuple made at run time: ``X | Y`` needs the members spelled out.
    return (msgspec.msgpack.Decoder(Union[GENERIC_FRAMES + frames]),  # noqa: UP007
            msgspec.msgpack.Decoder(Union[GENERIC_COMMANDS + commands]))  # noqa: UP007


# Decoders are made when the messages are registered, not at first use: msgspec reads a
# message type's annotations then, from its module, and a candidate's process removes
# the harness's modules before the candidate's code runs
# (services.sandbox.guard.hide_harness).
_GENERIC = _decoders((), ())
# Per role: the frames its child sends and the commands it answers beyond the generic
# ones (register_messages), and the (frame, command) decoders made of them.
_MESSAGES: dict[str, tuple[tuple[type, ...], tuple[type, ...]]] = {}
_DECODERS: dict[str, tuple[Any, Any]] = {}
_LOCK = threading.Lock()


def register_messages(role: str, frames: tuple[type, ...] = (),
                      commands: tuple[type, ...] = ()) -> None:
    """Declare what ``role``'s child sends (``frames``) and answers (``commands``)
    beyond the generic messages: tagged ``msgspec.Struct`` types, each tag unique
    among the role's messages. Called by :func:`services.sandbox.roles.register_role`.

    Raises:
        ValueError: ``role`` has other messages registered already.
        TypeError: the messages cannot form a tagged union (msgspec's message).
    """
    frames, commands = tuple(frames), tuple(commands)
    with _LOCK:
        known = _MESSAGES.get(role)
        if known is not None and known != (frames, commands):
            raise ValueError(f"role {role!r} has other messages registered already")
        if known is None:
            _DECODERS[role] = _decoders(frames, commands)
            _MESSAGES[role] = (frames, commands)


def frame_decoder(role: str) -> msgspec.msgpack.Decoder:
    """The decoder of what a ``role`` child sends: the generic frames and the role's
    (the generic frames only while nobody registered the role's messages)."""
    return _DECODERS.get(role, _GENERIC)[0]


def command_decoder(role: str) -> msgspec.msgpack.Decoder:
    """The decoder of what a ``role`` child is sent: :class:`Bye` and the role's commands."""
    return _DECODERS.get(role, _GENERIC)[1]


def encode_frame(frame: Any) -> bytes:
    """msgpack bytes of a frame or command."""
    return _encoder.encode(frame)


def encode_spec(spec: ChildSpec) -> bytes:
    """msgpack bytes of ``spec`` (sent to the fork server)."""
    return _encoder.encode(spec)


def frame_tag(key: bytes, previous: bytes, header: bytes, payload: Any) -> bytes:
    """Keyed BLAKE2b (RFC 7693) of ``previous`` tag + ``header`` + ``payload``, 32 bytes."""
    h = hashlib.blake2b(key=key, digest_size=TAG_BYTES)
    h.update(previous)
    h.update(header)
    h.update(payload)
    return h.digest()


def capture_tensor_methods() -> None:
    """Capture the ``torch.Tensor`` methods :func:`tensor_bytes` reads tensors with.

    Called by every child at its start (:func:`services.sandbox.child.main`), before any
    job code runs, and by a parent at its first :func:`tensor_bytes`; the fork server
    never runs candidate code, so what its children capture is torch's own.
    """
    global _TENSOR_METHODS
    import torch

    t = torch.Tensor
    _TENSOR_METHODS = (t.detach, t.to, t.contiguous, t.reshape, t.view, t.numpy, t.numel,
                       torch.uint8, t)


def tensor_bytes(t: Any) -> Any:
    """A buffer over ``t``'s bytes (CPU, contiguous), via the captured methods."""
    if _TENSOR_METHODS is None:
        capture_tensor_methods()
    detach, to, contiguous, reshape, view, numpy, numel, uint8, _ = _TENSOR_METHODS
    if not numel(t):
        return b""
    return numpy(view(reshape(contiguous(to(detach(t), "cpu")), -1), uint8))


class Channel:
    """The child's end of the result socket (blocking writes), tagging frames with
    ``key``; the commands it reads are ``role``'s (:func:`command_decoder`)."""

    def __init__(self, fd: int, key: bytes = b"", role: str = "") -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(True)
        self.role = role
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

    def send(self, frame: Any, raws: list[Any] = ()) -> None:
        """Write ``frame``, then each raw frame: a tensor's bytes, or a buffer as it is."""
        self._write(_encoder.encode(frame))
        tensor = _TENSOR_METHODS[-1] if _TENSOR_METHODS is not None else ()
        for t in raws:
            self._write(tensor_bytes(t) if isinstance(t, tensor) else t)

    def _read_exactly(self, n: int) -> bytearray | None:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                return None
            got += k
        return buf

    def recv(self) -> Any:
        """The parent's next command (:func:`command_decoder`); None when it closed the socket.

        Raises:
            msgspec.DecodeError: a malformed command.
        """
        data = self.recv_raw()
        return None if data is None else command_decoder(self.role).decode(data)

    def recv_raw(self) -> bytearray | None:
        """The parent's next raw frame (length-prefixed bytes); None at end of stream."""
        header = self._read_exactly(HEADER.size)
        if header is None:
            return None
        (size,) = HEADER.unpack(header)
        return self._read_exactly(size) if size else bytearray()
