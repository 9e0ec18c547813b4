"""Which code a sandboxed child runs for each role, registered by its owner.

A role (``reference``, ``candidate``, ``lower`` ...) names what a child does once it
is confined; its runner is a ``"module:function"`` path called with ``(spec,
channel)`` inside the child (:func:`services.sandbox.child.main`). The sandbox package
knows only ``probe`` (its own capability check); the worker registers its
verification roles and the generator its lowering, so the sandbox imports neither.
A spec carries the runner's path (:attr:`services.sandbox.wire.ChildSpec.runner`),
so the child needs no registry: the parent resolves the role when it builds the spec.
"""

from __future__ import annotations

_RUNNERS: dict[str, str] = {"probe": "services.sandbox.child:run_probe"}


def register_role(role: str, runner: str) -> None:
    """Register ``runner`` (``"package.module:function"``) for ``role``.

    Raises:
        ValueError: ``runner`` is not ``module:function``, or ``role`` is registered
            already with another runner.
    """
    module, sep, function = runner.partition(":")
    if not sep or not module or not function.isidentifier():
        raise ValueError(f"runner {runner!r} of role {role!r} must be 'module:function'")
    known = _RUNNERS.setdefault(role, runner)
    if known != runner:
        raise ValueError(f"role {role!r} is registered already with {known!r}")


def runner_of(role: str) -> str:
    """The runner registered for ``role``.

    Raises:
        KeyError: nobody registered ``role`` (the message lists the roles that are).
    """
    try:
        return _RUNNERS[role]
    except KeyError:
        raise KeyError(f"no sandbox role {role!r} is registered (registered: "
                       f"{', '.join(sorted(_RUNNERS))}); import the module that "
                       "registers it first") from None
