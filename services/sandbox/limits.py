"""Resource limits of every sandboxed child, from one table of settings.

One row per kind of child that runs code we did not write; each row is two settings
(services/common/settings.py), ``sandbox_<row>_address_space_bytes`` and
``sandbox_<row>_cpu_s``, applied by :func:`services.sandbox.hardening.enter_sandbox`.
Which row bounds which role is said where the role is registered
(:func:`services.sandbox.roles.register_role`; the rows and their defaults are
documented there: services/worker/wire.py, services/generator/coders/lowering_role.py),
so this table names no role: it holds every ``sandbox_<row>_*`` setting there is.

Address space is bytes beyond the forked child's own (the fork server's torch and
triton are mapped already) and applies on ``cpu`` only, unless the role's
registration says it binds on every backend (a child that maps no device memory):
CUDA and CANN map the device's memory into the address space, so a bound there
refuses the driver, not the task. CPU time is seconds; 0 derives it from the run's
wall-clock limit (``lowering_timeout_s``, or the request's ``timeout_s`` times the
machine's cores, plus 10 s). A child over its address space gets ``MemoryError`` (or
torch's "can't allocate memory"), and its failure names the setting and its value; one
over its CPU time is killed by SIGXCPU, named the same way.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

from services.common.settings import Settings
from services.sandbox.roles import registration

# Seconds of CPU time beyond the wall-clock limit (interpreter start, teardown).
CPU_SLACK_S = 10
# A setting of the table: sandbox_<row>_address_space_bytes or sandbox_<row>_cpu_s.
_SETTING = re.compile(r"sandbox_(?P<key>\w+_(?:address_space_bytes|cpu_s))")


def _gib(value: int) -> str:
    return f"{value / (1 << 30):.1f} GiB"


def _table(settings: Any) -> dict[str, int]:
    """``<row>_address_space_bytes`` / ``<row>_cpu_s`` -> value, for every such setting."""
    return {m["key"]: getattr(settings, name) for name in settings.__struct_fields__
            if (m := _SETTING.fullmatch(name))}


_DEFAULTS = _table(Settings())


@dataclass(frozen=True)
class Limit:
    """One resolved limit: its value (None: none) and the words that name it."""

    value: int | None
    note: str


class ChildLimits:
    """The table: per row, address space (bytes; 0 derived) and CPU time (seconds; 0
    derived), given as ``<row>_address_space_bytes=...`` / ``<row>_cpu_s=...``; a value
    not given is the setting's default (:class:`Settings`).

    Raises:
        TypeError: a keyword names no setting of the table.
    """

    def __init__(self, **values: int) -> None:
        unknown = sorted(set(values) - set(_DEFAULTS))
        if unknown:
            raise TypeError(f"ChildLimits got {', '.join(unknown)}; the table holds "
                            f"{', '.join(sorted(_DEFAULTS))}")
        self.values = {**_DEFAULTS, **values}

    def __repr__(self) -> str:
        return f"ChildLimits({self.values})"

    def address_space(self, role: str, backend: str, derived: int | None = None) -> Limit:
        """RLIMIT_AS headroom of a ``role`` child on ``backend``, bytes (None off cpu,
        unless the role's registration says its bound holds on every backend).

        ``derived``: the value when the role's setting is 0 (None: no limit).

        Raises:
            KeyError: ``role`` is not registered, or its row has no setting.
        """
        entry = registration(role)
        name = f"sandbox_{entry.row}_address_space_bytes"
        setting = self.values[f"{entry.row}_address_space_bytes"]
        if backend != "cpu" and not entry.address_space_off_cpu:
            return Limit(None, "")
        value = setting or derived
        if value is None:
            return Limit(None, "")
        if setting:
            note = f"AIKG_{name.upper()}={setting} ({_gib(setting)})"
        else:
            note = (f"{_gib(value)}, derived from the task's sizes since "
                    f"AIKG_{name.upper()} is 0")
        return Limit(value, note)

    def cpu_seconds(self, role: str, wall_s: float, cores: int | None = None) -> Limit:
        """RLIMIT_CPU of a ``role`` child whose run may last ``wall_s`` seconds.

        Derived (setting 0): ``ceil(wall_s)`` times ``cores`` (default: this machine's,
        for the worker's children; the lowering child runs on one) plus
        :data:`CPU_SLACK_S`.

        Raises:
            KeyError: ``role`` is not registered, or its row has no setting.
        """
        row = registration(role).row
        name = f"sandbox_{row}_cpu_s"
        setting = self.values[f"{row}_cpu_s"]
        if setting:
            return Limit(setting, f"AIKG_{name.upper()}={setting} s")
        cores = cores if cores is not None else max(1, os.cpu_count() or 1)
        value = math.ceil(wall_s) * cores + CPU_SLACK_S
        return Limit(value, f"{value} s of CPU time, derived from the run's time limit "
                     f"since AIKG_{name.upper()} is 0")

    def notes(self, role: str, backend: str, wall_s: float, *, derived_as: int | None = None,
              cores: int | None = None) -> tuple[int | None, int, dict[str, str]]:
        """(address space, CPU seconds, notes for the child spec) of one child."""
        space = self.address_space(role, backend, derived_as)
        cpu = self.cpu_seconds(role, wall_s, cores)
        notes = {"cpu": cpu.note}
        if space.value is not None:
            notes["address_space"] = space.note
        return space.value, int(cpu.value or 0), notes


def child_limits_from(settings: Settings) -> ChildLimits:
    """The table from :class:`services.common.settings.Settings`.

    Raises:
        ValueError: a value is negative (the message names the variable).
    """
    values = _table(settings)
    for key, value in values.items():
        if value < 0:
            raise ValueError(f"AIKG_SANDBOX_{key.upper()}={value} must be >= 0 (0: derived)")
    return ChildLimits(**values)
