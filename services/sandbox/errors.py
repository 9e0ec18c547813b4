"""The sandbox's errors, raised to its users: a fork server that is gone, a mechanism
refused, a child that broke the wire format or forged a frame."""

from __future__ import annotations


class PoolBroken(RuntimeError):
    """The fork server is gone and could not be restarted."""


class ProtocolError(RuntimeError):
    """A child sent something that is not a well-formed frame, or too much of it."""


class ForgedFrame(ProtocolError):
    """A frame's tag does not match: someone but the harness wrote on the result socket."""


class SandboxRefused(PoolBroken):
    """A mechanism the operator required (``sandbox_require``) is not available here."""
