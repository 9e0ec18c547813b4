"""Which code a sandboxed child runs for each role, registered by its owner.

A role (the sandbox's own ``probe``, and whatever its users register) names what a
child does once it is confined. Its owner registers, in one call
(:func:`register_role`): the runner, a ``"module:function"`` path called with
``(spec, channel)`` inside the child (:func:`services.sandbox.child.main`); the
messages its child sends and answers beyond the generic frames
(:func:`services.sandbox.wire.register_messages`); and its row of the limits table
(:mod:`services.sandbox.limits`). The worker registers its verification roles
(services/worker/wire.py) and the generator its lowering
(services/generator/coders/lowering_role.py), so the sandbox imports neither and
names none of their roles. A spec carries the runner's path
(:attr:`services.sandbox.wire.ChildSpec.runner`), so the child needs no registry to
find its code; it registers the role's messages again when its runner's module is
imported.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from services.sandbox import wire


@dataclass(frozen=True)
class Role:
    """A registered role: its runner (``module:function``), the row of the limits table
    that bounds its child (settings ``sandbox_<row>_address_space_bytes`` and
    ``sandbox_<row>_cpu_s``), and whether that address-space bound holds on every
    backend (a child that maps no device memory) or on ``cpu`` only."""

    runner: str
    row: str
    address_space_off_cpu: bool = False


_ROLES: dict[str, Role] = {"probe": Role("services.sandbox.child:run_probe", "probe")}
_LOCK = threading.Lock()


def register_role(role: str, runner: str, *, frames: tuple[type, ...] = (),
                  commands: tuple[type, ...] = (), limits: str | None = None,
                  address_space_off_cpu: bool = False) -> None:
    """Register ``role``: its ``runner`` (``"package.module:function"``), the
    ``frames`` its child sends and the ``commands`` it answers beyond the generic ones
    (tagged ``msgspec.Struct`` types), and ``limits``, the row of the limits table that
    bounds it (default: the role's own name; ``address_space_off_cpu``: that row's
    address space binds on every backend). Registering the same again is a no-op.

    Raises:
        ValueError: ``runner`` is not ``module:function``, or ``role`` is registered
            already otherwise.
    """
    module, sep, function = runner.partition(":")
    if not sep or not module or not function.isidentifier():
        raise ValueError(f"runner {runner!r} of role {role!r} must be 'module:function'")
    entry = Role(runner, limits or role, address_space_off_cpu)
    with _LOCK:
        known = _ROLES.setdefault(role, entry)
        if known != entry:
            raise ValueError(f"role {role!r} is registered already as {known}")
    wire.register_messages(role, frames, commands)


def _role(role: str) -> Role:
    try:
        return _ROLES[role]
    except KeyError:
        raise KeyError(f"no sandbox role {role!r} is registered (registered: "
                       f"{', '.join(sorted(_ROLES))}); import the module that "
                       "registers it first") from None


def runner_of(role: str) -> str:
    """The runner registered for ``role``.

    Raises:
        KeyError: nobody registered ``role`` (the message lists the roles that are).
    """
    return _role(role).runner


def registration(role: str) -> Role:
    """What ``role`` was registered with (its runner, its row of the limits table).

    Raises:
        KeyError: nobody registered ``role``.
    """
    return _role(role)


def registered() -> tuple[str, ...]:
    """The roles registered in this process, sorted."""
    return tuple(sorted(_ROLES))
